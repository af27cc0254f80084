"""The FLUX.1 transformer (Black Forest Labs), as diffusers' `FluxTransformer2DModel` computes."""

from typing import Any, NotRequired, TypeAlias, TypedDict, final

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jaxtyping import Array, Float, PRNGKeyArray

from .._misc import check_bool, check_int
from ._attention_settings import AttentionSettings
from ._conditioning import joint_conditioning, joint_embedders
from ._init import init_linears, zero_linear
from ._joint import BlockShape, JointAttention, Stream, check_text_shapes
from ._layers import (
    DEFAULT_ATTENTION,
    AbstractAttention,
    check_inputs,
    dense,
    final_layer,
    layer_norm,
    modulate,
    zero_final_layer,
)
from ._rope import apply_rope, rope_tables
from ._sequence import (
    attend_joint,
    attend_self,
    join_streams,
    part_streams,
    sequence_devices,
    split_tokens,
    streams_interleave,
)
from ._sequence_strategy import DEFAULT_SEQUENCE, SequenceStrategy
from ._stacked import AbstractAttentionModel, AbstractBlockLayout, BlockRemat, block_layout


_PACK = 2  # FLUX's pipelines pack 2 x 2 latent pixels into one token


class FluxCondition(TypedDict):
    """The conditioning of one example for `Flux`, as FLUX's text encoders give it.

    A plain `dict` at runtime, so a batch of them is a dict of arrays with a leading row axis.

    - `context`: T5-XXL's per-token states, `[context_length, context_dim]` (512 tokens of
        width 4096 in diffusers' FLUX.1-dev pipeline, 256 in FLUX.1-schnell's).
    - `pooled`: CLIP-L's pooled output, `[pooled_dim]` (768).
    - `guidance`: the guidance scale, a scalar, for a guidance-distilled model
        (`guidance_embeds=True`, FLUX.1-dev) only: such a model takes the scale as an input
        (embedded as the time is) instead of running twice as classifier-free guidance does.
    """

    context: Float[Array, "context_length context_dim"]
    pooled: Float[Array, " pooled_dim"]
    guidance: NotRequired[Float[Array, ""]]


def flux_position_ids(context_length: int, rows: int, cols: int) -> npt.NDArray[np.float32]:
    """The position ids of FLUX's token sequence, text first, as diffusers' pipelines build them.

    Every text token is at `(0, 0, 0)` (`txt_ids` are zeros); the image token of packed row
    `r` and column `c` is at `(0, r, c)` (`_prepare_latent_image_ids`).

    **Arguments:**

    - `context_length`: the number of text tokens.
    - `rows`, `cols`: the packed image grid (the latent's height and width over 2).

    **Returns:**

    `[context_length + rows * cols, 3]` float32.
    """
    image = np.zeros((rows, cols, 3), dtype=np.float32)
    image[..., 1] = np.arange(rows, dtype=np.float32)[:, None]
    image[..., 2] = np.arange(cols, dtype=np.float32)[None, :]
    text = np.zeros((context_length, 3), dtype=np.float32)
    return np.concatenate([text, image.reshape(rows * cols, 3)])


_Rope: TypeAlias = tuple[
    tuple[Float[Array, "L head_dim"], Float[Array, "L head_dim"]],
    tuple[Float[Array, "N head_dim"], Float[Array, "N head_dim"]],
]
"""The rotary features `(cos, sin)` of the text tokens, then of the image tokens."""

_Tokens: TypeAlias = Float[Array, "S D"]
_Text: TypeAlias = Float[Array, "L D"]
_Image: TypeAlias = Float[Array, "N D"]
_Streams: TypeAlias = tuple[_Text, _Image]
"""The text tokens and the image tokens, as the blocks take and give them."""
_Vector: TypeAlias = Float[Array, " D"]
"""The conditioning vector `c` (time, guidance and pooled text)."""


@final
class _FluxDoubleBlock(eqx.Module):
    """One double-stream block (diffusers' `FluxTransformerBlock`).

    Each stream (text and image) has its own adaLN-Zero, attention weights with RMS
    qk-norm and tanh-GELU feed-forward, as an SD3.5 block's; one attention over the text
    tokens then the image tokens, with rotary positions.

    **Arguments:**

    - `shape`: the block's dimensions.
    - `key`: a JAX PRNG key for the initialisation.
    """

    context: Stream
    image: Stream

    def __init__(self, shape: BlockShape, *, key: PRNGKeyArray) -> None:
        k_context, k_image = jax.random.split(key)
        self.context = Stream(shape, False, key=k_context)
        self.image = Stream(shape, False, key=k_image)

    def __call__(
        self, context: _Text, image: _Image, c: _Vector, rope: _Rope, attention: AttentionSettings
    ) -> _Streams:
        silu_c = jax.nn.silu(c)
        mod_context = self.context.modulations(silu_c)
        mod_image = self.image.modulations(silu_c)
        text_rope, image_rope = rope
        attended_image, attended_context = attend_joint(
            apply_rope(self.image.qkv(image, mod_image), *image_rope),
            apply_rope(self.context.qkv(context, mod_context), *text_rope),
            attention,
            text_first=True,
        )
        new_image = self.image.update(image, attended_image, mod_image)
        new_context = self.context.update(context, attended_context, mod_context)
        return new_context, new_image


@final
class _FluxSingleBlock(eqx.Module):
    """One single-stream block (diffusers' `FluxSingleTransformerBlock`) over text and image.

    One adaLN-Zero (shift, scale, gate), then from the same modulated tokens an attention
    (RMS qk-norm, rotary positions, no output projection of its own) and a tanh-GELU
    hidden layer, concatenated and projected together (`proj_out`), gated, added.

    **Arguments:**

    - `shape`: the block's dimensions.
    - `key`: a JAX PRNG key for the initialisation.
    """

    modulation: eqx.nn.Linear
    attn: JointAttention
    proj_mlp: eqx.nn.Linear
    proj_out: eqx.nn.Linear

    def __init__(self, shape: BlockShape, *, key: PRNGKeyArray) -> None:
        width, hidden = shape.width, shape.mlp_ratio * shape.width
        k_attn, k_mlp = jax.random.split(key)
        self.modulation = zero_linear(width, 3 * width, key=key)
        self.attn = JointAttention(width, shape.heads, shape.qk_norm, False, key=k_attn)
        self.proj_mlp, self.proj_out = init_linears(
            [(width, hidden), (width + hidden, width)], key=k_mlp
        )

    def __call__(
        self, context: _Text, image: _Image, c: _Vector, rope: _Rope, attention: AttentionSettings
    ) -> _Streams:
        mod = dense(self.modulation, jax.nn.silu(c)[None])[0].reshape(3, c.shape[0])
        text_rope, image_rope = rope
        if streams_interleave(sequence_devices(), context.shape[0]):
            # One sequence, as diffusers runs it: one matmul per layer, and one weight
            # gradient however many devices split the tokens.
            tokens = join_streams(context, image)
            normed = modulate(layer_norm(tokens), mod[0], mod[1])
            cos, sin = (join_streams(*parts) for parts in zip(text_rope, image_rope, strict=True))
            qkv = apply_rope(self.attn.qkv(normed), cos, sin)
            attended = attend_self(qkv[0], qkv[1], qkv[2], attention)
            added = self._added(tokens, normed, attended, mod[2])
            return part_streams(added, context.shape[0])
        # A text the axis does not divide stays whole beside the split image tokens: each
        # stream's token-wise layers apart (the same weights).
        normed_context = modulate(layer_norm(context), mod[0], mod[1])
        normed_image = modulate(layer_norm(image), mod[0], mod[1])
        attended_image, attended_context = attend_joint(
            apply_rope(self.attn.qkv(normed_image), *image_rope),
            apply_rope(self.attn.qkv(normed_context), *text_rope),
            attention,
            text_first=True,
        )

        return (
            self._added(context, normed_context, attended_context, mod[2]),
            self._added(image, normed_image, attended_image, mod[2]),
        )

    def _added(self, tokens: _Tokens, normed: _Tokens, attended: _Tokens, gate: _Vector) -> _Tokens:
        """The tokens plus the gated projection of their attention and GELU hidden layer."""
        hidden = jax.nn.gelu(dense(self.proj_mlp, normed), approximate=True)
        added: _Tokens = tokens + gate[None, :] * dense(
            self.proj_out, jnp.concatenate([attended, hidden], axis=1)
        )
        return added


def _flux_groups(double_depth: int, single_depth: int) -> tuple[tuple[int, int], ...]:
    groups = [(0, double_depth), (double_depth, double_depth + single_depth)]
    return tuple((start, stop) for start, stop in groups if stop > start)


def _check_sizes(sizes: dict[str, Any], axes_dims: tuple[int, ...]) -> None:
    """Raise a `ValueError` naming the `Flux` argument that does not fit the others."""
    for name, value in sizes.items():
        check_int(name, value, 0 if name.endswith("depth") else 1)
    if sizes["double_depth"] + sizes["single_depth"] == 0:
        raise ValueError("`double_depth` and `single_depth` must not both be 0.")
    if sizes["height"] % _PACK or sizes["width_latent"] % _PACK:
        raise ValueError(
            "`image_size` must be even in both axes (FLUX packs 2 x 2 latent pixels into a "
            f"token), got {(sizes['height'], sizes['width_latent'])}."
        )
    width, heads = sizes["width"], sizes["heads"]
    if width % heads != 0:
        raise ValueError(f"`heads` ({heads}) must divide `width` ({width}).")
    if len(axes_dims) != 3 or any(
        isinstance(d, bool) or not isinstance(d, int) or d <= 0 or d % 2 for d in axes_dims
    ):
        raise ValueError(f"`axes_dims` must be three positive even ints, got {axes_dims!r}.")
    if sum(axes_dims) != width // heads:
        raise ValueError(
            f"`axes_dims` ({axes_dims!r}) must sum to the head width `width // heads` "
            f"({width // heads})."
        )


@final
class Flux(AbstractAttentionModel):
    """The FLUX.1 transformer as a velocity network `v(x, t, cond)`.

    FLUX.1 (Black Forest Labs, 2024) on one unbatched channels-last latent, computing what
    diffusers' `FluxTransformer2DModel` computes with the inputs its pipelines give it
    (`load_diffusers` loads its weights, `save_diffusers` writes them back):

    - the latent `[H, W, C]` packed into `(H / 2) (W / 2)` tokens of `4 C` features, each
        token's features channel-major over its 2 x 2 pixels (the pipelines'
        `_pack_latents`), linearly embedded (`x_embedder`);
    - the text tokens linearly embedded (`context_embedder`);
    - the conditioning vector `c = time_mlp(features(1000 t)) [+ guidance_mlp(features(1000
        g))] + pooled_mlp(pooled)`, with SD3's 256 sinusoidal features, the guidance term
        only in a guidance-distilled model (`guidance_embeds`, FLUX.1-dev);
    - rotary positions over three axes (`axes_dims`, 16 + 56 + 56 in FLUX.1): every text
        token at `(0, 0, 0)`, the image token of packed row `r` and column `c` at
        `(0, r, c)`;
    - `double_depth` double-stream blocks (per-stream adaLN-Zero, RMS qk-norm and
        feed-forward, one attention over text then image), then `single_depth`
        single-stream blocks over the concatenated tokens (attention and feed-forward in
        parallel from one modulation), then a continuous adaLN (scale, shift) on the image
        tokens, a linear map to `4 C` features per token and the unpacking.

    A fresh model's adaLN modulations and final projection are zero, so the initial velocity
    is exactly 0. The blocks are held as `MMDiT` holds them (`stacked`, `remat`, `attention`;
    `with_settings` changes them on a built model): the double and the single blocks are
    the two groups of `block_groups`. Computes in the dtype of its parameters and returns
    the dtype of `x`.

    `Flux.dev_config()` and `Flux.schnell_config()` give FLUX.1-dev and FLUX.1-schnell.

    **Arguments:**

    - `image_size`: the latent's height and width (an int for a square); both even.
    - `channels`: the latent channels (16 in FLUX.1).
    - `double_depth`: the number of double-stream blocks (diffusers' `num_layers`).
    - `single_depth`: the number of single-stream blocks (`num_single_layers`).
    - `width`: the token width (`num_attention_heads * attention_head_dim`).
    - `heads`: the number of attention heads, dividing `width`.
    - `mlp_ratio`: the feed-forward hidden width over `width` (4 in diffusers).
    - `context_length`: the number of text tokens.
    - `context_dim`: the width of the text token states (`joint_attention_dim`).
    - `pooled_dim`: the width of the pooled text embedding (`pooled_projection_dim`).
    - `guidance_embeds`: whether the model takes a guidance scale as an input
        (`cond["guidance"]`).
    - `axes_dims`: the rotary feature width of each position axis, even, summing to the
        head width (`axes_dims_rope`).
    - `stacked`, `remat`, `attention`, `sequence_strategy`: as `MMDiT`'s
        (a sequence axis splits the image tokens; the text stays whole, except in the
        single-stream blocks, where it is split with them when the axis divides its length).
    - `key`: a JAX PRNG key for the initialisation.

    **Raises:**

    - `ValueError`: naming the argument, when a size is not a positive int (a depth may be
        0, not both), a side of `image_size` is odd, `heads` does not divide `width`,
        `axes_dims` are not three positive even ints summing to the head width, or a layout
        or attention setting is not one of its values.
    """

    x_embed: eqx.nn.Linear
    context_embed: eqx.nn.Linear
    time_mlp: tuple[eqx.nn.Linear, eqx.nn.Linear]
    guidance_mlp: tuple[eqx.nn.Linear, eqx.nn.Linear] | None
    pooled_mlp: tuple[eqx.nn.Linear, eqx.nn.Linear]
    blocks: tuple[_FluxDoubleBlock | _FluxSingleBlock, ...]  # as `block_layout` holds them
    block_layout: AbstractBlockLayout
    attention_settings: AttentionSettings
    final_modulation: eqx.nn.Linear
    final_proj: eqx.nn.Linear
    image_size: tuple[int, int] = eqx.field(static=True)
    channels: int = eqx.field(static=True)
    double_depth: int = eqx.field(static=True)
    single_depth: int = eqx.field(static=True)
    width: int = eqx.field(static=True)
    heads: int = eqx.field(static=True)
    mlp_ratio: int = eqx.field(static=True)
    context_length: int = eqx.field(static=True)
    context_dim: int = eqx.field(static=True)
    pooled_dim: int = eqx.field(static=True)
    guidance_embeds: bool = eqx.field(static=True)
    axes_dims: tuple[int, int, int] = eqx.field(static=True)

    def __init__(
        self,
        image_size: int | tuple[int, int] = 16,
        channels: int = 4,
        double_depth: int = 1,
        single_depth: int = 1,
        width: int = 64,
        heads: int = 2,
        mlp_ratio: int = 4,
        context_length: int = 8,
        context_dim: int = 32,
        pooled_dim: int = 32,
        guidance_embeds: bool = False,
        axes_dims: tuple[int, int, int] = (8, 12, 12),
        stacked: bool = True,
        remat: BlockRemat = None,
        attention: AbstractAttention = DEFAULT_ATTENTION,
        sequence_strategy: SequenceStrategy = DEFAULT_SEQUENCE,
        *,
        key: PRNGKeyArray,
    ) -> None:
        height, latent_width = (
            (image_size, image_size) if isinstance(image_size, int) else image_size
        )
        axes = tuple(axes_dims)
        _check_sizes(
            dict(
                height=height,
                width_latent=latent_width,
                channels=channels,
                double_depth=double_depth,
                single_depth=single_depth,
                width=width,
                heads=heads,
                mlp_ratio=mlp_ratio,
                context_length=context_length,
                context_dim=context_dim,
                pooled_dim=pooled_dim,
            ),
            axes,
        )
        check_bool("guidance_embeds", guidance_embeds)
        self.block_layout = block_layout(stacked, remat, _flux_groups(double_depth, single_depth))
        self.attention_settings = AttentionSettings(attention, sequence_strategy)
        self.image_size = (height, latent_width)
        self.channels = channels
        self.double_depth = double_depth
        self.single_depth = single_depth
        self.width = width
        self.heads = heads
        self.mlp_ratio = mlp_ratio
        self.context_length = context_length
        self.context_dim = context_dim
        self.pooled_dim = pooled_dim
        self.guidance_embeds = guidance_embeds
        self.axes_dims = (axes[0], axes[1], axes[2])
        self._init_arrays(key)

    def _init_arrays(self, key: PRNGKeyArray) -> None:
        """Draw every array of a fresh model (called once, from `__init__`)."""
        width, token_dim = self.width, _PACK * _PACK * self.channels
        depth = self.double_depth + self.single_depth
        k_lin, k_final, *k_blocks = (jax.random.fold_in(key, i) for i in range(2 + depth))
        emb = joint_embedders(
            token_dim, self.context_dim, self.pooled_dim, width, self.guidance_embeds, key=k_lin
        )
        self.x_embed, self.context_embed, self.time_mlp, self.pooled_mlp, self.guidance_mlp = emb
        shape = BlockShape(width, self.heads, self.mlp_ratio, True)
        blocks: list[_FluxDoubleBlock | _FluxSingleBlock] = [
            _FluxDoubleBlock(shape, key=k) for k in k_blocks[: self.double_depth]
        ]
        blocks += [_FluxSingleBlock(shape, key=k) for k in k_blocks[self.double_depth :]]
        self.blocks = self.block_layout.hold(blocks)
        self.final_modulation, self.final_proj = zero_final_layer(width, token_dim, key=k_final)

    @property
    def block_groups(self) -> tuple[tuple[int, int], ...]:
        """The `[start, stop)` block indices of the double-stream and the single-stream blocks."""
        return _flux_groups(self.double_depth, self.single_depth)

    @property
    def grid(self) -> tuple[int, int]:
        """The packed token grid, `(height // 2, width // 2)` of the latent."""
        return self.image_size[0] // _PACK, self.image_size[1] // _PACK

    @classmethod
    def dev_config(cls) -> dict[str, Any]:
        """The constructor arguments of FLUX.1-dev's transformer at 1024 x 1024.

        diffusers' `black-forest-labs/FLUX.1-dev` transformer `config.json`: `num_layers 19,
        num_single_layers 38, attention_head_dim 128, num_attention_heads 24,
        joint_attention_dim 4096, pooled_projection_dim 768, in_channels 64 (16 latent
        channels packed 2 x 2), guidance_embeds true, axes_dims_rope [16, 56, 56]`; the
        128 x 128 x 16 latent of a 1024 x 1024 image; 512 T5 tokens (the pipeline's
        `max_sequence_length`). Use as `Flux(**Flux.dev_config(), key=key)`, or under
        `eqx.filter_eval_shape`; pass another `image_size` for other resolutions.

        **Returns:**

        A dict of keyword arguments for `Flux`.
        """
        return dict(
            image_size=(128, 128),
            channels=16,
            double_depth=19,
            single_depth=38,
            width=3072,
            heads=24,
            mlp_ratio=4,
            context_length=512,
            context_dim=4096,
            pooled_dim=768,
            guidance_embeds=True,
            axes_dims=(16, 56, 56),
        )

    @classmethod
    def schnell_config(cls) -> dict[str, Any]:
        """The constructor arguments of FLUX.1-schnell's transformer at 1024 x 1024.

        FLUX.1-dev's architecture without the guidance embedding (`guidance_embeds false`),
        with 256 T5 tokens (its pipeline's `max_sequence_length` limit).

        **Returns:**

        A dict of keyword arguments for `Flux`.
        """
        return {**cls.dev_config(), "guidance_embeds": False, "context_length": 256}

    def rope(self) -> tuple[Float[Array, "S head_dim"], Float[Array, "S head_dim"]]:
        """The rotary features `(cos, sin)` of the whole sequence (text, then image)."""
        ids = flux_position_ids(self.context_length, *self.grid)
        cos, sin = rope_tables(ids, self.axes_dims)
        return jnp.asarray(cos), jnp.asarray(sin)

    def _blocks(self, context: _Text, image: _Image, c: _Vector) -> _Streams:
        """Every block in turn, as `block_layout` runs them."""
        cos, sin = self.rope()
        length = self.context_length
        rope = ((cos[:length], sin[:length]), (cos[length:], sin[length:]))

        def step(block: _FluxDoubleBlock | _FluxSingleBlock, carry: _Streams) -> _Streams:
            context, image = carry
            return block(context, split_tokens(image), c, rope, self.attention_settings)

        return self.block_layout.run(self.blocks, step, (context, image))

    def _pack(self, x: Float[Array, "H W C"]) -> Float[Array, "N P"]:
        rows, cols = self.grid
        packed = x.reshape(rows, _PACK, cols, _PACK, self.channels).transpose(0, 2, 4, 1, 3)
        return packed.reshape(rows * cols, self.channels * _PACK * _PACK)

    def _unpack(self, tokens: Float[Array, "N P"]) -> Float[Array, "H W C"]:
        rows, cols = self.grid
        x = tokens.reshape(rows, cols, self.channels, _PACK, _PACK).transpose(0, 3, 1, 4, 2)
        return x.reshape(*self.image_size, self.channels)

    def _text(
        self, cond: FluxCondition
    ) -> tuple[
        Float[Array, "context_length context_dim"],
        Float[Array, " pooled_dim"],
        Float[Array, ""] | None,
    ]:
        """The context, pooled vector and guidance scale of `cond`, checked, in the parameters'
        dtype."""
        dtype = self.x_embed.weight.dtype
        keys = {"context", "pooled"} | ({"guidance"} if self.guidance_embeds else set())
        if not isinstance(cond, dict) or set(cond) != keys:
            raise ValueError(
                f"`cond` must be a dict with keys {sorted(keys)} (a FluxCondition"
                f"{', with guidance: guidance_embeds is set' if self.guidance_embeds else ''}), "
                f"got {jax.tree_util.tree_structure(cond)}."
            )
        check_text_shapes(dict(cond), self.context_length, self.context_dim, self.pooled_dim)
        guidance = None
        if self.guidance_embeds:
            if jnp.shape(cond["guidance"]) != ():
                raise ValueError(
                    f"`cond['guidance']` must be a scalar, got shape {jnp.shape(cond['guidance'])}."
                )
            guidance = jnp.asarray(cond["guidance"]).astype(dtype)
        return cond["context"].astype(dtype), cond["pooled"].astype(dtype), guidance

    def __call__(
        self, x: Float[Array, "H W C"], t: Float[Array, ""], cond: FluxCondition
    ) -> Float[Array, "H W C"]:
        """The velocity at one unbatched example.

        **Arguments:**

        - `x`: the latent, `[*image_size, channels]`, channels-last.
        - `t`: the time, a scalar in `[0, 1]` (`t = 1` is noise; diffusers' timestep is
            `1000 t`).
        - `cond`: a `FluxCondition`: `context` `[context_length, context_dim]`, `pooled`
            `[pooled_dim]`, and `guidance` (a scalar) exactly when `guidance_embeds`.

        **Returns:**

        The velocity, `[*image_size, channels]`, in the dtype of `x`.

        **Raises:**

        - `ValueError`: naming `x`, `t` or `cond` when its shape or structure is wrong.
        """
        check_inputs(x, t, (*self.image_size, self.channels))
        outer = self._outer_weights()
        context_in, pooled, guidance = outer._text(cond)
        dtype = outer.x_embed.weight.dtype
        c = joint_conditioning(
            outer.time_mlp, outer.pooled_mlp, t, pooled, dtype, outer.guidance_mlp, guidance
        )
        image = dense(outer.x_embed, outer._pack(x.astype(dtype)))
        context = dense(outer.context_embed, context_in)
        _, image = self._blocks(context, image, c)
        out = final_layer(outer.final_modulation, outer.final_proj, c, image)
        return self._unpack(out).astype(x.dtype)
