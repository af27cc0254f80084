"""What the tests of the attention's variants share: a tiny SD3.5-shaped MMDiT, a batch of
two inputs for it, a model moved off its initialisation, and the check of one example's
attention and its gradient against the float64 statement."""

from typing import Any

import equinox as eqx
import jax
import numpy as np

from tests import numpy_reference as ref
from tests.diffusers_helpers import relative


SD35_SHAPED: dict[str, Any] = dict(
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
)
"""Two blocks of width 32 with two 16-wide heads, the query-key norm on, and a second
attention in block 0 (`MMDiT`'s arguments but `key`)."""


def batch_of_two(seed: int) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """Latents, times and text conditioning of two examples for `SD35_SHAPED`, in float32."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 8, 8, 4)).astype(np.float32)
    t = rng.uniform(size=(2,)).astype(np.float32)
    cond = {
        "context": rng.standard_normal((2, 3, 12)).astype(np.float32),
        "pooled": rng.standard_normal((2, 10)).astype(np.float32),
    }
    return x, t, cond


def dit_batch_of_two(seed: int, vocab_size: int = 8) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Images, times and prompt tokens of two examples for an 8 x 8 RGB `DiT` with 4 prompt
    tokens below `vocab_size`."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 8, 8, 3)).astype(np.float32)
    t = rng.uniform(size=(2,)).astype(np.float32)
    cond = rng.integers(0, vocab_size, size=(2, 4)).astype(np.int32)
    return x, t, cond


def perturbed(model: Any, seed: int = 1, scale: float = 0.1) -> Any:
    """`model` with every float leaf moved by Gaussian noise of `scale` drawn from `seed`, its
    zero-initialised layers too (so that every path of the model reaches the velocity and
    every gradient is nonzero)."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    moved = [
        p + scale * jax.random.normal(k, p.shape, p.dtype)
        for p, k in zip(leaves, keys, strict=True)
    ]
    return eqx.combine(jax.tree.unflatten(treedef, moved), static)


def assert_attention_statement(
    out: Any,
    grads: Any,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    d_out: np.ndarray,
    tolerance: float,
) -> None:
    """One example's attention `out`, `[S, heads, head_dim]`, and `grads`, the gradients of
    `sum(out * d_out)` in its queries, keys and values, each within `tolerance` (`relative`
    error) of the float64 statement (`numpy_reference.attention`, `attention_vjp`) at `q`,
    `k`, `v`."""
    assert relative(np.asarray(out, np.float64), ref.attention(q, k, v)) < tolerance
    want = ref.attention_vjp(q, k, v, d_out)
    for name, got, expected in zip("qkv", grads, want, strict=True):
        error = relative(np.asarray(got, np.float64), expected)
        assert error < tolerance, (name, error)
