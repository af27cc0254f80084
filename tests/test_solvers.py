"""The ODE solvers: `Euler` and `Heun` unchanged by the solver state (bit for bit, and against
float64 statements), and `DPMSolverPP2M` against a float64 statement of MixGRPO's release."""

import jax.numpy as jnp
import numpy as np
import pytest

import flowgrpo_eqx as fg
from tests import numpy_reference as ref


_A = np.asarray([[-0.5, 0.25, 0.0], [0.125, 0.75, -0.25], [0.0, -0.375, 0.5]])
_B = np.asarray([0.5, -1.0, 0.25])
_NOISE = np.asarray([[1.0, -0.5, 0.25], [0.75, 2.0, -1.5]])


def _linear_model(x, t, cond):
    """The fixed velocity field `v(x, t) = A x + b t` on one example."""
    return jnp.asarray(_A, x.dtype) @ x + t * jnp.asarray(_B, x.dtype)


def _linear_velocity(x, t):
    return x @ _A.T + t * _B


def _sample(solver, steps=5, shift=1.0):
    flow = fg.GuidedFlow(
        _linear_model, fg.RectifiedFlow(shift=shift), fg.InputSpec(), guidance=None
    )
    noise = jnp.asarray(_NOISE, jnp.float32)
    return np.asarray(flow.sample_latents(_linear_model, jnp.zeros((2, 1)), noise, solver, steps))


def _euler(x, grid):
    for t, t_next in zip(grid[:-1], grid[1:], strict=True):
        x = x + _linear_velocity(x, t) * (t_next - t)
    return x


def _heun(x, grid):
    for t, t_next in zip(grid[:-1], grid[1:], strict=True):
        v = _linear_velocity(x, t)
        x = x + 0.5 * (v + _linear_velocity(x + v * (t_next - t), t_next)) * (t_next - t)
    return x


# Float32 bits of `sample_latents` over 5 grid points, computed before the solvers carried a
# state (commit bd13e8b): the state must not change one bit of what they compute.
_BEFORE = {
    "Euler": [[1067476768, 1039153664, 3149393920], [1050200384, 1065823632, 3204487216]],
    "Heun": [[1068217843, 3166626577, 1023750816], [1052760080, 1065756842, 3205526082]],
}


@pytest.mark.parametrize("solver", [fg.Euler(), fg.Heun()], ids=["Euler", "Heun"])
def test_the_one_step_solvers_are_bit_identical_to_before_the_state(solver):
    got = _sample(solver)
    assert got.dtype == np.float32
    assert got.view(np.uint32).tolist() == _BEFORE[type(solver).__name__]
    assert solver.init(jnp.zeros((2, 3)), jnp.asarray(1.0)) is None


@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_the_one_step_solvers_match_their_float64_statements(shift):
    grid = ref.grid(6, shift)
    np.testing.assert_allclose(_sample(fg.Euler(), 6, shift), _euler(_NOISE, grid), atol=2e-6)
    np.testing.assert_allclose(_sample(fg.Heun(), 6, shift), _heun(_NOISE, grid), atol=2e-6)


@pytest.mark.parametrize("steps, shift", [(2, 1.0), (3, 1.0), (6, 1.0), (9, 3.0), (26, 3.0)])
def test_dpm_solver_pp_2m_matches_the_released_update(steps, shift):
    expected = ref.dpm_solver_pp_2m(_linear_velocity, _NOISE, ref.grid(steps, shift))
    got = _sample(fg.DPMSolverPP2M(), steps, shift)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, expected, rtol=0, atol=5e-6)


def test_dpm_solver_pp_2m_is_second_order_and_its_first_step_is_euler():
    # One step (t = 1 to 0) is first order: Euler's. Over a grid, the error against the
    # converged solution falls ~4x per halving of the step.
    np.testing.assert_array_equal(_sample(fg.DPMSolverPP2M(), 2), _sample(fg.Euler(), 2))
    exact = ref.dpm_solver_pp_2m(_linear_velocity, _NOISE, ref.grid(4001))
    errors = [
        np.abs(ref.dpm_solver_pp_2m(_linear_velocity, _NOISE, ref.grid(n)) - exact).max()
        for n in (17, 33, 65)
    ]
    assert errors[0] / errors[1] > 3.0 and errors[1] / errors[2] > 3.0


def test_dpm_solver_pp_2m_state_is_the_previous_data_prediction():
    solver = fg.DPMSolverPP2M()
    x = jnp.asarray(_NOISE, jnp.float32)
    state = solver.init(x, jnp.asarray(1.0, jnp.float32))
    assert not bool(state.filled)

    def velocity(y, t):
        return jnp.asarray(_linear_velocity(np.asarray(y, np.float64), float(t)), y.dtype)

    t, t_next = jnp.asarray(0.75, jnp.float32), jnp.asarray(0.5, jnp.float32)
    _, state = solver.step(velocity, x, t, t_next, state)
    assert bool(state.filled) and float(state.time) == 0.75
    np.testing.assert_allclose(
        state.data, _NOISE - 0.75 * _linear_velocity(_NOISE, 0.75), atol=1e-6
    )
