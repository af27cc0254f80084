"""Tests of the SD3-style `MMDiT` velocity network.

Small sizes throughout; the SD3-Medium size is only ever shape-evaluated. Inputs are made with
NumPy and passed into jitted calls (eager `jnp` ops compile once per shape).
"""

import functools
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flowgrpo_eqx as fg
from flowgrpo_eqx.models import ChunkedAttention, MMDiT, SaveDots, SaveNothing, SaveQKV
from flowgrpo_eqx.models._init import uniform_arrays
from flowgrpo_eqx.train import Trainer, default_optimizer
from tests.cli_rewards import brightness
from tests.diffusers_helpers import assert_leaves_close, velocity_and_sin_gradient
from tests.errors import NAMED_ARGUMENT_ERRORS
from tests.tiny_models import perturbed


KEY = jax.random.key(0)
SIZES = dict(
    image_size=8,
    channels=4,
    patch=2,
    width=32,
    heads=4,
    context_length=3,
    context_dim=12,
    pooled_dim=10,
)


def _model(depth: int = 2, **kwargs: Any) -> MMDiT:
    return MMDiT(**{**SIZES, "depth": depth, **kwargs}, key=KEY)


@eqx.filter_jit
def _vcall(model: Any, x: Any, t: Any, cond: Any) -> jax.Array:
    out: jax.Array = jax.vmap(model)(x, t, cond)
    return out


def _inputs(model: MMDiT, n: int, seed: int) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, model.image_size, model.image_size, model.channels))
    t = rng.uniform(size=(n,))
    cond = {
        "context": rng.standard_normal((n, model.context_length, model.context_dim)),
        "pooled": rng.standard_normal((n, model.pooled_dim)),
    }
    return x.astype(np.float32), t.astype(np.float32), jax.tree.map(np.float32, cond)


def _float_leaves(tree: Any) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array))]


def test_shapes_dtype_zero_velocity_and_joint_attention() -> None:
    # Depth 1: the only block's text stream is pre-only (as SD3's last block), so the context
    # can reach the image only through the joint attention's keys and values.
    model = _model(depth=1)
    assert model.blocks[-1].context.attn.out is None
    assert model.blocks[-1].image.attn.out is not None
    x, t, cond = _inputs(model, 2, 0)
    v = _vcall(model, x, t, cond)
    assert v.shape == x.shape and v.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(v), 0.0)
    half = eqx.filter_eval_shape(_vcall, model, x.astype(jnp.bfloat16), t, cond)
    assert half.shape == x.shape and half.dtype == jnp.bfloat16

    # Away from the zero init (same structure and shapes: no recompilation).
    model = perturbed(model, seed=3)
    base = np.asarray(_vcall(model, x, t, cond))
    assert np.all(np.isfinite(base)) and np.any(base != 0)
    other_context = {**cond, "context": cond["context"] + 1.0}
    assert np.max(np.abs(np.asarray(_vcall(model, x, t, other_context)) - base)) > 1e-3
    other_pooled = {**cond, "pooled": cond["pooled"] + 1.0}
    assert np.max(np.abs(np.asarray(_vcall(model, x, t, other_pooled)) - base)) > 1e-3


def test_init_draws_the_same_values_under_a_trace() -> None:
    # `eval_shape` of the SD3-Medium size traces the init; it draws in one batched call there.
    specs = [((300, 250), 1.0), ((5,), 2.0), ((70_000,), 0.5)]
    eager = uniform_arrays(KEY, specs)
    traced = jax.jit(lambda key: uniform_arrays(key, specs))(KEY)
    for a, b in zip(eager, traced, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_patchify_unpatchify_round_trip_is_exact() -> None:
    model = _model(depth=1)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((8, 8, 4)).astype(np.float32))
    tokens = model._patchify(x)
    assert tokens.shape == (16, 2 * 2 * 4)
    # Token 5 is the patch at grid row 1, column 1, flattened row-major, channels last.
    np.testing.assert_array_equal(np.asarray(tokens[5]), np.asarray(x[2:4, 2:4]).reshape(-1))
    np.testing.assert_array_equal(np.asarray(model._unpatchify(tokens)), np.asarray(x))


def test_every_block_is_the_identity_at_init() -> None:
    # Depth 2: a full block, and a last block whose text stream is pre-only.
    model = _model(depth=2)
    rng = np.random.default_rng(2)
    context = rng.standard_normal((model.context_length, model.width)).astype(np.float32)
    image = rng.standard_normal((16, model.width)).astype(np.float32)
    c = rng.standard_normal((model.width,)).astype(np.float32)
    apply = eqx.filter_jit(lambda blocks, *args: [block(*args) for block in blocks])
    for out_context, out_image in apply(model.unstacked_blocks(), context, image, c):
        np.testing.assert_array_equal(np.asarray(out_context), context)
        np.testing.assert_array_equal(np.asarray(out_image), image)


def test_token_id_conditioning() -> None:
    model = perturbed(_model(depth=1, vocab_size=5), seed=5)
    ids = jnp.asarray([4, 0, 9], jnp.int32)
    context, pooled = model._text(ids)
    assert model.token_embed is not None and model.token_pos_embed is not None
    assert model.pooled_token_embed is not None
    rows = np.asarray([4, 0, 4])  # Ids outside `[0, vocab_size)` are clipped.
    want_context = np.asarray(model.token_embed)[rows] + np.asarray(model.token_pos_embed)
    np.testing.assert_allclose(np.asarray(context), want_context, rtol=1e-6)
    want_pooled = np.asarray(model.pooled_token_embed)[rows].mean(axis=0)
    np.testing.assert_allclose(np.asarray(pooled), want_pooled, rtol=1e-5, atol=1e-6)
    x = jax.ShapeDtypeStruct((8, 8, 4), jnp.float32)
    v = eqx.filter_eval_shape(model, x, jax.ShapeDtypeStruct((), jnp.float32), ids)
    assert v.shape == (8, 8, 4) and v.dtype == jnp.float32


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(patch=3), "patch"),
        (dict(heads=5), "heads"),
        (dict(width=0), "width"),
        (dict(depth=0), "depth"),
        (dict(context_dim=0), "context_dim"),
        (dict(pooled_dim=-1), "pooled_dim"),
        (dict(context_length=0), "context_length"),
        (dict(mlp_ratio=True), "mlp_ratio"),
        (dict(vocab_size=0), "vocab_size"),
    ],
)
def test_bad_config_is_named(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(ValueError, match=f"`{name}`"):
        MMDiT(**{**SIZES, "depth": 1, **kwargs}, key=KEY)


def test_wrong_inputs_are_named() -> None:
    model = _model(depth=1)
    x, t, cond = _inputs(model, 1, 7)
    x, t, cond = x[0], t[0], jax.tree.map(lambda a: a[0], cond)
    call = eqx.filter_eval_shape
    with pytest.raises(ValueError, match="`x`"):
        call(model, x[:4], t, cond)
    with pytest.raises(ValueError, match=r"`cond\['context'\]`"):
        call(model, x, t, {**cond, "context": cond["context"][:2]})
    with pytest.raises(ValueError, match=r"`cond\['pooled'\]`"):
        call(model, x, t, {**cond, "pooled": cond["pooled"][:2]})
    with pytest.raises(ValueError, match="`cond`"):
        call(model, x, t, np.zeros(model.context_length, np.int32))
    with pytest.raises(ValueError, match="`cond`"):
        call(_model(depth=1, vocab_size=5), x, t, cond)


def test_sd3_medium_configuration_has_diffusers_parameter_count() -> None:
    config = MMDiT.sd3_medium_config()
    model = eqx.filter_eval_shape(MMDiT, **config, key=KEY)
    assert (model.depth, model.width, model.heads, model.patch) == (24, 1536, 24, 2)
    count = sum(
        int(np.prod(leaf.shape))
        for leaf in jax.tree.leaves(model)
        if isinstance(leaf, jax.ShapeDtypeStruct) and jnp.issubdtype(leaf.dtype, jnp.inexact)
    )
    # diffusers' SD3Transformer2DModel counts 2,028,328,000 (its position buffer not counted);
    # ours holds the 64 x 64 crop of the table besides.
    assert count == 2_028_328_000 + 64 * 64 * 1536, count
    # The velocity's shape at that size, without running it.
    latent = jax.ShapeDtypeStruct((128, 128, 16), jnp.bfloat16)
    cond = {
        "context": jax.ShapeDtypeStruct((154, 4096), jnp.bfloat16),
        "pooled": jax.ShapeDtypeStruct((2048,), jnp.bfloat16),
    }
    v = eqx.filter_eval_shape(model, latent, jax.ShapeDtypeStruct((), jnp.float32), cond)
    assert v.shape == (128, 128, 16) and v.dtype == jnp.bfloat16


def test_small_mmdit_trains_in_the_flow_grpo_loop() -> None:
    model = _model(depth=1)
    null = {
        "context": jnp.zeros((model.context_length, model.context_dim)),
        "pooled": jnp.zeros((model.pooled_dim,)),
    }
    objective = fg.FlowGRPOObjective(
        model,
        fg.RectifiedFlow(),
        fg.InputSpec(select=("context", "pooled"), null=null, latent_shape=(8, 8, 4)),
        guidance=fg.CFG(2.0),
        beta=0.0,
        clip_range=0.2,
        steps=3,
    )
    _, _, cond = _inputs(model, 2, 8)
    rows = {**cond, "prompt_id": np.arange(2)}
    rollout = fg.FlowRollout(objective, brightness, groups=2, steps=3)
    trainer = Trainer(objective, default_optimizer(1e-2, 0.0))
    state = trainer.init(jax.random.key(1))
    before = _float_leaves(state.variables.policy)
    batch, _ = rollout.collect(state.variables.policy, rows, jax.random.key(2))
    losses = []
    for _ in range(3):
        state, metrics = trainer.update(state, batch)
        losses.append(float(metrics["loss"]))
    assert np.all(np.isfinite(losses))
    after = _float_leaves(state.variables.policy)
    changed = [not np.array_equal(a, b) for a, b in zip(before, after, strict=True)]
    # The zero-initialised final projection moves first, then the blocks behind it.
    trained = state.variables.policy
    assert not np.array_equal(np.asarray(trained.final_proj.weight), 0.0)
    assert sum(changed) > len(changed) // 2


SD35_LIKE = dict(depth=4, qk_norm="rms_norm", dual_attention_layers=(0, 1))


def test_stacked_groups_follow_the_block_structure() -> None:
    assert MMDiT.sd35_medium_config()["dual_attention_layers"] == tuple(range(13))
    sd35 = eqx.filter_eval_shape(MMDiT, **MMDiT.sd35_medium_config(), key=KEY)
    assert sd35.block_groups == ((0, 13), (13, 23), (23, 24))
    assert [group.image.modulation.weight.shape[0] for group in sd35.blocks] == [13, 10, 1]
    assert sd35.blocks[0].attn2 is not None and sd35.blocks[1].attn2 is None
    assert sd35.blocks[2].context.attn.out is None
    sd3 = eqx.filter_eval_shape(MMDiT, **MMDiT.sd3_medium_config(), key=KEY)
    assert sd3.block_groups == ((0, 23), (23, 24))
    # The same parameters either way.
    count = lambda m: sum(leaf.size for leaf in jax.tree.leaves(m))  # noqa: E731
    unstacked = eqx.filter_eval_shape(
        MMDiT, **{**MMDiT.sd3_medium_config(), "stacked": False}, key=KEY
    )
    assert count(sd3) == count(unstacked)


@pytest.mark.parametrize(
    "settings",
    [
        dict(),
        dict(remat=SaveDots()),
        dict(remat=SaveNothing(), attention=ChunkedAttention(7)),
        dict(remat=(SaveDots(), SaveNothing(), SaveQKV(), SaveNothing())),
    ],
)
def test_stacked_remat_and_chunked_attention_compute_the_same_velocity_and_gradient(
    settings: dict[str, Any],
) -> None:
    stacked = perturbed(_model(**SD35_LIKE), seed=11)
    assert stacked.stacked and len(stacked.blocks) == 3
    assert (
        stacked.with_settings(stacked=False)
        .with_settings(stacked=True)
        .blocks[0]
        .image.fc1.weight.shape[0]
        == 2
    )
    other = stacked.with_settings(**settings)
    x, t, cond = _inputs(stacked, 2, 12)
    want, want_grads = _unstacked_velocity_and_gradient()
    velocity, gradient = velocity_and_sin_gradient(other, x, t, cond)
    np.testing.assert_allclose(np.asarray(velocity), want, rtol=0, atol=1e-6)
    # A remat per block holds the first group of two blocks in two runs: the reference's
    # gradient is restacked to the same runs.
    assert_leaves_close(gradient, want_grads.with_settings(remat=other.remat), 1e-5)


@functools.cache
def _unstacked_velocity_and_gradient() -> tuple[np.ndarray, Any]:
    """The reference of the settings test, computed once: the same parameters as one block
    after another (no scan, no remat, plain attention); the gradient restacked to compare."""
    plain = perturbed(_model(**SD35_LIKE), seed=11).with_settings(stacked=False)
    assert not plain.stacked and len(plain.blocks) == 4
    x, t, cond = _inputs(plain, 2, 12)
    velocity, gradient = velocity_and_sin_gradient(plain, x, t, cond)
    return np.asarray(velocity), gradient.with_settings(stacked=True)


def test_scan_keeps_the_program_size_flat_in_depth() -> None:
    def program_size(depth: int) -> int:
        model = eqx.filter_eval_shape(MMDiT, **{**SIZES, "depth": depth}, key=KEY)
        abstract = lambda leaf: isinstance(leaf, jax.ShapeDtypeStruct)  # noqa: E731
        params, static = eqx.partition(model, abstract, is_leaf=abstract)
        x = jax.ShapeDtypeStruct((8, 8, 4), jnp.float32)
        cond = {
            "context": jax.ShapeDtypeStruct((3, 12), jnp.float32),
            "pooled": jax.ShapeDtypeStruct((10,), jnp.float32),
        }
        t = jax.ShapeDtypeStruct((), jnp.float32)
        call = jax.jit(lambda p, *args: eqx.combine(p, static)(*args))
        return len(call.lower(params, x, t, cond).as_text())

    # Only the shapes' layer counts differ (3 vs 12 in the stacked arrays' types).
    small, large = program_size(3), program_size(12)
    assert abs(large - small) < 0.01 * small, (small, large)


@pytest.mark.parametrize(
    ("settings", "name"),
    [
        (dict(stacked=1), "stacked"),
        (dict(remat="everything"), "remat"),
        (dict(attention="flash"), "attention"),
        # A setting's name is read at the settings boundary (`attention_from_name`), not here.
        (dict(attention="chunked"), "attention"),
    ],
)
def test_bad_settings_are_named(settings: dict[str, Any], name: str) -> None:
    # The runtime type checker (when on) names the parameter first, as 'name'.
    pattern = f"`{name}`|'{name}'"
    with pytest.raises(NAMED_ARGUMENT_ERRORS, match=pattern):
        MMDiT(**{**SIZES, "depth": 1, **settings}, key=KEY)
    with pytest.raises(NAMED_ARGUMENT_ERRORS, match=pattern):
        _model(depth=1).with_settings(**settings)
