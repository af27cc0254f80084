"""`AutoencoderKL` against diffusers' `AutoencoderKL`, on channels-last images, without torch.

The fixtures under `tests/data/` were made by diffusers itself (`tools/make_vae_fixtures.py`,
run by hand with torch and diffusers): tiny random autoencoders with images and diffusers'
posterior, latents and decoded images for them, and the key layout and parameter counts of
SD3.5's and FLUX.1's VAE (built on torch's 'meta' device).
"""

import json
import pathlib
import shutil
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from flowgrpo_eqx.models import AutoencoderKL, ChunkedAttention, load_diffusers, save_diffusers
from flowgrpo_eqx.models._mirror import state_dict_leaves
from tests.diffusers_helpers import WEIGHTS, assert_saved_folder_matches, count, relative
from tests.tolerances import reference_model_rtol


DATA = pathlib.Path(__file__).resolve().parent / "data"


@pytest.fixture(scope="module", params=["vae_tiny", "vae_tiny_quant"])
def case(request: pytest.FixtureRequest) -> tuple[str, AutoencoderKL, dict[str, np.ndarray]]:
    model = load_diffusers(DATA / request.param)
    assert isinstance(model, AutoencoderKL)
    return request.param, model, dict(np.load(DATA / request.param / "io.npz"))


@eqx.filter_jit
def _encode_decode(model: AutoencoderKL, image: Any, latent: Any, noise: Any) -> Any:
    mean, logvar = jax.vmap(model.moments)(image)
    encoded = jax.vmap(model.encode)(image)
    decoded = jax.vmap(model.decode)(latent)
    sampled = (mean + jnp.exp(0.5 * logvar) * noise - model.shift_factor) * model.scaling_factor
    return mean, logvar, encoded, decoded, sampled


def test_encode_and_decode_match_diffusers(
    case: tuple[str, AutoencoderKL, dict[str, np.ndarray]],
) -> None:
    rtol = reference_model_rtol()
    _, model, io = case
    mean, logvar, encoded, decoded, sampled = (
        np.asarray(a) for a in _encode_decode(model, io["image"], io["latent"], io["noise"])
    )
    assert encoded.shape == io["latent"].shape == (2, 8, 12, 4)
    assert relative(mean, io["mean"]) < rtol
    assert relative(logvar, io["logvar"]) < rtol
    assert relative(encoded, io["latent"]) < rtol
    assert relative(sampled, io["sampled"]) < rtol
    assert decoded.shape == io["image"].shape
    assert relative(decoded, io["decoded"]) < rtol


def test_a_sampled_latent_draws_from_the_posterior(
    case: tuple[str, AutoencoderKL, dict[str, np.ndarray]],
) -> None:
    _, model, io = case
    image = jnp.asarray(io["image"][0])
    one = model.encode(image, key=jax.random.key(0))
    again = model.encode(image, key=jax.random.key(0))
    other = model.encode(image, key=jax.random.key(1))
    mean, logvar = model.moments(image)
    np.testing.assert_array_equal(np.asarray(one), np.asarray(again))
    assert not np.array_equal(np.asarray(one), np.asarray(other))
    noise = jax.random.normal(jax.random.key(0), mean.shape)
    want = (mean + jnp.exp(0.5 * logvar) * noise - model.shift_factor) * model.scaling_factor
    np.testing.assert_allclose(np.asarray(one), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_save_diffusers_round_trip(
    case: tuple[str, AutoencoderKL, dict[str, np.ndarray]], tmp_path: pathlib.Path
) -> None:
    name, model, io = case
    save_diffusers(tmp_path, model)
    assert_saved_folder_matches(DATA / name, tmp_path, unsaved=("force_upcast",))


def test_bfloat16_weights_decode_close_to_float32(
    case: tuple[str, AutoencoderKL, dict[str, np.ndarray]],
) -> None:
    name, _, io = case
    half = load_diffusers(DATA / name, dtype=jnp.bfloat16)
    assert isinstance(half, AutoencoderKL)
    assert half.decoder.conv_in.weight.dtype == jnp.bfloat16
    decoded = np.asarray(jax.vmap(half.decode)(jnp.asarray(io["latent"])), np.float32)
    assert relative(decoded, io["decoded"]) < 5e-2


def test_chunked_attention_computes_the_same(
    case: tuple[str, AutoencoderKL, dict[str, np.ndarray]],
) -> None:
    _, model, io = case
    chunked = eqx.tree_at(
        lambda m: m.attention_settings,
        model,
        type(model.attention_settings)(ChunkedAttention(16)),
    )
    want = np.asarray(jax.vmap(model.decode)(io["latent"]))
    got = np.asarray(jax.vmap(chunked.decode)(io["latent"]))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["sd35", "flux"])
def test_full_size_configs_have_diffusers_parameter_counts_and_keys(name: str) -> None:
    record = json.loads((DATA / "vae_keys.json").read_text())[name]
    config = AutoencoderKL.sd3_config() if name == "sd35" else AutoencoderKL.flux_config()
    assert config["scaling_factor"] == record["config"]["scaling_factor"]
    assert config["shift_factor"] == record["config"]["shift_factor"]
    model = eqx.filter_eval_shape(lambda key: AutoencoderKL(**config, key=key), jax.random.key(0))
    assert count(model) == record["parameters"] == 83_819_683
    ours = {key: list(leaf.shape) for key, leaf in state_dict_leaves(model).items()}
    assert ours == record["keys"]


def test_a_checkpoint_that_does_not_fit_lists_every_key(tmp_path: pathlib.Path) -> None:
    folder = tmp_path / "vae"
    shutil.copytree(DATA / "vae_tiny", folder)
    tensors = load_file(folder / WEIGHTS)
    tensors["decoder.up_blocks.9.resnets.0.conv1.weight"] = np.zeros((1,), np.float32)
    del tensors["encoder.conv_out.bias"]
    tensors["decoder.conv_in.weight"] = np.zeros((1, 2, 3, 3), np.float32)
    save_file(tensors, folder / WEIGHTS)
    with pytest.raises(ValueError, match="does not fit the AutoencoderKL") as error:
        load_diffusers(folder)
    message = str(error.value)
    assert "decoder.up_blocks.9.resnets.0.conv1.weight" in message
    assert "encoder.conv_out.bias" in message
    assert "decoder.conv_in.weight: (1, 2, 3, 3)" in message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("down_block_types", ["DownEncoderBlock2D", "AttnDownEncoderBlock2D"]),
        ("act_fn", "gelu"),
        ("latents_mean", [0.0] * 4),
        ("norm_num_groups", 3),
    ],
)
def test_a_config_the_module_cannot_compute_is_refused_by_its_field(
    field: str, value: Any, tmp_path: pathlib.Path
) -> None:
    folder = tmp_path / "vae"
    shutil.copytree(DATA / "vae_tiny", folder)
    config = json.loads((folder / "config.json").read_text())
    config[field] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"`{field}`|norm_num_groups"):
        load_diffusers(folder)


def test_images_of_the_wrong_shape_are_refused_by_name() -> None:
    model = AutoencoderKL(key=jax.random.key(0))
    with pytest.raises(ValueError, match="`image`"):
        model.encode(jnp.zeros((15, 16, 3)))
    with pytest.raises(ValueError, match="`latent`"):
        model.decode(jnp.zeros((8, 8, 3)))
