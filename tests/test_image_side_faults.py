"""The image side's files and inputs, given wrong as a careful user or a damaged download
would give them: each is refused before any compute by an error naming the argument or the
file and what was expected, or (a uint8 image) refused with the conversion to make.

The models are the tiny fixtures of `tests/data/` (CLIP, PickScore's CLIP, T5, the SD3 and Wan
autoencoders, the tokenizers). The suite's runtime type checker would refuse some of these
inputs first, by their annotations; it is off in this module, so that what is checked is what
a user of the library sees.
"""

import json
import pathlib
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest

from flowgrpo_eqx.models import (
    CLIPModel,
    PromptTokenizer,
    clip_pixels,
    load_clip,
    load_diffusers,
    load_t5,
)
from flowgrpo_eqx.rewards import CLIPScore, DeviceReward, PickScore


DATA = pathlib.Path(__file__).resolve().parent / "data"
CONVERT = r"float in \[-1, 1\]; convert uint8 with x / 127\.5 - 1"


@pytest.fixture(autouse=True)
def _as_a_user_calls_it() -> Iterator[None]:
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", False)


# --- files --------------------------------------------------------------------------------


def _edit_json(file: str, edit: Callable[[dict[str, Any]], None]) -> Callable[[pathlib.Path], None]:
    def make(folder: pathlib.Path) -> None:
        config = json.loads((folder / file).read_text())
        edit(config)
        (folder / file).write_text(json.dumps(config))

    return make


def _write(file: str, content: bytes | Callable[[bytes], bytes]) -> Callable[[pathlib.Path], None]:
    def make(folder: pathlib.Path) -> None:
        path = folder / file
        path.write_bytes(content(path.read_bytes()) if callable(content) else content)

    return make


def _unlink(file: str) -> Callable[[pathlib.Path], None]:
    return lambda folder: (folder / file).unlink()


def _shards_without_weight_map(folder: pathlib.Path) -> None:
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text('{"metadata": {}}')


def _bin_only(folder: pathlib.Path) -> None:
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"PK\x03\x04 a torch zip")


LOADERS: dict[str, Callable[[pathlib.Path], Any]] = {
    "clip/model": load_clip,
    "clip/text_l": load_clip,
    "t5/v1_1": load_t5,
    "vae_tiny": load_diffusers,
    "wan_vae_tiny": load_diffusers,
}

FILE_CASES: list[tuple[str, str, Callable[[pathlib.Path], None], str]] = [
    ("binary config.json (CLIP)", "clip/model", _write("config.json", b"\xff\xfe\x00\x01"),
     r"config\.json is not UTF-8 text \(byte 0xff at offset 0\)"),
    ("binary config.json (T5)", "t5/v1_1", _write("config.json", b"\x89PNG\r\n"),
     r"config\.json is not UTF-8 text"),
    ("binary config.json (VAE)", "vae_tiny", _write("config.json", b"\xc0\x80"),
     r"config\.json is not UTF-8 text"),
    ("binary config.json (Wan VAE)", "wan_vae_tiny", _write("config.json", b"\xff"),
     r"config\.json is not UTF-8 text"),
    ("config.json not JSON", "clip/text_l", _write("config.json", b"{hidden_size: 32"),
     r"config\.json is not JSON"),
    ("config.json a list", "vae_tiny", _write("config.json", b"[1, 2]"),
     r"config\.json must hold a JSON object of the model's settings, got list"),
    ("no config.json", "t5/v1_1", _unlink("config.json"), r"has no config\.json"),
    ("CLIP config without text_config", "clip/model",
     _edit_json("config.json", lambda c: c.pop("text_config")),
     r"config\.json: `text_config` must be a JSON object of settings, got nothing"),
    ("CLIP config with a vision_config list", "clip/model",
     _edit_json("config.json", lambda c: c.update(vision_config=[])),
     r"`vision_config` must be a JSON object"),
    ("CLIP config without hidden_size", "clip/text_l",
     _edit_json("config.json", lambda c: c.pop("hidden_size")),
     r"config\.json has no `hidden_size`"),
    ("CLIP config with heads not dividing the width", "clip/model",
     _edit_json("config.json", lambda c: c["text_config"].update(num_attention_heads=5)),
     r"config\.json gives a model this library cannot build: `heads` \(5\) must divide"),
    ("T5 config without d_kv", "t5/v1_1", _edit_json("config.json", lambda c: c.pop("d_kv")),
     r"config\.json has no `d_kv` \(an int >= 1\)"),
    ("T5 config with a d_kv string", "t5/v1_1",
     _edit_json("config.json", lambda c: c.update(d_kv="8")),
     r"config\.json: `d_kv` must be an int >= 1, got '8'"),
    ("VAE config of a bad block_out_channels", "vae_tiny",
     _edit_json("config.json", lambda c: c.update(block_out_channels=[7, 16])),
     r"config\.json gives a model this library cannot build: `block_out_channels`"),
    ("empty .safetensors", "clip/model", _write("model.safetensors", b""),
     r"model\.safetensors is not a readable safetensors file \(0 bytes"),
    ("truncated .safetensors", "t5/v1_1", _write("model.safetensors", lambda b: b[: len(b) // 2]),
     r"model\.safetensors is not a readable safetensors file .*empty, truncated or damaged"),
    ("garbled .safetensors", "vae_tiny",
     _write("diffusion_pytorch_model.safetensors", lambda b: bytes(len(b) // 4) + b"\xff" * 99),
     r"diffusion_pytorch_model\.safetensors is not a readable safetensors file"),
    ("a shard index without weight_map", "clip/text_l", _shards_without_weight_map,
     r"model\.safetensors\.index\.json has no `weight_map`"),
    ("a .bin checkpoint only", "clip/model", _bin_only,
     r"holds a PyTorch \.bin checkpoint.*save_pretrained\(.*safe_serialization=True\)"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("fixture", "make", "match"),
    [case[1:] for case in FILE_CASES],
    ids=[case[0] for case in FILE_CASES],
)
def test_a_damaged_model_folder_is_refused_naming_the_file(
    tmp_path: pathlib.Path, fixture: str, make: Callable[[pathlib.Path], None], match: str
) -> None:
    folder = tmp_path / "model"
    shutil.copytree(DATA / fixture, folder)
    make(folder)
    with pytest.raises(ValueError, match=match) as error:
        LOADERS[fixture](folder)
    assert str(folder) in str(error.value)


# --- tokenizers ---------------------------------------------------------------------------

TOKENIZERS = DATA / "tokenizers"


def _tokenizer(name: str, make: Callable[[pathlib.Path], None], tmp_path: pathlib.Path) -> Any:
    folder = tmp_path / name
    shutil.copytree(TOKENIZERS / name, folder)
    make(folder)
    return PromptTokenizer(folder, 77)


TOKENIZER_FILE_CASES = [
    ("truncated tokenizer.json", "clip_l_json", _write("tokenizer.json", lambda b: b[:300]),
     r"tokenizer\.json is not a"),
    ("tokenizer_config.json not JSON", "clip_g", _write("tokenizer_config.json", b"{pad: !"),
     r"tokenizer_config\.json is not a JSON file"),
    ("a pad_token missing from the vocabulary", "clip_g",
     _edit_json("tokenizer_config.json", lambda c: c.update(pad_token="<|none|>")),
     r"pad_token '<\|none\|>'"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "make", "match"),
    [case[1:] for case in TOKENIZER_FILE_CASES],
    ids=[case[0] for case in TOKENIZER_FILE_CASES],
)
def test_a_damaged_tokenizer_folder_is_refused_naming_the_file(
    tmp_path: pathlib.Path, name: str, make: Callable[[pathlib.Path], None], match: str
) -> None:
    pytest.importorskip("tokenizers")
    with pytest.raises(ValueError, match=match) as error:
        _tokenizer(name, make, tmp_path)
    assert str(tmp_path) in str(error.value)


@pytest.mark.parametrize(
    ("prompts", "match"),
    [
        ("a red cube", r"`prompts` must be a list of strings, got one str"),
        (["a red cube", None], r"`prompts\[1\]` must be a string, got NoneType"),
        (["a \ud800 cube"], r"`prompts\[0\]` is not valid Unicode"),
    ],
    ids=["one string", "None", "a lone surrogate"],
)
def test_bad_prompts_are_refused_by_name(prompts: Any, match: str) -> None:
    pytest.importorskip("tokenizers")
    tokenizer = PromptTokenizer(TOKENIZERS / "clip_l", 77)
    with pytest.raises(ValueError, match=match):
        tokenizer(prompts)


def test_no_prompts_give_no_rows_of_the_length() -> None:
    pytest.importorskip("tokenizers")
    ids, mask = PromptTokenizer(TOKENIZERS / "t5", 32).encode([])
    assert ids.shape == mask.shape == (0, 32) and ids.dtype == np.int32


# --- inputs -------------------------------------------------------------------------------


class Models:
    """The tiny models the input cases are given to, loaded once."""

    def __init__(self) -> None:
        clip = load_clip(DATA / "clip" / "model")
        assert isinstance(clip, CLIPModel)
        self.clip = clip
        self.pickscore = PickScore(clip)
        self.text = load_clip(DATA / "clip" / "text_l")
        self.t5 = load_t5(DATA / "t5" / "v1_1")
        self.vae = load_diffusers(DATA / "vae_tiny")
        self.wan_vae = load_diffusers(DATA / "wan_vae_tiny")
        io = dict(np.load(DATA / "clip" / "processor.npz"))
        self.ids = jnp.asarray(io["ids"])
        self.mask = jnp.asarray(io["mask"])
        self.images = jnp.asarray(io["square"] * 2.0 - 1.0, jnp.float32)  # [2, 32, 32, 3]
        self.prompts = jax.vmap(self.pickscore.prompt_embedding)(self.ids, self.mask)
        self.reward = DeviceReward(self.pickscore, key="prompt", name="pickscore")


@pytest.fixture(scope="module")
def models() -> Models:
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        return Models()
    finally:
        jaxtyping.config.update("jaxtyping_disable", False)


def _uint8(images: jax.Array) -> np.ndarray:
    return np.asarray(jnp.round((images + 1.0) * 127.5), np.uint8)


def _with_alpha(images: jax.Array) -> jax.Array:
    return jnp.concatenate([images, jnp.ones_like(images[..., :1])], axis=-1)


INPUT_CASES: list[tuple[str, Callable[[Models], Any], str]] = [
    # Images into the autoencoders.
    ("RGBA image into the VAE", lambda m: m.vae.encode(jnp.zeros((16, 16, 4))),
     r"`image` must have 3 channels last \(\[H, W, 3\]\), got shape \(16, 16, 4\)"),
    ("greyscale image into the VAE", lambda m: m.vae.encode(jnp.zeros((16, 16, 1))),
     r"`image` must have 3 channels last"),
    ("a 0x0 image into the VAE", lambda m: m.vae.encode(jnp.zeros((0, 0, 3))),
     r"`image` must not be empty"),
    ("uint8 image into the VAE", lambda m: m.vae.encode(jnp.zeros((16, 16, 3), jnp.uint8)),
     CONVERT + ", got uint8"),
    ("int32 image into the VAE", lambda m: m.vae.encode(jnp.zeros((16, 16, 3), jnp.int32)),
     CONVERT + ", got int32"),
    ("a batch into the VAE", lambda m: m.vae.encode(jnp.zeros((2, 16, 16, 3))),
     r"`image` must be \[H, W, 3\].*vmap it over a batch"),
    ("int32 latent into the VAE", lambda m: m.vae.decode(jnp.zeros((2, 2, 4), jnp.int32)),
     r"`latent` must be float"),
    ("uint8 video into the Wan VAE",
     lambda m: m.wan_vae.encode(jnp.zeros((1, 16, 16, 3), jnp.uint8)), CONVERT + ", got uint8"),
    ("RGBA video into the Wan VAE", lambda m: m.wan_vae.encode(jnp.zeros((1, 16, 16, 4))),
     r"`video` must have 3 channels last"),
    # Images into CLIP's processor and PickScore.
    ("RGBA image into clip_pixels", lambda m: clip_pixels(jnp.zeros((32, 32, 4)), 32),
     r"`images` must have 3 channels last"),
    ("greyscale image into clip_pixels", lambda m: clip_pixels(jnp.zeros((32, 32, 1)), 32),
     r"`images` must have 3 channels last"),
    ("a 0x0 image into clip_pixels", lambda m: clip_pixels(jnp.zeros((0, 0, 3)), 32),
     r"`images` must not be empty"),
    ("uint8 image into clip_pixels",
     lambda m: clip_pixels(jnp.zeros((32, 32, 3), jnp.uint8), 32),
     r"`images` must be float in \[0, 1\]; convert uint8 with x / 255, got uint8"),
    ("RGBA images into PickScore",
     lambda m: jax.vmap(m.pickscore)(_with_alpha(m.images), m.prompts),
     r"`image` must have 3 channels last"),
    ("greyscale images into PickScore",
     lambda m: jax.vmap(m.pickscore)(m.images[..., :1], m.prompts),
     r"`image` must have 3 channels"),
    ("uint8 images into PickScore",
     lambda m: jax.vmap(m.pickscore)(jnp.asarray(_uint8(m.images)), m.prompts), CONVERT),
    ("uint8 images into CLIPScore",
     lambda m: jax.vmap(CLIPScore(m.clip))(jnp.asarray(_uint8(m.images)), m.prompts), CONVERT),
    ("video samples [N, F, H, W, C] into PickScore",
     lambda m: jax.vmap(m.pickscore)(jnp.stack([m.images, m.images], 1), m.prompts),
     r"`image` must be \[H, W, 3\] channels-last, got shape \(2, 32, 32, 3\).*its frames"),
    ("a prompt embedding of the wrong width into PickScore",
     lambda m: jax.vmap(m.pickscore)(m.images, m.prompts[:, :5]),
     r"`prompt` must be one prompt's float embedding \[24\].*got shape \(5,\)"),
    ("pixels of another size into image_features",
     lambda m: m.clip.image_features(jnp.zeros((16, 16, 3))), r"`pixels` must be \[32, 32, 3\]"),
    # DeviceReward's batch.
    ("DeviceReward given 2 samples and 3 prompt embeddings",
     lambda m: m.reward(
         np.asarray(m.images), {"prompt": np.concatenate([m.prompts, m.prompts[:1]])}),
     r"`rows\['prompt'\]` must have one row per sample, \[N = 2, \.\.\.\], got shape \(3, 24\)"),
    ("DeviceReward given uint8 samples",
     lambda m: m.reward(_uint8(m.images), {"prompt": np.asarray(m.prompts)}), CONVERT),
    ("DeviceReward given no samples",
     lambda m: m.reward(np.zeros((0, 32, 32, 3), np.float32), {"prompt": np.zeros((0, 24))}),
     r"`samples` must be \[N, \*sample\] with N >= 1"),
    # Token ids.
    ("float token ids into CLIP", lambda m: m.clip.text_features(m.ids[0].astype(jnp.float32)),
     r"`ids` must be integer token ids .*got float32"),
    ("float token ids into T5", lambda m: m.t5(jnp.asarray([1.0, 2.0])),
     r"`ids` must be integer token ids"),
    ("T5 with zero tokens", lambda m: m.t5(jnp.zeros((0,), jnp.int32)),
     r"`ids` must be \[L\] with 1 <= L, got shape \(0,\)"),
    ("CLIP with zero tokens", lambda m: m.text(jnp.zeros((0,), jnp.int32)),
     r"`ids` must be \[L\] with 1 <= L <= 16, got shape \(0,\)"),
    ("a token id past CLIP's vocabulary", lambda m: m.clip.text_features(m.ids[0].at[1].set(99)),
     r"`ids` holds token id 99 at position 1; ids must be in \[0, 99\)"),
    ("a negative token id into CLIP", lambda m: m.text(m.ids[0].at[3].set(-1)),
     r"`ids` holds token id -1 at position 3"),
    ("a token id past T5's vocabulary", lambda m: m.t5(np.asarray([1, 64, 2], np.int32)),
     r"`ids` holds token id 64 at position 1; ids must be in \[0, 64\)"),
    ("a negative token id into T5", lambda m: m.t5(jnp.asarray([-1, 2])),
     r"`ids` holds token id -1 at position 0"),
    ("a mask of another length", lambda m: m.clip.text_features(m.ids[0], m.mask[0, :5]),
     r"`attention_mask` must be \[L\] = \(9,\) of ints"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("call", "match"), [case[1:] for case in INPUT_CASES], ids=[case[0] for case in INPUT_CASES]
)
def test_a_bad_input_is_refused_by_name_before_any_compute(
    models: Models, call: Callable[[Models], Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        call(models)


TRACED_CASES: list[tuple[str, Callable[[Models, jax.Array], Any], np.ndarray]] = [
    ("CLIP", lambda m, ids: m.clip.text_features(ids), np.asarray([[1, 5, 99, 0]])),
    ("CLIP, negative", lambda m, ids: m.text(ids).pooled, np.asarray([[1, -2, 3, 0]])),
    ("T5", lambda m, ids: m.t5(ids), np.asarray([[1, 2, 3], [1, 1000, 2]])),
    ("T5, negative", lambda m, ids: m.t5(ids), np.asarray([[0, -1, 3]])),
]


@pytest.mark.parametrize(
    ("call", "ids"), [case[1:] for case in TRACED_CASES], ids=[case[0] for case in TRACED_CASES]
)
def test_a_traced_token_id_outside_the_vocabulary_raises_from_the_program(
    models: Models, call: Callable[[Models, jax.Array], Any], ids: np.ndarray
) -> None:
    """Inside `jit` the ids are not known until the program runs: `jnp.take` read NaN past
    the table (CLIP's and T5's states all NaN) and wrapped a negative id round to its last
    entries."""
    program = eqx.filter_jit(lambda ids: jax.vmap(lambda row: call(models, row))(ids))
    with pytest.raises(eqx.EquinoxRuntimeError, match="`ids` holds a token id outside"):
        jax.block_until_ready(program(jnp.asarray(ids, jnp.int32)))


def test_the_documented_conversion_of_uint8_images_scores_as_the_floats(models: Models) -> None:
    """uint8 images were scored as floats in 0..255 (PickScore 0.145 where the same images as
    floats scored 0.088); converted as the refusal says, they score as the floats do."""
    as_uint8 = _uint8(models.images)
    converted = as_uint8.astype(np.float32) / 127.5 - 1
    from_uint8 = models.reward(converted, {"prompt": np.asarray(models.prompts)})
    from_floats = models.reward(np.asarray(models.images), {"prompt": np.asarray(models.prompts)})
    np.testing.assert_allclose(from_uint8, from_floats, rtol=1e-5)
    with pytest.raises(ValueError, match=CONVERT):
        models.reward(as_uint8, {"prompt": np.asarray(models.prompts)})
