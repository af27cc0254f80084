import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flowgrpo_eqx as fg
from tests import numpy_reference as ref
from tests.errors import NAMED_ARGUMENT_ERRORS, raises_named
from tests.tolerances import log_prob_rtol


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


KL_WEIGHTINGS = {"paper": fg.PaperKLWeighting(), "released": fg.ReleasedKLWeighting()}


@pytest.mark.parametrize("weighting", ["paper", "released"])
def test_kl_matches_numpy_both_weightings(weighting):
    rng = np.random.default_rng(3)
    grid = ref.grid(11, 3.0)
    sde = fg.FlowSDE(0.7, kl_weighting=KL_WEIGHTINGS[weighting])
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
    sde = fg.FlowSDE(kl_weighting=fg.ReleasedKLWeighting())
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
# window_for_indices: the whole grid is a window; one transition more is not.


def test_window_for_indices_accepts_exactly_the_grid():
    grid = fg.RectifiedFlow().timesteps(6)  # five transitions
    assert fg.window_for_indices(grid, 0, 5) == (1.0, 0.0)
    assert fg.window_for_indices(grid, 4, 1) == (float(grid[4]), 0.0)
    for first, count in ((0, 6), (1, 5), (5, 1), (-1, 2), (2, 0)):
        with pytest.raises(ValueError, match="`first`"):
            fg.window_for_indices(grid, first, count)


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
        released = fg.FlowSDE(kl_weighting=fg.ReleasedKLWeighting())
        assert released.kl(low, high, std, -0.25).dtype == jnp.float64
        assert sde.transition(low, low, 0.75, 0.5)[0].dtype == jnp.float32


@pytest.mark.parametrize("sde", [fg.FlowSDE(0.7), fg.CoefficientsPreservingSDE(0.7)])
def test_log_prob_takes_a_bfloat16_std_in_float32(sde):
    # In bfloat16 `log std` and `std^2` would be off by about 0.4%.
    rng = np.random.default_rng(0)
    x_next = rng.normal(size=5).astype(np.float32)
    mean = rng.normal(size=5).astype(np.float32)
    std = jnp.asarray(0.3, jnp.bfloat16)
    got = sde.log_prob(jnp.asarray(x_next), jnp.asarray(mean), std)
    assert got.dtype == jnp.float32
    want = ref.log_prob(x_next, mean, float(np.float32(std)))
    np.testing.assert_allclose(float(got), want, rtol=log_prob_rtol())


@pytest.mark.parametrize(
    "sde, kind", [(fg.FlowSDE(0.7), "flow"), (fg.CoefficientsPreservingSDE(0.7), "cps")]
)
def test_transition_takes_bfloat16_times_in_float32(sde, kind):
    # In bfloat16, t / (1 - t) and the other time terms would be off by up to 0.4%.
    rng = np.random.default_rng(1)
    x = rng.normal(size=4).astype(np.float32)
    v = rng.normal(size=4).astype(np.float32)
    t = jnp.asarray(0.9, jnp.bfloat16)
    t_next = jnp.asarray(0.7, jnp.bfloat16)
    mean, std = sde.transition(jnp.asarray(x), jnp.asarray(v), t, t_next)
    assert mean.dtype == jnp.float32 and std.dtype == jnp.float32
    want_mean, want_std = ref.transition(x, v, float(t), float(t_next), 0.7, kind)
    np.testing.assert_allclose(np.asarray(mean), want_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(std), want_std, rtol=1e-5)


def test_is_stochastic_has_the_broadcast_shape_of_its_times():
    sde = fg.FlowSDE(0.7)
    times = jnp.asarray([0.9, 0.5, 0.3], jnp.float32)
    end = jnp.asarray(0.2, jnp.float32)
    for t, t_next in ((times, end), (end + 0.7, times - 0.1)):
        got = sde.is_stochastic(t, t_next)
        assert got.shape == (3,)
        want = [
            ref.stochastic(a, b, 0.7) for a, b in np.broadcast(np.asarray(t), np.asarray(t_next))
        ]
        np.testing.assert_array_equal(np.asarray(got), want)


def test_a_window_that_is_not_a_pair_is_named():
    for window in ([0.8, 0.2], (0.8,), (0.8, 0.5, 0.2)):
        with raises_named(f"`window` must be a pair (start, stop), got {window!r}."):
            fg.FlowSDE(window=window)


def test_sde_messages_name_the_argument_first():
    with pytest.raises(ValueError, match=r"^`noise_level` must be a finite number >= 0, got -0.5"):
        fg.FlowSDE(-0.5)
    with pytest.raises(ValueError, match=r"^`noise_level` must be in \[0, 1\] for coeff"):
        fg.CoefficientsPreservingSDE(1.5)
    released = fg.FlowSDE(kl_weighting=fg.ReleasedKLWeighting())
    m = jnp.zeros(2)
    with pytest.raises(ValueError, match=r"^`dt` is required by kl when kl_weighting="):
        released.kl(m, m, 0.5)
    grid = fg.RectifiedFlow().timesteps(4)
    with pytest.raises(ValueError, match=r"^`first`=2 and `count`=2 select transitions outside"):
        fg.window_for_indices(grid, 2, 2)


# --------------------------------------------------------------------------------------
# The KL computes in float32 for low-precision means, whatever JAX's default dtype.


@pytest.mark.parametrize("sde", [fg.FlowSDE(0.7), fg.CoefficientsPreservingSDE(0.7)])
def test_kl_of_bfloat16_means_is_float32_with_x64_enabled(sde):
    mean = np.array([0.5, -1.0, 0.75])
    mean_ref = np.array([0.25, 0.0, 1.0])
    want = ref.kl_paper(mean, mean_ref, 0.5)
    released = fg.FlowSDE(0.7, kl_weighting=fg.ReleasedKLWeighting())
    with jax.enable_x64(True):
        low, low_ref = jnp.asarray(mean, jnp.bfloat16), jnp.asarray(mean_ref, jnp.bfloat16)
        # The std and dt as a bfloat16 array and a NumPy float64 (not weakly typed): cast too.
        std = jnp.asarray(0.5, jnp.bfloat16)
        got = sde.kl(low, low_ref, std)
        weighted = released.kl(low, low_ref, std, np.float64(-0.25))
    assert got.dtype == jnp.float32 and weighted.dtype == jnp.float32
    np.testing.assert_allclose(float(got), want, rtol=1e-6)
    np.testing.assert_allclose(float(weighted), 0.25 * want, rtol=1e-6)
