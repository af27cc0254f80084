"""Edges of the mathematical modules that the formula tests pass over: exact draws, dtypes
kept through low-precision inputs, the boundaries of argument checks, and error messages.
Each kills mutants that survived the formula tests, or was written against the diff of one
not yet run (docs/mutation.md)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flowgrpo_eqx as fg


# --------------------------------------------------------------------------------------
# AbstractSDE.sample: exactly `mean + std z` for the given draw, in the mean's dtype.


@pytest.mark.parametrize("sde", [fg.FlowSDE(), fg.CoefficientsPreservingSDE()])
def test_sample_is_mean_plus_std_times_the_given_draw(sde):
    mean = jnp.asarray([1.0, 2.0, -3.0], jnp.float32)
    noise = jnp.asarray([1.0, -2.0, 0.5], jnp.float32)
    got = sde.sample(mean, jnp.asarray(0.5, jnp.float32), noise)
    np.testing.assert_array_equal(np.asarray(got), [1.5, 1.0, -2.75])


def test_sample_keeps_a_bfloat16_mean_bfloat16():
    mean = jnp.asarray([1.0, 2.0], jnp.bfloat16)
    noise = jnp.asarray([1.0, -2.0], jnp.float32)
    got = fg.FlowSDE().sample(mean, jnp.asarray(0.5, jnp.float32), noise)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), [1.5, 1.0])


# --------------------------------------------------------------------------------------
# RectifiedFlow.interpolate keeps the data's dtype whatever the time's.


def test_interpolate_keeps_a_bfloat16_state_bfloat16():
    data = jnp.asarray([1.0, -2.0], jnp.bfloat16)
    noise = jnp.asarray([0.5, 0.5], jnp.bfloat16)
    got = fg.RectifiedFlow().interpolate(data, noise, jnp.asarray(0.25, jnp.float32))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), [0.875, -1.375])


# --------------------------------------------------------------------------------------
# window_for_indices: the whole grid is a window; one transition more is not.


def test_window_for_indices_accepts_exactly_the_grid():
    grid = fg.RectifiedFlow().timesteps(6)  # five transitions
    assert fg.window_for_indices(grid, 0, 5) == (1.0, 0.0)
    assert fg.window_for_indices(grid, 4, 1) == (float(grid[4]), 0.0)
    for first, count in ((0, 6), (1, 5), (5, 1), (-1, 2), (2, 0)):
        with pytest.raises(ValueError, match="`first`"):
            fg.window_for_indices(grid, first, count)


# --------------------------------------------------------------------------------------
# group_advantages: statistics in float64 whatever the rewards' dtype, eps = 0 allowed,
# inexact constant groups exactly 0, and messages that name the argument and the rows.


def test_float32_rewards_get_float64_statistics():
    # Near 1e8 a float32 sum rounds by tens: float32 statistics would move every advantage.
    rewards = np.array([1e8, 1e8 + 8, 1e8 + 16, 1e8 + 40], np.float32)
    got = fg.group_advantages(rewards, groups=4)
    exact = rewards.astype(np.float64)
    want = (exact - exact.mean()) / (exact.std() + 1e-4)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_eps_zero_is_allowed():
    got = fg.group_advantages(np.array([1.0, 3.0, 5.0, 9.0]), groups=2, eps=0.0)
    np.testing.assert_array_equal(got, [-1.0, 1.0, -1.0, 1.0])


@pytest.mark.parametrize("std", ["group", "global"])
def test_inexact_constant_group_is_exactly_zero(std):
    # 0.1 three times has a float64 mean of 0.1 + 1.4e-17: the zero must not be arithmetic.
    rewards = np.array([0.1, 0.1, 0.1, 1.0, 2.0, 4.0])
    got = fg.group_advantages(rewards, groups=3, std=std)
    assert np.all(got[:3] == 0.0), got[:3]
    assert np.all(got[3:] != 0.0)


def test_group_size_message_names_the_argument():
    with pytest.raises(ValueError, match="`groups` must be an int >= 1, got 0"):
        fg.group_advantages(np.zeros(4), groups=0)


def test_non_finite_message_names_the_rows():
    rewards = np.array([0.0, np.nan, 1.0, np.inf])
    with pytest.raises(ValueError, match=r"non-finite values at rows \[1, 3\]"):
        fg.group_advantages(rewards, groups=2)


# --------------------------------------------------------------------------------------
# RectifiedFlow.timesteps is float32 by its own choice, not by JAX's default dtype.


def test_grid_is_float32_with_x64_enabled():
    with jax.enable_x64(True):
        grid = fg.RectifiedFlow(3.0).timesteps(5)
        assert grid.dtype == jnp.float32
        assert float(grid[0]) == 1.0 and float(grid[-1]) == 0.0


# --------------------------------------------------------------------------------------
# The SDEs: window boundaries and tolerance, float64 when any input is float64, messages.


def test_window_may_span_the_whole_grid_and_no_more():
    assert fg.FlowSDE(0.7, window=(1.0, 0.0)).window == (1.0, 0.0)
    assert fg.CoefficientsPreservingSDE(1.0).noise_level == 1.0
    for window in ((0.5, 0.5), (0.4, 0.5), (1.5, 0.5), (0.5, -0.25)):
        with pytest.raises(ValueError, match=r"^`window` must be \(start, stop\) times"):
            fg.FlowSDE(0.7, window=window)


def test_window_tolerance_is_inclusive_at_one_millionth():
    sde = fg.FlowSDE(0.7, window=(0.5, 0.25))
    start = np.float32(0.5) + np.float32(1e-6)
    stop = np.float32(0.25) - np.float32(1e-6)
    assert bool(sde.is_stochastic(start, np.float32(0.3)))
    assert bool(sde.is_stochastic(np.float32(0.4), stop))
    assert not bool(sde.is_stochastic(np.nextafter(start, np.float32(1)), np.float32(0.3)))
    assert not bool(sde.is_stochastic(np.float32(0.4), np.nextafter(stop, np.float32(0))))


@pytest.mark.parametrize("sde", [fg.FlowSDE(0.7), fg.CoefficientsPreservingSDE(0.7)])
def test_any_float64_input_computes_in_float64(sde):
    with jax.enable_x64(True):
        low = jnp.asarray([0.25, -0.5], jnp.float32)
        high = jnp.asarray([0.5, 0.125], jnp.float64)
        for x, v in ((low, high), (high, low)):
            mean, std = sde.transition(x, v, 0.75, 0.5)
            assert mean.dtype == jnp.float64 and std.dtype == jnp.float64
        assert sde.log_prob(low, high, std).dtype == jnp.float64
        assert sde.log_prob(high, low, std).dtype == jnp.float64
        assert sde.kl(low, high, std).dtype == jnp.float64
        assert sde.kl(high, low, std).dtype == jnp.float64
        assert fg.FlowSDE(kl_weighting="released").kl(low, high, std, -0.25).dtype == jnp.float64
        assert sde.transition(low, low, 0.75, 0.5)[0].dtype == jnp.float32


def test_sde_messages_name_the_argument_first():
    with pytest.raises(ValueError, match=r"^`noise_level` must be a number >= 0, got -0.5"):
        fg.FlowSDE(-0.5)
    with pytest.raises(ValueError, match=r"^`noise_level` must be in \[0, 1\] for coeff"):
        fg.CoefficientsPreservingSDE(1.5)
    released = fg.FlowSDE(kl_weighting="released")
    m = jnp.zeros(2)
    with pytest.raises(ValueError, match=r"^`dt` is required by kl when kl_weighting="):
        released.kl(m, m, 0.5)
    grid = fg.RectifiedFlow().timesteps(4)
    with pytest.raises(ValueError, match=r"^`first`=2 and `count`=2 select transitions outside"):
        fg.window_for_indices(grid, 2, 2)
