"""Attention over a sequence split across the devices of one mesh axis.

The two strategies of the systems that split a sample's tokens over devices:

- **Ulysses** (DeepSpeed-Ulysses): each device holds `S / n` tokens of every head; one
    all-to-all gives each device every token of `heads / n` heads, attention runs there, and a
    second all-to-all gives the tokens back. Needs `n` to divide the heads.
- **Ring**: each device keeps its `S / n` queries and the blocks of keys and values travel
    round the ring (`ppermute`), `n` steps, each folded into an online softmax (running maximum,
    running sum, running weighted values), so no device ever holds all keys or all scores.

Both compute `plain_attention`'s function; the sequence must split evenly over the axis.
"""

from typing import Literal, TypeAlias, get_args

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import Array, Float

from ._layers import HEADS_FIRST, attention_scores, plain_attention


SequenceStrategy: TypeAlias = Literal["ulysses", "ring"]
"""How attention runs over a split sequence: `"ulysses"` (all-to-all to split heads) or
`"ring"` (keys and values passed round the devices, online softmax)."""

SEQUENCE_STRATEGIES: tuple[SequenceStrategy, ...] = get_args(SequenceStrategy)


def ulysses_attention(
    q: Float[Array, "s heads head_dim"],
    k: Float[Array, "s heads head_dim"],
    v: Float[Array, "s heads head_dim"],
    axis: str,
) -> Float[Array, "s heads head_dim"]:
    """Attention of this device's `s` queries over the whole sequence, inside `shard_map`.

    Each device holds a contiguous `s = S / n` tokens of every head; `n`, the size of `axis`,
    divides the heads.
    """
    whole = [
        jax.lax.all_to_all(x, axis, split_axis=1, concat_axis=0, tiled=True)  # type: ignore[no-untyped-call]
        for x in (q, k, v)
    ]
    attended = plain_attention(*whole)
    out: Float[Array, "s heads head_dim"] = jax.lax.all_to_all(  # type: ignore[no-untyped-call]
        attended, axis, split_axis=0, concat_axis=1, tiled=True
    )
    return out


def ring_attention(
    q: Float[Array, "s heads head_dim"],
    k: Float[Array, "s heads head_dim"],
    v: Float[Array, "s heads head_dim"],
    axis: str,
    size: int,
) -> Float[Array, "s heads head_dim"]:
    """Attention of this device's `s` queries over the whole sequence, inside `shard_map`:
    the `size` devices of `axis` pass their blocks of keys and values round the ring, and each
    block is folded into an online softmax in float32."""
    heads, length = q.shape[1], q.shape[0]
    running_max = jnp.full((heads, length), -jnp.inf, jnp.float32)
    running_sum = jnp.zeros((heads, length), jnp.float32)
    weighted = jnp.zeros((heads, length, v.shape[-1]), jnp.float32)
    ring = [(i, (i + 1) % size) for i in range(size)]
    for step in range(size):
        scores = attention_scores(q, k)
        new_max = jnp.maximum(running_max, jnp.max(scores, axis=-1))
        weights = jnp.exp(scores - new_max[..., None])
        correction = jnp.exp(running_max - new_max)
        running_sum = running_sum * correction + jnp.sum(weights, axis=-1)
        values = jnp.transpose(v, HEADS_FIRST).astype(jnp.float32)
        weighted = weighted * correction[..., None] + jnp.einsum("hqk,hkd->hqd", weights, values)
        running_max = new_max
        if step + 1 < size:
            k, v = jax.lax.ppermute((k, v), axis, ring)  # type: ignore[no-untyped-call]
    out = (weighted / running_sum[..., None]).astype(v.dtype)
    result: Float[Array, "s heads head_dim"] = jnp.transpose(out, HEADS_FIRST)
    return result


def sequence_parallel_attention(
    q: Float[Array, "S heads head_dim"],
    k: Float[Array, "S heads head_dim"],
    v: Float[Array, "S heads head_dim"],
    mesh: Mesh,
    axis: str,
    strategy: SequenceStrategy,
) -> Float[Array, "S heads head_dim"]:
    """Self-attention with the sequence split over `mesh`'s `axis`: what `plain_attention`
    computes, each device holding `S / n` of the tokens.

    **Arguments:**

    - `q`, `k`, `v`: the queries, keys and values of the whole sequence.
    - `mesh`: the device mesh.
    - `axis`: the name of the mesh axis the sequence is split over.
    - `strategy`: `"ulysses"` or `"ring"` (`SequenceStrategy`).

    **Returns:**

    The attended values, `[S, heads, head_dim]`, split over `axis` as the inputs.

    **Raises:**

    - `ValueError`: naming `strategy` when it is not one of its values, `axis` when the mesh
        has no such axis, or `q` when the axis's size does not divide the sequence (or, for
        Ulysses, the heads).
    """
    if strategy not in SEQUENCE_STRATEGIES:
        raise ValueError(f"`strategy` must be one of {SEQUENCE_STRATEGIES}, got {strategy!r}.")
    if axis not in mesh.shape:
        raise ValueError(f"`axis` must name an axis of the mesh {dict(mesh.shape)}, got {axis!r}.")
    size = mesh.shape[axis]
    length, heads = q.shape[0], q.shape[1]
    if length % size != 0 or (strategy == "ulysses" and heads % size != 0):
        what = "sequence length" if length % size != 0 else "number of heads"
        raise ValueError(
            f"`q`: the {what} ({length if length % size != 0 else heads}) must be a multiple "
            f"of the size of mesh axis {axis!r} ({size})."
        )
    spec = PartitionSpec(axis)  # type: ignore[no-untyped-call]

    def local(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        if strategy == "ulysses":
            return ulysses_attention(q, k, v, axis)
        return ring_attention(q, k, v, axis, size)

    split = jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)
    out: Float[Array, "S heads head_dim"] = split(q, k, v)
    return out
