"""The DiT's stacked blocks and per-block remat compute what its unstacked blocks compute, and
a remat per block holds the stacked blocks in runs of one policy."""

import functools
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flowgrpo_eqx.models import DiT, SaveDots, SaveNothing, SaveQKV
from flowgrpo_eqx.models._stacked import StackedLayout, runs_of_one_remat
from tests.diffusers_helpers import assert_leaves_close
from tests.errors import NAMED_ARGUMENT_ERRORS
from tests.tiny_models import perturbed


SIZES = dict(image_size=8, channels=3, patch=2, width=16, depth=3, heads=2, vocab_size=5)


def _perturbed() -> DiT:
    """A DiT whose zero-initialised layers are moved by a fixed draw."""
    return perturbed(DiT(**SIZES, key=jax.random.key(0)))


def _inputs() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 8, 8, 3)).astype(np.float32)
    t = rng.uniform(size=2).astype(np.float32)
    cond = np.asarray([[0, 1, 2, 3], [4, 4, 0, 1]], np.int32)
    return x, t, cond


@eqx.filter_jit
def _value_and_grads(model: Any, x: Any, t: Any, cond: Any) -> Any:
    """`sum(sin(v))` over the velocities of a batch, and its gradient in the parameters."""
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def value(params: Any) -> jax.Array:
        v = jax.vmap(eqx.combine(params, static))(x, t, cond)
        return jnp.sum(jnp.sin(v))

    return jax.value_and_grad(value)(params)


@functools.cache
def _unstacked_value_and_grads() -> Any:
    """The reference, computed once: the unstacked blocks without remat."""
    return _value_and_grads(_perturbed(), *_inputs())


@pytest.mark.parametrize(
    "settings",
    [
        dict(stacked=True),
        dict(remat=SaveNothing()),
        dict(stacked=True, remat=SaveDots()),
        dict(stacked=True, remat=(SaveDots(), SaveDots(), SaveNothing())),
        dict(remat=(SaveNothing(), None, SaveQKV())),
    ],
)
def test_stacked_and_remat_dit_compute_the_same_velocity_and_gradient(
    settings: dict[str, Any],
) -> None:
    other = _perturbed().with_settings(**settings)
    assert other.with_settings(stacked=False, remat=None).blocks[1].qkv.weight.shape == (48, 16)
    want_value, want_grads = _unstacked_value_and_grads()
    got_value, got_grads = _value_and_grads(other, *_inputs())
    np.testing.assert_allclose(float(got_value), float(want_value), rtol=1e-6)
    want_grads = want_grads.with_settings(**settings)
    assert_leaves_close(got_grads, want_grads, 1e-5)


def test_bad_dit_settings_are_named() -> None:
    with pytest.raises(NAMED_ARGUMENT_ERRORS, match="stacked"):
        DiT(**SIZES, stacked="yes", key=jax.random.key(0))
    with pytest.raises(NAMED_ARGUMENT_ERRORS, match="remat"):
        DiT(**SIZES, remat="all", key=jax.random.key(0))


def test_a_remat_per_block_holds_the_stacked_blocks_in_runs_of_one_policy() -> None:
    model = DiT(
        **SIZES, stacked=True, remat=(SaveDots(), SaveDots(), SaveNothing()), key=jax.random.key(0)
    )
    assert isinstance(model.block_layout, StackedLayout)
    assert model.block_layout.runs == ((0, 2), (2, 3))
    assert [group.qkv.weight.shape for group in model.blocks] == [(2, 48, 16), (1, 48, 16)]
    assert model.remat == (SaveDots(), SaveDots(), SaveNothing())
    uniform = model.with_settings(remat=SaveDots())
    assert [group.qkv.weight.shape for group in uniform.blocks] == [(3, 48, 16)]
    for got, want in zip(uniform.unstacked_blocks(), model.unstacked_blocks(), strict=True):
        np.testing.assert_array_equal(got.qkv.weight, want.qkv.weight)


def test_runs_split_the_groups_where_the_policy_changes() -> None:
    groups = ((0, 3), (3, 5), (5, 6))
    assert runs_of_one_remat(groups, SaveDots()) == groups
    assert runs_of_one_remat(groups, (SaveDots(),) * 6) == groups
    per_block = (SaveDots(), SaveDots(), SaveNothing(), SaveNothing(), None, None)
    assert runs_of_one_remat(groups, per_block) == ((0, 2), (2, 3), (3, 4), (4, 5), (5, 6))


@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize(
    "remat", [(SaveDots(), SaveNothing()), (SaveDots(), "all", SaveNothing()), ()]
)
def test_a_bad_remat_per_block_is_named(stacked: bool, remat: tuple[Any, ...]) -> None:
    with pytest.raises(NAMED_ARGUMENT_ERRORS, match="remat"):
        DiT(**SIZES, stacked=stacked, remat=remat, key=jax.random.key(0))
    with pytest.raises(NAMED_ARGUMENT_ERRORS, match="remat"):
        _perturbed().with_settings(stacked=stacked, remat=remat)
