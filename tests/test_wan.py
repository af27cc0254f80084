"""`Wan` against diffusers' `WanTransformer3DModel`, on video latents, without torch.

The fixtures under `tests/data/` were made by diffusers itself (`tools/make_flux_wan_fixtures.py
make`, run by hand with torch and diffusers): a tiny random Wan 2.1-style transformer with
video inputs and diffusers' outputs, the key layout and parameter counts of Wan 2.1-T2V-1.3B
and -14B (built on torch's 'meta' device), and DanceGRPO's Wan rollout grid.
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
from flowgrpo_eqx.models import (
    ChunkedAttention,
    SaveDots,
    SaveNothing,
    Wan,
    load_diffusers,
    save_diffusers,
    save_diffusers_lora,
)
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
TINY = DATA / "wan_tiny"
LATENT = (3, 4, 6)


@pytest.fixture(scope="module")
def tiny() -> Wan:
    model = load_diffusers(TINY, image_size=LATENT, context_length=5)
    assert isinstance(model, Wan)
    return model


@pytest.fixture(scope="module")
def io() -> dict[str, np.ndarray]:
    return dict(np.load(TINY / "io.npz"))


def _velocity(model: Any, io: dict[str, np.ndarray]) -> np.ndarray:
    return np.asarray(vcall(model, io["x"], io["t"], io["context"]), np.float32)


def test_load_diffusers_matches_diffusers_on_video(tiny: Wan, io: dict[str, np.ndarray]) -> None:
    assert io["x"].shape == (2, *LATENT, 4) and tiny.grid == (3, 2, 3)
    assert (tiny.depth, tiny.heads, tiny.width, tiny.patch) == (2, 2, 24, (1, 2, 2))
    assert relative(_velocity(tiny, io), io["v"]) < reference_model_rtol()


def test_every_layout_and_attention_computes_the_same(tiny: Wan, io: dict[str, np.ndarray]) -> None:
    want = _velocity(tiny, io)
    for variant in (
        tiny.with_settings(stacked=False),
        tiny.with_settings(remat=SaveDots(), attention=ChunkedAttention(4)),
    ):
        # The same function; chunks of queries round in another order (outputs reach ~30).
        np.testing.assert_allclose(_velocity(variant, io), want, rtol=1e-6, atol=1e-5)


def test_save_diffusers_round_trip(
    tiny: Wan, io: dict[str, np.ndarray], tmp_path: pathlib.Path
) -> None:
    save_diffusers(tmp_path, tiny)
    assert_saved_folder_matches(TINY, tmp_path)
    again = load_diffusers(tmp_path, image_size=LATENT, context_length=5, stacked=False)
    np.testing.assert_allclose(_velocity(again, io), _velocity(tiny, io), rtol=0, atol=1e-5)


def test_unused_missing_keys_and_unsupported_configs_are_named(tmp_path: pathlib.Path) -> None:
    folder = tmp_path / "wan"
    shutil.copytree(TINY, folder)
    tensors = load_file(folder / WEIGHTS)
    tensors["blocks.5.ffn.net.2.bias"] = np.zeros((3,), np.float32)
    del tensors["blocks.1.norm2.bias"]
    save_file(tensors, folder / WEIGHTS)
    with pytest.raises(ValueError, match="1 keys map to no leaf of the Wan") as error:
        load_diffusers(folder, image_size=LATENT, context_length=5)
    assert ".blocks[1].cross_norm_bias (key blocks.1.norm2.bias)" in str(error.value)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "image_dim": 1280}))
    with pytest.raises(ValueError, match="`image_dim`.*image-to-video"):
        load_diffusers(folder, image_size=LATENT, context_length=5)


def test_full_size_configs_have_diffusers_parameter_counts_and_keys() -> None:
    record = json.loads((DATA / "wan_keys.json").read_text())
    small = eqx.filter_eval_shape(
        lambda key: Wan(**Wan.t2v_1_3b_config(), stacked=False, key=key), jax.random.key(0)
    )
    large = eqx.filter_eval_shape(
        lambda key: Wan(**Wan.t2v_14b_config(), key=key), jax.random.key(0)
    )
    assert count(small) == record["t2v_1_3b_parameters"] == 1_418_996_800
    assert count(large) == record["t2v_14b_parameters"] == 14_288_491_584
    assert_layout_is(small, record["keys"])


def test_dancegrpo_wan_grid_is_the_shifted_uniform_grid() -> None:
    record = json.loads((DATA / "wan_sigmas.json").read_text())
    for name, sigmas in record.items():
        shift, steps = name.split("/")
        grid = np.asarray(fg.RectifiedFlow(shift=float(shift)).timesteps(int(steps) + 1))
        assert grid[0] == 1.0 and grid[-1] == 0.0
        np.testing.assert_allclose(grid, sigmas, rtol=0, atol=1e-6)


def test_a_fresh_model_is_zero_and_its_arguments_are_checked() -> None:
    model = Wan(key=jax.random.key(0))
    v = model(jnp.ones((3, 8, 8, 4)), jnp.asarray(0.3), jnp.ones((8, 32)))
    assert v.shape == (3, 8, 8, 4) and not np.any(np.asarray(v))
    with pytest.raises(ValueError, match="`cond`"):
        model(jnp.ones((3, 8, 8, 4)), jnp.asarray(0.3), jnp.ones((7, 32)))
    bad: list[tuple[dict[str, Any], str]] = [
        (dict(latent_size=(3, 7, 8)), "`?patch`?"),
        (dict(heads=5), "`?heads`?"),
        (dict(width=8, heads=2), "head width"),
        (dict(ffn_dim=0), "`?ffn_dim`?"),
        (dict(remat="all"), "`?remat`?"),
    ]
    for kwargs, name in bad:
        with pytest.raises(NAMED_ARGUMENT_ERRORS, match=name):
            Wan(**kwargs, key=jax.random.key(0))


def test_lora_adapters_export_in_diffusers_names(tiny: Wan, tmp_path: pathlib.Path) -> None:
    policy = lora.add(tiny, 2, key=jax.random.key(1), alpha=3.0)
    save_diffusers_lora(tmp_path, policy)
    adapters = load_file(tmp_path / "pytorch_lora_weights.safetensors")
    modules = {k.removeprefix("transformer.").rsplit(".lora_", 1)[0] for k in adapters}
    assert "blocks.1.attn2.to_k" in modules and "blocks.0.ffn.net.0.proj" in modules
    assert len(adapters) == 2 * len(modules)


def test_lora_adapters_of_blocks_held_in_two_runs_export_per_block(
    tiny: Wan, tmp_path: pathlib.Path
) -> None:
    # A remat per block holds the two blocks in two runs (`.blocks[0]`, `.blocks[1]`): each
    # run's adapters must go to its own block's diffusers names.
    split = tiny.with_settings(remat=(SaveDots(), SaveNothing()))
    assert [group.table.shape[0] for group in split.blocks] == [1, 1]
    modules = assert_exported_lora_merges(random_lora(split), TINY / WEIGHTS, tmp_path)
    assert {"blocks.0.attn1.to_q", "blocks.1.attn1.to_q"} <= modules


def test_an_nft_epoch_trains_on_video_latents(tiny: Wan) -> None:
    # The Flow-GRPO epoch on video is the Wan guide's (docs/guides/wan.md), run by the docs
    # tests with the same temporal-consistency reward.
    from flowgrpo_eqx.train import Trainer, default_optimizer, rl_epoch

    context = np.random.default_rng(0).standard_normal((2, 5, 12)).astype(np.float32)
    inputs = fg.InputSpec(null=np.zeros((5, 12), np.float32), latent_shape=(*LATENT, 4))

    def reward(samples: Any, rows: Any) -> np.ndarray:
        frames = np.asarray(samples)
        assert frames.shape == (4, *LATENT, 4)  # 2 prompts x 2 videos of [F, H, W, C]
        return -np.mean(np.diff(frames, axis=1) ** 2, axis=(1, 2, 3, 4)).astype(np.float64)

    flow = fg.GuidedFlow(tiny, fg.RectifiedFlow(shift=3.0), inputs, guidance=fg.CFG(5.0))
    objective = fg.DiffusionNFTObjective(flow, pretrained=lora.add(tiny, 2, key=jax.random.key(0)))
    rollout = fg.FlowRollout(objective, reward, groups=2, steps=3)
    trainer = Trainer(objective, default_optimizer(learning_rate=1e-3))
    state = trainer.init(jax.random.key(1))
    before = jax.tree.leaves(state.variables.policy.adapters)
    state, metrics, _ = rl_epoch(trainer, state, rollout, context, jax.random.key(2))
    assert np.isfinite(metrics["loss"]) and np.isfinite(metrics["reward_mean"])
    after = jax.tree.leaves(state.variables.policy.adapters)
    assert any(not np.array_equal(a, b) for a, b in zip(before, after, strict=True))
