"""Attention over a sample's tokens split across the devices of the mesh's `"sequence"` axis.

The two strategies of the systems that split a sample's tokens over devices:

- **Ulysses** (DeepSpeed-Ulysses): each device holds `S / n` tokens of every head; one
    all-to-all gives each device every token of `heads / n` heads, attention runs there, and a
    second all-to-all gives the tokens back. Needs `n` to divide the heads.
- **Ring**: each device keeps its `S / n` queries and the blocks of keys and values travel
    round the ring (`ppermute`), `n` steps, each folded into an online softmax (running maximum,
    running sum, running weighted values), so no device ever holds all keys or all scores.

Both compute `plain_attention`'s function. The models split their image (or video) tokens
over the axis between blocks (`split_tokens`) and keep the text tokens whole on every device
of the axis, as DanceGRPO's sequence parallelism (FastVideo's `parallel_attention`) and
xDiT's USP (`joint_strategy`) do: in a joint attention (`attend_joint`, MMDiT and FLUX) each
device takes its own heads of the text's queries, keys and values under Ulysses, and every
device folds the whole text's keys and values into its online softmax under ring; a
cross-attention to the text (Wan) needs no communication. Where text and image tokens pass
the same weights as one sequence (FLUX's single-stream blocks), the text is split with the
image instead (`join_streams`), so each token's layers run on one device only. Only the
sequence axis is manual inside these `shard_map`s; the data axis (rows, FSDP) stays with
XLA's partitioner.
"""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import Array, Float

from .._distributed import SEQUENCE_AXIS
from ._layers import (
    HEADS_FIRST,
    PLAIN_ATTENTION,
    SEQUENCE_STRATEGIES,
    AttentionSettings,
    Heads,
    KeyHeads,
    SequenceStrategy,
    attend,
    attend_to,
    attention_scores,
    chunk_queries,
    local_attention,
    merge_chunks,
)


_MODEL_NAMES = ("x", "sequence_strategy")  # what a model's user passes: its input, its setting


def sequence_devices() -> int:
    """How many devices split a sample's tokens: the size of the `"sequence"` axis of the
    current mesh (`jax.set_mesh`), or 1 outside a mesh or on a mesh without that axis."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or SEQUENCE_AXIS not in mesh.axis_names:
        return 1
    return int(mesh.shape[SEQUENCE_AXIS])


def split_tokens(tokens: Float[Array, " S *rest"]) -> Float[Array, " S *rest"]:
    """`tokens` (one sample's, between two blocks) constrained to be split over the mesh's
    sequence axis; unchanged when no sequence axis splits them. Every token-wise layer (norms,
    modulation, projections, feed-forward) then runs on each device's own tokens."""
    if sequence_devices() == 1:
        return tokens
    spec = PartitionSpec(SEQUENCE_AXIS, *([None] * (tokens.ndim - 1)))  # type: ignore[no-untyped-call]
    split: Float[Array, " S *rest"] = jax.lax.with_sharding_constraint(tokens, spec)  # type: ignore[no-untyped-call]
    return split


def streams_interleave(size: int, text_length: int) -> bool:
    """Whether `join_streams` can put a text of `text_length` tokens in one sequence with
    image tokens split over `size` devices: `size` divides it (or there is no split)."""
    return size == 1 or text_length % size == 0


def join_streams(text: Float[Array, "L D"], image: Float[Array, "N D"]) -> Float[Array, "S D"]:
    """Text and image tokens as one sequence of `L + N` tokens for token-wise layers and
    self-attention: text then image without a sequence axis; over `n` devices of one, each
    device's contiguous `(L + N) / n` tokens are its `L / n` text tokens then its own `N / n`
    image tokens, so that the text is split with the image at no cost and every token, text
    included, passes each layer on one device only (one weight gradient, not one per device).
    Attention is blind to the order of its keys, so only the result's order differs from
    text-then-image; `part_streams` undoes it. Needs `streams_interleave`."""
    size = sequence_devices()
    rest = text.shape[1:]
    both = [text.reshape(size, -1, *rest), split_tokens(image).reshape(size, -1, *rest)]
    joined = split_tokens(jnp.concatenate(both, axis=1))
    whole: Float[Array, "S D"] = split_tokens(joined.reshape(-1, *rest))
    return whole


def part_streams(
    tokens: Float[Array, "S D"], text_length: int
) -> tuple[Float[Array, "L D"], Float[Array, "N D"]]:
    """The text and the image tokens of `join_streams`'s sequence, in their own orders."""
    size = sequence_devices()
    rest = tokens.shape[1:]
    parts = split_tokens(tokens.reshape(size, -1, *rest))
    own = text_length // size
    text = parts[:, :own].reshape(text_length, *rest)
    image = split_tokens(parts[:, own:].reshape(-1, *rest))
    return text, image


class _Softmax(NamedTuple):
    """An online softmax's running state per head and query, in float32."""

    maximum: Float[Array, "heads S"]
    total: Float[Array, "heads S"]
    weighted: Float[Array, "heads S head_dim"]


def _start(q: Heads) -> _Softmax:
    # Made "like" the queries, so that inside `shard_map` the state differs between devices
    # as they do (a loop's carry must keep its type).
    heads_first = jnp.transpose(q, HEADS_FIRST)
    return _Softmax(
        jnp.full_like(heads_first[..., 0], -jnp.inf, jnp.float32),
        jnp.zeros_like(heads_first[..., 0], jnp.float32),
        jnp.zeros_like(heads_first, jnp.float32),
    )


def _fold(state: _Softmax, q: Heads, k: KeyHeads, v: KeyHeads) -> _Softmax:
    """The state after one more block of keys and values."""
    scores = attention_scores(q, k)
    maximum = jnp.maximum(state.maximum, jnp.max(scores, axis=-1))
    weights = jnp.exp(scores - maximum[..., None])
    correction = jnp.exp(state.maximum - maximum)
    values = jnp.transpose(v, HEADS_FIRST).astype(jnp.float32)
    return _Softmax(
        maximum,
        state.total * correction + jnp.sum(weights, axis=-1),
        state.weighted * correction[..., None] + jnp.einsum("hqk,hkd->hqd", weights, values),
    )


def _finish(state: _Softmax, dtype: jnp.dtype) -> Heads:
    out = (state.weighted / state.total[..., None]).astype(dtype)
    result: Heads = jnp.transpose(out, HEADS_FIRST)
    return result


def ring_attention(
    q: Heads,
    k: Heads,
    v: Heads,
    axis: str,
    size: int,
    whole_kv: tuple[Float[Array, "L heads head_dim"], Float[Array, "L heads head_dim"]]
    | None = None,
    chunk: int | None = None,
) -> Heads:
    """Attention of this device's queries over the whole sequence, inside `shard_map`: the
    `size` devices of `axis` pass their blocks of keys and values round the ring, and each
    block is folded into an online softmax in float32. `whole_kv`, keys and values every
    device holds whole (a joint attention's text), are folded in first. With `chunk`, each
    block is folded `chunk` queries at a time, each chunk rematerialised in the backward pass
    (as `"chunked"` attention), so only `[heads, chunk, block]` scores exist at once."""
    chunked = chunk is not None and q.shape[0] > chunk
    if chunked:
        assert chunk is not None
        queries = chunk_queries(q, chunk)
        one = jax.checkpoint(_fold)

        def fold(state: _Softmax, k: jax.Array, v: jax.Array) -> _Softmax:
            folded: _Softmax = jax.lax.map(
                lambda part: one(part[0], part[1], k, v), (state, queries)
            )
            return folded

        state = jax.vmap(_start)(queries)
    else:
        fold = functools.partial(_fold, q=q)
        state = _start(q)
    if whole_kv is not None:
        state = fold(state, k=whole_kv[0], v=whole_kv[1])
    ring = [(i, (i + 1) % size) for i in range(size)]

    def step(_: Any, carry: tuple[_Softmax, jax.Array, jax.Array]) -> tuple[_Softmax, Any, Any]:
        state, k, v = carry
        # The next block is sent before this one is folded, so the two can overlap.
        k_next, v_next = jax.lax.ppermute((k, v), axis, ring)  # type: ignore[no-untyped-call]
        return fold(state, k=k, v=v), k_next, v_next

    # One loop body whatever the ring's size; the last block is folded after the loop, so no
    # block is sent that nobody reads.
    state, k, v = jax.lax.fori_loop(0, size - 1, step, (state, k, v))
    state = fold(state, k=k, v=v)
    if not chunked:
        return _finish(state, v.dtype)
    return merge_chunks(jax.vmap(lambda part: _finish(part, v.dtype))(state), q.shape[0])


def ulysses_attention(
    q: Heads,
    k: Heads,
    v: Heads,
    axis: str,
    settings: AttentionSettings = PLAIN_ATTENTION,
) -> Heads:
    """Attention of this device's `s` queries over the whole sequence, inside `shard_map`.

    Each device holds a contiguous `s = S / n` tokens of every head; `n`, the size of `axis`,
    divides the heads. The attention of each device's heads runs as `settings` says.
    """
    whole = [
        jax.lax.all_to_all(x, axis, split_axis=1, concat_axis=0, tiled=True)  # type: ignore[no-untyped-call]
        for x in (q, k, v)
    ]
    attended = local_attention(whole[0], whole[1], whole[2], settings.attention)
    out: Heads = jax.lax.all_to_all(  # type: ignore[no-untyped-call]
        attended, axis, split_axis=0, concat_axis=1, tiled=True
    )
    return out


def _check_split(
    strategy: SequenceStrategy,
    axis: str,
    size: int,
    length: int,
    heads: int,
    names: tuple[str, str] = ("q", "strategy"),
) -> None:
    """Raise a `ValueError` unless `size` devices can split `length` tokens of `heads` heads
    with `strategy`, naming `names[0]` (the tokens) or `names[1]` (the strategy)."""
    tokens, setting = names
    if strategy not in SEQUENCE_STRATEGIES:
        raise ValueError(f"`{setting}` must be one of {SEQUENCE_STRATEGIES}, got {strategy!r}.")
    if length % size != 0:
        raise ValueError(
            f"`{tokens}`: the sequence length ({length}) must be a multiple of the size of mesh "
            f"axis {axis!r} ({size})."
        )
    if strategy == "ulysses" and heads % size != 0:
        raise ValueError(
            f"`{setting}`: Ulysses needs the number of heads ({heads}) to be a multiple of the "
            f"size of mesh axis {axis!r} ({size}); the ring strategy splits tokens only."
        )


def sequence_parallel_attention(
    q: Heads,
    k: Heads,
    v: Heads,
    mesh: Mesh | None,
    axis: str,
    strategy: SequenceStrategy,
    settings: AttentionSettings = PLAIN_ATTENTION,
) -> Heads:
    """Self-attention with the sequence split over `mesh`'s `axis`: what `plain_attention`
    computes, each device holding `S / n` of the tokens.

    **Arguments:**

    - `q`, `k`, `v`: the queries, keys and values of the whole sequence.
    - `mesh`: the device mesh; `None` for the current one (`jax.set_mesh`). Axes other than
        `axis` are left to XLA's partitioner (rows may be split over a data axis).
    - `axis`: the name of the mesh axis the sequence is split over.
    - `strategy`: `"ulysses"` or `"ring"` (`SequenceStrategy`).
    - `settings`: how each device's attention runs under Ulysses.

    **Returns:**

    The attended values, `[S, heads, head_dim]`, split over `axis` as the inputs.

    **Raises:**

    - `ValueError`: naming `strategy` when it is not one of its values, `axis` when the mesh
        has no such axis, or `q` when the axis's size does not divide the sequence (or, for
        Ulysses, the heads).
    """
    shape = dict((mesh or jax.sharding.get_abstract_mesh()).shape)
    if axis not in shape:
        raise ValueError(f"`axis` must name an axis of the mesh {shape}, got {axis!r}.")
    size = shape[axis]
    _check_split(strategy, axis, size, q.shape[0], q.shape[1])
    return _split_attention(q, k, v, mesh, axis, size, strategy, settings)


def _split_attention(
    q: Heads,
    k: Heads,
    v: Heads,
    mesh: Mesh | None,
    axis: str,
    size: int,
    strategy: SequenceStrategy,
    settings: AttentionSettings,
) -> Heads:
    """`sequence_parallel_attention` once its split is checked (`_check_split`)."""
    spec = PartitionSpec(axis)  # type: ignore[no-untyped-call]

    def local(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        if strategy == "ulysses":
            return ulysses_attention(q, k, v, axis, settings)
        return ring_attention(q, k, v, axis, size, chunk=settings.attention.ring_chunk)

    split = jax.shard_map(
        local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, axis_names={axis}
    )
    out: Heads = split(q, k, v)
    return out


def attend_self(q: Heads, k: Heads, v: Heads, settings: AttentionSettings) -> Float[Array, "S D"]:
    """Self-attention of one token stream, heads merged back, `[S, D]`: over the tokens
    split by the current mesh's sequence axis (`settings.sequence`'s strategy), or on one
    device as `attend_to` without one."""
    size = sequence_devices()
    if size == 1:
        return attend_to(q, k, v, settings)
    _check_split(settings.sequence, SEQUENCE_AXIS, size, q.shape[0], q.shape[1], _MODEL_NAMES)
    out = _split_attention(q, k, v, None, SEQUENCE_AXIS, size, settings.sequence, settings)
    return out.reshape(out.shape[0], -1)


def attend_joint(
    image: Float[Array, "3 N heads head_dim"],
    text: Float[Array, "3 L heads head_dim"],
    settings: AttentionSettings,
    text_first: bool,
) -> tuple[Float[Array, "N D"], Float[Array, "L D"]]:
    """One attention over two token streams (MMDiT's and FLUX's joint attention), each
    stream's result apart, heads merged back.

    Without a sequence axis the streams' queries, keys and values are concatenated (text
    first when `text_first`, as FLUX; image first otherwise, as SD3) and attended as one
    sequence. With one, the image tokens are split over it and the text tokens are whole on
    every device (see the module's docstring).

    **Arguments:**

    - `image`: the image stream's stacked queries, keys and values.
    - `text`: the text stream's.
    - `settings`: how attention is computed (`AttentionSettings`).
    - `text_first`: the order of the streams in the one-device sequence.

    **Returns:**

    `(image_out, text_out)`, `[N, D]` and `[L, D]`.

    **Raises:**

    - `ValueError`: when the sequence axis's size does not divide the image tokens (or, for
        Ulysses, the heads).
    """
    length, count = text.shape[1], image.shape[1]
    size = sequence_devices()
    if size == 1:
        parts = [text, image] if text_first else [image, text]
        attended = attend(jnp.concatenate(parts, axis=1), settings)
        if text_first:
            return attended[length:], attended[:length]
        return attended[:count], attended[count:]
    strategy = settings.sequence
    _check_split(strategy, SEQUENCE_AXIS, size, count, image.shape[2], _MODEL_NAMES)

    # The whole text crosses into and out of the split region in float32: its gradient and
    # result are summed over the axis there, and XLA's CPU backend fails to promote such a
    # sum in bfloat16 (the round trip of a bfloat16 value through float32 is exact).
    dtype = text.dtype

    def local(image: jax.Array, text: jax.Array) -> tuple[jax.Array, jax.Array]:
        # Marked as differing between devices while in float32, so that the sum of its
        # gradient over the axis (this mark's transpose) is taken in float32.
        text = jax.lax.pcast(text, SEQUENCE_AXIS, to="varying").astype(dtype)
        if strategy == "ulysses":
            return _ulysses_joint(image, text, size, settings, text_first)
        queries = jnp.concatenate([text[0], image[0]])
        out = ring_attention(
            queries, image[1], image[2], SEQUENCE_AXIS, size, (text[1], text[2]),
            settings.attention.ring_chunk,
        )  # fmt: skip
        text_out = jax.lax.pmean(out[:length].astype(jnp.float32), SEQUENCE_AXIS)  # type: ignore[no-untyped-call]
        return out[length:], text_out

    split, whole = PartitionSpec(None, SEQUENCE_AXIS), PartitionSpec()  # type: ignore[no-untyped-call]
    image_out, text_out = jax.shard_map(
        local,
        in_specs=(split, whole),
        out_specs=(PartitionSpec(SEQUENCE_AXIS), whole),  # type: ignore[no-untyped-call]
        axis_names={SEQUENCE_AXIS},
    )(image, text.astype(jnp.float32))
    return image_out.reshape(count, -1), text_out.astype(dtype).reshape(length, -1)


def _ulysses_joint(
    image: Float[Array, "3 n heads head_dim"],
    text: Float[Array, "3 L heads head_dim"],
    size: int,
    settings: AttentionSettings,
    text_first: bool,
) -> tuple[Float[Array, "n heads head_dim"], Float[Array, "L heads head_dim"]]:
    """Inside `shard_map`: every image token of this device's `heads / size` heads (one
    all-to-all), the same heads of the whole text, one attention over both, and back."""
    heads = text.shape[2] // size
    whole = jax.lax.all_to_all(image, SEQUENCE_AXIS, split_axis=2, concat_axis=1, tiled=True)  # type: ignore[no-untyped-call]
    start = jax.lax.axis_index(SEQUENCE_AXIS) * heads
    mine = jax.lax.dynamic_slice_in_dim(text, start, heads, axis=2)
    length, count = text.shape[1], whole.shape[1]
    joined = jnp.concatenate([mine, whole] if text_first else [whole, mine], axis=1)
    out = local_attention(joined[0], joined[1], joined[2], settings.attention)
    text_out, image_out = (out[:length], out[length:]) if text_first else (out[count:], out[:count])
    image_back = jax.lax.all_to_all(
        image_out, SEQUENCE_AXIS, split_axis=0, concat_axis=1, tiled=True
    )  # type: ignore[no-untyped-call]
    # Each device's heads of the text put in place and summed over the axis (in float32, as
    # the text leaves the split region): an all-gather whose result JAX knows to be the same
    # on every device, exact since all but one of the terms are zeros.
    zeros = jnp.zeros(text.shape[1:], jnp.float32)
    placed = jax.lax.dynamic_update_slice_in_dim(zeros, text_out.astype(jnp.float32), start, 1)
    text_whole: Float[Array, "L heads head_dim"] = jax.lax.psum(placed, SEQUENCE_AXIS)  # type: ignore[no-untyped-call]
    return image_back, text_whole
