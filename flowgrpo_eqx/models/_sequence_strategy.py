"""How attention runs over a sample's tokens split across the devices of a mesh axis: the
sequence-parallel strategies (`AbstractSequenceStrategy`: `UlyssesSequence`,
`RingSequence`) and the collectives each is made of, called inside `shard_map` by
`_sequence`'s attentions (see its docstring for how the models split their tokens)."""

import abc
import functools
from typing import Any, NamedTuple, TypeAlias, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from ._layers import (
    HEADS_FIRST,
    AbstractAttention,
    Heads,
    KeyHeads,
    attention_scores,
    chunk_queries,
    local_attention,
    merge_chunks,
)


_Stacked: TypeAlias = Float[Array, "3 S heads head_dim"]
_Text: TypeAlias = Float[Array, "L heads head_dim"]


class AbstractSequenceStrategy(eqx.Module):
    """How attention runs when a mesh axis (the models' `"sequence"` axis,
    `data_mesh(sequence=n)`) splits a sample's tokens over its devices. Every strategy
    computes one device's attention (`plain_attention`'s function); they differ in what
    travels between devices and in what they need of the axis. A strategy holds no array,
    so it adds no leaf to a model.

    The strategies: `UlyssesSequence`, `RingSequence`. Settings files and command lines
    name them (`"ulysses"`, `"ring"`: `sequence_strategy_from_name`).
    """

    @abc.abstractmethod
    def check_split(self, heads: int, axis: str, size: int, name: str) -> None:
        """Check that the `size` devices of `axis` can run this strategy on attention of
        `heads` heads (that `size` divides the tokens is checked apart).

        **Arguments:**

        - `heads`: the attention's number of heads.
        - `axis`: the name of the mesh axis the tokens are split over.
        - `size`: its number of devices.
        - `name`: the argument the error names.

        **Raises:**

        - `ValueError`: naming `name` when the strategy cannot split those heads.
        """

    @abc.abstractmethod
    def attend_split(
        self, q: Heads, k: Heads, v: Heads, axis: str, size: int, attention: AbstractAttention
    ) -> Heads:
        """Inside `shard_map` over `axis`: the self-attention of this device's queries over
        the whole sequence, each device holding a contiguous `S / size` of the tokens.

        **Arguments:**

        - `q`, `k`, `v`: this device's queries, keys and values, `[S / size, heads,
            head_dim]`.
        - `axis`: the name of the mesh axis the tokens are split over.
        - `size`: its number of devices.
        - `attention`: how attention is computed on one device (`AbstractAttention`).

        **Returns:**

        The attended values of this device's queries, `[S / size, heads, head_dim]`.
        """

    @abc.abstractmethod
    def attend_joint_split(
        self,
        image: _Stacked,
        text: Float[Array, "3 L heads head_dim"],
        axis: str,
        size: int,
        attention: AbstractAttention,
        text_first: bool,
    ) -> tuple[Heads, _Text]:
        """Inside `shard_map` over `axis`: one attention over two token streams (MMDiT's
        and FLUX's joint attention), the image tokens split over the axis and the text
        tokens whole on every device.

        **Arguments:**

        - `image`: this device's image queries, keys and values, `[3, N / size, heads,
            head_dim]`.
        - `text`: the whole text's, `[3, L, heads, head_dim]`, the same on every device.
        - `axis`: the name of the mesh axis the image tokens are split over.
        - `size`: its number of devices.
        - `attention`: how attention is computed on one device (`AbstractAttention`).
        - `text_first`: whether the text comes first in the one-device sequence (FLUX) or
            the image does (SD3).

        **Returns:**

        `(image_out, text_out)`: this device's image results, `[N / size, heads,
        head_dim]`, and the whole text's, `[L, heads, head_dim]`, in float32 and the same
        on every device.
        """


@final
class UlyssesSequence(AbstractSequenceStrategy):
    """DeepSpeed-Ulysses: an all-to-all turns "every head of `S / n` tokens" into "every
    token of `heads / n` heads", attention runs on each device as on one (any
    `AbstractAttention`), and a second all-to-all turns it back. The axis's size must divide
    the heads. In a joint attention each device takes its own heads of the whole text beside
    its image heads. Settings name it `"ulysses"`; the models' default.
    """

    def check_split(self, heads: int, axis: str, size: int, name: str) -> None:
        if heads % size != 0:
            raise ValueError(
                f"`{name}`: Ulysses needs the number of heads ({heads}) to be a multiple of "
                f"the size of mesh axis {axis!r} ({size}); RingSequence() splits tokens only."
            )

    def attend_split(
        self, q: Heads, k: Heads, v: Heads, axis: str, size: int, attention: AbstractAttention
    ) -> Heads:
        return ulysses_attention(q, k, v, axis, attention)

    def attend_joint_split(
        self,
        image: _Stacked,
        text: Float[Array, "3 L heads head_dim"],
        axis: str,
        size: int,
        attention: AbstractAttention,
        text_first: bool,
    ) -> tuple[Heads, _Text]:
        return _ulysses_joint(image, text, axis, size, attention, text_first)


@final
class RingSequence(AbstractSequenceStrategy):
    """Ring attention: each device keeps its queries and the blocks of keys and values
    travel round the devices of the axis (`ppermute`), each folded into an online softmax in
    float32 (`ring_attention`), `attention.ring_chunk` queries at a time where the attention
    has one (`ChunkedAttention`). No device holds every key; any axis size that divides the
    tokens works. In a joint attention every device folds the whole text's keys and values
    first. Settings name it `"ring"`.
    """

    def check_split(self, heads: int, axis: str, size: int, name: str) -> None:
        del heads, axis, size, name  # the ring splits tokens only

    def attend_split(
        self, q: Heads, k: Heads, v: Heads, axis: str, size: int, attention: AbstractAttention
    ) -> Heads:
        return ring_attention(q, k, v, axis, size, chunk=attention.ring_chunk)

    def attend_joint_split(
        self,
        image: _Stacked,
        text: Float[Array, "3 L heads head_dim"],
        axis: str,
        size: int,
        attention: AbstractAttention,
        text_first: bool,
    ) -> tuple[Heads, _Text]:
        del text_first  # the results are parted by stream, so the order does not show
        length = text.shape[1]
        queries = jnp.concatenate([text[0], image[0]])
        out = ring_attention(
            queries, image[1], image[2], axis, size, (text[1], text[2]), attention.ring_chunk
        )
        text_out: _Text = jax.lax.pmean(out[:length].astype(jnp.float32), axis)  # type: ignore[no-untyped-call]
        return out[length:], text_out


SequenceStrategy: TypeAlias = AbstractSequenceStrategy
"""A model's `sequence_strategy`: `UlyssesSequence()` or `RingSequence()`."""

DEFAULT_SEQUENCE = UlyssesSequence()
"""The models' default `sequence_strategy`: Ulysses."""

SEQUENCE_STRATEGY_NAMES: tuple[str, ...] = ("ulysses", "ring")
"""The names settings files and command lines give the sequence strategies
(`sequence_strategy_from_name`)."""


def sequence_strategy_from_name(name: str) -> AbstractSequenceStrategy:
    """The sequence-parallel strategy a settings file or command line names.

    **Arguments:**

    - `name`: `"ulysses"` (`UlyssesSequence`) or `"ring"` (`RingSequence`).

    **Returns:**

    The strategy.

    **Raises:**

    - `ValueError`: naming `sequence_strategy` when `name` is neither.
    """
    if name not in SEQUENCE_STRATEGY_NAMES:
        raise ValueError(
            f"`sequence_strategy` must be one of {SEQUENCE_STRATEGY_NAMES}, got {name!r}."
        )
    return UlyssesSequence() if name == "ulysses" else RingSequence()


def check_sequence_strategy(strategy: Any, name: str = "sequence_strategy") -> None:
    """Raise a `ValueError` naming `name` unless `strategy` is an
    `AbstractSequenceStrategy` (a name such as `"ring"` is refused: the boundary that reads
    it calls `sequence_strategy_from_name`)."""
    if not isinstance(strategy, AbstractSequenceStrategy):
        raise ValueError(
            f"`{name}` must be an AbstractSequenceStrategy (UlyssesSequence() or "
            f"RingSequence()), got {strategy!r}; `sequence_strategy_from_name` reads a "
            "setting's name."
        )


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
    attention: AbstractAttention,
) -> Heads:
    """Attention of this device's `s` queries over the whole sequence, inside `shard_map`.

    Each device holds a contiguous `s = S / n` tokens of every head; `n`, the size of `axis`,
    divides the heads. The attention of each device's heads runs as `attention` computes it.
    """
    whole = [
        jax.lax.all_to_all(x, axis, split_axis=1, concat_axis=0, tiled=True)  # type: ignore[no-untyped-call]
        for x in (q, k, v)
    ]
    attended = local_attention(whole[0], whole[1], whole[2], attention)
    out: Heads = jax.lax.all_to_all(  # type: ignore[no-untyped-call]
        attended, axis, split_axis=0, concat_axis=1, tiled=True
    )
    return out


def _ulysses_joint(
    image: Float[Array, "3 n heads head_dim"],
    text: Float[Array, "3 L heads head_dim"],
    axis: str,
    size: int,
    attention: AbstractAttention,
    text_first: bool,
) -> tuple[Float[Array, "n heads head_dim"], Float[Array, "L heads head_dim"]]:
    """Inside `shard_map`: every image token of this device's `heads / size` heads (one
    all-to-all), the same heads of the whole text, one attention over both, and back."""
    heads = text.shape[2] // size
    whole = jax.lax.all_to_all(image, axis, split_axis=2, concat_axis=1, tiled=True)  # type: ignore[no-untyped-call]
    start = jax.lax.axis_index(axis) * heads
    mine = jax.lax.dynamic_slice_in_dim(text, start, heads, axis=2)
    length, count = text.shape[1], whole.shape[1]
    joined = jnp.concatenate([mine, whole] if text_first else [whole, mine], axis=1)
    out = local_attention(joined[0], joined[1], joined[2], attention)
    text_out, image_out = (out[:length], out[length:]) if text_first else (out[count:], out[:count])
    image_back = jax.lax.all_to_all(image_out, axis, split_axis=0, concat_axis=1, tiled=True)  # type: ignore[no-untyped-call]
    # Each device's heads of the text put in place and summed over the axis (in float32, as
    # the text leaves the split region): an all-gather whose result JAX knows to be the same
    # on every device, exact since all but one of the terms are zeros.
    zeros = jnp.zeros(text.shape[1:], jnp.float32)
    placed = jax.lax.dynamic_update_slice_in_dim(zeros, text_out.astype(jnp.float32), start, 1)
    text_whole: Float[Array, "L heads head_dim"] = jax.lax.psum(placed, axis)  # type: ignore[no-untyped-call]
    return image_back, text_whole
