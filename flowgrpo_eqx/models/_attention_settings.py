"""How a model computes attention (`AttentionSettings`: one device's attention and the
sequence-parallel strategy) and the attentions of one device that take it."""

from typing import final

import equinox as eqx
from jaxtyping import Array, Float

from ._layers import DEFAULT_ATTENTION, AbstractAttention, Heads, KeyHeads, local_attention
from ._sequence_strategy import DEFAULT_SEQUENCE, AbstractSequenceStrategy, check_sequence_strategy


@final
class AttentionSettings(eqx.Module):
    """How a model computes attention; it holds no array, so it adds no leaf to the model.

    **Arguments:**

    - `attention`: how attention is computed on one device (`AbstractAttention`).
    - `sequence`: how attention runs over tokens split by a mesh's `"sequence"` axis
        (`AbstractSequenceStrategy`); unused without one.

    **Raises:**

    - `ValueError`: naming `attention` when it is not an `AbstractAttention`, or
        `sequence_strategy` (the models' name for `sequence`) when it is not an
        `AbstractSequenceStrategy`.
    """

    attention: AbstractAttention = eqx.field(static=True)
    sequence: AbstractSequenceStrategy = eqx.field(default=DEFAULT_SEQUENCE, static=True)

    def __check_init__(self) -> None:
        if not isinstance(self.attention, AbstractAttention):
            raise ValueError(
                "`attention` must be an AbstractAttention (PlainAttention(), "
                f"ChunkedAttention(chunk), SplashAttention(block), ...), got "
                f"{self.attention!r}; `attention_from_name` reads a setting's name."
            )
        check_sequence_strategy(self.sequence)


PLAIN_ATTENTION = AttentionSettings(DEFAULT_ATTENTION)
"""Attention in its plain form: the default where a layer takes `AttentionSettings`."""


def attend(
    qkv: Float[Array, "3 S heads head_dim"], settings: AttentionSettings
) -> Float[Array, "S D"]:
    """Multi-head attention of the queries, keys and values, heads merged back, `[S, D]`,
    as `settings.attention` computes it."""
    return attend_to(qkv[0], qkv[1], qkv[2], settings)


def attend_to(
    q: Heads, k: KeyHeads, v: KeyHeads, settings: AttentionSettings
) -> Float[Array, "S D"]:
    """Multi-head attention of `S` queries over `K` keys and values (a cross-attention when
    they come from another sequence), heads merged back, `[S, D]`, as `settings.attention`
    computes it."""
    attended = local_attention(q, k, v, settings.attention)
    return attended.reshape(attended.shape[0], -1)
