"""CLIP's towers against transformers' `CLIPTextModel`, `CLIPTextModelWithProjection` and
`CLIPModel`, and the CLIP image processor, without torch.

The fixtures under `tests/data/clip/` were made by transformers itself
(`tools/make_clip_fixtures.py`, run by hand with torch and transformers).
"""

import json
import pathlib
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from flowgrpo_eqx.models import CLIPModel, CLIPTextModel, TowerShape, clip_pixels, load_clip
from flowgrpo_eqx.models._mirror import state_dict_leaves
from tests.diffusers_helpers import count, relative
from tests.tolerances import reference_model_rtol


CLIP = pathlib.Path(__file__).resolve().parent / "data" / "clip"


@pytest.mark.parametrize("name", ["text_l", "text_g"])
def test_text_towers_match_transformers(name: str) -> None:
    rtol = reference_model_rtol()
    model = load_clip(CLIP / name)
    assert isinstance(model, CLIPTextModel)
    io = dict(np.load(CLIP / name / "io.npz"))
    out = jax.vmap(model)(jnp.asarray(io["ids"]))
    assert relative(np.asarray(out.hidden_states), io["hidden_states"]) < rtol
    assert relative(np.asarray(out.last_hidden_state), io["last"]) < rtol
    assert relative(np.asarray(out.pooled), io["pooled"]) < rtol
    masked = jax.vmap(model)(jnp.asarray(io["ids"]), jnp.asarray(io["mask"]))
    if name == "text_g":
        assert out.text_embeds is not None and masked.text_embeds is not None
        assert relative(np.asarray(out.text_embeds), io["text_embeds"]) < rtol
        assert relative(np.asarray(masked.text_embeds), io["pooled_masked"]) < rtol
    else:
        assert out.text_embeds is None
        assert relative(np.asarray(masked.pooled), io["pooled_masked"]) < rtol


def test_clip_model_features_and_pickscore_match_transformers() -> None:
    rtol = reference_model_rtol()
    model = load_clip(CLIP / "model")
    assert isinstance(model, CLIPModel)
    io = dict(np.load(CLIP / "model" / "io.npz"))
    image = np.asarray(jax.vmap(model.image_features)(jnp.asarray(io["pixels"])))
    text = np.asarray(
        jax.vmap(model.text_features)(jnp.asarray(io["ids"]), jnp.asarray(io["mask"]))
    )
    assert relative(image, io["image_features"]) < rtol
    assert relative(text, io["text_features"]) < rtol
    # flow_grpo's statement in float64 on our features: the temperature times the cosine / 26.
    cosine = np.sum(image.astype(np.float64) * text, axis=1) / (
        np.linalg.norm(image.astype(np.float64), axis=1) * np.linalg.norm(text, axis=1)
    )
    score = np.exp(float(model.logit_scale)) * cosine / 26
    np.testing.assert_allclose(score, io["pickscore"], rtol=rtol)


def test_the_image_processor_in_jax() -> None:
    io = dict(np.load(CLIP / "processor.npz"))
    square = np.asarray(jax.vmap(lambda x: clip_pixels(x, 32))(jnp.asarray(io["square"])))
    np.testing.assert_allclose(square, io["square_pixels"], rtol=0, atol=1e-5)
    wide = np.asarray(jax.vmap(lambda x: clip_pixels(x, 32))(jnp.asarray(io["wide"])))
    # Resampled, the two differ: PIL resamples the 8-bit image and rounds its result to 8
    # bits, and treats the border otherwise. On uniform noise (the hardest case for a bicubic
    # filter) the mean difference was 0.0048 of the normalised range (a third of an 8-bit
    # step) and the largest 0.21 (14 steps, at the border).
    assert wide.shape == io["wide_pixels"].shape
    difference = np.abs(wide - io["wide_pixels"])
    assert np.mean(difference) < 0.01 and np.max(difference) < 0.3


def test_a_checkpoint_that_does_not_fit_lists_every_key(tmp_path: pathlib.Path) -> None:
    folder = tmp_path / "clip"
    shutil.copytree(CLIP / "text_g", folder)
    tensors = load_file(folder / "model.safetensors")
    del tensors["text_projection.weight"]
    tensors["text_model.encoder.layers.7.mlp.fc1.weight"] = np.zeros((1,), np.float32)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match="does not fit the CLIPTextModel") as error:
        load_clip(folder)
    assert "text_projection.weight" in str(error.value)
    assert "text_model.encoder.layers.7.mlp.fc1.weight" in str(error.value)


def test_an_architecture_that_is_not_clips_is_refused_by_name(tmp_path: pathlib.Path) -> None:
    folder = tmp_path / "clip"
    shutil.copytree(CLIP / "text_l", folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["T5EncoderModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="`architectures`"):
        load_clip(folder)


def test_too_long_a_prompt_is_refused_by_name() -> None:
    model = load_clip(CLIP / "text_l")
    with pytest.raises(ValueError, match="`ids`"):
        model(jnp.zeros((17,), jnp.int32))


def _shape(make, **kwargs):
    return eqx.filter_eval_shape(lambda key: make(**kwargs, key=key), jax.random.key(0))


@pytest.mark.parametrize("name", ["clip_l", "clip_g", "pickscore"])
def test_full_size_configs_have_transformers_parameter_counts_and_keys(name: str) -> None:
    record = json.loads((CLIP / "clip_keys.json").read_text())[name]
    if name == "pickscore":
        model = _shape(
            CLIPModel,
            text=TowerShape(1024, 16, 4096, 24, "gelu", 1e-5),
            vision=TowerShape(1280, 16, 5120, 32, "gelu", 1e-5),
            projection_dim=1024,
            image_size=224,
            patch_size=14,
        )
        want = 986_109_441
    else:
        width, heads, layers, act = (
            (768, 12, 12, "quick_gelu") if name == "clip_l" else (1280, 20, 32, "gelu")
        )
        model = _shape(
            CLIPTextModel,
            shape=TowerShape(width, heads, 4 * width, layers, act, 1e-5),
            projection_dim=width,
        )
        want = 123_650_304 if name == "clip_l" else 694_659_840
    assert count(model) == record["parameters"] == want
    ours = {key: list(leaf.shape) for key, leaf in state_dict_leaves(model).items()}
    assert ours == record["keys"]
