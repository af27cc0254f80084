"""Property tests of `flowgrpo_eqx.lora` on a small user model (`eqx.nn.MLP`, tanh).

The expectation is a float64 NumPy forward pass with every adapted weight written out as
`W + (alpha / rank) B A`; trained with the library's `Trainer`, the base stays bit-identical
whatever the number of updates. Each distinct (rank, selected layers) compiles once, so examples
are few.
"""

import pathlib
import tempfile
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, strategies as st

import flowgrpo_eqx as fg
from flowgrpo_eqx import lora, testing as T
from flowgrpo_eqx.train import Trainer, default_optimizer
from tests import tolerances


DIM, COND, WIDTH, DEPTH = 3, 2, 6, 2
ROWS = 4


class TanhMLP(eqx.Module):
    """`eqx.nn.MLP` (tanh) on `[x, t, cond]`."""

    mlp: eqx.nn.MLP

    def __call__(self, x: jax.Array, t: jax.Array, cond: jax.Array) -> jax.Array:
        out: jax.Array = self.mlp(jnp.concatenate([x, t[None], cond]))
        return out


BASE = TanhMLP(eqx.nn.MLP(DIM + 1 + COND, DIM, WIDTH, DEPTH, jnp.tanh, key=jax.random.key(0)))
NUM_LAYERS = DEPTH + 1


@eqx.filter_jit
def vcall(model: Any, x: Any, t: Any, cond: Any) -> jax.Array:
    out: jax.Array = jax.vmap(model)(x, t, cond)
    return out


def inputs(seed: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    return (
        jnp.asarray(rng.normal(size=(ROWS, DIM)), jnp.float32),
        jnp.asarray(rng.uniform(size=(ROWS,)), jnp.float32),
        jnp.asarray(rng.normal(size=(ROWS, COND)), jnp.float32),
    )


def adapted_model(rank: int, alpha: float, chosen: list[int], seed: int) -> Any:
    return lora.add(
        BASE,
        rank,
        key=jax.random.key(seed),
        alpha=alpha,
        where=lambda m: [m.mlp.layers[i] for i in chosen],
    )


def with_random_adapters(model: Any, seed: int, scale: float) -> Any:
    rng = np.random.default_rng(seed)
    drawn = jax.tree.map(
        lambda leaf: jnp.asarray(scale * rng.normal(size=leaf.shape), leaf.dtype),
        lora.adapters(model),
    )
    return lora.with_adapters(model, drawn)


def numpy_forward(model: Any, x: jax.Array, t: jax.Array, cond: jax.Array) -> np.ndarray:
    """The adapted model in float64 NumPy, batched over rows."""
    by_path = dict(zip(model.layer_paths, model.adapters, strict=True))
    scale = model.alpha / model.rank
    h = np.concatenate(
        [np.asarray(x, np.float64), np.asarray(t, np.float64)[:, None], np.asarray(cond)], 1
    )
    for index, layer in enumerate(BASE.mlp.layers):
        weight = np.asarray(layer.weight, np.float64)
        adapter = by_path.get(f".mlp.layers[{index}]")
        if adapter is not None:
            weight = weight + scale * (
                np.asarray(adapter.b, np.float64) @ np.asarray(adapter.a, np.float64)
            )
        h = h @ weight.T + np.asarray(layer.bias, np.float64)
        if index < NUM_LAYERS - 1:
            h = np.tanh(h)
    return h


def leaves_equal(left: Any, right: Any) -> bool:
    a, b = jax.tree.leaves(left), jax.tree.leaves(right)
    return len(a) == len(b) and all(np.array_equal(p, q) for p, q in zip(a, b, strict=True))


_ranks = st.integers(1, 3)
_alphas = st.floats(0.25, 8.0)
_chosen = st.lists(st.integers(0, NUM_LAYERS - 1), min_size=1, max_size=NUM_LAYERS, unique=True)
_seeds = st.integers(0, 2**31 - 1)


@T.property_settings(10)
@given(rank=_ranks, alpha=_alphas, chosen=_chosen, seed=_seeds)
def test_fresh_adapters_change_nothing(
    rank: int, alpha: float, chosen: list[int], seed: int
) -> None:
    model = adapted_model(rank, alpha, chosen, seed)
    x, t, cond = inputs(seed)
    np.testing.assert_array_equal(
        np.asarray(vcall(model, x, t, cond)), np.asarray(vcall(BASE, x, t, cond))
    )
    assert model.layer_paths == tuple(f".mlp.layers[{i}]" for i in sorted(chosen))
    assert sum(jax.tree.leaves(lora.adapter_filter(model))) == 2 * len(chosen)
    assert leaves_equal(lora.base(model), BASE)


@T.property_settings(10)
@given(
    rank=_ranks,
    alpha=_alphas,
    chosen=_chosen,
    seed=_seeds,
    scale=st.floats(0.01, 1.0),
)
def test_random_adapters_compute_w_plus_scaled_ba(
    rank: int, alpha: float, chosen: list[int], seed: int, scale: float
) -> None:
    model = with_random_adapters(adapted_model(rank, alpha, chosen, seed), seed + 1, scale)
    x, t, cond = inputs(seed)
    expected = numpy_forward(model, x, t, cond)
    # float32 rounding is relative to the largest terms of a layer, not to each output: an
    # output that cancels down from terms of size 50 keeps their absolute error.
    magnitude = max(1.0, float(np.abs(expected).max()))
    atol = tolerances.tanh_model_atol(4e-6 * magnitude, magnitude)
    np.testing.assert_allclose(np.asarray(vcall(model, x, t, cond)), expected, rtol=1e-5, atol=atol)
    merged = eqx.filter_jit(lora.merge)(model)
    assert jax.tree.structure(merged) == jax.tree.structure(BASE)
    np.testing.assert_allclose(
        np.asarray(vcall(merged, x, t, cond)), expected, rtol=1e-5, atol=atol
    )
    assert leaves_equal(lora.base(model), BASE)


@T.property_settings(10)
@given(rank=_ranks, alpha=_alphas, chosen=_chosen, seed=_seeds)
def test_adapter_files_round_trip(rank: int, alpha: float, chosen: list[int], seed: int) -> None:
    model = with_random_adapters(adapted_model(rank, alpha, chosen, seed), seed + 1, 0.5)
    with tempfile.TemporaryDirectory() as folder:
        path = pathlib.Path(folder) / "adapters.lora"
        lora.save_adapters(path, model)
        loaded = lora.load_adapters(path, BASE)
    assert (loaded.layer_paths, loaded.rank, loaded.alpha) == (
        model.layer_paths,
        model.rank,
        model.alpha,
    )
    assert leaves_equal(loaded, model)
    fresh = adapted_model(rank, alpha, chosen, seed)
    assert leaves_equal(lora.with_adapters(fresh, lora.adapters(loaded)), model)
    assert lora.fingerprint(lora.base(loaded)) == lora.fingerprint(BASE)


# --------------------------------------------------------------------------------------
# Training a policy with adapters: the base never moves.

TRAIN_ROWS, TRAIN_K = 4, 2
TRAIN_POLICY = lora.add(BASE, 2, key=jax.random.key(7), alpha=4.0)
TRAIN_OBJECTIVE = fg.FlowGRPOObjective(
    TRAIN_POLICY,
    fg.RectifiedFlow(),
    fg.InputSpec(null=jnp.zeros(COND), latent_shape=(DIM,)),
    beta=0.2,
    clip_range=0.2,
    guidance=fg.CFG(2.0),
)
TRAINER = Trainer(TRAIN_OBJECTIVE, default_optimizer(3e-2, 0.0), ema_decay=0.5)


@eqx.filter_jit
def rescored(variables: fg.FlowGRPOVariables, batch: fg.Transitions) -> jax.Array:
    out: jax.Array = TRAIN_OBJECTIVE.log_probs(variables, batch)
    return out


def on_policy_batch(variables: fg.FlowGRPOVariables, seed: int) -> fg.Transitions:
    """Random transitions whose `old_log_probs` are the policy's own (ratio 1)."""
    rng = np.random.default_rng(seed)
    grid = np.linspace(1.0, 0.0, TRAIN_K + 2)
    latents = rng.normal(size=(TRAIN_ROWS, TRAIN_K, DIM))
    batch = fg.Transitions(
        latents=jnp.asarray(latents, jnp.float32),
        next_latents=jnp.asarray(latents + 0.3 * rng.normal(size=latents.shape), jnp.float32),
        timesteps=jnp.asarray(np.tile(grid[:TRAIN_K], (TRAIN_ROWS, 1)), jnp.float32),
        next_timesteps=jnp.asarray(np.tile(grid[1 : TRAIN_K + 1], (TRAIN_ROWS, 1)), jnp.float32),
        old_log_probs=jnp.zeros((TRAIN_ROWS, TRAIN_K), jnp.float32),
        transition_mask=jnp.ones((TRAIN_ROWS, TRAIN_K), bool),
        advantages=jnp.asarray(rng.normal(size=(TRAIN_ROWS,)), jnp.float32),
        cond=jnp.asarray(rng.normal(size=(TRAIN_ROWS, COND)), jnp.float32),
    )
    on_policy: fg.Transitions = eqx.tree_at(
        lambda b: b.old_log_probs, batch, rescored(variables, batch)
    )
    return on_policy


@T.property_settings(6)
@given(updates=st.integers(0, 4), seed=_seeds)
def test_trainer_updates_move_adapters_only(updates: int, seed: int) -> None:
    state = TRAINER.init(jax.random.key(seed))
    adapters_before = [np.asarray(x) for x in jax.tree.leaves(TRAIN_POLICY.adapters)]
    for index in range(updates):
        batch = on_policy_batch(state.variables, seed + index)
        state, metrics = TRAINER.update(state, batch)
        if index == 0:
            assert float(metrics["ratio"]) == 1.0 and float(metrics["kl"]) == 0.0
    policy = state.variables.policy
    assert leaves_equal(lora.base(policy), BASE)
    frozen = lora.adapter_filter(policy)
    assert leaves_equal(
        eqx.filter(policy, frozen, inverse=True),
        eqx.filter(TRAIN_POLICY, frozen, inverse=True),
    )
    adapters_after = [np.asarray(x) for x in jax.tree.leaves(policy.adapters)]
    changed = any(
        not np.array_equal(a, b) for a, b in zip(adapters_before, adapters_after, strict=True)
    )
    assert changed == (updates > 0)
    # The EMA is of the adapters: adapter arrays only.
    assert len(jax.tree.leaves(state.ema)) == len(adapters_after)
