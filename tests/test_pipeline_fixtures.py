"""The tiny published-layout pipelines under `tests/data/pipelines/` load with the library as
it is: each component, each tokenizer with diffusers' ids, and the prompt encoders give what
diffusers' `encode_prompt` gave.

The fixtures were made by diffusers and transformers themselves
(`tools/make_pipeline_fixtures.py`, run by hand with diffusers 0.42.1 and transformers 5.25):
`save_pretrained` of tiny random SD3.5, FLUX.1-dev, FLUX.1-schnell and Wan 2.1 T2V pipelines,
with the tokenizers in the published layouts, and a PickScore model and processor; beside each,
`<name>_io.npz` (`encode_prompt`'s embeddings and the end-to-end outputs of two steps, which
these tests do not read yet) and `<name>_io.json` (every argument passed).
"""

import json
import pathlib
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flowgrpo_eqx.models import (
    AutoencoderKL,
    AutoencoderKLWan,
    CLIPModel,
    CLIPTextModel,
    Flux,
    FluxPromptEncoder,
    MMDiT,
    PromptTokenizer,
    SD3PromptEncoder,
    Wan,
    WanPromptEncoder,
    load_clip,
    load_diffusers,
    load_t5,
)
from flowgrpo_eqx.rewards import PickScore
from tests.diffusers_helpers import relative
from tests.tolerances import reference_model_rtol


PIPELINES = pathlib.Path(__file__).resolve().parent / "data" / "pipelines"
pytest.importorskip("tokenizers", reason="PromptTokenizer reads tokenizer files with it")
CLASSES = {
    "sd35": ("StableDiffusion3Pipeline", MMDiT, AutoencoderKL),
    "flux_dev": ("FluxPipeline", Flux, AutoencoderKL),
    "flux_schnell": ("FluxPipeline", Flux, AutoencoderKL),
    "wan": ("WanPipeline", Wan, AutoencoderKLWan),
}
# Each tokenizer folder and its length, as the pipeline calls it (max_sequence_length 16).
TOKENIZERS = {
    "sd35": {"tokenizer": 77, "tokenizer_2": 77, "tokenizer_3": 16},
    "flux_dev": {"tokenizer": 77, "tokenizer_2": 16},
    "flux_schnell": {"tokenizer": 77, "tokenizer_2": 16},
    "wan": {"tokenizer": 16},
}


def _io(name: str) -> dict[str, np.ndarray]:
    return dict(np.load(PIPELINES / f"{name}_io.npz"))


def _clip(folder: pathlib.Path) -> CLIPTextModel:
    model = load_clip(folder)
    assert isinstance(model, CLIPTextModel)
    return model


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_each_pipeline_folder_loads_as_published(name: str) -> None:
    folder = PIPELINES / name
    pipeline, transformer_type, vae_type = CLASSES[name]
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == pipeline
    assert isinstance(load_diffusers(folder / "transformer"), transformer_type)
    assert isinstance(load_diffusers(folder / "vae"), vae_type)
    encoders = [key for key in index if key.startswith("text_encoder") and index[key][0]]
    for encoder in encoders:
        architecture = index[encoder][1]
        if architecture.startswith("CLIP"):
            projected = architecture == "CLIPTextModelWithProjection"
            assert (_clip(folder / encoder).text_projection is not None) == projected
            assert projected == (name == "sd35")  # FLUX's CLIP-L has no projection
        else:
            assert architecture in ("T5EncoderModel", "UMT5EncoderModel")
            load_t5(folder / encoder)
    # The CLIP tokenizers as SD3 and FLUX.1 publish them: no tokenizer.json.
    for sub in TOKENIZERS[name]:
        published = sorted(path.name for path in (folder / sub).iterdir())
        assert ("tokenizer.json" in published) == (index[sub][1] == "T5Tokenizer"), published


def test_flux_dev_has_a_guidance_embedding_and_schnell_none() -> None:
    for name, guidance in (("flux_dev", True), ("flux_schnell", False)):
        config = json.loads((PIPELINES / name / "transformer" / "config.json").read_text())
        assert config["guidance_embeds"] is guidance


@pytest.mark.parametrize(
    ("name", "sub"), [(name, sub) for name, subs in TOKENIZERS.items() for sub in subs]
)
def test_each_tokenizer_gives_the_ids_diffusers_used(name: str, sub: str) -> None:
    io = _io(name)
    prompts = json.loads((PIPELINES / f"{name}_io.json").read_text())["prompts"]
    if name == "wan":  # WanPipeline cleans its prompts (collapsed whitespace; no ftfy here)
        prompts = [" ".join(prompt.split()) for prompt in prompts]
    tokenizer = PromptTokenizer(PIPELINES / name / sub, TOKENIZERS[name][sub])
    ids, mask = tokenizer.encode(prompts)
    np.testing.assert_array_equal(ids, io[f"ids_{sub}"])
    np.testing.assert_array_equal(mask, io[f"mask_{sub}"])
    if f"negative_ids_{sub}" in io:
        np.testing.assert_array_equal(tokenizer(["", ""]), io[f"negative_ids_{sub}"])


@pytest.mark.parametrize(
    ("name", "sub"),
    [("sd35", "tokenizer_3"), ("flux_dev", "tokenizer_2"), ("wan", "tokenizer")],
)
def test_the_published_spiece_model_gives_the_same_ids(
    tmp_path: pathlib.Path, name: str, sub: str
) -> None:
    # T5's folders hold both files; without tokenizer.json, spiece.model is read.
    for file in ("spiece.model", "tokenizer_config.json"):
        shutil.copy(PIPELINES / name / sub / file, tmp_path / file)
    length = TOKENIZERS[name][sub]
    prompts = [*json.loads((PIPELINES / f"{name}_io.json").read_text())["prompts"], ""]
    np.testing.assert_array_equal(
        PromptTokenizer(tmp_path, length)(prompts),
        PromptTokenizer(PIPELINES / name / sub, length)(prompts),
    )


def _close(got: Any, want: np.ndarray) -> None:
    assert np.asarray(got).shape == want.shape
    assert relative(np.asarray(got), want) < reference_model_rtol()


def test_sd35_prompt_encoder_is_encode_prompt() -> None:
    folder, io = PIPELINES / "sd35", _io("sd35")
    encoder = SD3PromptEncoder(
        _clip(folder / "text_encoder"),
        _clip(folder / "text_encoder_2"),
        load_t5(folder / "text_encoder_3"),
    )
    for prefix in ("", "negative_"):
        ids = [jnp.asarray(io[f"{prefix}ids_{sub}"]) for sub in TOKENIZERS["sd35"]]
        cond = jax.vmap(encoder)(*ids)
        _close(cond["context"], io[f"{prefix}prompt_embeds"])
        _close(cond["pooled"], io[f"{prefix}pooled_prompt_embeds"])


@pytest.mark.parametrize("name", ["flux_dev", "flux_schnell"])
def test_flux_prompt_encoder_is_encode_prompt(name: str) -> None:
    folder, io = PIPELINES / name, _io(name)
    encoder = FluxPromptEncoder(_clip(folder / "text_encoder"), load_t5(folder / "text_encoder_2"))
    cond = jax.vmap(encoder)(jnp.asarray(io["ids_tokenizer"]), jnp.asarray(io["ids_tokenizer_2"]))
    _close(cond["context"], io["prompt_embeds"])
    _close(cond["pooled"], io["pooled_prompt_embeds"])


def test_wan_prompt_encoder_is_encode_prompt() -> None:
    io = _io("wan")
    encoder = WanPromptEncoder(load_t5(PIPELINES / "wan" / "text_encoder"))
    for prefix in ("", "negative_"):
        ids, mask = io[f"{prefix}ids_tokenizer"], io[f"{prefix}mask_tokenizer"]
        context = jax.vmap(encoder)(jnp.asarray(ids), jnp.asarray(mask))
        _close(context, io[f"{prefix}prompt_embeds"])


def test_pickscore_loads_from_its_model_and_processor_folders() -> None:
    rewards = PIPELINES / "rewards"
    io = dict(np.load(rewards / "pickscore_io.npz"))
    model = load_clip(rewards / "pickscore")
    assert isinstance(model, CLIPModel)
    ids, mask = PromptTokenizer(rewards / "processor", 77).encode([str(p) for p in io["prompts"]])
    np.testing.assert_array_equal(ids, io["ids"])
    np.testing.assert_array_equal(mask, io["mask"])
    processor = json.loads((rewards / "processor" / "preprocessor_config.json").read_text())
    assert processor["crop_size"] == {"height": model.image_size, "width": model.image_size}
    reward = PickScore(model)
    embeddings = jax.vmap(reward.prompt_embedding)(jnp.asarray(ids), jnp.asarray(mask))
    features = io["text_features"]
    _close(embeddings, features / np.linalg.norm(features, axis=-1, keepdims=True))
    scores = jax.vmap(reward, in_axes=(None, 0))(jnp.asarray(io["image"]), embeddings)
    _close(scores, io["pickscore"])
