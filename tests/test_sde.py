import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flowgrpo_eqx as fg
from tests import numpy_reference as ref
from tests.errors import NAMED_ARGUMENT_ERRORS


SDES = {"flow": fg.FlowSDE, "cps": fg.CoefficientsPreservingSDE}


def _random_transitions(seed, count=20, dim=6, shift=3.0, steps=11):
    rng = np.random.default_rng(seed)
    grid = ref.grid(steps, shift)
    for _ in range(count):
        i = int(rng.integers(0, steps - 1))
        yield (
            rng.normal(size=dim).astype(np.float32),
            rng.normal(size=dim).astype(np.float32),
            np.float32(grid[i]),
            np.float32(grid[i + 1]),
            rng.normal(size=dim).astype(np.float32),
        )


@pytest.mark.parametrize("kind", ["flow", "cps"])
@pytest.mark.parametrize("noise_level", [0.0, 0.3, 0.7, 1.0])
def test_transition_and_log_prob_match_numpy(kind, noise_level):
    sde = SDES[kind](noise_level=noise_level)
    for x, v, t, t_next, z in _random_transitions(int(noise_level * 10)):
        mean, std = sde.transition(jnp.asarray(x), jnp.asarray(v), t, t_next)
        want_mean, want_std = ref.transition(x, v, float(t), float(t_next), noise_level, kind)
        np.testing.assert_allclose(np.asarray(mean), want_mean, rtol=2e-5, atol=2e-6)
        np.testing.assert_allclose(float(std), want_std, rtol=2e-5, atol=1e-7)
        x_next = want_mean + want_std * z
        got = sde.log_prob(jnp.asarray(x_next, jnp.float32), mean, std)
        np.testing.assert_allclose(
            float(got), ref.log_prob(x_next, want_mean, want_std), rtol=1e-4, atol=1e-4
        )


def test_window_makes_outside_transitions_euler():
    grid = ref.grid(11, 1.0)
    window = fg.window_for_indices(jnp.asarray(grid), 2, 3)
    sde = fg.FlowSDE(noise_level=0.7, window=window)
    x = jnp.ones(3)
    v = jnp.full(3, 2.0)
    for i in range(10):
        t, t_next = float(grid[i]), float(grid[i + 1])
        mean, std = sde.transition(x, v, t, t_next)
        inside = 2 <= i < 5
        assert bool(sde.is_stochastic(t, t_next)) == inside
        want_mean, want_std = ref.transition(
            np.ones(3), np.full(3, 2.0), t, t_next, 0.7, window=window
        )
        np.testing.assert_allclose(np.asarray(mean), want_mean, rtol=1e-5)
        assert (float(std) > 0) == inside
        if not inside:
            np.testing.assert_allclose(np.asarray(mean), 1.0 + 2.0 * (t_next - t), rtol=1e-6)
            assert float(std) == 0.0
            assert float(sde.log_prob(mean, mean, std)) == 0.0


def test_first_transition_std_is_noise_level():
    for shift in (1.0, 3.0):
        grid = fg.RectifiedFlow(shift).timesteps(11)
        _, std = fg.FlowSDE(0.7).transition(jnp.zeros(2), jnp.zeros(2), grid[0], grid[1])
        assert abs(float(std) - 0.7) < 1e-6


def test_cps_is_deterministic_at_data_end():
    sde = fg.CoefficientsPreservingSDE(0.7)
    mean, std = sde.transition(jnp.ones(2), jnp.ones(2), 0.1, 0.0)
    assert float(std) == 0.0
    np.testing.assert_allclose(np.asarray(mean), 1.0 - 0.1, rtol=1e-6)


@pytest.mark.parametrize("weighting", ["paper", "released"])
def test_kl_matches_numpy_both_weightings(weighting):
    rng = np.random.default_rng(3)
    grid = ref.grid(11, 3.0)
    sde = fg.FlowSDE(0.7, kl_weighting=weighting)
    for i in range(10):
        t, t_next = float(grid[i]), float(grid[i + 1])
        x, v, v_ref = (rng.normal(size=5) for _ in range(3))
        mean, std = sde.transition(
            jnp.asarray(x, jnp.float32), jnp.asarray(v, jnp.float32), t, t_next
        )
        mean_ref, _ = sde.transition(
            jnp.asarray(x, jnp.float32), jnp.asarray(v_ref, jnp.float32), t, t_next
        )
        got = float(sde.kl(mean, mean_ref, std, t_next - t))
        want_mean, want_std = ref.gaussian(x, v, t, t_next, 0.7, "flow")
        want_ref, _ = ref.gaussian(x, v_ref, t, t_next, 0.7, "flow")
        if weighting == "paper":
            want = ref.kl_paper(want_mean, want_ref, want_std)
        else:
            sigma = want_std / math.sqrt(t - t_next)
            want = ref.kl_released(want_mean, want_ref, sigma)
            np.testing.assert_allclose(
                want, (t - t_next) * ref.kl_paper(want_mean, want_ref, want_std), rtol=1e-9
            )
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-9)


def test_released_kl_requires_dt():
    sde = fg.FlowSDE(kl_weighting="released")
    with pytest.raises(ValueError, match="dt"):
        sde.kl(jnp.zeros(2), jnp.ones(2), jnp.asarray(0.5))


def test_low_precision_inputs_computed_in_float32():
    sde = fg.FlowSDE()
    x = jnp.ones(4, jnp.bfloat16)
    mean, std = sde.transition(x, x, 0.5, 0.4)
    assert mean.dtype == jnp.float32 and std.dtype == jnp.float32
    assert sde.log_prob(x, mean, std).dtype == jnp.float32


def test_sample_has_requested_moments():
    sde = fg.FlowSDE()
    noise = jax.random.normal(jax.random.key(0), (20000,))
    draws = sde.sample(jnp.full((20000,), 2.0), jnp.asarray(0.5), noise)
    assert abs(float(draws.mean()) - 2.0) < 0.02
    assert abs(float(draws.std()) - 0.5) < 0.02


@pytest.mark.parametrize(
    "kind, kwargs, name",
    [
        ("flow", {"noise_level": -0.1}, "noise_level"),
        ("cps", {"noise_level": -0.1}, "noise_level"),
        ("flow", {"kl_weighting": "other"}, "kl_weighting"),
        ("flow", {"window": (0.5, 0.6)}, "window"),
        ("flow", {"window": (1.5, 0.2)}, "window"),
        ("cps", {"window": (0.5, -0.1)}, "window"),
        ("cps", {"noise_level": 1.5}, "noise_level"),
    ],
)
def test_bad_settings_named(kind, kwargs, name):
    with pytest.raises(NAMED_ARGUMENT_ERRORS, match=name):
        SDES[kind](**kwargs)


def test_window_for_indices_outside_grid():
    grid = fg.RectifiedFlow().timesteps(11)
    with pytest.raises(ValueError, match="outside the grid"):
        fg.window_for_indices(grid, 8, 5)
