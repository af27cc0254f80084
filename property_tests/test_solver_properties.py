"""Property tests of the ODE solvers: DPM-Solver++(2M) is Euler where first order is exact.

Every expectation is an independent float64 NumPy statement.
"""

import jax.numpy as jnp
import numpy as np
from hypothesis import given, strategies as st
from hypothesis.extra import numpy as hnp

import flowgrpo_eqx as fg
import flowgrpo_eqx.testing as T
from tests import numpy_reference as ref


_values = st.floats(-4.0, 4.0, width=32)


def _rows() -> st.SearchStrategy[np.ndarray]:
    return hnp.arrays(np.float32, (2, 3), elements=_values)


def _straight_model(x, t, cond):
    """`v = (x - c) / t`: the straight path to `c`, whose data prediction is always `c`."""
    return (x - cond) / t


@T.property_settings(15)
@given(
    noise=_rows(),
    target=_rows(),
    steps=st.integers(2, 12),
    shift=st.floats(0.25, 5.0),
)
def test_dpm_solver_pp_2m_equals_euler_on_a_straight_field(noise, target, steps, shift):
    # Every data prediction is `c`, so the second-order correction (m - m_prev) vanishes and
    # each step is the first-order one, which is Euler's; both land on `c` exactly.
    flow = fg.GuidedFlow(
        _straight_model, fg.RectifiedFlow(shift=shift), fg.InputSpec(), guidance=None
    )
    x, c = jnp.asarray(noise), jnp.asarray(target)
    dpm = flow.sample_latents(_straight_model, c, x, fg.DPMSolverPP2M(), steps)
    euler = flow.sample_latents(_straight_model, c, x, fg.Euler(), steps)
    want = ref.dpm_solver_pp_2m(
        lambda y, t: (y - target.astype(np.float64)) / t, noise, ref.grid(steps, shift)
    )
    np.testing.assert_allclose(want, target.astype(np.float64), rtol=0, atol=1e-9)
    np.testing.assert_allclose(np.asarray(dpm), want, rtol=0, atol=2e-5)
    np.testing.assert_allclose(np.asarray(dpm), np.asarray(euler), rtol=0, atol=2e-5)


@T.property_settings(40)
@given(
    x=_rows(),
    matrix=hnp.arrays(np.float32, (3, 3), elements=st.floats(-2.0, 2.0, width=32)),
    times=st.tuples(st.floats(0.0, 1.0), st.floats(0.0, 1.0)).filter(
        lambda ab: max(ab) > 1e-3 and abs(ab[0] - ab[1]) > 1e-3
    ),
)
def test_dpm_solver_pp_2m_first_step_is_euler(x, matrix, times):
    # From `init`, a step is first order, `(t_next / t) x + (alpha_next - alpha sigma_next /
    # sigma) (x - t v)`, which is `x + (t_next - t) v` on any field.
    t, t_next = max(times), min(times)
    a = matrix.astype(np.float64)
    want = x.astype(np.float64) + (t_next - t) * (x.astype(np.float64) @ a.T)
    solver = fg.DPMSolverPP2M()
    state = solver.init(jnp.asarray(x), jnp.asarray(t, jnp.float32))
    got, state = solver.step(
        lambda y, s: y @ jnp.asarray(matrix).T,
        jnp.asarray(x),
        jnp.asarray(t, jnp.float32),
        jnp.asarray(t_next, jnp.float32),
        state,
    )
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
    assert bool(state.filled)
