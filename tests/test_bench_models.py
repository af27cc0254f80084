"""`bench.models`' shaped-matmul ceiling counts each matmul as often as the program runs it, and
the full-size rows count the model's FLOPs without the query-key norm's products."""

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


@pytest.mark.parametrize("precision", ["default", "highest"])
def test_the_full_size_model_flops_leave_out_the_query_key_norms_products(
    precision: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The norm's block-diagonal 0/1 products compute a per-head mean, not the architecture's
    matmuls (`NOT_MODEL_PRODUCTS`): the model's FLOPs are the same as with the norm computed
    on the heads split apart (no products), at the default matmul precision and at the one
    the suite sets on a TPU."""
    from bench import _full_size
    from flowgrpo_eqx.models import _joint
    from flowgrpo_eqx.models._layers import rms_norm

    (row,) = _full_size.rows("sd35m b8 splash nothing")
    with jax.default_matmul_precision(precision):
        library = _full_size.model_flops(row)
        monkeypatch.setattr(_joint, "head_rms_norm", rms_norm)
        split = _full_size.model_flops(row)
    assert library == split
    assert 58.5e12 < library < 58.7e12
