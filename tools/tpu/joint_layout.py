"""`python -m tools.tpu.joint_layout`: SD3.5-Medium's step with the joint attention's
queries, keys and values brought to the splash kernel another way, timed beside the
library's on one accelerator.

In the library a block stacks each stream's queries, keys and values (`[3, S_i, 24, 64]`),
`attend_joint` concatenates the two streams, and `splash_attention` transposes each of the
three to heads first and pads it to the kernel's blocks, then transposes the result back.
The profile of `sd35m b8 splash nothing` on a TPU v5e (`tools/tpu/op_sources.py`, the norm
split into heads) gives those moves about 94 ms of the 1,136 ms step: the concatenation 36.0
(a transposing copy), the padding 27.4, the transposes 30.9, beside 40 ms in the backward
taking the stack apart. `joined_padded` makes the padding part of the one concatenation and
transposes the stacked three once, then calls the same kernel with the same mask; one
device's splash attention only (elsewhere it is the library's). It is not the library's
until it is faster, and then with its own tests.

    bash tools/tpu/run.sh python -m tools.tpu.joint_layout [--row ROW] [--calls 5] [--profile]

Prints one JSON object: the bench's measurement of the row (`bench._full_size.measure`) with
the library's joint attention and with the variant, in one process (`--profile` adds each
one's device profile, with the time by the function that made the ops). Compare the
variants' `ms`.
"""

import functools
import math
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import jax
import jax.numpy as jnp

from flowgrpo_eqx.models import _flux, _mmdit, _sequence, _splash
from flowgrpo_eqx.models._layers import QKV, AttentionSettings, named
from tools.tpu._compare import compare, swapped


def _splash_call(
    seq: int, heads: int, block: int, interpret: bool, q: Any, k: Any, v: Any
) -> jax.Array:
    return _splash.kernel_call(seq, seq, heads, block, interpret, q.dtype)(q, k, v)


def joined_padded_attend_joint(
    image: jax.Array, text: jax.Array, settings: AttentionSettings, text_first: bool
) -> tuple[jax.Array, jax.Array]:
    """`attend_joint`'s function (`image` `[3, N, heads, head_dim]`, `text` `[3, L, ...]`;
    the streams' results `[N, D]` and `[L, D]`), for one device's splash attention with the
    streams joined and padded in one concatenation and transposed to heads first once;
    otherwise the library's `attend_joint`."""
    if settings.kind != "splash" or _sequence.sequence_devices() != 1:
        return _sequence.attend_joint(image, text, settings, text_first)
    length, count = text.shape[1], image.shape[1]
    seq = length + count
    heads, dim = image.shape[2], image.shape[3]
    _, _, padded, _ = _splash._mask(seq, seq, heads, settings.chunk)
    parts = [text, image] if text_first else [image, text]
    pad = jnp.zeros((3, padded - seq, heads, dim), image.dtype)
    joined = jnp.transpose(jnp.concatenate([*parts, pad], axis=1), (0, 2, 1, 3))
    scale = jnp.asarray(1.0 / math.sqrt(dim), joined.dtype)
    q, k, v = (named(x, QKV) for x in (joined[0] * scale, joined[1], joined[2]))
    with jax.numpy_dtype_promotion("standard"):
        out = jax.lax.platform_dependent(
            q,
            k,
            v,
            tpu=functools.partial(_splash_call, seq, heads, settings.chunk, False),
            default=functools.partial(_splash_call, seq, heads, settings.chunk, True),
        )
    out = named(out, _splash.ATTENTION_RESIDUALS)
    merged = jnp.transpose(out[:, :seq], (1, 0, 2)).reshape(seq, heads * dim).astype(v.dtype)
    if text_first:
        return merged[length:], merged[:length]
    return merged[:count], merged[count:]


VARIANTS: dict[str, Callable[..., tuple[jax.Array, jax.Array]] | None] = {
    "library": None,
    "joined_padded": joined_padded_attend_joint,
}
"""The joint attentions to time: `None` for the library's own."""


def joint_attention(attend_joint: Callable[..., Any] | None) -> AbstractContextManager[None]:
    """Within the block, MMDiT's and FLUX's joint attention is `attend_joint` (the library's
    when `None`), put back after."""
    return swapped([_mmdit, _flux], "attend_joint", attend_joint)


def main(argv: list[str] | None = None) -> int:
    variants = {name: functools.partial(joint_attention, one) for name, one in VARIANTS.items()}
    return compare("python -m tools.tpu.joint_layout", __doc__ or "", variants, argv)


if __name__ == "__main__":
    sys.exit(main())
