"""Fused attention for TPUs: Pallas's splash attention kernel on one example's heads.

Splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`, shipped with JAX) runs
the whole softmax attention, forward and backward, block by block in the TPU's on-chip
memory with an online softmax: the `[heads, S, K]` scores are never written to HBM. The
kernel wants sequence lengths that are multiples of its blocks; `splash_attention` pads the
queries and keys to a multiple of the block and masks the padded keys (their columns of the
score matrix are excluded from every softmax), so it computes `plain_attention`'s function
on any length. Padded queries attend like any other and their rows are dropped.

On a TPU the kernel is compiled by Mosaic; lowered for any other platform (CPU in CI) the
same kernel runs in Pallas's interpreter (`lax.platform_dependent` picks per platform when
the program is lowered, so a program compiled ahead of time for a TPU topology on a CPU
host gets the compiled kernel). The interpreter is exact and slow: it is for tests.
"""

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float


LANES = 128
"""The TPU's vector lane count: splash's blocks are multiples of it."""

ATTENTION_RESIDUALS = "attention"
"""The name (`jax.ad_checkpoint.checkpoint_name`) of an attention's result and of the fused
kernel's softmax statistics, which a remat policy may save (`SaveAttention`)."""


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


KEY_BLOCK_LIMIT = 1536
"""The most keys the kernel reads in one block (a multiple of its computing block, `block`).
On a TPU v5e, blocks of 1,536 keys made splash attention's forward 13-15% and its value and
gradient 14-16% faster than blocks of 512, at SD3.5-Medium's joint shape (1,357 tokens of
64-wide heads) and at 4,608 tokens of 128-wide heads; one block of 4,608 such keys overflows
the kernel's on-chip memory (`docs/accelerators.md`)."""


def _block(length: int, block: int) -> int:
    """The block for a sequence of `length`: `block`, or less for a shorter sequence (the
    length rounded up to the lanes), so that a short sequence is not padded to a long block."""
    return min(block, _round_up(length, LANES))


def _key_block(padded: int, block: int) -> int:
    """The kernel's block of keys over `padded` keys computed `block` at a time: the largest
    multiple of `block` that divides `padded`, up to `KEY_BLOCK_LIMIT` (`block` at least), so
    that the keys are read in few blocks and padded no further."""
    blocks = padded // block
    most = max(1, KEY_BLOCK_LIMIT // block)
    return block * max(n for n in range(1, min(most, blocks) + 1) if blocks % n == 0)


def padded_keys_mask(padded_q: int, padded_kv: int, keys: int, heads: int) -> Any:
    """The kernel's multi-head mask over `padded_q` queries and `padded_kv` keys, of which the
    first `keys` are attended and the rest, padding, are masked out of every softmax."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as mask_lib,
    )

    if padded_kv == keys:
        one: mask_lib.Mask = mask_lib.FullMask((padded_q, padded_kv))
    else:
        allowed = np.zeros((padded_q, padded_kv), np.bool_)
        allowed[:, :keys] = True
        one = mask_lib.NumpyMask(allowed)
    return mask_lib.MultiHeadMask([one] * heads)


@functools.lru_cache(maxsize=64)
def _mask(queries: int, keys: int, heads: int, block: int) -> tuple[Any, Any, int, int]:
    """The mask and block sizes of the kernel for `queries` queries over `keys` keys of
    `heads` heads, with the padded lengths it takes: one object per shape, so that splash's
    own cache of the processed mask (done on the host) is hit on every later trace. Both
    sequences are padded to a multiple of `block` (`_block`); the queries go in blocks of
    that size, the keys in blocks of `_key_block`, their scores computed `block` at a time.
    The kernel holds the keys sequence-minor (`[heads, head_dim, S]`, its `SEQ_MINOR`
    layout): it transposes them once and scores each block as a plain product. On a TPU v5e
    that made the whole training step of SD3.5-Medium, FLUX.1 and Wan 2.1 0.3-0.6% faster
    than the keys held head-dim-minor (`docs/accelerators.md`)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as kernel_lib,
    )

    block_q, block_kv = _block(queries, block), _block(keys, block)
    padded_q, padded_kv = _round_up(queries, block_q), _round_up(keys, block_kv)
    keys_read = _key_block(padded_kv, block_kv)
    sizes = kernel_lib.BlockSizes(
        block_q=block_q,
        block_kv=keys_read,
        block_kv_compute=block_kv,
        block_q_dkv=block_q,
        block_kv_dkv=keys_read,
        block_kv_dkv_compute=block_kv,
        use_fused_bwd_kernel=True,
        k_layout=kernel_lib.QKVLayout.SEQ_MINOR,
    )
    return padded_keys_mask(padded_q, padded_kv, keys, heads), sizes, padded_q, padded_kv


def _kernel(queries: int, keys: int, heads: int, block: int, interpret: bool) -> Any:
    """The splash kernel for the shape (`_mask`), built in the current trace: its block tables
    become constants of the program being traced (made eagerly they would be placed on the
    current mesh's devices, which an ahead-of-time plan's cannot hold)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as kernel_lib,
    )

    mask, sizes, _, _ = _mask(queries, keys, heads, block)
    return kernel_lib.make_splash_mha(
        mask,
        block_sizes=sizes,
        head_shards=1,
        q_seq_shards=1,
        residual_checkpoint_name=ATTENTION_RESIDUALS,
        interpret=interpret,
    )


def _at_default_precision(make: Callable[[], Any]) -> Callable[[Array, Array, Array], Array]:
    """`make()(q, k, v)` with its forward and its backward both traced at the default matmul
    precision, whatever precision is set around the call or around the gradient (the backward
    of a custom VJP is traced where the gradient is taken, outside any scope of the caller's
    forward). The kernel is made inside each trace, so that its tables are that trace's."""

    @jax.custom_vjp
    def call(q: Array, k: Array, v: Array) -> Array:
        with jax.default_matmul_precision("default"):
            out: Array = make()(q, k, v)
        return out

    def forward(q: Array, k: Array, v: Array) -> tuple[Array, Any]:
        with jax.default_matmul_precision("default"):
            out, pullback = jax.vjp(make(), q, k, v)
        return out, pullback

    def backward(pullback: Any, cotangent: Array) -> Any:
        with jax.default_matmul_precision("default"):
            return pullback(cotangent)

    call.defvjp(forward, backward)
    return call


def kernel_call(
    queries: int, keys: int, heads: int, block: int, interpret: bool, dtype: Any
) -> Callable[[Array, Array, Array], Array]:
    """The splash kernel for `queries` queries over `keys` keys in `heads` heads, as a
    function of the heads-first queries (already scaled), keys and values, each padded to
    its multiple of the block (`_mask`), whose padded keys it masks.

    Mosaic refuses a multi-pass precision for half-precision operands, which a caller's
    `jax.default_matmul_precision` would ask of the kernel's products: for a half-precision
    `dtype` the kernel runs at the default precision (`_at_default_precision`); float32
    operands keep the caller's precision.
    """
    make = functools.partial(_kernel, queries, keys, heads, block, interpret)
    if jnp.dtype(dtype).itemsize < 4:
        return _at_default_precision(make)
    kernel: Callable[[Array, Array, Array], Array] = make()
    return kernel


def multi_device_axes() -> tuple[str, ...]:
    """The axes of the current mesh (`jax.set_mesh`) of more than one device, where the
    library cannot call the kernel yet: XLA cannot partition a Mosaic kernel over an axis it
    splits, and inside a `shard_map` (the sequence axis's Ulysses) splash's kernel does not
    say how its result varies over the manual axes, which `shard_map`'s checks require."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    return tuple(name for name, size in mesh.shape.items() if size > 1)


def check_block(name: str, block: int) -> None:
    """Raise a `ValueError` naming `name` unless `block` is a positive multiple of `LANES`."""
    if not (isinstance(block, int) and block > 0 and block % LANES == 0):
        raise ValueError(
            f"`{name}` must be a positive multiple of {LANES} for splash attention (its blocks "
            f"of queries and keys), got {block!r}."
        )


def splash_attention(
    q: Float[Array, "S heads head_dim"],
    k: Float[Array, "K heads head_dim"],
    v: Float[Array, "K heads head_dim"],
    block: int,
) -> Float[Array, "S heads head_dim"]:
    """Softmax attention of `S` queries over `K` keys by the splash kernel, `[S, heads,
    head_dim]`: `plain_attention`'s function, the scores never materialised.

    **Arguments:**

    - `q`, `k`, `v`: one example's queries, keys and values (float32 or bfloat16).
    - `block`: the queries per block and the keys scored at a time, a multiple of 128
        (less for a shorter sequence); the sequences are padded to a multiple of it, and
        the keys are read in blocks of up to `KEY_BLOCK_LIMIT` (`_key_block`).

    **Returns:**

    The attended values, in `v`'s dtype.

    **Raises:**

    - `ValueError`: naming `block` unless it is a positive multiple of 128; naming
        `attention` on a mesh of several devices (`multi_device_axes`).
    """
    check_block("block", block)
    axes = multi_device_axes()
    if axes:
        raise ValueError(
            f"`attention`=SplashAttention cannot run on a mesh of several devices (axes "
            f"{axes}) yet: the kernel must be called per device, which the library does not "
            "do (docs/accelerators.md); use ChunkedAttention or PlainAttention ('chunked' or "
            "'xla' in settings) on several devices, or AutoAttention ('auto'), which takes "
            "the plain form there."
        )
    queries, heads, head_dim = q.shape
    keys = k.shape[0]
    # The kernel computes q k^T without scaling: the queries are scaled first, in their dtype
    # (exact for a power-of-two head dimension).
    scale = jnp.asarray(1.0 / math.sqrt(head_dim), q.dtype)

    def run(q: jax.Array, k: jax.Array, v: jax.Array, interpret: bool) -> jax.Array:
        _, _, padded_q, padded_kv = _mask(queries, keys, heads, block)

        def heads_first(x: jax.Array, padded: int) -> jax.Array:
            x = jnp.transpose(x, (1, 0, 2))
            return jnp.pad(x, ((0, 0), (0, padded - x.shape[1]), (0, 0)))

        call = kernel_call(queries, keys, heads, block, interpret, q.dtype)
        out = call(
            heads_first(q * scale, padded_q),
            heads_first(k, padded_kv),
            heads_first(v, padded_kv),
        )
        return jnp.transpose(out[:, :queries], (1, 0, 2)).astype(v.dtype)

    attended: Float[Array, "S heads head_dim"] = jax.lax.platform_dependent(
        q,
        k,
        v,
        tpu=functools.partial(run, interpret=False),
        default=functools.partial(run, interpret=True),
    )
    return attended
