import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flowgrpo_eqx as fg
from tests import numpy_reference as ref


@pytest.mark.parametrize("steps", [2, 3, 11, 41])
@pytest.mark.parametrize("shift", [1.0, 3.0, 0.5])
def test_timesteps_match_numpy_grid(steps, shift):
    grid = fg.RectifiedFlow(shift=shift).timesteps(steps)
    assert grid.shape == (steps,)
    assert grid.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(grid), ref.grid(steps, shift), rtol=1e-6, atol=1e-7)
    assert float(grid[0]) == 1.0 and float(grid[-1]) == 0.0
    assert np.all(np.diff(np.asarray(grid)) < 0)


def test_eleven_steps_give_ten_transitions():
    grid = fg.RectifiedFlow().timesteps(11)
    assert grid.shape[0] - 1 == 10


def test_interpolation_and_velocity_target():
    flow = fg.RectifiedFlow()
    data = jnp.array([1.0, -2.0])
    noise = jnp.array([0.5, 0.5])
    np.testing.assert_allclose(flow.interpolate(data, noise, 0.25), 0.75 * data + 0.25 * noise)
    np.testing.assert_allclose(flow.velocity_target(data, noise), noise - data)


@pytest.mark.parametrize("steps", [1, 0, -3, True])
def test_bad_steps_named(steps):
    with pytest.raises(ValueError, match="steps"):
        fg.RectifiedFlow().timesteps(steps)


def test_non_int_steps_named():
    # Under the runtime type checker a float is a type error; without it, a ValueError.
    with pytest.raises((ValueError, TypeError), match="steps"):
        fg.RectifiedFlow().timesteps(2.5)


def test_bad_shift_named():
    with pytest.raises(ValueError, match="shift"):
        fg.RectifiedFlow(shift=0.0)


# --------------------------------------------------------------------------------------
# RectifiedFlow.interpolate keeps the data's dtype whatever the time's.


def test_interpolate_keeps_a_bfloat16_state_bfloat16():
    data = jnp.asarray([1.0, -2.0], jnp.bfloat16)
    noise = jnp.asarray([0.5, 0.5], jnp.bfloat16)
    got = fg.RectifiedFlow().interpolate(data, noise, jnp.asarray(0.25, jnp.float32))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), [0.875, -1.375])


# --------------------------------------------------------------------------------------
# RectifiedFlow.timesteps is float32 by its own choice, not by JAX's default dtype.


def test_grid_is_float32_with_x64_enabled():
    with jax.enable_x64(True):
        grid = fg.RectifiedFlow(3.0).timesteps(5)
        assert grid.dtype == jnp.float32
        assert float(grid[0]) == 1.0 and float(grid[-1]) == 0.0
