"""The pieces of a joint-attention block that MMDiT's blocks and FLUX's double-stream blocks
share: one stream's adaLN-Zero modulation, attention weights and feed-forward, SD3's time
features and the text inputs' shape check."""

from typing import Any, NamedTuple, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from ._init import init_linears, ones, zero_linear
from ._layers import dense, head_rms_norm, layer_norm, modulate, time_features


TIME_FEATURES = 256
"""How many sinusoidal time features SD3's and FLUX's time embeddings start with."""


def sd3_time_features(t: Float[Array, ""]) -> Float[Array, " 256"]:
    """SD3's 256 time features of `t` in [0, 1] (`time_features` of the timestep `1000 t`)."""
    return time_features(t, TIME_FEATURES)


def check_text_shapes(
    cond: dict[str, Any], context_length: int, context_dim: int, pooled_dim: int
) -> None:
    """Raise a `ValueError` naming `cond['context']` or `cond['pooled']` unless their shapes
    are `[context_length, context_dim]` and `[pooled_dim]`."""
    want = (context_length, context_dim)
    if cond["context"].shape != want:
        raise ValueError(f"`cond['context']` must have shape {want}, got {cond['context'].shape}.")
    if cond["pooled"].shape != (pooled_dim,):
        raise ValueError(
            f"`cond['pooled']` must have shape ({pooled_dim},), got {cond['pooled'].shape}."
        )


@final
class JointAttention(eqx.Module):
    """One token stream's attention weights: its queries, keys, values and output projection.

    diffusers' `Attention`: `to_q`, `to_k`, `to_v` (or `add_q_proj`, ... for the text
    stream), the optional RMS norms of each head's queries and keys, and `to_out.0` (or
    `to_add_out`), absent for the last block's pre-only text stream.

    **Arguments:**

    - `width`: the token width.
    - `heads`: the number of attention heads; divides `width`.
    - `qk_norm`: whether queries and keys are RMS-normalised per head.
    - `has_out`: whether the stream has an output projection.
    - `key`: a JAX PRNG key for the initialisation.
    """

    q: eqx.nn.Linear
    k: eqx.nn.Linear
    v: eqx.nn.Linear
    norm_q: Float[Array, " head_dim"] | None
    norm_k: Float[Array, " head_dim"] | None
    out: eqx.nn.Linear | None
    heads: int = eqx.field(static=True)

    def __init__(
        self, width: int, heads: int, qk_norm: bool, has_out: bool, *, key: PRNGKeyArray
    ) -> None:
        self.heads = heads
        linears = init_linears([(width, width)] * (4 if has_out else 3), key=key)
        self.q, self.k, self.v = linears[:3]
        self.out = linears[3] if has_out else None
        head_dim = width // heads
        self.norm_q = ones((head_dim,)) if qk_norm else None
        self.norm_k = ones((head_dim,)) if qk_norm else None

    def qkv(self, h: Float[Array, "S D"]) -> Float[Array, "3 S heads head_dim"]:
        """The queries, keys and values of the (already modulated) tokens, split into heads."""
        seq, width = h.shape

        def heads(linear: eqx.nn.Linear) -> Float[Array, "S heads head_dim"]:
            return dense(linear, h).reshape(seq, self.heads, width // self.heads)

        q, k, v = heads(self.q), heads(self.k), heads(self.v)
        if self.norm_q is not None and self.norm_k is not None:
            q, k = head_rms_norm(q, self.norm_q), head_rms_norm(k, self.norm_k)
        return jnp.stack([q, k, v])


@final
class BlockShape(NamedTuple):
    """What every block of one MMDiT shares: the token width, the attention heads (a
    divisor of `width`), the feed-forward hidden width over `width`, and whether queries and
    keys are RMS-normalised per head."""

    width: int
    heads: int
    mlp_ratio: int
    qk_norm: bool


class Stream(eqx.Module):
    """One stream's weights (text or image) in one MMDiT block.

    `modulation` is diffusers' adaLN linear, its output rows in diffusers' chunk order: for
    a full stream (`AdaLayerNormZero`) shift, scale and gate of the attention, then of the
    feed-forward; for the image stream of a dual-attention block (SD3.5's
    `SD35AdaLayerNormZeroX`) three more, shift, scale and gate of the second attention; for
    the last block's pre-only text stream (`AdaLayerNormContinuous`) scale, then shift. A
    pre-only stream keeps only what the joint attention needs from it (its modulation and
    its queries, keys and values): its output is unused.

    **Arguments:**

    - `shape`: the block's dimensions.
    - `pre_only`: whether to keep only the modulation and the queries, keys and values.
    - `dual`: whether the block has a second, image-only attention (image stream only).
    - `key`: a JAX PRNG key for the initialisation.
    """

    modulation: eqx.nn.Linear
    attn: JointAttention
    fc1: eqx.nn.Linear | None
    fc2: eqx.nn.Linear | None
    pre_only: bool = eqx.field(static=True)

    def __init__(
        self, shape: BlockShape, pre_only: bool, dual: bool = False, *, key: PRNGKeyArray
    ) -> None:
        width, heads, mlp_ratio, qk_norm = shape
        k_attn, k_mlp = jax.random.split(key)
        self.pre_only = pre_only
        chunks = 2 if pre_only else 9 if dual else 6
        self.modulation = zero_linear(width, chunks * width, key=key)
        self.attn = JointAttention(width, heads, qk_norm, not pre_only, key=k_attn)
        if pre_only:
            self.fc1 = self.fc2 = None
        else:
            self.fc1, self.fc2 = init_linears(
                [(width, mlp_ratio * width), (mlp_ratio * width, width)], key=k_mlp
            )

    def modulations(self, silu_c: Float[Array, " D"]) -> Float[Array, "M D"]:
        """The stream's modulation vectors (rows in diffusers' chunk order) of `silu(c)`."""
        out: Float[Array, "M D"] = dense(self.modulation, silu_c[None])[0].reshape(
            -1, silu_c.shape[0]
        )
        return out

    def qkv(
        self, h: Float[Array, "S D"], mod: Float[Array, "M D"]
    ) -> Float[Array, "3 S heads head_dim"]:
        """The queries, keys and values of the tokens, normalised and modulated first, for
        the (joint) attention."""
        if self.pre_only:
            return self.attn.qkv(modulate(layer_norm(h), mod[1], mod[0]))
        return self.attn.qkv(modulate(layer_norm(h), mod[0], mod[1]))

    def residual(
        self, h: Float[Array, "S D"], attended: Float[Array, "S D"], mod: Float[Array, "M D"]
    ) -> Float[Array, "S D"]:
        """The gated attention residual added to the tokens (unchanged if pre-only)."""
        if self.attn.out is None:
            return h
        out: Float[Array, "S D"] = h + mod[2][None, :] * dense(self.attn.out, attended)
        return out

    def feed_forward(self, h: Float[Array, "S D"], mod: Float[Array, "M D"]) -> Float[Array, "S D"]:
        """The gated tanh-GELU feed-forward residual added to the tokens."""
        if self.fc1 is None or self.fc2 is None:
            return h
        hidden = jax.nn.gelu(
            dense(self.fc1, modulate(layer_norm(h), mod[3], mod[4])), approximate=True
        )
        out: Float[Array, "S D"] = h + mod[5][None, :] * dense(self.fc2, hidden)
        return out

    def update(
        self, h: Float[Array, "S D"], attended: Float[Array, "S D"], mod: Float[Array, "M D"]
    ) -> Float[Array, "S D"]:
        """The tokens after the block: the attention residual, then the feed-forward one
        (unchanged if pre-only)."""
        return self.feed_forward(self.residual(h, attended, mod), mod)
