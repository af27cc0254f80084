"""The Wan 2.1 video transformer, as diffusers' `WanTransformer3DModel` computes it."""

import math
from typing import Any, final

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from .._misc import check_int, check_number
from ._attention_settings import AttentionSettings, attend_to
from ._init import init_linears, ones, zero_linear, zeros
from ._layers import (
    DEFAULT_ATTENTION,
    AbstractAttention,
    check_inputs,
    dense,
    layer_norm,
    modulate,
    rms_norm,
    silu_mlp,
    time_features,
)
from ._rope import apply_rope, rope_tables
from ._sequence import attend_self, split_tokens
from ._sequence_strategy import DEFAULT_SEQUENCE, SequenceStrategy
from ._stacked import AbstractAttentionModel, AbstractBlockLayout, BlockRemat, block_layout


def wan_rope_dims(head_dim: int) -> tuple[int, int, int]:
    """The rotary feature widths of Wan's frame, row and column axes for a head width.

    diffusers' `WanRotaryPosEmbed`: rows and columns get `2 * (head_dim // 6)` each, frames
    the rest (44, 42, 42 for Wan 2.1's head width 128).
    """
    side = 2 * (head_dim // 6)
    return head_dim - 2 * side, side, side


def wan_position_ids(frames: int, rows: int, cols: int) -> np.ndarray:
    """`(frame, row, column)` of each patch token, frame-major then row-major (the order of
    diffusers' `patch_embedding(...).flatten(2)`), `[frames * rows * cols, 3]` float32."""
    grid = np.stack(
        np.meshgrid(np.arange(frames), np.arange(rows), np.arange(cols), indexing="ij"), axis=-1
    )
    return grid.reshape(-1, 3).astype(np.float32)


@final
class _WanAttention(eqx.Module):
    """One attention's weights (diffusers' `WanAttention`): queries, keys, values, the output
    projection, and RMS norms of the queries and the keys across all heads at once.

    **Arguments:**

    - `width`: the token width.
    - `eps`: the RMS norms' epsilon.
    - `key`: a JAX PRNG key for the initialisation.
    """

    q: eqx.nn.Linear
    k: eqx.nn.Linear
    v: eqx.nn.Linear
    out: eqx.nn.Linear
    norm_q: Float[Array, " D"]
    norm_k: Float[Array, " D"]
    eps: float = eqx.field(static=True)

    def __init__(self, width: int, eps: float, *, key: PRNGKeyArray) -> None:
        self.q, self.k, self.v, self.out = init_linears([(width, width)] * 4, key=key)
        self.norm_q = ones((width,))
        self.norm_k = ones((width,))
        self.eps = eps

    def __call__(
        self,
        h: Float[Array, "S D"],
        source: Float[Array, "K D"],
        heads: int,
        rope: tuple[Float[Array, "S hd"], Float[Array, "S hd"]] | None,
        attention: AttentionSettings,
    ) -> Float[Array, "S D"]:
        """Attention of `h`'s tokens over `source`'s: with `rope`, a self-attention (`source`
        is `h`) with the rotary positions on queries and keys, over the whole sequence even
        when a sequence axis splits it (`attend_self`); without, a cross-attention to the
        text, which every device holds whole, so each device's queries need no other's."""

        def split(x: Float[Array, "N D"]) -> Float[Array, "N heads hd"]:
            return x.reshape(x.shape[0], heads, -1)

        q = split(rms_norm(dense(self.q, h), self.norm_q, self.eps))
        k = split(rms_norm(dense(self.k, source), self.norm_k, self.eps))
        v = split(dense(self.v, source))
        if rope is None:
            return dense(self.out, attend_to(q, k, v, attention))
        q, k, v = apply_rope(jnp.stack([q, k, v]), *rope)
        out: Float[Array, "S D"] = dense(self.out, attend_self(q, k, v, attention))
        return out


@final
class _WanBlock(eqx.Module):
    """One Wan transformer block (diffusers' `WanTransformerBlock`).

    A learned `[6, D]` table plus the time projection gives shift, scale and gate of the
    self-attention and of the feed-forward; the self-attention has rotary positions; the
    cross-attention to the text tokens follows an affine LayerNorm (with `cross_attn_norm`;
    else the tokens as they are) and is added without a gate; the feed-forward is tanh-GELU.

    **Arguments:**

    - `width`: the token width.
    - `ffn_dim`: the feed-forward hidden width.
    - `eps`: the epsilon of every norm of the block.
    - `cross_attn_norm`: whether the cross-attention's input is layer-normalised.
    - `key`: a JAX PRNG key for the initialisation.
    """

    table: Float[Array, "6 D"]
    self_attn: _WanAttention
    cross_norm_weight: Float[Array, " D"] | None
    cross_norm_bias: Float[Array, " D"] | None
    cross_attn: _WanAttention
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear
    eps: float = eqx.field(static=True)

    def __init__(
        self, width: int, ffn_dim: int, eps: float, cross_attn_norm: bool, *, key: PRNGKeyArray
    ) -> None:
        k_table, k_self, k_cross, k_ff = jax.random.split(key, 4)
        self.table = jax.random.normal(k_table, (6, width), jnp.float32) / math.sqrt(width)
        self.self_attn = _WanAttention(width, eps, key=k_self)
        if cross_attn_norm:
            self.cross_norm_weight = ones((width,))
            self.cross_norm_bias = zeros((width,))
        else:
            self.cross_norm_weight = self.cross_norm_bias = None
        self.cross_attn = _WanAttention(width, eps, key=k_cross)
        self.fc1, self.fc2 = init_linears([(width, ffn_dim), (ffn_dim, width)], key=k_ff)
        self.eps = eps

    def __call__(
        self,
        h: Float[Array, "S D"],
        context: Float[Array, "L D"],
        time: Float[Array, "6 D"],
        heads: int,
        rope: tuple[Float[Array, "S hd"], Float[Array, "S hd"]],
        attention: AttentionSettings,
    ) -> Float[Array, "S D"]:
        mod = self.table.astype(time.dtype) + time
        attn_in = modulate(layer_norm(h, self.eps), mod[0], mod[1])
        h = h + mod[2][None, :] * self.self_attn(attn_in, attn_in, heads, rope, attention)
        normed = h
        if self.cross_norm_weight is not None and self.cross_norm_bias is not None:
            normed = (
                layer_norm(h, self.eps) * self.cross_norm_weight[None, :]
                + self.cross_norm_bias[None, :]
            )
        h = h + self.cross_attn(normed, context, heads, None, attention)
        hidden = jax.nn.gelu(
            dense(self.fc1, modulate(layer_norm(h, self.eps), mod[3], mod[4])), approximate=True
        )
        out: Float[Array, "S D"] = h + mod[5][None, :] * dense(self.fc2, hidden)
        return out


def _check_wan(sizes: dict[str, Any], patch: tuple[int, ...], latent: tuple[int, ...]) -> None:
    """Raise a `ValueError` naming the `Wan` argument that does not fit the others."""
    for name, value in sizes.items():
        check_int(name, value, 1)
    if len(patch) != 3 or any(
        isinstance(p, bool) or not isinstance(p, int) or p < 1 for p in patch
    ):
        raise ValueError(f"`patch` must be three positive ints, got {patch!r}.")
    if len(latent) != 3 or any(
        isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in latent
    ):
        raise ValueError(f"`latent_size` must be three positive ints, got {latent!r}.")
    if any(d % p for d, p in zip(latent, patch, strict=True)):
        raise ValueError(f"`patch` ({patch}) must divide `latent_size` ({latent}) on each axis.")
    if sizes["width"] % sizes["heads"]:
        raise ValueError(f"`heads` ({sizes['heads']}) must divide `width` ({sizes['width']}).")
    head_dim = sizes["width"] // sizes["heads"]
    if head_dim % 2 or min(wan_rope_dims(head_dim)) < 2:
        raise ValueError(
            f"the head width `width // heads` ({head_dim}) must be even and at least 6 "
            "(three rotary axes)."
        )


@final
class Wan(AbstractAttentionModel):
    """The Wan 2.1 text-to-video transformer as a velocity network `v(x, t, cond)`.

    Wan 2.1 (Alibaba, 2025) on one unbatched channels-last video latent `[F, H, W, C]`,
    computing what diffusers' `WanTransformer3DModel` computes (`load_diffusers` loads its
    weights, `save_diffusers` writes them back):

    - the latent cut into `patch = (1, 2, 2)` patches (frames, rows, columns), each linearly
        embedded (diffusers' strided 3D convolution), frame-major then row-major;
    - the text tokens (umT5-XXL's states) through a tanh-GELU MLP (`text_embedder`);
    - the time: `freq_dim` (256) sinusoidal features of `1000 t`, an MLP (`temb`), and a
        linear map of `silu(temb)` to six vectors that every block adds to its own learned
        `[6, D]` table (shift, scale, gate of the self-attention, then of the feed-forward);
    - `depth` blocks: self-attention with RMS qk-norm across heads and rotary positions
        over frames, rows and columns (`wan_rope_dims` of the head width), a cross-attention
        to the text after an affine LayerNorm, a tanh-GELU feed-forward;
    - a final LayerNorm modulated by a learned `[2, D]` table plus `temb` (shift, scale),
        a linear map to each patch's values, and the unpatching.

    A fresh model's time projection and final projection are zero (velocity 0); its tables are
    drawn as diffusers draws them (`N(0, 1) / sqrt(D)`). The blocks are held as `MMDiT`'s are
    (`stacked`, `remat`, `attention`, `with_settings`), in one group. Computes in the dtype of
    its parameters and returns the dtype of `x`. `Wan.t2v_1_3b_config()` and
    `Wan.t2v_14b_config()` give Wan 2.1's two text-to-video sizes.

    `cond` is the text's per-token states, `[context_length, text_dim]` (512 tokens of width
    4096 from umT5-XXL in diffusers' `WanPipeline`).

    **Arguments:**

    - `latent_size`: the latent's `(frames, height, width)`; `patch` divides each.
    - `channels`: the latent channels (16 in Wan 2.1).
    - `patch`: the patch's `(frames, rows, columns)`, `(1, 2, 2)` in Wan 2.1.
    - `depth`: the number of blocks (`num_layers`).
    - `width`: the token width (`num_attention_heads * attention_head_dim`).
    - `heads`: the number of attention heads, dividing `width`.
    - `ffn_dim`: the feed-forward hidden width.
    - `context_length`: the number of text tokens.
    - `text_dim`: the width of the text states.
    - `freq_dim`: how many sinusoidal time features the time MLP takes (256 in Wan 2.1).
    - `eps`: the epsilon of every layer norm and of the queries' and keys' RMS norms (`1e-6`
        in Wan 2.1).
    - `cross_attn_norm`: whether each cross-attention's input is layer-normalised with an
        affine part (Wan 2.1's `True`); else it takes the tokens as they are.
    - `stacked`, `remat`, `attention`, `sequence_strategy`: as `MMDiT`'s
        (a sequence axis splits the video tokens; the text stays whole).
    - `key`: a JAX PRNG key for the initialisation.

    **Raises:**

    - `ValueError`: naming the argument, when a size is not a positive int, `patch` does not
        divide `latent_size`, `heads` does not divide `width`, the head width is odd or below
        6, `freq_dim` is odd, `eps` is not positive, or a layout or attention setting is not
        one of its values.
    """

    patch_embed: eqx.nn.Linear
    time_mlp: tuple[eqx.nn.Linear, eqx.nn.Linear]
    time_proj: eqx.nn.Linear
    text_mlp: tuple[eqx.nn.Linear, eqx.nn.Linear]
    blocks: tuple[_WanBlock, ...]  # as `block_layout` holds them
    block_layout: AbstractBlockLayout
    attention_settings: AttentionSettings
    final_table: Float[Array, "2 D"]
    final_proj: eqx.nn.Linear
    latent_size: tuple[int, int, int] = eqx.field(static=True)
    channels: int = eqx.field(static=True)
    patch: tuple[int, int, int] = eqx.field(static=True)
    depth: int = eqx.field(static=True)
    width: int = eqx.field(static=True)
    heads: int = eqx.field(static=True)
    ffn_dim: int = eqx.field(static=True)
    context_length: int = eqx.field(static=True)
    text_dim: int = eqx.field(static=True)
    freq_dim: int = eqx.field(static=True)
    eps: float = eqx.field(static=True)
    cross_attn_norm: bool = eqx.field(static=True)

    def __init__(
        self,
        latent_size: tuple[int, int, int] = (3, 8, 8),
        channels: int = 4,
        patch: tuple[int, int, int] = (1, 2, 2),
        depth: int = 2,
        width: int = 48,
        heads: int = 2,
        ffn_dim: int = 96,
        context_length: int = 8,
        text_dim: int = 32,
        freq_dim: int = 256,
        eps: float = 1e-6,
        cross_attn_norm: bool = True,
        stacked: bool = True,
        remat: BlockRemat = None,
        attention: AbstractAttention = DEFAULT_ATTENTION,
        sequence_strategy: SequenceStrategy = DEFAULT_SEQUENCE,
        *,
        key: PRNGKeyArray,
    ) -> None:
        sizes = dict(
            channels=channels,
            depth=depth,
            width=width,
            heads=heads,
            ffn_dim=ffn_dim,
            context_length=context_length,
            text_dim=text_dim,
            freq_dim=freq_dim,
        )
        _check_wan(sizes, tuple(patch), tuple(latent_size))
        if freq_dim % 2:
            raise ValueError(f"`freq_dim` must be even (cosines and sines), got {freq_dim}.")
        check_number("eps", eps, minimum=0, include_minimum=False)
        self.block_layout = block_layout(stacked, remat, ((0, depth),))
        self.attention_settings = AttentionSettings(attention, sequence_strategy)
        self.latent_size = (latent_size[0], latent_size[1], latent_size[2])
        self.channels = channels
        self.patch = (patch[0], patch[1], patch[2])
        self.depth = depth
        self.width = width
        self.heads = heads
        self.ffn_dim = ffn_dim
        self.context_length = context_length
        self.text_dim = text_dim
        self.freq_dim = freq_dim
        self.eps = eps
        self.cross_attn_norm = cross_attn_norm
        patch_dim = math.prod(self.patch) * channels
        k_lin, k_table, k_final, *k_blocks = (jax.random.fold_in(key, i) for i in range(3 + depth))
        # As diffusers draws its modulation tables: N(0, 1) / sqrt(width).
        self.final_table = jax.random.normal(k_table, (2, width), jnp.float32) / math.sqrt(width)
        embed, time_0, time_1, text_0, text_1 = init_linears(
            [
                (patch_dim, width),
                (freq_dim, width),
                (width, width),
                (text_dim, width),
                (width, width),
            ],
            key=k_lin,
        )
        self.patch_embed = embed
        self.time_mlp = (time_0, time_1)
        self.text_mlp = (text_0, text_1)
        self.time_proj = zero_linear(width, 6 * width, key=k_final)
        self.blocks = self.block_layout.hold(
            [_WanBlock(width, ffn_dim, eps, cross_attn_norm, key=k) for k in k_blocks]
        )
        self.final_proj = zero_linear(width, patch_dim, key=k_final)

    @property
    def block_groups(self) -> tuple[tuple[int, int], ...]:
        """One group: every block has one structure."""
        return ((0, self.depth),)

    @property
    def grid(self) -> tuple[int, int, int]:
        """The patch grid: `latent_size` over `patch`, axis by axis."""
        f, h, w = self.latent_size
        pf, ph, pw = self.patch
        return f // pf, h // ph, w // pw

    @classmethod
    def t2v_1_3b_config(cls) -> dict[str, Any]:
        """The constructor arguments of Wan 2.1-T2V-1.3B at 480 x 832, 81 frames.

        diffusers' `Wan-AI/Wan2.1-T2V-1.3B-Diffusers` transformer `config.json`: `num_layers
        30, num_attention_heads 12, attention_head_dim 128, ffn_dim 8960, text_dim 4096,
        freq_dim 256, patch_size [1, 2, 2], in_channels 16, qk_norm rms_norm_across_heads,
        cross_attn_norm true`; the latent of 81 frames at 480 x 832 (the VAE's 4x temporal
        and 8x spatial compression: 21 x 60 x 104 x 16); 512 text tokens.

        **Returns:**

        A dict of keyword arguments for `Wan`.
        """
        return dict(
            latent_size=(21, 60, 104),
            channels=16,
            patch=(1, 2, 2),
            depth=30,
            width=1536,
            heads=12,
            ffn_dim=8960,
            context_length=512,
            text_dim=4096,
        )

    @classmethod
    def t2v_14b_config(cls) -> dict[str, Any]:
        """The constructor arguments of Wan 2.1-T2V-14B at 720 x 1280, 81 frames.

        `Wan-AI/Wan2.1-T2V-14B-Diffusers`: `num_layers 40, num_attention_heads 40,
        attention_head_dim 128, ffn_dim 13824`, otherwise as the 1.3B; the latent of 81
        frames at 720 x 1280 is 21 x 90 x 160 x 16.

        **Returns:**

        A dict of keyword arguments for `Wan`.
        """
        return {
            **cls.t2v_1_3b_config(),
            "latent_size": (21, 90, 160),
            "depth": 40,
            "width": 5120,
            "heads": 40,
            "ffn_dim": 13824,
        }

    def rope(self) -> tuple[Float[Array, "S hd"], Float[Array, "S hd"]]:
        """The rotary features `(cos, sin)` of every patch token."""
        cos, sin = rope_tables(
            wan_position_ids(*self.grid), wan_rope_dims(self.width // self.heads)
        )
        return jnp.asarray(cos), jnp.asarray(sin)

    def _patchify(self, x: Float[Array, "F H W C"]) -> Float[Array, "N P"]:
        (gf, gh, gw), (pf, ph, pw) = self.grid, self.patch
        patches = x.reshape(gf, pf, gh, ph, gw, pw, self.channels).transpose(0, 2, 4, 1, 3, 5, 6)
        return patches.reshape(gf * gh * gw, pf * ph * pw * self.channels)

    def _unpatchify(self, tokens: Float[Array, "N P"]) -> Float[Array, "F H W C"]:
        (gf, gh, gw), (pf, ph, pw) = self.grid, self.patch
        x = tokens.reshape(gf, gh, gw, pf, ph, pw, self.channels).transpose(0, 3, 1, 4, 2, 5, 6)
        return x.reshape(*self.latent_size, self.channels)

    def __call__(
        self,
        x: Float[Array, "F H W C"],
        t: Float[Array, ""],
        cond: Float[Array, "context_length text_dim"],
    ) -> Float[Array, "F H W C"]:
        """The velocity at one unbatched video latent.

        **Arguments:**

        - `x`: the latent, `[*latent_size, channels]`, channels-last.
        - `t`: the time, a scalar in `[0, 1]` (`t = 1` is noise; diffusers' timestep is
            `1000 t`).
        - `cond`: the text states, `[context_length, text_dim]`.

        **Returns:**

        The velocity, `[*latent_size, channels]`, in the dtype of `x`.

        **Raises:**

        - `ValueError`: naming `x`, `t` or `cond` when its shape is wrong.
        """
        check_inputs(x, t, (*self.latent_size, self.channels))
        if cond.shape != (self.context_length, self.text_dim):
            raise ValueError(
                f"`cond` must have shape {(self.context_length, self.text_dim)}, got {cond.shape}."
            )
        outer = self._outer_weights()
        dtype = outer.patch_embed.weight.dtype
        temb = silu_mlp(outer.time_mlp, time_features(t, self.freq_dim).astype(dtype))
        time = dense(outer.time_proj, jax.nn.silu(temb))[0].reshape(6, self.width)
        hidden = jax.nn.gelu(dense(outer.text_mlp[0], cond.astype(dtype)), approximate=True)
        context = dense(outer.text_mlp[1], hidden)
        h = dense(outer.patch_embed, outer._patchify(x.astype(dtype)))
        rope = self.rope()

        def step(block: _WanBlock, h: Float[Array, "S D"]) -> Float[Array, "S D"]:
            return block(split_tokens(h), context, time, self.heads, rope, self.attention_settings)

        h = self.block_layout.run(self.blocks, step, h)
        mod = outer.final_table.astype(dtype) + temb
        out = dense(outer.final_proj, modulate(layer_norm(h, self.eps), mod[0], mod[1]))
        return self._unpatchify(out).astype(x.dtype)
