"""`bench.models`' shaped-matmul ceiling counts each matmul as often as the program runs it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import _products, models


def _program(x: jax.Array, w: jax.Array, v: jax.Array) -> jax.Array:
    def step(h: jax.Array, _: None) -> tuple[jax.Array, None]:
        return jnp.tanh(h @ w), None

    h, _ = jax.lax.scan(step, x, None, length=3)
    return jnp.einsum("bi,bj->ij", h, v)


ARGS = (jnp.ones((8, 16)), jnp.ones((16, 16)), jnp.ones((8, 4)))


def test_dot_generals_counts_a_scan_body_once_per_iteration() -> None:
    dots = _products.dot_generals(jax.make_jaxpr(_program)(*ARGS).jaxpr)
    by_shapes = {(key[0], key[2]): count for key, count in dots.items()}
    assert by_shapes == {((8, 16), (16, 16)): 3, ((8, 16), (8, 4)): 1}


def test_the_ceiling_runs_every_matmul_and_counts_its_flops() -> None:
    call, info = models.matmul_ceiling(_program, ARGS)
    assert info == {"distinct": 2, "instances": 4, "flops": 3 * 2 * 8 * 16 * 16 + 2 * 8 * 16 * 4}
    assert np.isfinite(float(call()))


def test_the_profile_argument_is_checked() -> None:
    with pytest.raises(SystemExit):
        models.main(["--profile", "mmdit:nowhere"])
    with pytest.raises(SystemExit):
        models.main(["--models", "unet"])
