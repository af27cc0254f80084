"""Property tests of `flowgrpo_eqx.lora` on a small user model (`eqx.nn.MLP`, tanh).

The expectation is a float64 NumPy forward pass with every adapted weight written out as
`W + (alpha / rank) B A`. Each distinct (rank, selected layers) compiles once, so examples
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

from flowgrpo_eqx import lora
from property_tests import _strategies as S


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


@S.fast_settings(10)
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


@S.fast_settings(10)
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
    np.testing.assert_allclose(np.asarray(vcall(model, x, t, cond)), expected, rtol=1e-5, atol=2e-6)
    merged = eqx.filter_jit(lora.merge)(model)
    assert jax.tree.structure(merged) == jax.tree.structure(BASE)
    np.testing.assert_allclose(
        np.asarray(vcall(merged, x, t, cond)), expected, rtol=1e-5, atol=2e-6
    )
    assert leaves_equal(lora.base(model), BASE)


@S.fast_settings(10)
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
