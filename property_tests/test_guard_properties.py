"""Properties of GRPO-Guard's RatioNorm and step weights (docs/mathematics/flow_grpo.md §5a)."""

import jax.numpy as jnp
import numpy as np
from hypothesis import given, strategies as st
from hypothesis.extra import numpy as hnp

import flowgrpo_eqx as fg
import flowgrpo_eqx.testing as T
from tests import numpy_reference as ref


@st.composite
def _steps(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Log-ratios, stds, durations and a kept set of one `[N, K]` minibatch."""
    n, k = draw(st.integers(1, 6)), draw(st.integers(1, 4))
    log_ratio = draw(hnp.arrays(np.float32, (n, k), elements=st.floats(-3.0, 3.0, width=32)))
    std = draw(hnp.arrays(np.float32, (n, k), elements=st.floats(0.0625, 2.0, width=32)))
    dt = draw(hnp.arrays(np.float32, (n, k), elements=st.floats(0.0625, 0.5, width=32)))
    kept = draw(hnp.arrays(np.bool_, (n, k)))
    return log_ratio, std, dt, kept


@T.property_settings(30)
@given(steps=_steps(), shift=st.floats(-2.0, 2.0, width=32))
def test_ratio_norm_has_mean_zero_per_step_over_kept_transitions(steps, shift):
    log_ratio, std, _, kept = steps
    normalised = np.asarray(
        fg.ratio_norm(jnp.asarray(log_ratio), jnp.asarray(std), jnp.asarray(kept))
    )
    np.testing.assert_allclose(normalised, ref.ratio_norm(log_ratio, std, kept), atol=2e-5)
    assert np.all(normalised[~kept] == 0.0)
    for j in range(kept.shape[1]):
        if kept[:, j].any():
            assert abs(float(normalised[kept[:, j], j].mean())) <= 1e-5
    # A drift common to a step (the same shift of every kept row's scaled log-ratio) is removed.
    drifted = log_ratio + np.float32(shift) / std
    again = np.asarray(fg.ratio_norm(jnp.asarray(drifted), jnp.asarray(std), jnp.asarray(kept)))
    np.testing.assert_allclose(again, normalised, atol=5e-5)


@T.property_settings(30)
@given(steps=_steps(), scale=st.floats(0.125, 8.0, width=32))
def test_step_weights_average_one_and_ignore_the_time_unit(steps, scale):
    _, _, dt, kept = steps
    t_next = np.zeros_like(dt)
    weights = np.asarray(fg.step_weights(jnp.asarray(dt), jnp.asarray(t_next), jnp.asarray(kept)))
    np.testing.assert_allclose(weights, ref.step_weights(dt, t_next, kept), rtol=1e-5)
    assert np.all(weights[~kept] == 0.0)
    if kept.any():
        np.testing.assert_allclose(weights[kept].mean(), 1.0, rtol=1e-5)
    scaled = np.asarray(
        fg.step_weights(jnp.asarray(dt * np.float32(scale)), jnp.asarray(t_next), jnp.asarray(kept))
    )
    np.testing.assert_allclose(scaled, weights, rtol=1e-4)
