"""Fixtures for `flowgrpo_eqx.models.PromptTokenizer` on the tokenizer folders pipelines
publish, made with transformers itself.

As the other fixture scripts (read `tools/make_sd3_fixtures.py` for the environment), this runs
by hand in a venv with transformers, tokenizers and sentencepiece (transformers 5.25.0,
tokenizers 0.23.3, sentencepiece 0.2.3); nothing is downloaded, every vocabulary is learned
here from a small corpus:

    /tmp/venv-torch/bin/python tools/make_tokenizer_fixtures.py make

It writes `tests/data/tokenizers/`:

- `clip_l/` and `clip_g/`: CLIP's byte-level BPE as SD3 and FLUX.1 publish it, `vocab.json` +
    `merges.txt` and no `tokenizer.json`: the 256 byte symbols, then their `</w>` forms, then
    the symbols of 400 merges learned from the corpus by counting pairs (CLIP's own order),
    then `<|startoftext|>` and `<|endoftext|>` last. `clip_l/` has an older transformers'
    configuration (special tokens as `AddedToken` dicts, normalised, in both
    `tokenizer_config.json` and `special_tokens_map.json`; padding `<|endoftext|>`);
    `clip_g/` a newer one, as SD3's `tokenizer_2/` (an `added_tokens_decoder`; padding `!`,
    id 0, a special token);
- `t5/`: a T5 folder as published without `tokenizer.json`: `spiece.model`, a SentencePiece
    Unigram model trained here (NFKC normalisation, `nmt_nfkc`, as T5's; `<pad>` 0, `</s>` 1,
    `<unk>` 2, no `<s>`), with a configuration naming 100 `extra_ids` (each sentinel in the
    `added_tokens_decoder`, stripping spaces on both sides as T5's are); `umt5/`: an umT5-like
    one (`<pad>` 0, `</s>` 1, `<s>` 2, `<unk>` 3; 300 `extra_ids`; a small normalisation
    table of its own instead of NFKC; an older configuration with `special_tokens_map.json`);
- `<name>_json/` for each: what transformers' `save_pretrained` writes of the tokenizer it
    loaded from the folder above (`tokenizer.json` and `tokenizer_config.json`);
- `ids.json`: for 44 prompts (flow_grpo-style prompts, punctuation, digits, capitals, extra
    and leading spaces, tabs and newlines, accents, unicode quotes, emoji, CJK, special tokens
    written out, a prompt longer than both lengths, the empty string), the ids and attention
    masks transformers gives with `padding="max_length", truncation=True, max_length=L` as
    diffusers' pipelines call it (`L` 77 for CLIP, 32 for T5), by `CLIPTokenizer` (transformers
    5's `CLIPTokenizerFast` is the same class) and `T5TokenizerFast` (likewise `T5Tokenizer`)
    `from_pretrained` of each folder; and, for reference, what other readers give
    (`references`): SentencePiece itself (`sentencepiece`) and transformers' own slow-to-fast
    converters (`CLIPConverter`, `T5Converter`: what transformers 4's fast tokenizers were
    built from), where they differ from transformers' (`differs`: the prompts' indices, and
    the reader's `ids` and `mask` of those prompts).

The functions that build the vocabularies (`clip_vocabulary`, `sentencepiece_model`,
`write_clip_folder`, `write_t5_folder`) are used by `tools/make_pipeline_fixtures.py` too.
"""

import functools
import io
import itertools
import json
import pathlib
import shutil
import sys
import tempfile
from collections import Counter
from typing import Any


OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / "tokenizers"
CLIP_LENGTH = 77
T5_LENGTH = 32
CLIP_MERGES = 400

_OBJECTS = [
    "cat", "dog", "horse", "bench", "giraffe", "teddy bear", "bicycle", "umbrella", "apple",
    "banana", "cup", "clock", "chair", "lighthouse", "astronaut", "mountain", "river", "city",
    "flower", "bowl of fruit", "skateboard", "kitchen", "car", "train", "boat", "pizza",
]  # fmt: skip
_COLORS = ["red", "blue", "green", "yellow", "purple", "black", "white", "orange", "pink"]
_COUNTS = ["a", "one", "two", "three", "four", "five"]
_PLACES = [
    "on the left of", "on the right of", "next to", "under", "above", "behind", "in front of",
]  # fmt: skip
_STYLES = [
    "a photo of", "a painting of", "an oil painting of", "a close-up of",
    "a black and white photograph of", "a drawing of", "a 3d render of",
]  # fmt: skip
_EXTRA_LINES = [
    "highly detailed, 4k, trending on artstation, sharp focus, studio lighting.",
    "in the style of van gogh, at sunset, under a stormy sky, in the snow!",
    "the quick brown fox jumps over the lazy dog; don't, can't, it's, we'll, I'm, they're.",
    "numbers 0 1 2 3 4 5 6 7 8 9 and 3.14, 2024, 100%.",
    "une photo d'un chat assis sur une chaise rouge, café crème, brûlée, naïve, résumé.",
    "Ein Foto einer Katze auf einem roten Stuhl in Zürich, schön und groß.",
    "日本の猫の写真。一只猫坐在红色的椅子上。",
    "Ωmega α β γ, “quoted” and ‘single’ — dashes… and ½ cup.",
]
_SCENES = [
    "A weathered fisherman mending nets beside a wooden pier at dawn.",
    "Steam rises from a ceramic teapot on a windowsill covered in frost.",
    "Children flying bright kites above a windswept meadow of wildflowers.",
    "An abandoned greenhouse overgrown with ivy, sunlight streaming through broken glass.",
    "A vintage typewriter surrounded by crumpled paper and a flickering candle.",
    "Neon signs reflected in rain puddles along a narrow alley at midnight.",
    "A golden retriever splashing through shallow waves on a pebble beach.",
    "Snowcapped volcanoes towering over terraced rice fields and misty valleys.",
    "An astronomer peering through a brass telescope inside a domed observatory.",
    "Freshly baked croissants cooling on a marble counter in a quiet bakery.",
    "A hummingbird hovering near scarlet hibiscus blossoms in the tropical heat.",
    "Ancient stone ruins half buried in desert sand beneath a violet twilight.",
    "A jazz quartet performing in a smoky basement club with velvet curtains.",
    "Paper lanterns drifting across a calm lake during a summer festival.",
    "A tiny robot watering succulents on a cluttered apartment balcony.",
    "Glaciers calving into turquoise water while seals rest on floating ice.",
    "An elderly couple dancing in a sunlit kitchen full of copper pans.",
    "Autumn leaves swirling around a cobblestone plaza with a bronze fountain.",
    "A submarine exploring bioluminescent coral reefs deep under the ocean.",
    "Thunderclouds gathering over endless wheat fields and a lonely windmill.",
    "A chess match in a crowded park, pigeons pecking at scattered breadcrumbs.",
    "Watercolor sketch of a sleepy harbor town with pastel houses and sailboats.",
    "A knight in polished armor resting under an oak tree beside his horse.",
    "Macro photograph of morning dew clinging to a spider web.",
    "Futuristic train gliding silently through a forest of glass skyscrapers.",
    "A library ladder leaning against shelves stacked with leather-bound books.",
]

PROMPTS = [
    "a photo of a cat",
    "A red cube on the left of a blue sphere.",
    "An astronaut riding a horse on the moon, highly detailed, 4k",
    "a photo of a bench and a giraffe",
    "three green apples and one yellow banana",
    "a black and white photograph of a city street at night!",
    "wow!! a dog",
    "!!!",
    "Hello,   World",
    "  leading and trailing spaces  ",
    "tab\tseparated\nnew line",
    "\r\n windows line end",
    "café crème brûlée",
    "naïve résumé in Zürich",
    "combining e\u0301 accent",
    "It’s a “quoted” phrase — with dashes… and ‘single quotes’",
    "emoji 🐱🚀 party 🎉",
    "一只猫坐在红色的椅子上",
    "日本の猫の写真",
    "ＦＵＬＬ ｗｉｄｔｈ ｔｅｘｔ",
    "ligature ﬁne ﬂower",
    "½ cup of ² squared",
    "Ωmega α β γ Greek",
    "русский текст",
    "a cat\u00a0with a non-breaking space",
    "zero\u200bwidth",
    "a\u3000ideographic space",
    "numbers 1234567890 and 3.14",
    "don't, can't, we'll, I'm, they're, it's",
    "UPPER CASE PROMPT",
    "MiXeD CaSe",
    "#hashtag @mention http://example.com/path?q=1",
    "snake_case and kebab-case and CamelCase",
    "a<|endoftext|>b",
    "<|startoftext|> hi",
    "<|ENDOFTEXT|> shouted",
    "</s> and <pad> and <unk>",
    "a <extra_id_0> b<extra_id_1>c <extra_id_99>",
    "",
    " ",
    "a painting of a lighthouse at sunset in the style of van gogh",
    "four purple umbrellas under a stormy sky",
    "an oil painting of a mountain landscape with a river",
    " ".join(
        f"{count} {color} {thing}"
        for count, color, thing in zip(
            itertools.cycle(_COUNTS), itertools.cycle(_COLORS), _OBJECTS, strict=False
        )
    ),
]

# umT5's normalisation table here: a few of NFKC's mappings (full-width letters, ligatures,
# quotes, the no-break and ideographic spaces), so that its precompiled map is small.
_SMALL_RULES = [
    *((0xFF21 + i, [0x41 + i]) for i in range(26)),
    *((0xFF41 + i, [0x61 + i]) for i in range(26)),
    (0xFB01, [0x66, 0x69]),
    (0xFB02, [0x66, 0x6C]),
    (0x2019, [0x27]),
    (0x201C, [0x22]),
    (0x201D, [0x22]),
    (0x00A0, [0x20]),
    (0x3000, [0x20]),
]


def corpus() -> list[str]:
    """The corpus every vocabulary is learned from: flow_grpo-style prompts, and a few lines
    of punctuation, digits and other languages."""
    lines = []
    for (style, count, color), thing in zip(
        itertools.product(_STYLES, _COUNTS, _COLORS), itertools.cycle(_OBJECTS), strict=False
    ):
        place = _PLACES[len(lines) % len(_PLACES)]
        other = _OBJECTS[(len(lines) * 7) % len(_OBJECTS)]
        lines.append(f"{style} {count} {color} {thing} {place} a {other}")
    return lines + _SCENES * 2 + _EXTRA_LINES * 4


@functools.cache
def clip_vocabulary() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """CLIP's vocabulary in CLIP's order, learned from `corpus()`: the 256 byte symbols, their
    `</w>` forms, the symbol of each of `CLIP_MERGES` merges (the most frequent pair each time,
    counted over the corpus's words split as CLIP splits them), then `<|startoftext|>` and
    `<|endoftext|>`."""
    import regex
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = bytes_to_unicode()
    split = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+""")
    words: Counter[tuple[str, ...]] = Counter()
    for line in corpus():
        for word in split.findall(regex.sub(r"\s+", " ", line).lower()):
            pieces = [symbols[byte] for byte in word.encode("utf-8")]
            pieces[-1] += "</w>"
            words[tuple(pieces)] += 1
    base = list(symbols.values())
    tokens = base + [symbol + "</w>" for symbol in base]
    merges: list[tuple[str, str]] = []
    while len(merges) < CLIP_MERGES:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:], strict=False):
                pairs[pair] += count
        (first, second), _ = max(pairs.items(), key=lambda item: (item[1], item[0]))
        merges.append((first, second))
        tokens.append(first + second)
        merged: Counter[tuple[str, ...]] = Counter()
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if word[i : i + 2] == (first, second):
                    out.append(first + second)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += count
        words = merged
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    assert len(set(tokens)) == len(tokens)
    return {token: i for i, token in enumerate(tokens)}, merges


def _added(content: str, *, normalized: bool, strip: bool = False) -> dict[str, Any]:
    return {
        "content": content,
        "lstrip": strip,
        "normalized": normalized,
        "rstrip": strip,
        "single_word": False,
        "special": True,
    }


def write_clip_folder(folder: pathlib.Path, pad: str, *, legacy: bool) -> None:
    """A CLIP tokenizer folder as published: `vocab.json`, `merges.txt` (with its `#version`
    line), `tokenizer_config.json` and `special_tokens_map.json`, no `tokenizer.json`.

    `legacy`: the special tokens as an older transformers wrote them (normalised `AddedToken`
    dicts, no `added_tokens_decoder`); else as a newer one did (SD3's `tokenizer_2/`)."""
    vocab, merges = clip_vocabulary()
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False) + "\n")
    (folder / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8"
    )
    config: dict[str, Any] = {"add_prefix_space": False}
    if legacy:
        token = {"lstrip": False, "normalized": True, "rstrip": False, "single_word": False}
        start = {"__type": "AddedToken", "content": "<|startoftext|>", **token}
        end = {"__type": "AddedToken", "content": "<|endoftext|>", **token}
        config.update(bos_token=start, eos_token=end, unk_token=end)
        special = {
            "bos_token": {key: v for key, v in start.items() if key != "__type"},
            "eos_token": {key: v for key, v in end.items() if key != "__type"},
            "pad_token": pad,
            "unk_token": {key: v for key, v in end.items() if key != "__type"},
        }
    else:
        decoder = {
            str(vocab["<|startoftext|>"]): _added("<|startoftext|>", normalized=True),
            str(vocab["<|endoftext|>"]): _added("<|endoftext|>", normalized=False),
        }
        if pad not in ("<|startoftext|>", "<|endoftext|>"):
            decoder = {str(vocab[pad]): _added(pad, normalized=False), **decoder}
        config["added_tokens_decoder"] = decoder
        config.update(bos_token="<|startoftext|>", eos_token="<|endoftext|>")
        config.update(unk_token="<|endoftext|>")
        special = {
            "bos_token": _added("<|startoftext|>", normalized=True),
            "eos_token": _added("<|endoftext|>", normalized=False),
            "pad_token": _added(pad, normalized=False),
            "unk_token": _added("<|endoftext|>", normalized=False),
        }
        for value in special.values():
            value.pop("special")
    config.update(
        clean_up_tokenization_spaces=True,
        do_lower_case=True,
        errors="replace",
        model_max_length=CLIP_LENGTH,
        pad_token=pad,
        tokenizer_class="CLIPTokenizer",
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def sentencepiece_model(*, umt5: bool, small_rules: bool, vocab_size: int = 600) -> bytes:
    """A SentencePiece Unigram model trained on `corpus()`: T5's special pieces (`<pad>` 0,
    `</s>` 1, `<unk>` 2, no `<s>`) or umT5's (`<s>` 2 and `<unk>` 3), NFKC normalisation
    (`nmt_nfkc`, T5's) or the small table `_SMALL_RULES`."""
    import sentencepiece
    from sentencepiece import sentencepiece_model_pb2

    ids = dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3) if umt5 else {}
    ids = ids or dict(pad_id=0, eos_id=1, unk_id=2, bos_id=-1)
    with tempfile.TemporaryDirectory() as tmp:
        rules: dict[str, Any] = {"normalization_rule_name": "nmt_nfkc"}
        if small_rules:
            table = pathlib.Path(tmp) / "rules.tsv"
            table.write_text(
                "".join(
                    f"{source:X}\t{' '.join(f'{c:X}' for c in target)}\n"
                    for source, target in _SMALL_RULES
                )
            )
            rules = {"normalization_rule_tsv": str(table)}
        model = io.BytesIO()
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(corpus()),
            model_writer=model,
            vocab_size=vocab_size,
            model_type="unigram",
            character_coverage=1.0,
            hard_vocab_limit=False,
            num_threads=1,
            minloglevel=2,
            **rules,
            **ids,
        )
    # The trainer records the table's (temporary) path: clear it, so the file is the same
    # from run to run and in every folder that holds it.
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model.getvalue())
    proto.normalizer_spec.ClearField("normalization_rule_tsv")
    return proto.SerializeToString(deterministic=True)


def write_t5_folder(folder: pathlib.Path, model: bytes, extra_ids: int, *, legacy: bool) -> None:
    """A T5 tokenizer folder as published without `tokenizer.json`: `spiece.model` and the
    configuration (`extra_ids` sentinels after the pieces, last id first).

    `legacy`: an older transformers' configuration (`special_tokens_map.json`, no
    `added_tokens_decoder`); else a newer one's (each special token and sentinel in the
    `added_tokens_decoder`, the sentinels stripping spaces on both sides, as T5's do)."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    (folder / "spiece.model").write_bytes(model)
    sentinels = [f"<extra_id_{i}>" for i in range(extra_ids)]
    config: dict[str, Any] = {
        "additional_special_tokens": sentinels,
        "clean_up_tokenization_spaces": True,
        "eos_token": "</s>",
        "extra_ids": extra_ids,
        "legacy": True,
        "model_max_length": 512,
        "pad_token": "<pad>",
        "sp_model_kwargs": {},
        "tokenizer_class": "T5Tokenizer",
        "unk_token": "<unk>",
    }
    if legacy:
        special = {
            "additional_special_tokens": sentinels,
            "eos_token": "</s>",
            "pad_token": "<pad>",
            "unk_token": "<unk>",
        }
        (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    else:
        pieces = len(proto.pieces)
        decoder = {
            str(i): _added(p.piece, normalized=False)
            for i, p in enumerate(proto.pieces)
            if p.piece in ("<pad>", "</s>", "<unk>")
        }
        for i in range(extra_ids):
            decoder[str(pieces + extra_ids - 1 - i)] = _added(
                f"<extra_id_{i}>", normalized=False, strip=True
            )
        config = {"added_tokens_decoder": decoder, **config}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _encode(tokenizer: Any, length: int) -> dict[str, list[list[int]]]:
    out = tokenizer(PROMPTS, padding="max_length", truncation=True, max_length=length)
    return {"ids": out["input_ids"], "mask": out["attention_mask"]}


def _backend(tokenizer: Any, pad: str, length: int) -> dict[str, list[list[int]]]:
    tokenizer.enable_truncation(length)
    tokenizer.enable_padding(length=length, pad_id=tokenizer.token_to_id(pad), pad_token=pad)
    encodings = tokenizer.encode_batch(PROMPTS)
    return {"ids": [e.ids for e in encodings], "mask": [e.attention_mask for e in encodings]}


def _clip_converter(folder: pathlib.Path, pad: str) -> dict[str, list[list[int]]]:
    """transformers' `CLIPConverter` (what transformers 4's `CLIPTokenizerFast` was built
    from) on the folder's files, its special tokens added as the fast tokenizer added them."""
    from types import SimpleNamespace

    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import CLIPConverter

    vocab = json.loads((folder / "vocab.json").read_text())
    lines = (folder / "merges.txt").read_text(encoding="utf-8").splitlines()[1:]
    merges = [tuple(line.split(" ")) for line in lines]
    original = SimpleNamespace(
        encoder=vocab,
        bpe_ranks={merge: i for i, merge in enumerate(merges)},
        unk_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        eos_token_id=vocab["<|endoftext|>"],
        bos_token="<|startoftext|>",
        bos_token_id=vocab["<|startoftext|>"],
    )
    tokenizer = CLIPConverter(original).converted()
    specials = dict.fromkeys(["<|startoftext|>", "<|endoftext|>", pad])
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in specials])
    return _backend(tokenizer, pad, CLIP_LENGTH)


def _t5_converter(folder: pathlib.Path, extra_ids: int) -> dict[str, list[list[int]]]:
    """transformers' `T5Converter` (what transformers 4's `T5TokenizerFast` was built from)
    on the folder's `spiece.model`, its special tokens added as the fast tokenizer added
    them."""
    from types import SimpleNamespace

    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import T5Converter

    original = SimpleNamespace(
        vocab_file=str(folder / "spiece.model"), _extra_ids=extra_ids, legacy=True
    )
    converter = T5Converter(original)
    pieces = [p.piece for p in converter.proto.pieces]
    original.convert_tokens_to_ids = lambda token: pieces.index(token)
    tokenizer = converter.converted()
    specials = ["</s>", "<unk>", "<pad>", *(f"<extra_id_{i}>" for i in range(extra_ids))]
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in specials])
    return _backend(tokenizer, "<pad>", T5_LENGTH)


def _sentencepiece(folder: pathlib.Path) -> dict[str, list[list[int]]]:
    """SentencePiece's own ids, `</s>` appended, truncated and padded as transformers does."""
    import sentencepiece

    model = sentencepiece.SentencePieceProcessor(model_file=str(folder / "spiece.model"))
    ids, mask = [], []
    for prompt in PROMPTS:
        row = model.encode(prompt)[: T5_LENGTH - 1] + [model.eos_id()]
        ids.append(row + [model.pad_id()] * (T5_LENGTH - len(row)))
        mask.append([1] * len(row) + [0] * (T5_LENGTH - len(row)))
    return {"ids": ids, "mask": mask}


def _reference(ours: dict[str, list[list[int]]], other: dict[str, list[list[int]]]) -> Any:
    """Another reader's ids and masks where they differ from transformers': `differs`, the
    prompts' indices, and `ids` and `mask` of those prompts."""
    differs = [
        i
        for i in range(len(PROMPTS))
        if ours["ids"][i] != other["ids"][i] or ours["mask"][i] != other["mask"][i]
    ]
    return {
        "differs": differs,
        "ids": [other["ids"][i] for i in differs],
        "mask": [other["mask"][i] for i in differs],
    }


def make() -> None:
    import tokenizers
    import transformers
    from transformers import CLIPTokenizer, T5TokenizerFast

    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    write_clip_folder(OUT / "clip_l", "<|endoftext|>", legacy=True)
    write_clip_folder(OUT / "clip_g", "!", legacy=False)
    extra = {"t5": 100, "umt5": 300}
    write_t5_folder(
        OUT / "t5", sentencepiece_model(umt5=False, small_rules=False), 100, legacy=False
    )
    write_t5_folder(
        OUT / "umt5", sentencepiece_model(umt5=True, small_rules=True), 300, legacy=True
    )

    record: dict[str, Any] = {
        "versions": {
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
        "prompts": PROMPTS,
        "folders": {},
    }
    for name, pad in (("clip_l", "<|endoftext|>"), ("clip_g", "!")):
        tokenizer = CLIPTokenizer.from_pretrained(OUT / name)
        assert type(transformers.CLIPTokenizerFast.from_pretrained(OUT / name)) is CLIPTokenizer
        tokenizer.save_pretrained(OUT / f"{name}_json")
        ours = _encode(tokenizer, CLIP_LENGTH)
        again = _encode(CLIPTokenizer.from_pretrained(OUT / f"{name}_json"), CLIP_LENGTH)
        assert again == ours, f"{name}: transformers' ids differ from its saved tokenizer.json's"
        converter = _clip_converter(OUT / name, pad)
        record["folders"][name] = {
            "class": "CLIPTokenizer",
            "length": CLIP_LENGTH,
            **ours,
            "references": {"CLIPConverter": _reference(ours, converter)},
        }
    for name, count in extra.items():
        tokenizer = T5TokenizerFast.from_pretrained(OUT / name)
        tokenizer.save_pretrained(OUT / f"{name}_json")
        ours = _encode(tokenizer, T5_LENGTH)
        again = _encode(T5TokenizerFast.from_pretrained(OUT / f"{name}_json"), T5_LENGTH)
        assert again == ours, f"{name}: transformers' ids differ from its saved tokenizer.json's"
        references = {
            "sentencepiece": _sentencepiece(OUT / name),
            "T5Converter": _t5_converter(OUT / name, count),
        }
        record["folders"][name] = {
            "class": "T5TokenizerFast",
            "length": T5_LENGTH,
            **ours,
            "references": {key: _reference(ours, value) for key, value in references.items()},
        }
    (OUT / "ids.json").write_text(json.dumps(record, ensure_ascii=False) + "\n")
    for name, folder in record["folders"].items():
        for key, value in folder["references"].items():
            print(name, key, "differs on", [PROMPTS[i] for i in value["differs"]])


if __name__ == "__main__":
    if sys.argv[1:] != ["make"]:
        sys.exit("usage: python tools/make_tokenizer_fixtures.py make")
    make()
