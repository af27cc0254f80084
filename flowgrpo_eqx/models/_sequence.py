"""Attention over a sample's tokens split across the devices of the mesh's `"sequence"` axis.

The two strategies of the systems that split a sample's tokens over devices
(`AbstractSequenceStrategy`, in `_sequence_strategy`):

- **Ulysses** (DeepSpeed-Ulysses, `UlyssesSequence`): each device holds `S / n` tokens of
    every head; one all-to-all gives each device every token of `heads / n` heads, attention
    runs there, and a second all-to-all gives the tokens back. Needs `n` to divide the heads.
- **Ring** (`RingSequence`): each device keeps its `S / n` queries and the blocks of keys
    and values travel round the ring (`ppermute`), `n` steps, each folded into an online
    softmax (running maximum, running sum, running weighted values), so no device ever holds
    all keys or all scores.

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

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import Array, Float

from .._distributed import SEQUENCE_AXIS
from ._attention_settings import PLAIN_ATTENTION, AttentionSettings, attend, attend_to
from ._layers import Heads
from ._sequence_strategy import AbstractSequenceStrategy, check_sequence_strategy


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


def _check_split(
    strategy: AbstractSequenceStrategy,
    axis: str,
    size: int,
    length: int,
    heads: int,
    names: tuple[str, str] = ("q", "strategy"),
) -> None:
    """Raise a `ValueError` unless `size` devices can split `length` tokens of `heads` heads
    with `strategy`, naming `names[0]` (the tokens) or `names[1]` (the strategy)."""
    tokens, setting = names
    if length % size != 0:
        raise ValueError(
            f"`{tokens}`: the sequence length ({length}) must be a multiple of the size of mesh "
            f"axis {axis!r} ({size})."
        )
    strategy.check_split(heads, axis, size, setting)


def sequence_parallel_attention(
    q: Heads,
    k: Heads,
    v: Heads,
    mesh: Mesh | None,
    axis: str,
    strategy: AbstractSequenceStrategy,
    settings: AttentionSettings = PLAIN_ATTENTION,
) -> Heads:
    """Self-attention with the sequence split over `mesh`'s `axis`: what `plain_attention`
    computes, each device holding `S / n` of the tokens.

    **Arguments:**

    - `q`, `k`, `v`: the queries, keys and values of the whole sequence.
    - `mesh`: the device mesh; `None` for the current one (`jax.set_mesh`). Axes other than
        `axis` are left to XLA's partitioner (rows may be split over a data axis).
    - `axis`: the name of the mesh axis the sequence is split over.
    - `strategy`: how the attention runs over the split (`UlyssesSequence()` or
        `RingSequence()`).
    - `settings`: how each device's attention is computed (`settings.attention`).

    **Returns:**

    The attended values, `[S, heads, head_dim]`, split over `axis` as the inputs.

    **Raises:**

    - `ValueError`: naming `strategy` when it is not an `AbstractSequenceStrategy` or (for
        Ulysses) the axis's size does not divide the heads, `axis` when the mesh has no such
        axis, or `q` when the axis's size does not divide the sequence.
    """
    check_sequence_strategy(strategy, "strategy")
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
    strategy: AbstractSequenceStrategy,
    settings: AttentionSettings,
) -> Heads:
    """`sequence_parallel_attention` once its split is checked (`_check_split`)."""
    spec = PartitionSpec(axis)  # type: ignore[no-untyped-call]

    def local(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return strategy.attend_split(q, k, v, axis, size, settings.attention)

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
        return strategy.attend_joint_split(
            image, text, SEQUENCE_AXIS, size, settings.attention, text_first
        )

    split, whole = PartitionSpec(None, SEQUENCE_AXIS), PartitionSpec()  # type: ignore[no-untyped-call]
    image_out, text_out = jax.shard_map(
        local,
        in_specs=(split, whole),
        out_specs=(PartitionSpec(SEQUENCE_AXIS), whole),  # type: ignore[no-untyped-call]
        axis_names={SEQUENCE_AXIS},
    )(image, text.astype(jnp.float32))
    return image_out.reshape(count, -1), text_out.astype(dtype).reshape(length, -1)
