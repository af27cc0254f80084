"""`head_rms_norm`, the query-key norm of SD3's and FLUX's attention, against a float64
statement of diffusers' per-head `RMSNorm`."""

import jax.numpy as jnp
import numpy as np
import pytest

from flowgrpo_eqx.models._layers import head_rms_norm


def _per_head_rms_norm(h: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Each head's features, `h` `[S, heads, head_dim]`, over their root mean square, times
    `weight`."""
    h = h.astype(np.float64)
    return h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + eps) * weight.astype(np.float64)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(("heads", "head_dim"), [(4, 64), (3, 128), (1, 8)])
def test_each_head_is_normalised_apart_with_the_shared_weight(dtype, heads, head_dim):
    rng = np.random.default_rng(heads * head_dim)
    # Heads of very different scales: a head's statistics must not leak into another's.
    scales = 10.0 ** rng.uniform(-2, 2, size=(1, heads, 1))
    h = (scales * rng.standard_normal((7, heads, head_dim))).astype(np.float32)
    weight = (1.0 + 0.1 * rng.standard_normal(head_dim)).astype(np.float32)
    out = head_rms_norm(jnp.asarray(h, dtype), jnp.asarray(weight, dtype), eps=1e-6)
    assert out.shape == h.shape and out.dtype == dtype
    expected = _per_head_rms_norm(
        np.asarray(jnp.asarray(h, dtype), np.float64),
        np.asarray(jnp.asarray(weight, dtype), np.float64),
        1e-6,
    )
    # float32: the statistics' rounding; bfloat16: the result's and the product's roundings.
    tolerance = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(
        np.asarray(out, np.float64), expected, rtol=tolerance, atol=tolerance
    )


def test_eps_is_added_to_each_heads_mean_square():
    h = np.zeros((2, 2, 4), np.float32)
    h[:, 0] = 1e-3
    out = head_rms_norm(jnp.asarray(h), jnp.ones(4, jnp.float32), eps=1e-2)
    expected = _per_head_rms_norm(h, np.ones(4), 1e-2)
    assert abs(expected[0, 0, 0] - 1e-3 / np.sqrt(1e-6 + 1e-2)) < 1e-9
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=1e-5, atol=1e-7)
