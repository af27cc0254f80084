"""`PromptTokenizer` on tokenizer folders as pipelines publish them, against transformers' ids.

The fixtures under `tests/data/tokenizers/` were made by transformers itself
(`tools/make_tokenizer_fixtures.py`, run by hand with transformers 5.25 and sentencepiece):
CLIP's `vocab.json` + `merges.txt` (SD3's CLIP-L, padded with `<|endoftext|>`, and CLIP-G,
padded with `!`) and T5's and umT5's `spiece.model`, without `tokenizer.json`; beside each,
`<name>_json/`, what transformers' `save_pretrained` writes (`tokenizer.json`); and `ids.json`,
transformers' ids and masks for 44 prompts (`CLIPTokenizer`, `T5TokenizerFast`, with
`padding="max_length", truncation=True` as diffusers calls them).
"""

import json
import pathlib
import shutil
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from flowgrpo_eqx.models import PromptTokenizer


TOKENIZERS = pathlib.Path(__file__).resolve().parent / "data" / "tokenizers"
pytest.importorskip("tokenizers", reason="PromptTokenizer reads tokenizer files with it")
RECORD: dict[str, Any] = json.loads((TOKENIZERS / "ids.json").read_text(encoding="utf-8"))
PROMPTS: list[str] = RECORD["prompts"]


@pytest.mark.parametrize("layout", ["published", "tokenizer.json"])
@pytest.mark.parametrize("name", ["clip_l", "clip_g", "t5", "umt5"])
def test_the_ids_are_transformers_ids(name: str, layout: str) -> None:
    folder = TOKENIZERS / (name if layout == "published" else f"{name}_json")
    assert (folder / "tokenizer.json").exists() == (layout == "tokenizer.json")
    expected = RECORD["folders"][name]
    ids, mask = PromptTokenizer(folder, expected["length"]).encode(PROMPTS)
    assert ids.shape == mask.shape == (len(PROMPTS), expected["length"])
    assert ids.dtype == mask.dtype == np.int32
    wrong = [
        prompt
        for prompt, row, row_mask, want, want_mask in zip(
            PROMPTS, ids, mask, expected["ids"], expected["mask"], strict=True
        )
        if row.tolist() != want or row_mask.tolist() != want_mask
    ]
    assert wrong == []


def test_the_fixtures_hold_what_the_readers_are_for() -> None:
    # Truncation: the long prompt fills every row, its end token kept last.
    for name, end in (("clip_l", "<|endoftext|>"), ("t5", "</s>")):
        expected = RECORD["folders"][name]
        vocab = PromptTokenizer(TOKENIZERS / f"{name}_json", 8)._tokenizer
        assert expected["mask"][-1] == [1] * expected["length"]
        assert expected["ids"][-1][-1] == vocab.token_to_id(end)
    # CLIP-G pads with "!" (id 0), and transformers makes it a special token, so a prompt's
    # last "!" is id 0 there and "!</w>" (256, the 256 byte symbols first) for CLIP-L.
    night = PROMPTS.index("a black and white photograph of a city street at night!")
    assert RECORD["folders"]["clip_g"]["ids"][night].count(256) == 0
    assert RECORD["folders"]["clip_l"]["ids"][night].count(256) == 1
    # transformers 5's T5 tokenizer gives unknown pieces id 2 whatever the model's unknown id
    # (umT5's is 3 here): SentencePiece itself and transformers' converter (transformers 4)
    # give 3. PromptTokenizer gives transformers 5's ids.
    umt5 = RECORD["folders"]["umt5"]
    sentencepiece = umt5["references"]["sentencepiece"]
    emoji = PROMPTS.index("emoji 🐱🚀 party 🎉")
    assert emoji in sentencepiece["differs"]
    assert 3 in sentencepiece["ids"][sentencepiece["differs"].index(emoji)]
    assert 3 not in umt5["ids"][emoji] and 2 in umt5["ids"][emoji]


def test_a_folder_is_read_in_the_first_layout_it_holds(tmp_path: pathlib.Path) -> None:
    # tokenizer.json wins over CLIP's files: a word-level tokenizer.json beside CLIP's BPE.
    shutil.copytree(TOKENIZERS / "clip_g", tmp_path, dirs_exist_ok=True)
    word_level = pathlib.Path(__file__).resolve().parent / "data" / "prompts" / "tokenizer"
    shutil.copytree(word_level, tmp_path, dirs_exist_ok=True)
    (tmp_path / "special_tokens_map.json").unlink()  # its "!" would be the padding
    assert (tmp_path / "vocab.json").exists() and (tmp_path / "merges.txt").exists()
    ids = PromptTokenizer(tmp_path, 6)(["a red cube"])
    np.testing.assert_array_equal(ids, PromptTokenizer(word_level, 6)(["a red cube"]))


def test_no_prompts_give_no_rows() -> None:
    tokenizer = PromptTokenizer(TOKENIZERS / "t5", 16)
    ids, mask = tokenizer.encode([])
    assert ids.shape == mask.shape == (0, 16) and ids.dtype == mask.dtype == np.int32
    assert tokenizer(()).shape == (0, 16)


@pytest.mark.parametrize(
    ("prompts", "match"),
    [
        ("a photo of a cat", "`prompts` must be a list of strings"),
        (["a cat", None], r"`prompts\[1\]` must be a string"),
        ([3], r"`prompts\[0\]` must be a string"),
        (["a cat", "\ud800"], r"`prompts\[1\]` is not valid Unicode"),
    ],
    ids=["one string", "None", "an int", "a lone surrogate"],
)
def test_bad_prompts_are_refused_by_name(prompts: Any, match: str) -> None:
    tokenizer = PromptTokenizer(TOKENIZERS / "clip_l", 77)
    # Under the suite's runtime type checker a wrong type may be refused first, by name.
    with pytest.raises((ValueError, TypeError), match=match + "|prompts"):
        tokenizer(prompts)
    with pytest.raises((ValueError, TypeError), match=match + "|prompts"):
        tokenizer.encode(prompts)


def _copy(name: str) -> Callable[[pathlib.Path], None]:
    return lambda folder: shutil.copytree(TOKENIZERS / name, folder, dirs_exist_ok=True)


def _edit_config(name: str, file: str = "tokenizer_config.json", **changes: Any) -> Any:
    def make(folder: pathlib.Path) -> None:
        _copy(name)(folder)
        settings = json.loads((folder / file).read_text())
        (folder / file).write_text(json.dumps({**settings, **changes}))

    return make


def _write(name: str, file: str, content: bytes | Callable[[bytes], bytes]) -> Any:
    def make(folder: pathlib.Path) -> None:
        _copy(name)(folder)
        path = folder / file
        path.write_bytes(content(path.read_bytes()) if callable(content) else content)

    return make


def _without(name: str, file: str) -> Any:
    def make(folder: pathlib.Path) -> None:
        _copy(name)(folder)
        (folder / file).unlink()

    return make


# A SentencePiece model of one piece, "a", trained as BPE (TrainerSpec.model_type 2).
_BPE_MODEL = b"\x0a\x03\x0a\x01a" + b"\x12\x02\x18\x02"


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda folder: None, r"has none of tokenizer\.json, vocab\.json \+ merges\.txt"),
        (_without("clip_l", "merges.txt"), "has vocab.json but no merges.txt"),
        (_without("clip_l", "vocab.json"), "has merges.txt but no vocab.json"),
        (_edit_config("clip_g", pad_token="<|none|>"), r"pad_token '<\|none\|>'.*vocab\.json"),
        (_edit_config("t5", pad_token="<none>"), "pad_token '<none>'.*spiece.model"),
        (_edit_config("t5_json", pad_token="<none>"), "pad_token '<none>'"),
        (
            _edit_config("clip_l", "special_tokens_map.json", eos_token="<|none|>"),
            r"eos_token '<\|none\|>'",
        ),
        (_write("clip_l_json", "tokenizer.json", lambda b: b[:300]), "tokenizer.json is not a"),
        (_write("clip_g", "tokenizer_config.json", b"{pad_token: !"), "config.json is not a JSON"),
        (_write("clip_g", "tokenizer_config.json", b"[]"), "must hold a JSON object"),
        (_write("clip_g", "vocab.json", b'["a", "b"]'), "must map tokens to int ids"),
        (_write("clip_g", "merges.txt", b"#version: 0.2\na b c\n"), "merges.txt, line 2"),
        (_write("clip_g", "merges.txt", b"#version: 0.2\nq \xc3\xa9\n"), "do not make a BPE"),
        (_write("t5", "spiece.model", lambda b: b[: len(b) // 2]), "not a SentencePiece model"),
        (_write("t5", "spiece.model", b"\xff" * 32), "not a SentencePiece model"),
        (_write("t5", "spiece.model", b""), "holds no pieces"),
        (_write("t5", "spiece.model", _BPE_MODEL), "only Unigram models"),
        (_edit_config("t5", extra_ids=-1), "`extra_ids` must be an int >= 0"),
        (_edit_config("clip_g", tokenizer_class="GPT2Tokenizer"), "names 'GPT2Tokenizer'"),
    ],
    ids=[
        "no known file",
        "vocab.json without merges.txt",
        "merges.txt without vocab.json",
        "CLIP's pad_token not in the vocabulary",
        "T5's pad_token not in the vocabulary",
        "tokenizer.json's pad_token not in the vocabulary",
        "eos_token not in the vocabulary",
        "truncated tokenizer.json",
        "tokenizer_config.json not JSON",
        "tokenizer_config.json not an object",
        "vocab.json not a mapping",
        "merges.txt line of three symbols",
        "merges.txt symbols not in the vocabulary",
        "truncated spiece.model",
        "garbled spiece.model",
        "empty spiece.model",
        "BPE spiece.model",
        "negative extra_ids",
        "another tokenizer class",
    ],
)
def test_a_bad_folder_is_refused_naming_the_file(
    tmp_path: pathlib.Path, make: Callable[[pathlib.Path], None], match: str
) -> None:
    make(tmp_path)
    with pytest.raises(ValueError, match=match) as error:
        PromptTokenizer(tmp_path, 77)
    assert str(tmp_path) in str(error.value)
