"""`AutoencoderKLWan` against diffusers' `AutoencoderKLWan`, on channels-last videos, without
torch.

The fixtures under `tests/data/` were made by diffusers itself (`tools/make_wan_vae_fixtures.py`,
run by hand with torch and diffusers): a tiny random autoencoder of Wan 2.1's structure with a
video of 9 frames and diffusers' posterior, latents and decoded video for it (diffusers
encodes the first frame, then four at a time, and decodes one latent frame at a time, through
its causal cache), and the key layout and parameter count of Wan 2.1's VAE (built on torch's
'meta' device).
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

from flowgrpo_eqx.models import AutoencoderKLWan, load_diffusers, save_diffusers
from flowgrpo_eqx.models._mirror import state_dict_leaves
from tests.diffusers_helpers import WEIGHTS, assert_saved_folder_matches, count, relative
from tests.errors import NAMED_ARGUMENT_ERRORS
from tests.tolerances import reference_model_rtol


DATA = pathlib.Path(__file__).resolve().parent / "data"
TINY = DATA / "wan_vae_tiny"


@pytest.fixture(scope="module")
def case() -> tuple[AutoencoderKLWan, dict[str, np.ndarray]]:
    model = load_diffusers(TINY)
    assert isinstance(model, AutoencoderKLWan)
    io = dict(np.load(TINY / "io.npz"))
    io["video"] = io["pixels"].astype(np.float32) / np.float32(127.5) - np.float32(1.0)
    return model, io


@eqx.filter_jit
def _moments(model: AutoencoderKLWan, video: Any, chunk: int | None = None) -> Any:
    return model.moments(video, chunk=chunk)


@eqx.filter_jit
def _encode(model: AutoencoderKLWan, video: Any, key: Any = None) -> Any:
    return model.encode(video, key=key)


@eqx.filter_jit
def _decode(model: AutoencoderKLWan, latent: Any, chunk: int | None = None) -> Any:
    return model.decode(latent, chunk=chunk)


def test_encode_and_decode_match_diffusers(
    case: tuple[AutoencoderKLWan, dict[str, np.ndarray]],
) -> None:
    rtol = reference_model_rtol()
    model, io = case
    mean, logvar = (np.asarray(a) for a in _moments(model, io["video"]))
    encoded = np.asarray(_encode(model, io["video"]))
    decoded = np.asarray(_decode(model, io["latent"]))
    assert encoded.shape == io["latent"].shape == (3, 2, 3, 4)
    assert relative(mean, io["mean"]) < rtol
    assert relative(logvar, io["logvar"]) < rtol
    assert relative(encoded, io["latent"]) < rtol
    latents_mean = np.asarray(model.latents_mean, np.float32)
    inverse_std = np.float32(1.0) / np.asarray(model.latents_std, np.float32)
    sampled = (mean + np.exp(0.5 * logvar) * io["noise"] - latents_mean) * inverse_std
    assert relative(sampled, io["sampled"]) < rtol
    assert decoded.shape == io["video"].shape
    assert relative(decoded, io["decoded"]) < rtol
    # The clamp to [-1, 1] is reached and matched: a part of the values sits on it.
    assert 0.01 < np.mean(np.abs(io["decoded"]) == 1.0) < 0.5


def test_a_sampled_latent_draws_from_the_posterior(
    case: tuple[AutoencoderKLWan, dict[str, np.ndarray]],
) -> None:
    model, io = case
    video = jnp.asarray(io["video"])
    one = _encode(model, video, jax.random.key(0))
    again = _encode(model, video, jax.random.key(0))
    other = _encode(model, video, jax.random.key(1))
    mean, logvar = _moments(model, video)
    np.testing.assert_array_equal(np.asarray(one), np.asarray(again))
    assert not np.array_equal(np.asarray(one), np.asarray(other))
    noise = jax.random.normal(jax.random.key(0), mean.shape)
    latents_mean = jnp.asarray(model.latents_mean, jnp.float32)[None, None, None, :]
    std = jnp.asarray(model.latents_std, jnp.float32)[None, None, None, :]
    want = (mean + jnp.exp(0.5 * logvar) * noise - latents_mean) / std
    np.testing.assert_allclose(np.asarray(one), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_chunked_decoding_and_encoding_compute_the_same(
    case: tuple[AutoencoderKLWan, dict[str, np.ndarray]],
) -> None:
    model, io = case
    whole = np.asarray(_decode(model, io["latent"]))
    # One latent frame at a time (diffusers' way), and a first frame then two.
    for chunk in (1, 2):
        got = np.asarray(_decode(model, io["latent"], chunk))
        np.testing.assert_allclose(got, whole, rtol=1e-5, atol=1e-5, err_msg=f"chunk {chunk}")
    # Six latent frames in chunks of two: the first, two scanned steps, one left over.
    latent = jax.random.normal(jax.random.key(2), (6, 2, 3, 4))
    whole = np.asarray(_decode(model, latent))
    assert whole.shape == (21, 16, 24, 3)
    got = np.asarray(_decode(model, latent, 2))
    np.testing.assert_allclose(got, whole, rtol=1e-5, atol=1e-5)
    # The encoder: four frames a step (diffusers' way) and eight (one step here).
    mean, logvar = (np.asarray(a) for a in _moments(model, io["video"]))
    for chunk in (4, 8):
        got_mean, got_logvar = (np.asarray(a) for a in _moments(model, io["video"], chunk))
        np.testing.assert_allclose(got_mean, mean, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got_logvar, logvar, rtol=1e-5, atol=1e-5)


def test_save_diffusers_round_trip(
    case: tuple[AutoencoderKLWan, dict[str, np.ndarray]], tmp_path: pathlib.Path
) -> None:
    model, _ = case
    save_diffusers(tmp_path, model)
    assert_saved_folder_matches(TINY, tmp_path, same_fields=True)
    again = load_diffusers(tmp_path)
    assert isinstance(again, AutoencoderKLWan)
    assert again.latents_std == model.latents_std


def test_bfloat16_weights_decode_close_to_float32(
    case: tuple[AutoencoderKLWan, dict[str, np.ndarray]],
) -> None:
    _, io = case
    half = load_diffusers(TINY, dtype=jnp.bfloat16)
    assert isinstance(half, AutoencoderKLWan)
    assert half.decoder.conv_in.weight.dtype == jnp.bfloat16
    decoded = np.asarray(_decode(half, jnp.asarray(io["latent"])))
    assert decoded.dtype == np.float32
    # diffusers' own bfloat16 decode of this latent is off its float32 one by 0.23 at most
    # (relative to the largest value) and 0.009 on average: the dozens of rounded layers.
    assert relative(decoded, io["decoded"]) < 0.25
    assert np.mean(np.abs(decoded - io["decoded"])) < 0.03


def test_wan_2_1_config_has_diffusers_parameter_count_and_keys() -> None:
    record = json.loads((DATA / "wan_vae_keys.json").read_text())["wan_2_1"]
    config = AutoencoderKLWan.wan_2_1_config()
    for field in ("base_dim", "z_dim", "num_res_blocks", "decoder_base_dim"):
        assert config[field] == record["config"][field], field
    for field in ("dim_mult", "temperal_downsample", "latents_mean", "latents_std"):
        assert list(config[field]) == record["config"][field], field
    assert record["config"]["attn_scales"] == [] and record["config"]["patch_size"] is None
    model = eqx.filter_eval_shape(
        lambda key: AutoencoderKLWan(**config, key=key), jax.random.key(0)
    )
    assert count(model) == record["parameters"] == 126_892_531
    ours = {key: list(leaf.shape) for key, leaf in state_dict_leaves(model).items()}
    assert ours == record["keys"]
    assert model.spatial_factor == record["config"]["scale_factor_spatial"] == 8
    assert model.temporal_factor == record["config"]["scale_factor_temporal"] == 4


def test_a_checkpoint_that_does_not_fit_lists_every_key(tmp_path: pathlib.Path) -> None:
    folder = tmp_path / "vae"
    shutil.copytree(TINY, folder)
    tensors = load_file(folder / WEIGHTS)
    tensors["decoder.up_blocks.9.resnets.0.conv1.weight"] = np.zeros((1,), np.float32)
    del tensors["encoder.down_blocks.3.time_conv.bias"]
    tensors["decoder.conv_in.weight"] = np.zeros((1, 2, 3, 3, 3), np.float32)
    save_file(tensors, folder / WEIGHTS)
    with pytest.raises(ValueError, match="does not fit the AutoencoderKLWan") as error:
        load_diffusers(folder)
    message = str(error.value)
    assert "decoder.up_blocks.9.resnets.0.conv1.weight" in message
    assert "encoder.down_blocks.3.time_conv.bias" in message
    assert "decoder.conv_in.weight: (1, 2, 3, 3, 3)" in message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("is_residual", True),
        ("patch_size", 2),
        ("attn_scales", [0.5]),
        ("temperal_downsample", [False, True]),
        ("temperal_downsample", [True, True, True]),
        ("dim_mult", []),
        ("latents_mean", [0.0] * 3),
        ("latents_std", [1.0, 1.0, 0.0, 1.0]),
        ("z_dim", 0),
    ],
)
def test_a_config_the_module_cannot_compute_is_refused_by_its_field(
    field: str, value: Any, tmp_path: pathlib.Path
) -> None:
    folder = tmp_path / "vae"
    shutil.copytree(TINY, folder)
    config = json.loads((folder / "config.json").read_text())
    config[field] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"`{field}`"):
        load_diffusers(folder)


def test_videos_latents_and_chunks_of_the_wrong_shape_are_refused_by_name() -> None:
    model = AutoencoderKLWan(key=jax.random.key(0))
    assert (model.spatial_factor, model.temporal_factor) == (2, 2)
    for video in (jnp.zeros((4, 8, 8, 3)), jnp.zeros((5, 7, 8, 3)), jnp.zeros((5, 8, 8, 4))):
        with pytest.raises(ValueError, match="`video`"):
            model.encode(video)
    with pytest.raises(ValueError, match="`chunk`"):
        model.encode(jnp.zeros((5, 8, 8, 3)), chunk=2)
    with pytest.raises(ValueError, match="`latent`"):
        model.decode(jnp.zeros((3, 4, 4, 3)))
    with pytest.raises(ValueError, match="`chunk`"):
        model.decode(jnp.zeros((3, 4, 4, 4)), chunk=0)
    # A video of 1 + 4k frames, the tiny default halving time once: 1 + 2k latent frames.
    assert model.encode(jnp.zeros((5, 8, 8, 3))).shape == (3, 4, 4, 4)
    assert model.decode(jnp.zeros((3, 4, 4, 4))).shape == (5, 8, 8, 3)


def test_constructor_arguments_are_checked_by_name() -> None:
    key = jax.random.key(0)
    with pytest.raises(ValueError, match="`base_dim`"):
        AutoencoderKLWan(base_dim=0, key=key)
    with pytest.raises(ValueError, match="`decoder_base_dim`"):
        AutoencoderKLWan(decoder_base_dim=0, key=key)
    with pytest.raises(ValueError, match="`temperal_downsample`"):
        AutoencoderKLWan(temperal_downsample=(True, True), key=key)
    with pytest.raises(ValueError, match="`temperal_downsample`"):
        AutoencoderKLWan(dim_mult=(1, 1, 1, 1), temperal_downsample=(True,) * 3, key=key)
    with pytest.raises(ValueError, match="`latents_std`"):
        AutoencoderKLWan(latents_std=(1.0, -1.0, 1.0, 1.0), key=key)
    with pytest.raises(ValueError, match="`latents_mean`"):
        AutoencoderKLWan(latents_mean=(0.0, float("nan"), 0.0, 0.0), key=key)
    # A setting's name is read at the settings boundary (`attention_from_name`), not here; the
    # runtime type checker (when on) names the parameter first, as 'attention'.
    with pytest.raises(NAMED_ARGUMENT_ERRORS, match="`attention`|'attention'"):
        AutoencoderKLWan(attention="splash", key=key)  # type: ignore[arg-type]
