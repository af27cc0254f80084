"""Tokenizer folders as pipelines publish them, read into a `tokenizers.Tokenizer` without
transformers, sentencepiece or protobuf.

Three layouts are read, whichever the folder holds (in this order):

- `tokenizer.json`: the `tokenizers` package's own file, read as it is.
- `vocab.json` + `merges.txt`: CLIP's byte-level BPE (SD3's and FLUX.1's `tokenizer/` and
  `tokenizer_2/`, PickScore's processor), built as transformers' `CLIPTokenizer` builds it.
- `spiece.model`: T5's or umT5's SentencePiece Unigram model (a protobuf, parsed here by a
  small wire-format reader), built as transformers' `T5Tokenizer` (`T5TokenizerFast`) builds
  it.

`tokenizer_config.json` (and, where it has no `added_tokens_decoder`, `special_tokens_map.json`,
whose keys then win, as transformers reads them) gives the special and added tokens and the
padding token. The built tokenizers give transformers 5's ids exactly
(`tests/test_tokenizer_layouts.py`, with fixtures made by transformers itself:
`tools/make_tokenizer_fixtures.py`).
"""

import json
import pathlib
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE, Unigram


TOKENIZER_JSON = "tokenizer.json"
CLIP_FILES = ("vocab.json", "merges.txt")
SENTENCEPIECE_FILE = "spiece.model"
LOOKED_FOR = "tokenizer.json, vocab.json + merges.txt (CLIP's BPE) or spiece.model (T5's)"

# The named special tokens transformers adds to the tokenizer, in its order.
_NAMED = tuple(f"{name}_token" for name in ("bos", "eos", "unk", "sep", "pad", "cls", "mask"))
_LISTED = ("additional_special_tokens", "extra_special_tokens")
_ADDED_TOKEN_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")

# transformers' `CLIPTokenizer`: its defaults and its split of the normalised text (CLIP's
# regex, the special tokens first), each piece then mapped to byte-level symbols.
_CLIP_DEFAULTS = {
    "bos_token": "<|startoftext|>",
    "eos_token": "<|endoftext|>",
    "unk_token": "<|endoftext|>",
    "pad_token": "<|endoftext|>",
}
_CLIP_SPLIT = (
    r"<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]"
    r"|[^\s\p{L}\p{N}]+"
)
_CLIP_CLASSES = ("CLIPTokenizer", "CLIPTokenizerFast")

# transformers' `T5Tokenizer`: its defaults, and the unknown piece's id, which it fixes at 2
# (T5's layout: <pad> 0, </s> 1, <unk> 2) whatever the SentencePiece model says.
_T5_DEFAULTS = {"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
_T5_UNK_ID = 2
_T5_EXTRA_IDS = 100
_T5_CLASSES = ("T5Tokenizer", "T5TokenizerFast")
_SENTENCEPIECE_CONTROL = 3
_SENTENCEPIECE_UNIGRAM = 1


def read_tokenizer(folder: pathlib.Path) -> tuple[Tokenizer, str | None]:
    """The tokenizer a folder holds, and its padding token.

    **Arguments:**

    - `folder`: the tokenizer's folder.

    **Returns:**

    `(tokenizer, pad)`: the tokenizer with its normaliser, pre-tokeniser, post-processor and
    special tokens (no padding or truncation set), and the padding token the folder names
    (its reader's default for CLIP's and T5's files; from `tokenizer.json`'s own padding, or
    `None`, for a `tokenizer.json` whose configuration names none).

    **Raises:**

    - `ValueError`: naming the folder when it holds none of the known files (the message
        lists them), or naming the file that is missing, unreadable or malformed.
    """
    if not folder.is_dir():
        raise ValueError(f"`path` ({folder}) is not a folder; looked for {LOOKED_FOR} in it.")
    settings = _settings(folder)
    if (folder / TOKENIZER_JSON).is_file():
        tokenizer = _from_tokenizer_json(folder / TOKENIZER_JSON)
        padding = tokenizer.padding
        default = None if padding is None else str(padding["pad_token"])
        return tokenizer, _token(settings.get("pad_token")) or default
    present = [name for name in CLIP_FILES if (folder / name).is_file()]
    if present:
        if len(present) == 1:
            missing = next(name for name in CLIP_FILES if name not in present)
            raise ValueError(
                f"`path` ({folder}) has {present[0]} but no {missing}: CLIP's BPE needs both."
            )
        _check_class(folder, settings, _CLIP_CLASSES, "vocab.json + merges.txt")
        settings = {**_CLIP_DEFAULTS, **settings}
        return _clip_tokenizer(folder, settings), _token(settings["pad_token"])
    if (folder / SENTENCEPIECE_FILE).is_file():
        _check_class(folder, settings, _T5_CLASSES, SENTENCEPIECE_FILE)
        settings = {**_T5_DEFAULTS, **settings}
        return _t5_tokenizer(folder, settings), _token(settings["pad_token"])
    raise ValueError(f"`path` ({folder}) has none of {LOOKED_FOR}.")


def _read_json(path: pathlib.Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not a JSON file: {error}.") from error


def _read_object(path: pathlib.Path) -> dict[str, Any]:
    value = _read_json(path)
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(value).__name__}.")
    return value


def _settings(folder: pathlib.Path) -> dict[str, Any]:
    """`tokenizer_config.json`, with `special_tokens_map.json`'s keys over it where the config
    has no `added_tokens_decoder` (transformers reads the map only then)."""
    config = folder / "tokenizer_config.json"
    settings = _read_object(config) if config.is_file() else {}
    special = folder / "special_tokens_map.json"
    if "added_tokens_decoder" not in settings and special.is_file():
        settings.update(_read_object(special))
    return settings


def _token(value: Any) -> str | None:
    """A token's text: a string, or an added token's serialised `content`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _added_token(value: Any, *, special: bool) -> AddedToken | None:
    if isinstance(value, str):
        return AddedToken(value, special=special)
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        flags = {key: bool(value[key]) for key in _ADDED_TOKEN_FLAGS if key in value}
        flags.setdefault("special", special)
        return AddedToken(value["content"], **flags)
    return None


def _check_class(
    folder: pathlib.Path, settings: dict[str, Any], classes: tuple[str, ...], files: str
) -> None:
    named = settings.get("tokenizer_class")
    if named is not None and named not in classes:
        raise ValueError(
            f"`path` ({folder}): tokenizer_config.json names {named!r}, but {files} is read "
            f"only as {' or '.join(classes)}."
        )


def _add_special_tokens(tokenizer: Tokenizer, settings: dict[str, Any], path: pathlib.Path) -> None:
    """Add the folder's added and special tokens as transformers 5 does: the
    `added_tokens_decoder`'s tokens by id; then each named special token and each listed one
    whose text is not among those, unless an equal token (text and flags) is already
    pending. A token in the vocabulary keeps its id, a new one is appended; of two tokens of
    one text, the later's flags win (as the `tokenizers` package adds them)."""
    decoder = settings.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        raise ValueError(f"{path}: `added_tokens_decoder` must be an object.")
    try:
        ordered = sorted(decoder.items(), key=lambda item: int(item[0]))
    except ValueError as error:
        raise ValueError(f"{path}: `added_tokens_decoder`'s keys must be ids.") from error
    pending: list[str | AddedToken] = []
    for _, value in ordered:
        token = _added_token(value, special=False)
        if token is None:
            raise ValueError(f"{path}: `added_tokens_decoder` holds {value!r}, not a token.")
        pending.append(token)
    texts = {str(token) for token in pending}
    for value in [*(settings.get(name) for name in _NAMED), *_listed(settings)]:
        special = value if isinstance(value, str) else _added_token(value, special=True)
        if special is not None and str(special) not in texts and special not in pending:
            pending.append(special)
    tokenizer.add_tokens(
        [AddedToken(token, special=True) if isinstance(token, str) else token for token in pending]
    )


def _from_tokenizer_json(path: pathlib.Path) -> Tokenizer:
    try:
        return Tokenizer.from_file(str(path))
    except Exception as error:  # the package raises its own untyped exceptions
        raise ValueError(
            f"{path} is not a tokenizer file the `tokenizers` package reads: {error}"
        ) from error


def _check_vocabulary(
    tokenizer: Tokenizer, settings: dict[str, Any], names: tuple[str, ...], vocabulary: pathlib.Path
) -> None:
    """Raise unless each named token is in the model's vocabulary or the configuration's
    `added_tokens_decoder` (transformers would append it with a new id, past the text
    encoder's embeddings)."""
    decoder = settings.get("added_tokens_decoder") or {}
    added = {_token(value) for value in decoder.values()} if isinstance(decoder, dict) else set()
    for name in names:
        token = _token(settings.get(name))
        if token is None or (tokenizer.token_to_id(token) is None and token not in added):
            raise ValueError(
                f"`path` ({vocabulary.parent}): the {name} {token!r} of tokenizer_config.json "
                f"(or special_tokens_map.json) is not in the vocabulary ({vocabulary.name})."
            )


def _id(tokenizer: Tokenizer, token: str) -> int:
    found = tokenizer.token_to_id(token)
    assert found is not None, token  # checked by _check_vocabulary
    return found


# CLIP's byte-level BPE -----------------------------------------------------------------------


def _clip_tokenizer(folder: pathlib.Path, settings: dict[str, Any]) -> Tokenizer:
    """transformers' `CLIPTokenizer` of `vocab.json` and `merges.txt`: BPE whose words end in
    `</w>`, NFC, whitespace runs as one space, lower case, CLIP's regex split then byte-level
    symbols, `<|startoftext|> ... <|endoftext|>` around the ids."""
    vocab_path, merges_path = (folder / name for name in CLIP_FILES)
    vocab = _read_json(vocab_path)
    if not (
        isinstance(vocab, dict)
        and all(isinstance(key, str) and type(value) is int for key, value in vocab.items())
    ):
        raise ValueError(f"{vocab_path} must map tokens to int ids.")
    merges = _read_merges(merges_path)
    unk = _token(settings["unk_token"])
    try:
        model = BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="</w>",
            fuse_unk=False,
            unk_token=unk,
        )
    except Exception as error:  # the package raises its own untyped exceptions
        raise ValueError(f"{vocab_path} and {merges_path} do not make a BPE: {error}") from error
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()]
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_CLIP_SPLIT), behavior="removed", invert=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    _check_vocabulary(tokenizer, settings, ("bos_token", "eos_token", "pad_token"), vocab_path)
    _add_special_tokens(tokenizer, settings, folder / "tokenizer_config.json")
    bos, eos = str(_token(settings["bos_token"])), str(_token(settings["eos_token"]))
    tokenizer.post_processor = processors.RobertaProcessing(
        (eos, _id(tokenizer, eos)),
        (bos, _id(tokenizer, bos)),
        trim_offsets=False,
        add_prefix_space=False,
    )
    return tokenizer


def _read_merges(path: pathlib.Path) -> list[tuple[str, str]]:
    """`merges.txt`: a `#version` line, then one merge a line, its two symbols split by a
    space (as the `tokenizers` package reads the file)."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not a UTF-8 text file: {error}.") from error
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    merges: list[tuple[str, str]] = []
    for number, line in enumerate(lines, start=1):
        line = line.removesuffix("\r")
        if line.startswith("#version"):
            continue
        parts = line.split(" ")
        if len(parts) != 2 or not all(parts):
            raise ValueError(f"{path}, line {number}: a merge is two symbols, got {line!r}.")
        merges.append((parts[0], parts[1]))
    return merges


# T5's SentencePiece Unigram ------------------------------------------------------------------


@dataclass(frozen=True)
class _Piece:
    text: str
    score: float
    type: int


@dataclass(frozen=True)
class _SentencePieceModel:
    """What the tokenizer is built from, of a SentencePiece `ModelProto`."""

    pieces: list[_Piece]
    precompiled_charsmap: bytes


def _t5_tokenizer(folder: pathlib.Path, settings: dict[str, Any]) -> Tokenizer:
    """transformers' `T5Tokenizer` of `spiece.model`: the pieces with their scores, then the
    `extra_ids` sentinels `<extra_id_{n-1}>` ... `<extra_id_0>` (score 0) as a Unigram model;
    the model's precompiled normaliser; whitespace splits, each word given a leading `▁`; `</s>`
    after the ids; the control pieces and sentinels as special tokens."""
    path = folder / SENTENCEPIECE_FILE
    model = _parse_sentencepiece(path)
    extra_ids = settings.get("extra_ids", _T5_EXTRA_IDS)
    if type(extra_ids) is not int or extra_ids < 0:
        raise ValueError(f"{folder / 'tokenizer_config.json'}: `extra_ids` must be an int >= 0.")
    vocab = [(piece.text, piece.score) for piece in model.pieces]
    vocab += [(f"<extra_id_{i}>", 0.0) for i in range(extra_ids - 1, -1, -1)]
    try:
        tokenizer = Tokenizer(Unigram(vocab, unk_id=_T5_UNK_ID, byte_fallback=False))
    except Exception as error:  # the package raises its own untyped exceptions
        raise ValueError(f"{path} does not make a Unigram model: {error}") from error
    if model.precompiled_charsmap:
        try:
            tokenizer.normalizer = normalizers.Precompiled(model.precompiled_charsmap)
        except Exception as error:  # the package raises its own untyped exceptions
            raise ValueError(f"{path}: its normaliser's precompiled map is malformed.") from error
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True),
        ]
    )
    # transformers lists the control pieces and the sentinels in place of the configuration's
    # `additional_special_tokens` (its `extra_special_tokens` stay).
    control = [piece.text for piece in model.pieces if piece.type == _SENTENCEPIECE_CONTROL]
    listed = [*control, *(f"<extra_id_{i}>" for i in range(extra_ids))]
    _check_vocabulary(tokenizer, settings, ("eos_token", "pad_token"), path)
    _add_special_tokens(
        tokenizer,
        {**settings, "additional_special_tokens": listed},
        folder / "tokenizer_config.json",
    )
    eos = str(_token(settings["eos_token"]))
    tokenizer.post_processor = processors.TemplateProcessing(
        single=["$A", eos],
        pair=["$A", eos, "$B", eos],
        special_tokens=[(eos, _id(tokenizer, eos))],
    )
    return tokenizer


def _listed(settings: dict[str, Any]) -> list[Any]:
    values: list[Any] = []
    for name in _LISTED:
        listed = settings.get(name)
        if isinstance(listed, list):
            values.extend(listed)
    return values


# A SentencePiece model is a protobuf message (sentencepiece_model.proto): ModelProto holds its
# pieces (field 1), its TrainerSpec (2) and its NormalizerSpec (3). Only what the tokenizer is
# built from is read; every other field is skipped by its wire type.
_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5


def _parse_sentencepiece(path: pathlib.Path) -> _SentencePieceModel:
    data = path.read_bytes()
    try:
        pieces: list[_Piece] = []
        model_type = _SENTENCEPIECE_UNIGRAM
        charsmap = b""
        for number, wire, value in _fields(data):
            if number == 1 and isinstance(value, bytes):
                pieces.append(_parse_piece(value))
            elif number == 2 and isinstance(value, bytes):
                for field, _, item in _fields(value):
                    if field == 3 and isinstance(item, int):
                        model_type = item
            elif number == 3 and isinstance(value, bytes):
                for field, _, item in _fields(value):
                    if field == 2 and isinstance(item, bytes):
                        charsmap = item
            elif number in (1, 2, 3):
                raise ValueError(f"field {number} has wire type {wire}")
    except (ValueError, UnicodeDecodeError, struct.error) as error:
        raise ValueError(f"{path} is not a SentencePiece model: {error}.") from error
    if not pieces:
        raise ValueError(f"{path} is not a SentencePiece model: it holds no pieces.")
    if model_type != _SENTENCEPIECE_UNIGRAM:
        raise ValueError(
            f"{path} is a SentencePiece model of type {model_type}; only Unigram models (type 1, "
            "T5's and umT5's) are read."
        )
    return _SentencePieceModel(pieces, charsmap)


def _parse_piece(data: bytes) -> _Piece:
    text, score, kind = None, 0.0, 1
    for number, _, value in _fields(data):
        if number == 1 and isinstance(value, bytes):
            text = value.decode("utf-8")
        elif number == 2 and isinstance(value, bytes) and len(value) == 4:
            score = struct.unpack("<f", value)[0]
        elif number == 3 and isinstance(value, int):
            kind = value
    if text is None:
        raise ValueError("a piece has no text")
    return _Piece(text, score, kind)


def _fields(data: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """A protobuf message's fields in order: `(number, wire type, value)`, the value an int for
    a varint and the raw bytes otherwise."""
    position = 0
    while position < len(data):
        key, position = _varint(data, position)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise ValueError("a field numbered 0")
        value: int | bytes
        if wire == _VARINT:
            value, position = _varint(data, position)
        elif wire == _LENGTH:
            size, position = _varint(data, position)
            if position + size > len(data):
                raise ValueError("a field runs past the end of its message")
            value, position = data[position : position + size], position + size
        elif wire in (_FIXED64, _FIXED32):
            size = 8 if wire == _FIXED64 else 4
            if position + size > len(data):
                raise ValueError("a field runs past the end of its message")
            value, position = data[position : position + size], position + size
        else:
            raise ValueError(f"wire type {wire}")
        yield number, wire, value


def _varint(data: bytes, position: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if position >= len(data):
            raise ValueError("a varint runs past the end of its message")
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position
        shift += 7
        if shift >= 64:
            raise ValueError("a varint longer than 10 bytes")
