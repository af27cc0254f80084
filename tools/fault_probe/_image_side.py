"""Faults of the image side: the model folders, tokenizers and inputs of the autoencoders,
CLIP, T5, PickScore and `DeviceReward`, given wrong as a careful user or a damaged download
gives them. Each runs in a fresh interpreter of the checkout (as `python` runs it, without
the test suite's runtime type checker) on the tiny models of `tests/data/`, judged as the
library group judges its snippets (`_library`): a refusal is `named` when it is a
`ValueError` (or, for ids only known on the device, `eqx.error_if`'s `EquinoxRuntimeError`)
whose message names the argument or the file; a value returned is `held` only where it is
the documented one (no prompts give `(0, length)` ids)."""

from collections.abc import Mapping
from typing import Any

from ._library import RUNTIME_ERRORS, Case, probe
from ._probe import REPO, Fault


GROUP = "image side"

SETUP = f"""\
import shutil
from flowgrpo_eqx.models import (
    CLIPModel, PromptTokenizer, clip_pixels, load_clip, load_diffusers, load_t5,
)
from flowgrpo_eqx.rewards import DeviceReward, PickScore

DATA = pathlib.Path({str(REPO / "tests" / "data")!r})


def copy(name):
    folder = pathlib.Path("model")
    shutil.copytree(DATA / name, folder)
    return folder


def edit(file, change):
    config = json.loads(file.read_text())
    change(config)
    file.write_text(json.dumps(config))
"""
"""The imports and helpers of every snippet: a copy of a fixture folder to damage."""

MODELS = """\
clip = load_clip(DATA / "clip" / "model")
pickscore = PickScore(clip)
io = dict(np.load(DATA / "clip" / "processor.npz"))
ids, mask = jnp.asarray(io["ids"]), jnp.asarray(io["mask"])
images = jnp.asarray(io["square"] * 2.0 - 1.0, jnp.float32)
prompts = jax.vmap(pickscore.prompt_embedding)(ids, mask)
uint8 = np.asarray(jnp.round((images + 1.0) * 127.5), np.uint8)
"""
"""PickScore's tiny CLIP, two prompts' ids and embeddings, two 32x32 images in [-1, 1] and
the same as uint8."""

CONVERT = ("x / 127.5 - 1",)
"""What a refusal of a uint8 image must say: the conversion to make."""


def _no_rows(value: Mapping[str, Any]) -> str | None:
    if value["shape"] == [0, 77] and value["mask"] == [0, 77]:
        return "no prompts give ids and mask of shape (0, 77), as documented"
    return None


def _file(name: str, fixture: str, damage: str, loader: str, names: tuple[str, ...]) -> Case:
    body = f"""
folder = copy({fixture!r})
{damage}
result = {{"loaded": type({loader}(folder)).__name__}}
"""
    return Case(name, SETUP, body, names)


FILES: tuple[Case, ...] = (
    _file("a binary config.json (CLIP)", "clip/model",
          'pathlib.Path(folder, "config.json").write_bytes(bytes([0xFF, 0xFE, 0, 1]))',
          "load_clip", ("config.json is not UTF-8",)),
    _file("a binary config.json (T5)", "t5/v1_1",
          'pathlib.Path(folder, "config.json").write_bytes(b"\\x89PNG\\r\\n")',
          "load_t5", ("config.json is not UTF-8",)),
    _file("a binary config.json (VAE)", "vae_tiny",
          'pathlib.Path(folder, "config.json").write_bytes(b"\\xc0\\x80")',
          "load_diffusers", ("config.json is not UTF-8",)),
    _file("a config.json that is a list", "vae_tiny",
          'pathlib.Path(folder, "config.json").write_text("[1, 2]")',
          "load_diffusers", ("config.json must hold a JSON object",)),
    _file("a CLIP config without text_config", "clip/model",
          'edit(folder / "config.json", lambda c: c.pop("text_config"))',
          "load_clip", ("`text_config`",)),
    _file("a T5 config without d_kv", "t5/v1_1",
          'edit(folder / "config.json", lambda c: c.pop("d_kv"))', "load_t5", ("`d_kv`",)),
    _file("a truncated .safetensors", "clip/model",
          'f = folder / "model.safetensors"; f.write_bytes(f.read_bytes()[:1000])',
          "load_clip", ("model.safetensors is not a readable safetensors file",)),
    _file("an empty .safetensors", "t5/v1_1", '(folder / "model.safetensors").write_bytes(b"")',
          "load_t5", ("model.safetensors is not a readable safetensors file",)),
    _file("a garbled .safetensors", "vae_tiny",
          'f = folder / "diffusion_pytorch_model.safetensors"; '
          'f.write_bytes(b"\\xff" * f.stat().st_size)',
          "load_diffusers", ("diffusion_pytorch_model.safetensors is not a readable",)),
    _file("a shard index without weight_map", "clip/text_l",
          '(folder / "model.safetensors").unlink(); '
          '(folder / "model.safetensors.index.json").write_text("{}")',
          "load_clip", ("weight_map",)),
    _file("a .bin checkpoint only", "clip/model",
          '(folder / "model.safetensors").unlink(); '
          '(folder / "pytorch_model.bin").write_bytes(b"PK")',
          "load_clip", ("PyTorch .bin checkpoint",)),
    Case("a truncated tokenizer.json", SETUP, """
folder = copy("tokenizers/clip_l_json")
f = folder / "tokenizer.json"
f.write_bytes(f.read_bytes()[:300])
result = {"built": repr(PromptTokenizer(folder, 77))}
""", ("tokenizer.json is not a",)),
    Case("a tokenizer_config.json that is not JSON", SETUP, """
folder = copy("tokenizers/clip_g")
(folder / "tokenizer_config.json").write_bytes(b"{pad_token: !")
result = {"built": repr(PromptTokenizer(folder, 77))}
""", ("tokenizer_config.json is not a JSON",)),
    Case("a pad_token missing from the vocabulary", SETUP, """
folder = copy("tokenizers/clip_g")
edit(folder / "tokenizer_config.json", lambda c: c.update(pad_token="<|none|>"))
result = {"built": repr(PromptTokenizer(folder, 77))}
""", ("pad_token",)),
)  # fmt: skip


def _input(name: str, body: str, names: tuple[str, ...], errors: tuple[str, ...] = ()) -> Case:
    return Case(name, SETUP + MODELS, body, names, errors or ("ValueError",))


INPUTS: tuple[Case, ...] = (
    _input("an RGBA image into the VAE", """
vae = load_diffusers(DATA / "vae_tiny")
result = {"latent": list(vae.encode(jnp.zeros((16, 16, 4))).shape)}
""", ("`image`",)),
    _input("a greyscale image into clip_pixels",
           "result = {'pixels': list(clip_pixels(jnp.zeros((32, 32, 1)), 32).shape)}",
           ("`images`",)),
    _input("a 0x0 image into clip_pixels",
           "result = {'pixels': list(clip_pixels(jnp.zeros((0, 0, 3)), 32).shape)}",
           ("`images`",)),
    _input("RGBA images into PickScore", """
rgba = jnp.concatenate([images, jnp.ones_like(images[..., :1])], axis=-1)
result = {"scores": np.asarray(jax.vmap(pickscore)(rgba, prompts)).tolist()}
""", ("`image`",)),
    _input("video samples [N, F, H, W, C] into PickScore", """
video = jnp.stack([images, images], axis=1)
result = {"scores": np.asarray(jax.vmap(pickscore)(video, prompts)).tolist()}
""", ("`image`",)),
    _input("a prompt embedding of the wrong width into PickScore", """
result = {"scores": np.asarray(jax.vmap(pickscore)(images, prompts[:, :5])).tolist()}
""", ("`prompt`",)),
    _input("float token ids into CLIP",
           "result = {'features': np.asarray(clip.text_features(ids[0] * 1.0)).tolist()}",
           ("`ids`",)),
    _input("T5 with zero tokens", """
t5 = load_t5(DATA / "t5" / "v1_1")
result = {"states": list(t5(jnp.zeros((0,), jnp.int32)).shape)}
""", ("`ids`",)),
    _input("DeviceReward given 2 samples and 3 prompt embeddings", """
reward = DeviceReward(pickscore, key="prompt")
three = np.concatenate([np.asarray(prompts), np.asarray(prompts)[:1]])
result = {"scores": reward(np.asarray(images), {"prompt": three}).tolist()}
""", ("`rows['prompt']`",)),
    # What was taken silently.
    _input("uint8 images into the VAE", """
vae = load_diffusers(DATA / "vae_tiny")
result = {"latent": str(jax.vmap(vae.encode)(jnp.zeros((2, 16, 16, 3), jnp.uint8)).dtype)}
""", CONVERT),
    _input("an int32 image into the VAE", """
vae = load_diffusers(DATA / "vae_tiny")
result = {"latent": str(vae.encode(jnp.zeros((16, 16, 3), jnp.int32)).dtype)}
""", CONVERT),
    _input("a uint8 video into the Wan VAE", """
vae = load_diffusers(DATA / "wan_vae_tiny")
result = {"latent": str(vae.encode(jnp.zeros((1, 16, 16, 3), jnp.uint8)).dtype)}
""", CONVERT),
    _input("uint8 images into PickScore",
           "result = {'scores': np.asarray(jax.vmap(pickscore)(jnp.asarray(uint8), prompts))"
           ".tolist()}", CONVERT),
    _input("uint8 samples into DeviceReward", """
reward = DeviceReward(pickscore, key="prompt")
result = {"scores": reward(uint8, {"prompt": np.asarray(prompts)}).tolist()}
""", CONVERT),
    _input("a token id past CLIP's vocabulary",
           "result = {'features': np.asarray(clip.text_features(ids[0].at[1].set(99))).tolist()}",
           ("`ids`",)),
    _input("a negative token id into CLIP",
           "result = {'features': np.asarray(clip.text_features(ids[0].at[1].set(-1))).tolist()}",
           ("`ids`",)),
    _input("a token id past T5's vocabulary, traced", """
t5 = load_t5(DATA / "t5" / "v1_1")
states = eqx.filter_jit(jax.vmap(t5))(jnp.asarray([[1, 2, 3], [1, 1000, 2]]))
result = {"finite": bool(jnp.all(jnp.isfinite(states)))}
""", ("`ids`",), RUNTIME_ERRORS),
    _input("a negative token id into T5, traced", """
t5 = load_t5(DATA / "t5" / "v1_1")
states = eqx.filter_jit(jax.vmap(t5))(jnp.asarray([[0, -1, 3]]))
result = {"first": np.asarray(states[0, 1, :3]).tolist()}
""", ("`ids`",), RUNTIME_ERRORS),
    # Prompts.
    _input("one string instead of a list of prompts", """
tokenizer = PromptTokenizer(DATA / "tokenizers" / "clip_l", 77)
result = {"shape": list(tokenizer("a red cube").shape)}
""", ("`prompts`",)),
    _input("a prompt that is None", """
tokenizer = PromptTokenizer(DATA / "tokenizers" / "clip_l", 77)
result = {"shape": list(tokenizer(["a red cube", None]).shape)}
""", ("`prompts[1]`",)),
    _input("a prompt holding a lone surrogate", """
tokenizer = PromptTokenizer(DATA / "tokenizers" / "clip_l", 77)
result = {"shape": list(tokenizer(["a \\ud800 cube"]).shape)}
""", ("`prompts[0]`",)),
    Case("an empty prompt list", SETUP, """
ids, mask = PromptTokenizer(DATA / "tokenizers" / "clip_l", 77).encode([])
result = {"shape": list(ids.shape), "mask": list(mask.shape)}
""", ("`prompts`",), held=_no_rows),
)  # fmt: skip

CASES: tuple[Case, ...] = FILES + INPUTS


def faults() -> list[Fault]:
    """Every fault of the image side, one fresh interpreter each."""
    return [Fault(GROUP, case.name, probe(case)) for case in CASES]
