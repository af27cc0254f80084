"""`tools.tpu.norm_variants`: the query-key RMSNorm computed on the row's layout is the
per-head RMSNorm (a float64 statement), and swapped into a model it computes the same
velocity."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flowgrpo_eqx.models import MMDiT, _joint
from tools.tpu.norm_variants import joint_attention_norm, lane_dense_head_rms_norm


def _per_head_rms_norm(h: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    h = h.astype(np.float64)
    return h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + eps) * weight.astype(np.float64)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_lane_dense_norm_is_the_per_head_rms_norm(dtype):
    rng = np.random.default_rng(0)
    h = (3.0 * rng.standard_normal((7, 4, 64))).astype(np.float32)
    weight = (1.0 + 0.1 * rng.standard_normal(64)).astype(np.float32)
    out = lane_dense_head_rms_norm(jnp.asarray(h, dtype), jnp.asarray(weight, dtype), eps=1e-6)
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


def test_swapped_into_a_model_it_computes_the_same_velocity_and_is_put_back():
    model = MMDiT(
        image_size=8,
        channels=4,
        patch=2,
        depth=2,
        width=32,
        heads=2,
        context_length=3,
        context_dim=12,
        pooled_dim=10,
        qk_norm="rms_norm",
        dual_attention_layers=(0,),
        key=jax.random.key(0),
    )
    params, static = eqx.partition(model, eqx.is_inexact_array)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    noisy = [
        p + 0.1 * jax.random.normal(k, p.shape, p.dtype) for p, k in zip(leaves, keys, strict=True)
    ]
    model = eqx.combine(jax.tree.unflatten(treedef, noisy), static)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 8, 8, 4)).astype(np.float32)
    t = rng.uniform(size=(2,)).astype(np.float32)
    cond = {
        "context": rng.standard_normal((2, 3, 12)).astype(np.float32),
        "pooled": rng.standard_normal((2, 10)).astype(np.float32),
    }

    def velocity() -> np.ndarray:
        return np.asarray(jax.jit(jax.vmap(model))(x, t, cond))

    library = velocity()
    assert np.abs(library).max() > 1e-2
    with joint_attention_norm(lane_dense_head_rms_norm):
        assert _joint.rms_norm is lane_dense_head_rms_norm
        swapped = velocity()
    assert _joint.rms_norm is not lane_dense_head_rms_norm
    np.testing.assert_allclose(swapped, library, rtol=1e-5, atol=1e-5)
