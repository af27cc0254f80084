"""`tools.tpu.norm_variants`: the query-key RMSNorm computed on the heads split apart,
swapped into a model for the library's, computes the same velocity (the library's against a
float64 statement: `tests/test_head_rms_norm.py`)."""

import equinox as eqx
import jax
import numpy as np

from flowgrpo_eqx.models import MMDiT, _joint
from tools.tpu.norm_variants import joint_attention_norm, split_heads_rms_norm


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
    with joint_attention_norm(split_heads_rms_norm):
        assert _joint.head_rms_norm is split_heads_rms_norm
        swapped = velocity()
    assert _joint.head_rms_norm is not split_heads_rms_norm
    np.testing.assert_allclose(swapped, library, rtol=1e-5, atol=1e-5)
