"""Tests of `flowgrpo_eqx.lora`: adapters on the shipped models and on a user model.

Expected values are float64 NumPy statements of `W + (alpha / rank) B A`; inputs are made
with NumPy and passed to jitted calls (eager ops compile once per shape on a small CPU).
"""

import math
import os
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flowgrpo_eqx import lora
from flowgrpo_eqx.models import DiT, MLPVelocity
from tests import tolerances
from tests.test_docs import DOCS, run_page


RNG = np.random.default_rng(0)


class UserMLP(eqx.Module):
    """A user model: `eqx.nn.MLP` (tanh) on `[x, t, cond]`, written outside the library."""

    mlp: eqx.nn.MLP

    def __init__(self, dim: int, cond_dim: int, key: jax.Array):
        self.mlp = eqx.nn.MLP(dim + 1 + cond_dim, dim, 12, 2, activation=jnp.tanh, key=key)

    def __call__(self, x: jax.Array, t: jax.Array, cond: jax.Array) -> jax.Array:
        out: jax.Array = self.mlp(jnp.concatenate([x, t[None], cond]))
        return out


class OneLinear(eqx.Module):
    """A user model made of one `eqx.nn.Linear` applied to `x`."""

    layer: eqx.nn.Linear

    def __call__(self, x: jax.Array, t: jax.Array, cond: jax.Array) -> jax.Array:
        out: jax.Array = self.layer(x)
        return out


def randomised(model: Any, seed: int, scale: float = 0.3) -> Any:
    """Every float array replaced by `N(0, scale^2)` values (the DiT starts with v = 0)."""
    rng = np.random.default_rng(seed)

    def draw(leaf: Any) -> Any:
        if not eqx.is_inexact_array(leaf):
            return leaf
        return jnp.asarray(scale * rng.normal(size=leaf.shape), leaf.dtype)

    return jax.tree.map(draw, model)


def random_adapters(model: lora.LoraModel[Any], seed: int, scale: float = 0.3) -> Any:
    """`model` with every adapter's `a` and `b` drawn from `N(0, scale^2)`."""
    rng = np.random.default_rng(seed)
    drawn = jax.tree.map(
        lambda leaf: jnp.asarray(scale * rng.normal(size=leaf.shape), leaf.dtype),
        lora.adapters(model),
    )
    return lora.with_adapters(model, drawn)


def make_model(kind: str) -> tuple[Any, tuple[Any, Any, Any]]:
    """A small model of each kind and a batch of 3 inputs for it."""
    key = jax.random.key(1)
    if kind == "mlp":
        model: Any = MLPVelocity(4, 2, hidden=16, depth=2, time_features=8, key=key)
        x = RNG.normal(size=(3, 4)).astype(np.float32)
        cond: Any = RNG.normal(size=(3, 2)).astype(np.float32)
    elif kind == "dit":
        model = DiT(4, 2, 2, width=8, depth=2, heads=2, vocab_size=5, prompt_length=3, key=key)
        model = randomised(model, 2)
        x = RNG.normal(size=(3, 4, 4, 2)).astype(np.float32)
        cond = RNG.integers(0, 5, size=(3, 3)).astype(np.int32)
    else:
        model = UserMLP(4, 2, key)
        x = RNG.normal(size=(3, 4)).astype(np.float32)
        cond = RNG.normal(size=(3, 2)).astype(np.float32)
    t = RNG.uniform(size=(3,)).astype(np.float32)
    return model, (jnp.asarray(x), jnp.asarray(t), jnp.asarray(cond))


@eqx.filter_jit
def vcall(model: Any, x: Any, t: Any, cond: Any) -> jax.Array:
    """The model on a batch, `vmap` over rows, as the library calls it."""
    out: jax.Array = jax.vmap(model)(x, t, cond)
    return out


@eqx.filter_jit
def call(model: Any, x: Any, t: Any, cond: Any) -> jax.Array:
    """The model on one unbatched example."""
    out: jax.Array = model(x, t, cond)
    return out


merge = eqx.filter_jit(lora.merge)


def leaves_equal(left: Any, right: Any) -> bool:
    a, b = jax.tree.leaves(left), jax.tree.leaves(right)
    return len(a) == len(b) and all(np.array_equal(p, q) for p, q in zip(a, b, strict=True))


KINDS = ("mlp", "dit", "user")


# --------------------------------------------------------------------------------------
# A fresh adapter changes nothing; random adapters compute W + (alpha / rank) B A.


@pytest.mark.parametrize("kind", KINDS)
def test_fresh_adapters_give_bit_identical_outputs(kind: str) -> None:
    model, (x, t, cond) = make_model(kind)
    adapted = lora.add(model, 3, key=jax.random.key(5))
    expected = np.asarray(vcall(model, x, t, cond))
    assert np.any(expected != 0)
    np.testing.assert_array_equal(np.asarray(vcall(adapted, x, t, cond)), expected)
    single = call(adapted, x[0], t[0], cond[0])
    np.testing.assert_array_equal(np.asarray(single), np.asarray(call(model, x[0], t[0], cond[0])))
    assert all(not np.any(np.asarray(adapter.b)) for adapter in adapted.adapters)
    # `a` is N(0, 1 / rank^2), the Flow-GRPO release's (PEFT "gaussian") initialisation.
    draws = np.concatenate([np.asarray(adapter.a).ravel() for adapter in adapted.adapters])
    assert abs(np.std(draws) * 3 - 1) < 0.2
    assert abs(np.mean(draws) * 3) < 0.2


def test_adapted_user_model_matches_numpy_float64() -> None:
    model, (x, t, cond) = make_model("user")
    rank, alpha = 2, 5.0
    adapted = random_adapters(lora.add(model, rank, key=jax.random.key(0), alpha=alpha), 3)
    by_path = dict(zip(adapted.layer_paths, adapted.adapters, strict=True))
    h = np.concatenate(
        [np.asarray(x, np.float64), np.asarray(t, np.float64)[:, None], np.asarray(cond)], 1
    )
    for index, layer in enumerate(model.mlp.layers):
        adapter = by_path[f".mlp.layers[{index}]"]
        weight = np.asarray(layer.weight, np.float64) + alpha / rank * (
            np.asarray(adapter.b, np.float64) @ np.asarray(adapter.a, np.float64)
        )
        h = h @ weight.T + np.asarray(layer.bias, np.float64)
        if index < len(model.mlp.layers) - 1:
            h = np.tanh(h)
    np.testing.assert_allclose(
        np.asarray(vcall(adapted, x, t, cond)), h, rtol=1e-5, atol=tolerances.tanh_model_atol(1e-6)
    )
    merged = merge(adapted)
    np.testing.assert_allclose(
        np.asarray(vcall(merged, x, t, cond)),
        np.asarray(vcall(adapted, x, t, cond)),
        rtol=1e-5,
        atol=1e-7,
    )


@pytest.mark.parametrize(
    ("in_features", "out_features", "use_bias"),
    [(5, 3, True), (5, 3, False), ("scalar", 3, True), (4, "scalar", True)],
)
def test_one_linear_layer_is_w_plus_scaled_ba(
    in_features: Any, out_features: Any, use_bias: bool
) -> None:
    layer = eqx.nn.Linear(in_features, out_features, use_bias, key=jax.random.key(0))
    model = OneLinear(layer)
    rank, alpha = 2, 3.0
    adapted = random_adapters(lora.add(model, rank, key=jax.random.key(1), alpha=alpha), 4)
    (adapter,) = adapted.adapters
    in_size = 1 if in_features == "scalar" else in_features
    assert adapter.a.shape == (rank, in_size)
    x = RNG.normal(size=(6,) if in_features == "scalar" else (6, in_size)).astype(np.float32)
    x_np = np.asarray(x, np.float64).reshape(6, in_size)
    weight = np.asarray(layer.weight, np.float64) + alpha / rank * (
        np.asarray(adapter.b, np.float64) @ np.asarray(adapter.a, np.float64)
    )
    expected = x_np @ weight.T
    if use_bias:
        expected = expected + np.asarray(layer.bias, np.float64)
    if out_features == "scalar":
        expected = expected[:, 0]
    got = vcall(adapted, jnp.asarray(x), jnp.zeros(6), jnp.zeros((6, 1)))
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-6)
    merged_weight = np.asarray(lora.merge(adapted).layer.weight, np.float64)
    np.testing.assert_allclose(merged_weight, weight, rtol=1e-6, atol=1e-7)


def test_adapters_on_layers_read_directly_take_effect() -> None:
    # The DiT reads `qkv.weight` (reshaped for a head-major einsum) and `proj.weight`
    # without calling the layers; the adapters must still act on them.
    model, (x, t, cond) = make_model("dit")
    rank, alpha = 2, 4  # an int alpha is accepted
    adapted = lora.add(
        model,
        rank,
        key=jax.random.key(0),
        alpha=alpha,
        where=lambda m: [block.qkv for block in m.blocks] + [block.proj for block in m.blocks],
    )
    adapted = random_adapters(adapted, 6)
    # In the model's tree order, whatever order `where` lists them in.
    assert adapted.layer_paths == (
        ".blocks[0].qkv",
        ".blocks[0].proj",
        ".blocks[1].qkv",
        ".blocks[1].proj",
    )
    by_path = dict(zip(adapted.layer_paths, adapted.adapters, strict=True))

    def folded(layer: eqx.nn.Linear, path: str) -> eqx.nn.Linear:
        adapter = by_path[path]
        weight = np.asarray(layer.weight, np.float64) + alpha / rank * (
            np.asarray(adapter.b, np.float64) @ np.asarray(adapter.a, np.float64)
        )
        return eqx.tree_at(lambda m: m.weight, layer, jnp.asarray(weight, jnp.float32))

    by_hand = model
    for i in range(2):
        by_hand = eqx.tree_at(
            lambda m, i=i: (m.blocks[i].qkv, m.blocks[i].proj),
            by_hand,
            (
                folded(model.blocks[i].qkv, f".blocks[{i}].qkv"),
                folded(model.blocks[i].proj, f".blocks[{i}].proj"),
            ),
        )
    got = np.asarray(vcall(adapted, x, t, cond))
    assert np.max(np.abs(got - np.asarray(vcall(model, x, t, cond)))) > 1e-3
    np.testing.assert_allclose(got, np.asarray(vcall(by_hand, x, t, cond)), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------
# Selecting layers.


def test_where_selects_dit_attention_projections() -> None:
    model, _ = make_model("dit")
    depth, width = len(model.blocks), model.width
    every = lora.add(model, 2, key=jax.random.key(0))
    # patch_embed, time_mlp x2, cond_mlp x2, 5 per block, final_modulation, final_proj.
    assert len(every.adapters) == 5 + 5 * depth + 2
    attention = lora.add(
        model,
        2,
        key=jax.random.key(0),
        where=lambda m: [layer for block in m.blocks for layer in (block.qkv, block.proj)],
    )
    assert attention.layer_paths == tuple(
        f".blocks[{i}].{name}" for i in range(depth) for name in ("qkv", "proj")
    )
    shapes = [(adapter.a.shape, adapter.b.shape) for adapter in attention.adapters]
    assert shapes == [((2, width), (3 * width, 2)), ((2, width), (width, 2))] * depth
    marked = jax.tree.leaves(lora.adapter_filter(attention))
    assert sum(marked) == 2 * len(attention.adapters)
    one = lora.add(model, 2, key=jax.random.key(0), where=lambda m: m.final_proj)
    assert one.layer_paths == (".final_proj",)


def test_has_adapters_looks_through_containers() -> None:
    model, _ = make_model("mlp")
    adapted = lora.add(model, 2, key=jax.random.key(0))
    assert lora.has_adapters(adapted)
    assert lora.has_adapters({"policy": adapted, "held": model})
    assert not lora.has_adapters(model)
    assert not lora.has_adapters(lora.merge(adapted))
    assert not lora.has_adapters(lora.base(adapted))
    assert not any(jax.tree.leaves(lora.adapter_filter(model)))


# --------------------------------------------------------------------------------------
# Training the adapters only.


def toy_regression(model: Any, x: Any, t: Any, cond: Any, target: Any) -> jax.Array:
    return jnp.mean((jax.vmap(model)(x, t, cond) - target) ** 2)


@pytest.mark.parametrize("kind", ("mlp", "dit"))
def test_adamw_on_adapter_partition_leaves_base_bit_identical(kind: str) -> None:
    model, (x, t, cond) = make_model(kind)
    target = jnp.asarray(RNG.normal(size=x.shape).astype(np.float32))
    adapted = lora.add(model, 2, key=jax.random.key(3))
    trainable, frozen = eqx.partition(adapted, lora.adapter_filter(adapted))
    optimizer = optax.adamw(1e-2)
    opt_state = optimizer.init(trainable)

    @eqx.filter_jit
    def update(trainable: Any, opt_state: Any) -> tuple[Any, Any, jax.Array]:
        def loss(trainable: Any) -> jax.Array:
            return toy_regression(eqx.combine(trainable, frozen), x, t, cond, target)

        value, grads = eqx.filter_value_and_grad(loss)(trainable)
        # (optax mixes Python floats with its int32 step count, as a user's default allows.)
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = optimizer.update(grads, opt_state, trainable)
        return eqx.apply_updates(trainable, updates), opt_state, value

    losses = []
    for _ in range(5):
        trainable, opt_state, value = update(trainable, opt_state)
        losses.append(float(value))
    trained = eqx.combine(trainable, frozen)

    assert losses[-1] < losses[0]
    assert leaves_equal(lora.base(trained), model)
    assert leaves_equal(
        eqx.filter(trained, lora.adapter_filter(trained), inverse=True),
        eqx.filter(adapted, lora.adapter_filter(adapted), inverse=True),
    )
    for before, after in zip(adapted.adapters, trained.adapters, strict=True):
        assert not np.array_equal(before.a, after.a)
        assert not np.array_equal(before.b, after.b)


def test_optimizer_state_holds_only_adapter_sized_arrays() -> None:
    model, _ = make_model("dit")
    adapted = lora.add(model, 2, key=jax.random.key(0))
    trainable, _ = eqx.partition(adapted, lora.adapter_filter(adapted))
    opt_state = optax.adamw(1e-3).init(trainable)
    adapter_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(adapted.adapters))
    base_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    state_leaves = jax.tree.leaves(opt_state)
    scalars = [leaf for leaf in state_leaves if leaf.ndim == 0]
    assert sum(leaf.nbytes for leaf in state_leaves) == 2 * adapter_bytes + sum(
        leaf.nbytes for leaf in scalars
    )
    assert len(scalars) <= 2
    assert adapter_bytes < base_bytes


def test_adapters_and_with_adapters_round_trip_and_average() -> None:
    model, (x, t, cond) = make_model("mlp")
    fresh = lora.add(model, 2, key=jax.random.key(0))
    trained = random_adapters(fresh, 7)
    only = lora.adapters(trained)
    assert sum(leaf.size for leaf in jax.tree.leaves(only)) == sum(
        leaf.size for leaf in jax.tree.leaves(trained.adapters)
    )
    restored = lora.with_adapters(fresh, only)
    assert leaves_equal(restored, trained)
    assert leaves_equal(lora.with_adapters(fresh, trained), trained)
    # An exponential moving average of the adapters, put back on the model.
    average = jax.tree.map(lambda e, p: 0.5 * e + 0.5 * p, lora.adapters(fresh), only)
    averaged = lora.with_adapters(trained, average)
    for mixed, a, b in zip(averaged.adapters, fresh.adapters, trained.adapters, strict=True):
        np.testing.assert_allclose(mixed.b, 0.5 * np.asarray(a.b) + 0.5 * np.asarray(b.b))
    assert leaves_equal(lora.base(averaged), model)


# --------------------------------------------------------------------------------------
# Serialisation.


def test_save_and_load_adapters_round_trip(tmp_path: Any) -> None:
    model, (x, t, cond) = make_model("dit")
    adapted = random_adapters(
        lora.add(model, 2, key=jax.random.key(0), alpha=3.0, where=lambda m: m.blocks[1].qkv), 8
    )
    path = tmp_path / "adapters" / "policy.lora"
    lora.save_adapters(path, adapted)
    assert os.path.getsize(path) < sum(
        leaf.nbytes for leaf in jax.tree.leaves(eqx.filter(model, eqx.is_array))
    )
    loaded = lora.load_adapters(path, model)
    assert loaded.layer_paths == (".blocks[1].qkv",)
    assert (loaded.rank, loaded.alpha) == (2, 3.0)
    assert leaves_equal(loaded.adapters, adapted.adapters)
    np.testing.assert_array_equal(
        np.asarray(vcall(loaded, x, t, cond)), np.asarray(vcall(adapted, x, t, cond))
    )


def test_loading_adapters_onto_another_base_names_file_and_fingerprints(tmp_path: Any) -> None:
    model, _ = make_model("mlp")
    other = MLPVelocity(4, 2, hidden=16, depth=2, time_features=8, key=jax.random.key(9))
    path = tmp_path / "a.lora"
    lora.save_adapters(path, lora.add(model, 2, key=jax.random.key(0)))
    expected, found = lora.fingerprint(model), lora.fingerprint(other)
    assert expected != found
    with pytest.raises(ValueError, match=str(path)) as raised:
        lora.load_adapters(path, other)
    assert expected in str(raised.value) and found in str(raised.value)
    not_adapters = tmp_path / "model.eqx"
    eqx.tree_serialise_leaves(not_adapters, model)
    with pytest.raises(ValueError, match="model.eqx"):
        lora.load_adapters(not_adapters, model)


def test_merged_model_serialises_into_the_base_structure(tmp_path: Any) -> None:
    model, (x, t, cond) = make_model("dit")
    adapted = random_adapters(lora.add(model, 2, key=jax.random.key(0)), 10)
    merged = merge(adapted)
    assert jax.tree.structure(merged) == jax.tree.structure(model)
    path = tmp_path / "merged.eqx"
    eqx.tree_serialise_leaves(path, merged)
    loaded = eqx.tree_deserialise_leaves(path, model)
    assert leaves_equal(loaded, merged)
    np.testing.assert_allclose(
        np.asarray(vcall(loaded, x, t, cond)),
        np.asarray(vcall(adapted, x, t, cond)),
        rtol=1e-5,
        atol=1e-6,
    )


def test_fingerprint_depends_on_weights_only() -> None:
    model, _ = make_model("mlp")
    digest = lora.fingerprint(model)
    assert len(digest) == 16 and int(digest, 16) >= 0
    assert lora.fingerprint(jax.tree.map(lambda leaf: np.array(leaf), model)) == digest
    assert lora.fingerprint(lora.base(lora.add(model, 2, key=jax.random.key(0)))) == digest
    nudged = eqx.tree_at(lambda m: m.out.bias, model, model.out.bias.at[0].add(1e-6))
    assert lora.fingerprint(nudged) != digest
    as_bf16 = jax.tree.map(lambda leaf: leaf.astype(jnp.bfloat16), eqx.filter(model, eqx.is_array))
    assert lora.fingerprint(as_bf16) != digest


# --------------------------------------------------------------------------------------
# Bad input.


# Under the runtime type checker the tests run with, an argument of the wrong type is a
# `TypeError` naming the parameter; without it, the same `ValueError` as a bad value.


@pytest.mark.parametrize("rank", [0, -1, True])
def test_bad_rank_names_rank(rank: Any) -> None:
    model, _ = make_model("mlp")
    with pytest.raises(ValueError, match="`rank`"):
        lora.add(model, rank, key=jax.random.key(0))


@pytest.mark.parametrize("rank", [1.5, "2"])
def test_non_int_rank_names_rank(rank: Any) -> None:
    model, _ = make_model("mlp")
    with pytest.raises((ValueError, TypeError), match="rank"):
        lora.add(model, rank, key=jax.random.key(0))


@pytest.mark.parametrize("alpha", [0.0, -1.0, math.nan, math.inf, False])
def test_bad_alpha_names_alpha(alpha: Any) -> None:
    model, _ = make_model("mlp")
    with pytest.raises(ValueError, match="`alpha`"):
        lora.add(model, 2, key=jax.random.key(0), alpha=alpha)


def test_non_number_alpha_names_alpha() -> None:
    model, _ = make_model("mlp")
    with pytest.raises((ValueError, TypeError), match="alpha"):
        lora.add(model, 2, key=jax.random.key(0), alpha="1")


@pytest.mark.parametrize(
    "where",
    [
        lambda m: [],
        lambda m: m.pos_embed,
        lambda m: [m.final_proj, m.blocks],
        lambda m: eqx.nn.Linear(2, 2, key=jax.random.key(0)),
    ],
    ids=["nothing", "an-array", "not-a-linear", "outside-the-model"],
)
def test_bad_where_names_where(where: Any) -> None:
    model, _ = make_model("dit")
    with pytest.raises(ValueError, match="`where`"):
        lora.add(model, 2, key=jax.random.key(0), where=where)


def test_non_callable_where_names_where() -> None:
    model, _ = make_model("dit")
    with pytest.raises((ValueError, TypeError), match="where"):
        lora.add(model, 2, key=jax.random.key(0), where="blocks")  # type: ignore[arg-type]


def test_where_none_on_a_model_without_linears_names_where() -> None:
    with pytest.raises(ValueError, match="`where`"):
        lora.add(jnp.tanh, 2, key=jax.random.key(0))


def test_adding_twice_and_misusing_the_functions_name_the_argument() -> None:
    model, _ = make_model("mlp")
    adapted = lora.add(model, 2, key=jax.random.key(0))
    with pytest.raises(ValueError, match="`model`"):
        lora.add(adapted, 2, key=jax.random.key(0))
    with pytest.raises((ValueError, TypeError), match="model"):
        lora.merge(model)
    with pytest.raises((ValueError, TypeError), match="model"):
        lora.base(model)
    with pytest.raises(ValueError, match="`model`"):
        lora.with_adapters(model, lora.adapters(adapted))
    with pytest.raises(ValueError, match="`adapters`"):
        lora.with_adapters(adapted, lora.adapters(lora.add(model, 3, key=jax.random.key(0))))
    with pytest.raises(ValueError, match="`base_model`"):
        lora.fingerprint(adapted)
    with pytest.raises((ValueError, TypeError), match="model"):
        lora.save_adapters("unused.lora", model)
    with pytest.raises(ValueError, match="`base_model`"):
        lora.load_adapters("unused.lora", adapted)


def test_docs_example_runs(tmp_path: Any, monkeypatch: Any) -> None:
    # The guide's blocks as tests/test_docs.py runs every page's (which leaves this one here).
    namespace = run_page(DOCS / "guides" / "lora.md", tmp_path, monkeypatch)
    policy, base = namespace["policy"], namespace["base"]
    assert policy.layer_paths == (
        ".blocks[0].qkv",
        ".blocks[0].proj",
        ".blocks[1].qkv",
        ".blocks[1].proj",
    )
    assert any(np.any(np.asarray(adapter.b)) for adapter in policy.adapters)
    assert leaves_equal(namespace["reference"], base)
    loaded = eqx.tree_deserialise_leaves(tmp_path / "policy.eqx", base)
    assert leaves_equal(loaded, namespace["export"])


def test_float32_adapters_over_a_bfloat16_base_merge_in_float32() -> None:
    """`lora.add(dtype=jnp.float32)` keeps the adapters in float32 over a bfloat16 base; the
    merged weight is the base's plus the update computed in float32, cast back to bfloat16."""
    layer = eqx.nn.Linear(6, 5, key=jax.random.key(0))
    layer = eqx.tree_at(lambda m: m.weight, layer, layer.weight.astype(jnp.bfloat16))
    adapted = lora.add(layer, 2, alpha=3.0, key=jax.random.key(1), dtype=jnp.float32)
    b = jax.random.normal(jax.random.key(2), (5, 2), jnp.float32)
    adapted = eqx.tree_at(lambda m: m.adapters[0].b, adapted, b)
    assert adapted.adapters[0].a.dtype == jnp.float32 and b.dtype == jnp.float32
    merged = lora.merge(adapted).weight
    assert merged.dtype == jnp.bfloat16
    a = np.asarray(adapted.adapters[0].a, np.float64)
    expected = np.asarray(layer.weight, np.float64) + 1.5 * np.asarray(b, np.float64) @ a
    np.testing.assert_allclose(np.asarray(merged, np.float64), expected, rtol=1e-2, atol=1e-2)
    np.testing.assert_array_equal(
        np.asarray(merged), np.asarray(expected.astype(np.float32).astype(jnp.bfloat16))
    )
    same = lora.add(layer, 2, key=jax.random.key(1))
    assert same.adapters[0].a.dtype == jnp.bfloat16  # the weight's dtype by default
