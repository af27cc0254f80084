"""Property tests of `FlowSDE` and the time grid (docs/mathematics/index.md §1-§4).

Every expectation is an independent float64 NumPy statement of the formulas in
docs/mathematics/index.md.
"""

import math

import jax.numpy as jnp
import numpy as np
from hypothesis import example, given, strategies as st
from hypothesis.extra import numpy as hnp

import flowgrpo_eqx as fg
import flowgrpo_eqx.testing as T
from property_tests import _strategies as S
from tests import numpy_reference as ref, tolerances


HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)

_dims = st.sampled_from((3, 4))
_values = st.floats(-10.0, 10.0, width=32)
_stds = st.floats(0.015625, 10.0, width=32)
_shifts = st.floats(0.05, 10.0)
_noise_levels = st.floats(0.0, 2.0)


def _vectors(dim: int) -> st.SearchStrategy[np.ndarray]:
    return hnp.arrays(np.float32, (dim,), elements=_values)


# --------------------------------------------------------------------------------------
# 7. KL >= 0, 0 on equal means, released weighting = |dt| * paper.


@T.property_settings(60)
@given(
    data=st.data(),
    dim=_dims,
    std=_stds,
    dt=st.floats(1e-3, 1.0),
    kind=st.sampled_from(("flow", "cps")),
)
def test_kl_nonnegative_zero_on_equal_means_and_released_weighting(
    data: st.DataObject, dim: int, std: float, dt: float, kind: str
) -> None:
    mean = data.draw(_vectors(dim))
    mean_ref = data.draw(_vectors(dim))
    sde_class = fg.FlowSDE if kind == "flow" else fg.CoefficientsPreservingSDE
    paper = sde_class(0.7)
    released = sde_class(0.7, kl_weighting=fg.ReleasedKLWeighting())
    m, m_ref = jnp.asarray(mean), jnp.asarray(mean_ref)

    kl = float(paper.kl(m, m_ref, std))
    assert kl >= 0.0
    assert float(paper.kl(m, m, std)) == 0.0
    assert float(released.kl(m, m, std, -dt)) == 0.0
    want = np.mean((mean.astype(np.float64) - mean_ref.astype(np.float64)) ** 2) / (
        2 * np.float64(np.float32(std)) ** 2
    )
    np.testing.assert_allclose(kl, want, rtol=1e-5, atol=1e-30)

    # The released weighting is |dt| times the paper's, for either sign of dt.
    for signed_dt in (-dt, dt):
        np.testing.assert_allclose(
            float(released.kl(m, m_ref, std, signed_dt)),
            abs(np.float32(signed_dt)) * kl,
            rtol=1e-5,
            atol=1e-30,
        )
    # A deterministic transition (std 0) has no KL.
    assert float(paper.kl(m, m_ref, 0.0)) == 0.0


# --------------------------------------------------------------------------------------
# 9. The grid starts at 1 and ends at 0; the first transition's std is `noise_level`.


@T.property_settings(60)
@given(shift=_shifts, steps=st.integers(2, 60))
@example(shift=1.0, steps=2)
@example(shift=3.0, steps=41)
@example(shift=0.1, steps=11)  # float32 grid[0] = 0.99999976
@example(shift=1.32, steps=11)  # float32 grid[0] = 1.0000001
def test_grid_endpoints_are_exactly_one_and_zero(shift: float, steps: int) -> None:
    grid = np.asarray(fg.RectifiedFlow(shift).timesteps(steps))
    assert grid.shape == (steps,)
    assert grid.dtype == np.float32
    assert grid[0] == 1.0, f"grid starts at {grid[0]!r}"
    assert grid[-1] == 0.0, f"grid ends at {grid[-1]!r}"
    assert np.all(np.diff(grid) < 0)
    # The interior agrees with the float64 formula of mathematics §1.
    u = np.linspace(1.0, 0.0, steps)
    np.testing.assert_allclose(grid, shift * u / (1 + (shift - 1) * u), rtol=1e-5, atol=1e-7)


@T.property_settings(60)
@given(shift=_shifts, steps=st.integers(2, 60), noise_level=_noise_levels, dim=_dims)
@example(shift=1.0, steps=2, noise_level=0.7, dim=3)
@example(shift=0.1, steps=11, noise_level=0.7, dim=3)
@example(shift=1.32, steps=11, noise_level=0.7, dim=3)
def test_first_transition_std_is_noise_level(
    shift: float, steps: int, noise_level: float, dim: int
) -> None:
    grid = fg.RectifiedFlow(shift).timesteps(steps)
    sde = fg.FlowSDE(noise_level)
    x = jnp.linspace(-1.0, 1.0, dim)
    v = jnp.linspace(0.5, -0.5, dim)
    _, std = sde.transition(x, v, grid[0], grid[1])
    np.testing.assert_allclose(float(std), noise_level, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------------------
# 9. log_prob: the density of the mean itself, and the mean-coordinate formula.


@T.property_settings(60)
@given(data=st.data(), dim=_dims, std=_stds)
def test_log_prob_matches_mean_coordinate_formula(
    data: st.DataObject, dim: int, std: float
) -> None:
    sde = fg.FlowSDE()
    mean = data.draw(_vectors(dim))
    x_next = data.draw(_vectors(dim))
    m = jnp.asarray(mean)

    at_mean = float(sde.log_prob(m, m, std))
    np.testing.assert_allclose(
        at_mean,
        -math.log(np.float32(std)) - HALF_LOG_2PI,
        rtol=1e-6,
        atol=tolerances.log_density_atol(1e-6),
    )

    s = np.float64(np.float32(std))
    residual = x_next.astype(np.float64) - mean.astype(np.float64)
    want = np.mean(-(residual**2) / (2 * s**2) - np.log(s) - HALF_LOG_2PI)
    got = float(sde.log_prob(jnp.asarray(x_next), m, std))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=tolerances.log_density_atol(1e-5))
    # The density is never above the one at the mean.
    assert got <= at_mean + 1e-6
    # Deterministic transitions carry no density.
    assert float(sde.log_prob(jnp.asarray(x_next), m, 0.0)) == 0.0


@T.property_settings(40)
@given(
    data=st.data(),
    dim=_dims,
    kind=st.sampled_from(("flow", "cps")),
    noise_level=st.floats(0.05, 1.0),
    steps=st.integers(3, 20),
    shift=st.sampled_from((1.0, 3.0)),
)
def test_transition_matches_numpy_and_sampled_log_prob(
    data: st.DataObject, dim: int, kind: str, noise_level: float, steps: int, shift: float
) -> None:
    grid = S.grid_of(steps, shift)
    i = data.draw(st.integers(0, steps - 2))
    x = data.draw(_vectors(dim))
    v = data.draw(_vectors(dim))
    t, t_next = grid[i], grid[i + 1]
    sde = (fg.FlowSDE if kind == "flow" else fg.CoefficientsPreservingSDE)(noise_level)
    mean, std = sde.transition(jnp.asarray(x), jnp.asarray(v), t, t_next)
    stochastic = not (kind == "cps" and t_next == 0)
    assert bool(sde.is_stochastic(t, t_next)) == stochastic
    level = np.asarray([noise_level if stochastic else 0.0])
    want_mean, want_std = ref.gaussian(
        x[None], v[None], np.asarray([t]), np.asarray([t_next]), level, kind
    )
    np.testing.assert_allclose(float(std), want_std[0], rtol=2e-5, atol=1e-7)
    scale = 1.0 + float(np.max(np.abs(want_mean)))
    np.testing.assert_allclose(np.asarray(mean), want_mean[0], rtol=2e-5, atol=2e-6 * scale)
    if stochastic:
        z = data.draw(hnp.arrays(np.float32, (dim,), elements=st.floats(-3, 3, width=32)))
        x_next = mean + std * jnp.asarray(z)
        got = float(sde.log_prob(x_next, mean, std))
        want = float(np.mean(-0.5 * z.astype(np.float64) ** 2)) - math.log(want_std[0])
        want -= HALF_LOG_2PI
        # x_next - mean is recomputed in float32: allow the round-off of |mean| over std.
        slack = 8 * float(np.finfo(np.float32).eps) * scale / float(std) * 3.0
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 + slack)
    else:
        assert float(std) == 0.0


@T.property_settings(40)
@given(
    noise_level=st.floats(0.9, 1.0),
    steps=st.integers(3, 20),
    position=st.floats(0.0, 1.0),
    x=_vectors(3),
    v=_vectors(3),
)
@example(
    noise_level=0.999,
    steps=3,
    position=0.0,
    x=np.ones(3, np.float32),
    v=np.zeros(3, np.float32),
)
def test_cps_mean_is_accurate_for_noise_levels_near_one(
    noise_level: float, steps: int, position: float, x: np.ndarray, v: np.ndarray
) -> None:
    """The CPS mean's `sqrt(t_next^2 - std^2)` is `t_next cos(a pi / 2)`: it must not lose
    float32 precision to cancellation when `a` is near 1 (allowed: `a <= 1` for CPS)."""
    grid = S.grid_of(steps, 1.0)
    i = min(int(position * (steps - 2)), steps - 3)  # t_next > 0: stochastic
    t, t_next = grid[i], grid[i + 1]
    mean, std = fg.CoefficientsPreservingSDE(noise_level).transition(
        jnp.asarray(x), jnp.asarray(v), t, t_next
    )
    want_mean, want_std = ref.gaussian(
        x[None], v[None], np.asarray([t]), np.asarray([t_next]), np.asarray([noise_level]), "cps"
    )
    np.testing.assert_allclose(float(std), want_std[0], rtol=2e-5, atol=1e-7)
    scale = 1.0 + float(np.max(np.abs(want_mean)))
    np.testing.assert_allclose(np.asarray(mean), want_mean[0], rtol=2e-5, atol=2e-6 * scale)


@T.property_settings(40)
@given(grid=T.time_grids(shifts=st.just(3.0)))
def test_public_grid_invariant(grid: np.ndarray) -> None:
    steps = grid.shape[0]
    T.assert_grid_endpoints(fg.RectifiedFlow(3.0), steps)
    np.testing.assert_allclose(grid, ref.grid(steps, 3.0), rtol=1e-5, atol=1e-7)


@T.property_settings(60)
@given(
    data=st.data(),
    dim=_dims,
    kind=st.sampled_from(("flow", "cps")),
    noise_level=st.sampled_from((0.0, 0.5, 0.9)),
    steps=st.integers(3, 12),
    windowed=st.booleans(),
)
def test_public_sde_invariants(
    data: st.DataObject, dim: int, kind: str, noise_level: float, steps: int, windowed: bool
) -> None:
    grid = S.grid_of(steps, 3.0)
    i = data.draw(st.integers(0, steps - 2))
    window = fg.window_for_indices(jnp.asarray(grid), 0, 1) if windowed else None
    sde = (fg.FlowSDE if kind == "flow" else fg.CoefficientsPreservingSDE)(
        noise_level, window=window
    )
    T.assert_sde_invariants(
        sde,
        data.draw(_vectors(dim)),
        data.draw(_vectors(dim)),
        float(grid[i]),
        float(grid[i + 1]),
        data.draw(hnp.arrays(np.float32, (dim,), elements=st.floats(-3, 3, width=32))),
        data.draw(_vectors(dim)),
    )
    # Which intervals are stochastic is the NumPy oracle's statement.
    _, std = sde.transition(jnp.zeros(dim), jnp.zeros(dim), grid[i], grid[i + 1])
    assert (float(std) > 0) == bool(ref.stochastic(grid[i], grid[i + 1], noise_level, kind, window))
