"""`Flux` against diffusers' `FluxTransformer2DModel` and FLUX's time grid, without torch.

The fixtures under `tests/data/` were made by diffusers itself (`tools/make_flux_wan_fixtures.py
make`, run by hand with torch and diffusers): a tiny random FLUX.1-dev-style transformer
(guidance embedding, double- and single-stream blocks) with inputs and diffusers' outputs on a
non-square latent, the key layout and parameter counts of the full-size FLUX.1-dev and
-schnell (built on torch's 'meta' device), and the sigmas of `FluxPipeline`'s scheduler.
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

import flowgrpo_eqx as fg
from flowgrpo_eqx import lora
from flowgrpo_eqx.models import ChunkedAttention, Flux, SaveNothing, load_diffusers, save_diffusers
from tests.diffusers_helpers import (
    WEIGHTS,
    assert_exported_lora_merges,
    assert_layout_is,
    assert_saved_folder_matches,
    count,
    random_lora,
    relative,
    vcall,
)
from tests.errors import NAMED_ARGUMENT_ERRORS
from tests.tolerances import reference_model_rtol


DATA = pathlib.Path(__file__).resolve().parent / "data"
TINY = DATA / "flux_tiny"
IMAGE = (8, 6)


@pytest.fixture(scope="module")
def tiny() -> Flux:
    model = load_diffusers(TINY, image_size=IMAGE, context_length=5)
    assert isinstance(model, Flux)
    return model


@pytest.fixture(scope="module")
def io() -> dict[str, np.ndarray]:
    return dict(np.load(TINY / "io.npz"))


def _velocity(model: Any, io: dict[str, np.ndarray]) -> np.ndarray:
    cond = {"context": io["context"], "pooled": io["pooled"], "guidance": io["guidance"]}
    return np.asarray(vcall(model, io["x"], io["t"], cond), np.float32)


def test_load_diffusers_matches_diffusers(tiny: Flux, io: dict[str, np.ndarray]) -> None:
    assert tiny.guidance_embeds and tiny.guidance_mlp is not None
    assert (tiny.double_depth, tiny.single_depth, tiny.channels) == (2, 2, 4)
    assert tiny.stacked and tiny.block_groups == ((0, 2), (2, 4))
    assert relative(_velocity(tiny, io), io["v"]) < reference_model_rtol()
    # The guidance scale is an input: another scale, another velocity.
    other = dict(io, guidance=io["guidance"] + 2.0)
    assert relative(_velocity(tiny, other), io["v"]) > 1e-3


def test_every_layout_and_attention_computes_the_same(
    tiny: Flux, io: dict[str, np.ndarray]
) -> None:
    want = _velocity(tiny, io)
    variants = [
        tiny.with_settings(stacked=False),
        tiny.with_settings(remat=SaveNothing(), attention=ChunkedAttention(7)),
    ]
    for variant in variants:
        # The same function; chunks of queries round in another order (outputs reach ~30).
        np.testing.assert_allclose(_velocity(variant, io), want, rtol=1e-6, atol=1e-5)
    assert len(variants[0].blocks) == 4 and variants[0].unstacked_blocks()[3] is not None


def test_save_diffusers_round_trip(
    tiny: Flux, io: dict[str, np.ndarray], tmp_path: pathlib.Path
) -> None:
    save_diffusers(tmp_path, tiny)
    assert_saved_folder_matches(TINY, tmp_path, same_fields=True)
    again = load_diffusers(tmp_path, image_size=IMAGE, context_length=5, stacked=False)
    np.testing.assert_allclose(_velocity(again, io), _velocity(tiny, io), rtol=0, atol=1e-5)


def test_unused_and_missing_keys_are_listed(tmp_path: pathlib.Path) -> None:
    folder = tmp_path / "flux"
    shutil.copytree(TINY, folder)
    tensors = load_file(folder / WEIGHTS)
    tensors["single_transformer_blocks.7.proj_mlp.bias"] = np.zeros((3,), np.float32)
    del tensors["single_transformer_blocks.1.attn.norm_k.weight"]
    save_file(tensors, folder / WEIGHTS)
    with pytest.raises(ValueError, match="1 keys map to no leaf of the Flux") as error:
        load_diffusers(folder, image_size=IMAGE, context_length=5)
    message = str(error.value)
    assert "single_transformer_blocks.7.proj_mlp.bias" in message
    assert "1 leaves have no key" in message
    assert ".blocks[3].attn.norm_k (key single_transformer_blocks.1.attn.norm_k.weight)" in message


def test_full_size_configs_have_diffusers_parameter_counts_and_keys() -> None:
    record = json.loads((DATA / "flux_keys.json").read_text())
    dev = eqx.filter_eval_shape(
        lambda key: Flux(**Flux.dev_config(), stacked=False, key=key), jax.random.key(0)
    )
    schnell = eqx.filter_eval_shape(
        lambda key: Flux(**Flux.schnell_config(), key=key), jax.random.key(0)
    )
    assert count(dev) == record["dev_parameters"] == 11_901_408_320
    assert count(schnell) == record["schnell_parameters"] == 11_891_178_560
    assert_layout_is(dev, record["keys"])


def test_flux_grid_is_the_pipelines_sigmas() -> None:
    record = json.loads((DATA / "flux_sigmas.json").read_text())
    for name, sigmas in record["dev"].items():
        steps, tokens = (int(part) for part in name.split("/"))
        assert len(sigmas) == steps + 1
        grid = np.asarray(
            fg.RectifiedFlow(shift=fg.flux_shift(tokens), grid=fg.FluxGrid()).timesteps(steps + 1)
        )
        assert grid.dtype == np.float32 and grid[0] == 1.0 and grid[-1] == 0.0
        np.testing.assert_allclose(grid, sigmas, rtol=0, atol=1e-6)
    for steps, sigmas in record["schnell"].items():
        grid = np.asarray(fg.RectifiedFlow(grid=fg.FluxGrid()).timesteps(int(steps) + 1))
        np.testing.assert_allclose(grid, sigmas, rtol=0, atol=1e-6)
    # The shift is e^mu, mu linear in the tokens from 0.5 at 256 to 1.15 at 4096.
    np.testing.assert_allclose(fg.flux_shift(256), np.exp(0.5), rtol=1e-12)
    np.testing.assert_allclose(fg.flux_shift(4096), np.exp(1.15), rtol=1e-12)
    with pytest.raises(NAMED_ARGUMENT_ERRORS, match="`image_tokens`"):
        fg.flux_shift(0)


def test_a_fresh_model_is_zero_and_its_arguments_are_checked() -> None:
    model = Flux(image_size=(4, 6), channels=2, guidance_embeds=True, key=jax.random.key(0))
    cond = {"context": jnp.ones((8, 32)), "pooled": jnp.ones((32,)), "guidance": jnp.asarray(4.0)}
    v = model(jnp.ones((4, 6, 2)), jnp.asarray(0.3), cond)
    assert v.shape == (4, 6, 2) and not np.any(np.asarray(v))
    with pytest.raises(ValueError, match="`cond`.*guidance"):
        model(
            jnp.ones((4, 6, 2)),
            jnp.asarray(0.3),
            {"context": cond["context"], "pooled": cond["pooled"]},
        )
    with pytest.raises(ValueError, match="`x`"):
        model(jnp.ones((6, 4, 2)), jnp.asarray(0.3), cond)
    bad: list[tuple[dict[str, Any], str]] = [
        (dict(image_size=(5, 6)), "`?image_size`?"),
        (dict(axes_dims=(8, 8, 8)), "`?axes_dims`?"),
        (dict(heads=3), "`?heads`?"),
        (dict(double_depth=0, single_depth=0), "`?double_depth`?"),
        (dict(guidance_embeds=1), "`?guidance_embeds`?"),
        (dict(attention="flash"), "`?attention`?"),
    ]
    for kwargs, name in bad:
        with pytest.raises(NAMED_ARGUMENT_ERRORS, match=name):
            Flux(**kwargs, key=jax.random.key(0))


def test_lora_adapters_export_in_diffusers_names(tiny: Flux, tmp_path: pathlib.Path) -> None:
    modules = assert_exported_lora_merges(random_lora(tiny), TINY / WEIGHTS, tmp_path)
    # One adapter per block of each stacked group, every linear layer of diffusers' model.
    base = load_file(TINY / WEIGHTS)
    assert modules == {k.removesuffix(".weight") for k, v in base.items() if v.ndim == 2}


def test_an_nft_epoch_trains_the_adapters_of_tiny_flux(tiny: Flux) -> None:
    # The Flow-GRPO epoch is the FLUX guide's (docs/guides/flux.md), run by the docs tests.
    from flowgrpo_eqx.train import Trainer, default_optimizer, rl_epoch

    rng = np.random.default_rng(0)
    rows = {
        "context": rng.standard_normal((2, 5, 12)).astype(np.float32),
        "pooled": rng.standard_normal((2, 10)).astype(np.float32),
    }
    flow = fg.GuidedFlow(
        tiny,
        fg.RectifiedFlow(shift=fg.flux_shift(12), grid=fg.FluxGrid()),
        fg.InputSpec(select=("context", "pooled"), latent_shape=(*IMAGE, 4)),
        guidance=fg.EmbeddedGuidance(3.5),
    )

    def reward(samples: Any, rows: Any) -> np.ndarray:
        return -np.mean(np.asarray(samples) ** 2, axis=(1, 2, 3)).astype(np.float64)

    policy = lora.add(tiny, 2, key=jax.random.key(0))
    objective = fg.DiffusionNFTObjective(flow, pretrained=policy)
    rollout = fg.FlowRollout(objective, reward, groups=2, steps=3)
    trainer = Trainer(objective, default_optimizer(learning_rate=1e-3))
    state = trainer.init(jax.random.key(1))
    before = jax.tree.leaves(state.variables.policy.adapters)
    state, metrics, _ = rl_epoch(trainer, state, rollout, rows, jax.random.key(2))
    assert np.isfinite(metrics["loss"]) and np.isfinite(metrics["reward_mean"])
    after = jax.tree.leaves(state.variables.policy.adapters)
    assert any(not np.array_equal(a, b) for a, b in zip(before, after, strict=True))
