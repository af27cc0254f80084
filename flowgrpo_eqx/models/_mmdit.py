"""The multimodal diffusion transformer (MMDiT) of Stable Diffusion 3 and 3.5."""

import math
from collections.abc import Sequence
from typing import Any, Literal, TypedDict, final

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._buffer import Buffer
from .._misc import check_int
from ._attention_settings import PLAIN_ATTENTION, AttentionSettings
from ._conditioning import joint_conditioning, joint_embedders
from ._init import uniform_arrays
from ._joint import BlockShape, JointAttention, Stream, check_text_shapes
from ._layers import (
    DEFAULT_ATTENTION,
    AbstractAttention,
    check_inputs,
    dense,
    final_layer,
    layer_norm,
    modulate,
    patchify,
    unpatchify,
    zero_final_layer,
)
from ._sequence import attend_joint, attend_self, split_tokens
from ._sequence_strategy import DEFAULT_SEQUENCE, SequenceStrategy
from ._stacked import AbstractAttentionModel, AbstractBlockLayout, BlockRemat, block_layout


class MMDiTCondition(TypedDict):
    """The text conditioning of one example for `MMDiT`, as a text encoder gives it.

    A plain `dict` at runtime, so a batch of them is a dict of arrays with a leading row axis
    and `InputSpec(select=("context", "pooled"), ...)` picks it out of a row.

    - `context`: the per-token embeddings, `[context_length, context_dim]` (in SD3 the CLIP-L
        and CLIP-G penultimate states, zero-padded to 4096 and concatenated with T5-XXL's along
        the sequence: 77 + 77 tokens in the reference code, 77 + 256 in diffusers' pipelines).
    - `pooled`: the pooled embedding, `[pooled_dim]` (in SD3 CLIP-L's and CLIP-G's pooled
        outputs concatenated: 768 + 1280 = 2048).
    """

    context: Float[Array, "context_length context_dim"]
    pooled: Float[Array, " pooled_dim"]


def _pos_table(
    table: int, base: int, width: int, first: int = 0, size: int | None = None
) -> npt.NDArray[np.float32]:
    """diffusers' `get_2d_sincos_pos_embed(width, table, base_size=base)`, `[table**2, width]`,
    or its square crop of rows and columns `first .. first + size - 1`, `[size**2, width]`
    (computed alone: the whole table of a large model is most of a gigabyte).

    Position `i` along an axis is `i / (table / base)` (float32); the first half of the
    features encodes the column, the second the row, each `[sin, cos]` of the position times
    `10^4 ** (-k / (width / 4))`, in float64, then float32. Row-major over `(row, column)`.
    """
    size = table - first if size is None else size
    scale = np.float32(table / base)
    pos = (np.arange(table, dtype=np.float32)[first : first + size] / scale).astype(np.float64)
    quarter = width // 4
    omega = 1.0 / 10_000.0 ** (np.arange(quarter, dtype=np.float64) / (width / 4.0))
    rows, cols = np.meshgrid(pos, pos, indexing="ij")

    def sincos(p: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        out = np.outer(p.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    return np.concatenate([sincos(cols), sincos(rows)], axis=1).astype(np.float32)


def pos_crop(table: int, grid: int) -> tuple[int, int]:
    """The first row (and column) and the size of the centred `grid x grid` crop."""
    return (table - grid) // 2, grid


@final
class _MMDiTBlock(eqx.Module):
    """One MMDiT block (diffusers' `JointTransformerBlock`).

    Per-stream adaLN-Zero and weights, one joint attention over both streams and, in SD3.5's
    dual-attention blocks, a second attention over the image tokens alone (`attn2`).

    **Arguments:**

    - `shape`: the block's dimensions.
    - `context_pre_only`: whether the text stream is pre-only (the last block).
    - `dual`: whether the block has the image-only second attention.
    - `key`: a JAX PRNG key for the initialisation.
    """

    context: Stream
    image: Stream
    attn2: JointAttention | None

    def __init__(
        self, shape: BlockShape, context_pre_only: bool, dual: bool = False, *, key: PRNGKeyArray
    ) -> None:
        k_context, k_image, k_attn2 = jax.random.split(key, 3)
        self.context = Stream(shape, context_pre_only, key=k_context)
        self.image = Stream(shape, False, dual, key=k_image)
        self.attn2 = (
            JointAttention(shape.width, shape.heads, shape.qk_norm, True, key=k_attn2)
            if dual
            else None
        )

    def __call__(
        self,
        context: Float[Array, "L D"],
        image: Float[Array, "N D"],
        c: Float[Array, " D"],
        attention: AttentionSettings = PLAIN_ATTENTION,
    ) -> tuple[Float[Array, "L D"], Float[Array, "N D"]]:
        """Apply the block to both token streams, modulated by the vector `c`.

        **Arguments:**

        - `context`: the text tokens, `[L, D]`.
        - `image`: the image tokens, `[N, D]`.
        - `c`: the conditioning vector (time and pooled text), `[D]`.
        - `attention`: how attention is computed.

        **Returns:**

        The updated `(context, image)` tokens; `context` is returned unchanged by a block whose
        text stream is pre-only.
        """
        silu_c = jax.nn.silu(c)
        mod_context = self.context.modulations(silu_c)
        mod_image = self.image.modulations(silu_c)
        # diffusers' order, image tokens first: the same attention, the same rounding.
        attended_image, attended_context = attend_joint(
            self.image.qkv(image, mod_image),
            self.context.qkv(context, mod_context),
            attention,
            text_first=False,
        )
        new_image = self.image.residual(image, attended_image, mod_image)
        if self.attn2 is not None and self.attn2.out is not None:
            image_in2 = modulate(layer_norm(image), mod_image[6], mod_image[7])
            q, k, v = self.attn2.qkv(image_in2)
            second = dense(self.attn2.out, attend_self(q, k, v, attention))
            new_image = new_image + mod_image[8][None, :] * second
        new_image = self.image.feed_forward(new_image, mod_image)
        new_context = self.context.update(context, attended_context, mod_context)
        return new_context, new_image


def block_groups(depth: int, dual: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """The `[start, stop)` runs of consecutive blocks of one structure.

    A block's structure is whether it has SD3.5's second attention and whether it is the
    last (pre-only text stream): SD3.5-Medium's 24 blocks make three groups (13 dual, 10
    plain, the last alone), SD3-Medium's two (23 plain, the last).
    """
    kinds = [(i in dual, i == depth - 1) for i in range(depth)]
    groups: list[tuple[int, int]] = []
    start = 0
    for i in range(1, depth + 1):
        if i == depth or kinds[i] != kinds[start]:
            groups.append((start, i))
            start = i
    return tuple(groups)


def _check_config(
    sizes: dict[str, Any],
    *,
    vocab_size: Any,
    qk_norm: Any,
    depth: int,
    dual: tuple[Any, ...],
    pos_embed_max_size: Any,
) -> None:
    """Raise a `ValueError` naming the `MMDiT` argument that does not fit the others."""
    for name, value in sizes.items():
        check_int(name, value, 1)
    if vocab_size is not None:
        check_int("vocab_size", vocab_size, 1)
    image_size, sample_size, patch = sizes["image_size"], sizes["sample_size"], sizes["patch"]
    width, heads = sizes["width"], sizes["heads"]
    if image_size % patch != 0:
        raise ValueError(f"`patch` ({patch}) must divide `image_size` ({image_size}).")
    if sample_size % patch != 0:
        raise ValueError(f"`patch` ({patch}) must divide `sample_size` ({sample_size}).")
    if width % heads != 0:
        raise ValueError(f"`heads` ({heads}) must divide `width` ({width}).")
    if width % 4 != 0:
        raise ValueError(f"`width` must be a multiple of 4, got {width}.")
    if qk_norm not in (None, "rms_norm"):
        raise ValueError(f"`qk_norm` must be None or 'rms_norm', got {qk_norm!r}.")
    if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < depth for i in dual):
        raise ValueError(
            f"`dual_attention_layers` must be block indices in [0, {depth}), got {dual!r}."
        )
    if pos_embed_max_size is not None:
        check_int("pos_embed_max_size", pos_embed_max_size, image_size // patch)


def _token_tables(
    vocab_size: int | None,
    context_length: int,
    context_dim: int,
    pooled_dim: int,
    key: PRNGKeyArray,
) -> tuple[Float[Array, "V C"] | None, Float[Array, "L C"] | None, Float[Array, "V P"] | None]:
    """The token, per-position and pooled token tables of token-id conditioning, or Nones."""
    if vocab_size is None:
        return None, None, None
    # Unit-variance embeddings (uniform on [-sqrt 3, sqrt 3)).
    unit = math.sqrt(3)
    token, position, pooled = uniform_arrays(
        key,
        [
            ((vocab_size, context_dim), unit),
            ((context_length, context_dim), unit),
            ((vocab_size, pooled_dim), unit),
        ],
    )
    return token, position, pooled


@final
class MMDiT(AbstractAttentionModel):
    """The multimodal diffusion transformer of SD3 and SD3.5 as a velocity network `v(x, t, cond)`.

    The MMDiT of Stable Diffusion 3 (Esser et al. 2024, arXiv:2403.03206) and 3.5 on one
    unbatched channels-last latent, computing what diffusers' `SD3Transformer2DModel`
    computes (`load_diffusers` loads its weights, `save_diffusers` writes them back). Two
    token streams, each with its own weights:

    - image: the latent cut into `patch x patch` patches, each linearly embedded (diffusers'
        strided convolution), plus fixed 2D sin-cos position features, cropped from the
        centre of a `pos_embed_max_size`-square table as diffusers does (a `Buffer`, as
        diffusers' buffer: `Trainer` never trains or weight-decays it);
    - text: the context token embeddings, linearly mapped to the token width.

    The conditioning vector is `c = time_mlp(features(1000 t)) + pooled_mlp(pooled)`, with
    diffusers' 256 sinusoidal time features (cosines first) of the timestep `1000 t`. Every
    block modulates each stream with its own adaLN-Zero (shift, scale, gate for the
    attention and for the tanh-GELU feed-forward, in diffusers' chunk order), projects each
    stream to queries, keys and values with its own weights (RMS-normalised per head when
    `qk_norm="rms_norm"`), runs one joint attention over both sequences, and splits the
    result back for each stream's own output projection and feed-forward. SD3.5's
    dual-attention blocks (`dual_attention_layers`) add a second, image-only attention with
    its own modulation. The last block's text stream is pre-only: it supplies keys and
    values but has no output projection or feed-forward. The final layer is a continuous
    adaLN (scale, then shift) on the image tokens and a linear map to `patch * patch *
    channels` per token, then unpatchify.

    A fresh model's adaLN modulations and final projection are zero, so every block is the
    identity at init and the initial velocity is exactly 0; the other linear layers keep
    Equinox's default uniform init and the query and key norms start at one.

    `cond` is an `MMDiTCondition` dict `{"context": [context_length, context_dim], "pooled":
    [pooled_dim]}`, as a text encoder gives it. If `vocab_size` is given, `cond` is instead a
    `[context_length]` array of token ids in `[0, vocab_size)` (ids outside are clipped) and
    the model embeds them itself: context = a token table plus a learned per-position table,
    and pooled = the mean over tokens of a second token table. This stands in for a text
    encoder in small tests and demos (such a model has no diffusers counterpart).

    **Memory.** The blocks are held stacked by default (`stacked=True`): each run of
    consecutive blocks of one structure (`block_groups`: SD3.5's dual-attention blocks, the
    plain ones, the last one) is one `_MMDiTBlock` whose arrays have a leading layer axis,
    and the call iterates over it with `jax.lax.scan`, so the compiled program and its compile
    time do not grow with depth. `remat` rematerialises each block in the backward pass, so
    only one block's activations are live at a time; `attention=ChunkedAttention(chunk)` (or
    `CudnnAttention()` on GPU) avoids materialising every attention score. None of these
    settings changes what the model computes; `with_settings` changes them on a built model.
    Inside a step on a data mesh (`jax.set_mesh`; `Trainer.update` sets it from the state's
    shardings), each block's weights are gathered whole as the scan reaches them
    (`gather_weights`), the FSDP pattern: the rows stay split and only weights travel.

    **Sequence parallelism.** Inside a step on a mesh with a `"sequence"` axis
    (`data_mesh(sequence=n)`; `Trainer.update` and `FlowRollout` set it), the image tokens
    are split over that axis between the blocks and the text tokens are whole on each of its
    devices; the joint attention runs as `sequence_strategy` says (`attend_joint`). The
    function computed is the same.

    `MMDiT.sd3_medium_config()` gives SD3-Medium (2,034,619,456 parameters with the cropped
    position table), `MMDiT.sd35_medium_config()` SD3.5-Medium. Computes in the dtype of its
    parameters and returns the dtype of `x`.

    **Arguments:**

    - `image_size`: the height and width of the (square) latent.
    - `channels`: the number of latent channels.
    - `patch`: the patch size; divides `image_size`.
    - `depth`: the number of blocks.
    - `width`: the token width, a multiple of 4; `None` means SD3's `64 * depth`.
    - `heads`: the number of attention heads, dividing `width`; `None` means SD3's `depth`.
    - `mlp_ratio`: the feed-forward hidden width over `width` (4 in diffusers).
    - `context_length`: the number of text tokens.
    - `context_dim`: the width of the text token embeddings.
    - `pooled_dim`: the width of the pooled text embedding.
    - `vocab_size`: `None` for float text embeddings as `cond`, or the number of token ids
        for token-id `cond`.
    - `qk_norm`: `None`, or `"rms_norm"` to RMS-normalise each head's queries and keys
        (SD3.5).
    - `dual_attention_layers`: the indices of the blocks with SD3.5's second, image-only
        attention.
    - `pos_embed_max_size`: the side of the position table the image's is cropped from
        (diffusers' `pos_embed_max_size`), at least `image_size // patch`; `None` for a
        table of exactly the image's grid.
    - `sample_size`: the latent size the position table is laid out for (diffusers'
        `sample_size`: a position step is `(sample_size / patch) / table side`); `None`
        means `image_size`.
    - `stacked`: whether the blocks are held stacked per group and scanned over (see
        above), or as one module per block (`blocks[i]` is block `i`).
    - `remat`: what each block keeps for the backward pass (`Remat`: `SaveNothing()`,
        `SaveQKV()`, `SaveAttention()`, `SaveDots()` or `None`), or a tuple with one of those
        per block (`BlockRemat`: e.g. `(SaveDots(),) * 12 + (SaveNothing(),) * 12` saves the
        products of the first 12 of 24 blocks and recomputes the rest).
    - `attention`: how attention is computed (`AbstractAttention`: `PlainAttention()`,
        `CudnnAttention()`, `ChunkedAttention(chunk)`, `SplashAttention(block)`,
        `AutoAttention(block)`).
    - `sequence_strategy`: `UlyssesSequence()` (default) or `RingSequence()`
        (`AbstractSequenceStrategy`): how attention runs when the current mesh's `"sequence"`
        axis splits the image tokens (see **Sequence parallelism**); unused without one.
    - `key`: a JAX PRNG key for the initialisation.

    **Raises:**

    - `ValueError`: naming the argument, when a size is not a positive int, or `patch` does
        not divide `image_size` or `sample_size`, or `heads` does not divide `width`, or
        `width` is not a multiple of 4, or `qk_norm` is not `None` or `"rms_norm"`, or a
        dual attention layer is not a block index, or `pos_embed_max_size` is less than
        `image_size // patch`, or `stacked` or `remat` is not one of its values, or
        `attention` is not an `AbstractAttention`, or `sequence_strategy` is not an
        `AbstractSequenceStrategy` (a name such as `"ring"` included:
        `sequence_strategy_from_name` reads one).
    """

    patch_embed: eqx.nn.Linear
    pos_embed: Buffer  # fixed, as diffusers' buffer: `Trainer` never trains it
    context_embed: eqx.nn.Linear
    time_mlp: tuple[eqx.nn.Linear, eqx.nn.Linear]
    pooled_mlp: tuple[eqx.nn.Linear, eqx.nn.Linear]
    token_embed: Float[Array, "vocab_size context_dim"] | None
    token_pos_embed: Float[Array, "context_length context_dim"] | None
    pooled_token_embed: Float[Array, "vocab_size pooled_dim"] | None
    blocks: tuple[_MMDiTBlock, ...]  # as `block_layout` holds them
    block_layout: AbstractBlockLayout
    attention_settings: AttentionSettings
    final_modulation: eqx.nn.Linear
    final_proj: eqx.nn.Linear
    image_size: int = eqx.field(static=True)
    channels: int = eqx.field(static=True)
    patch: int = eqx.field(static=True)
    depth: int = eqx.field(static=True)
    width: int = eqx.field(static=True)
    heads: int = eqx.field(static=True)
    mlp_ratio: int = eqx.field(static=True)
    context_length: int = eqx.field(static=True)
    context_dim: int = eqx.field(static=True)
    pooled_dim: int = eqx.field(static=True)
    vocab_size: int | None = eqx.field(static=True)
    qk_norm: Literal["rms_norm"] | None = eqx.field(static=True)
    dual_attention_layers: tuple[int, ...] = eqx.field(static=True)
    pos_embed_max_size: int | None = eqx.field(static=True)
    sample_size: int = eqx.field(static=True)

    def __init__(
        self,
        image_size: int = 16,
        channels: int = 4,
        patch: int = 2,
        depth: int = 2,
        width: int | None = None,
        heads: int | None = None,
        mlp_ratio: int = 4,
        context_length: int = 8,
        context_dim: int = 32,
        pooled_dim: int = 32,
        vocab_size: int | None = None,
        qk_norm: Literal["rms_norm"] | None = None,
        dual_attention_layers: Sequence[int] = (),
        pos_embed_max_size: int | None = None,
        sample_size: int | None = None,
        stacked: bool = True,
        remat: BlockRemat = None,
        attention: AbstractAttention = DEFAULT_ATTENTION,
        sequence_strategy: SequenceStrategy = DEFAULT_SEQUENCE,
        *,
        key: PRNGKeyArray,
    ) -> None:
        check_int("depth", depth, 1)
        dual = tuple(dual_attention_layers)
        width = 64 * depth if width is None else width
        heads = depth if heads is None else heads
        sample_size = image_size if sample_size is None else sample_size
        _check_config(
            dict(
                image_size=image_size,
                channels=channels,
                patch=patch,
                width=width,
                heads=heads,
                mlp_ratio=mlp_ratio,
                context_length=context_length,
                context_dim=context_dim,
                pooled_dim=pooled_dim,
                sample_size=sample_size,
            ),
            vocab_size=vocab_size,
            qk_norm=qk_norm,
            depth=depth,
            dual=dual,
            pos_embed_max_size=pos_embed_max_size,
        )
        self.block_layout = block_layout(stacked, remat, block_groups(depth, dual))
        self.attention_settings = AttentionSettings(attention, sequence_strategy)
        self.image_size = image_size
        self.channels = channels
        self.patch = patch
        self.depth = depth
        self.width = width
        self.heads = heads
        self.mlp_ratio = mlp_ratio
        self.context_length = context_length
        self.context_dim = context_dim
        self.pooled_dim = pooled_dim
        self.vocab_size = vocab_size
        self.qk_norm = qk_norm
        self.dual_attention_layers = tuple(sorted(set(dual)))
        self.pos_embed_max_size = pos_embed_max_size
        self.sample_size = sample_size
        self._init_arrays(key)

    def _init_arrays(self, key: PRNGKeyArray) -> None:
        """Draw every array of a fresh model (called once, from `__init__`)."""
        width, patch_dim = self.width, self.patch * self.patch * self.channels
        k_lin, k_emb, k_final, *k_blocks = (
            jax.random.fold_in(key, i) for i in range(3 + self.depth)
        )
        emb = joint_embedders(
            patch_dim, self.context_dim, self.pooled_dim, width, guidance=False, key=k_lin
        )
        self.patch_embed, self.context_embed, self.time_mlp, self.pooled_mlp, _ = emb
        self.pos_embed = Buffer(jax.device_put(self.position_table()))
        self.token_embed, self.token_pos_embed, self.pooled_token_embed = _token_tables(
            self.vocab_size, self.context_length, self.context_dim, self.pooled_dim, k_emb
        )
        shape = BlockShape(width, self.heads, self.mlp_ratio, self.qk_norm is not None)
        blocks = [
            _MMDiTBlock(shape, i == self.depth - 1, i in self.dual_attention_layers, key=k)
            for i, k in enumerate(k_blocks)
        ]
        self.blocks = self.block_layout.hold(blocks)
        self.final_modulation, self.final_proj = zero_final_layer(width, patch_dim, key=k_final)

    @property
    def block_groups(self) -> tuple[tuple[int, int], ...]:
        """The `[start, stop)` block indices of each group of one structure (see `stacked`)."""
        return block_groups(self.depth, self.dual_attention_layers)

    def position_table(self, full: bool = False) -> npt.NDArray[np.float32]:
        """The fixed position features, as diffusers' `PatchEmbed` computes them.

        **Arguments:**

        - `full`: `False` for this image's `[(image_size // patch)**2, width]` features (the
            centred crop of the table), `True` for the whole `[side**2, width]` table
            (`side` is `pos_embed_max_size`, or the image's grid without one).

        **Returns:**

        A float32 NumPy array.
        """
        grid = self.image_size // self.patch
        side = grid if self.pos_embed_max_size is None else self.pos_embed_max_size
        base = self.sample_size // self.patch
        if full:
            return _pos_table(side, base, self.width)
        top, size = pos_crop(side, grid)
        return _pos_table(side, base, self.width, top, size)

    @classmethod
    def sd3_medium_config(cls) -> dict[str, Any]:
        """The constructor arguments of SD3-Medium's MMDiT (2,034,619,456 parameters).

        diffusers' `stabilityai/stable-diffusion-3-medium-diffusers` transformer: depth 24,
        so width `64 * 24 = 1536` and 24 heads; patch 2 on the 128 x 128 x 16 latents of
        1024 x 1024 images, position table 192 (diffusers counts 2,028,328,000 parameters,
        without the position table; ours holds its `64 * 64 x 1536` crop); 154 text tokens
        (77 CLIP + 77 T5) of width 4096; pooled width 2048; MLP ratio 4. Use as
        `MMDiT(**MMDiT.sd3_medium_config(), key=key)`, or under `eqx.filter_eval_shape` to
        inspect it without allocating it.

        **Returns:**

        A dict of keyword arguments for `MMDiT`.
        """
        return dict(
            image_size=128,
            channels=16,
            patch=2,
            depth=24,
            width=1536,
            heads=24,
            mlp_ratio=4,
            context_length=154,
            context_dim=4096,
            pooled_dim=2048,
            vocab_size=None,
            qk_norm=None,
            dual_attention_layers=(),
            pos_embed_max_size=192,
            sample_size=128,
        )

    @classmethod
    def sd35_medium_config(cls) -> dict[str, Any]:
        """The constructor arguments of SD3.5-Medium's MMDiT.

        diffusers' `stabilityai/stable-diffusion-3.5-medium` transformer `config.json`:
        `num_layers 24, attention_head_dim 64, num_attention_heads 24, joint_attention_dim
        4096, caption_projection_dim 1536, pooled_projection_dim 2048, pos_embed_max_size
        384, dual_attention_layers 0-12, qk_norm rms_norm`, on 128 x 128 x 16 latents. diffusers
        counts 2,243,171,520 parameters (its position buffer not counted); ours adds the
        `64 * 64 x 1536` crop of the table. 333 text tokens (77 CLIP + 256 T5, diffusers'
        pipeline default).

        **Returns:**

        A dict of keyword arguments for `MMDiT`.
        """
        return {
            **cls.sd3_medium_config(),
            "context_length": 333,
            "qk_norm": "rms_norm",
            "dual_attention_layers": tuple(range(13)),
            "pos_embed_max_size": 384,
        }

    def _blocks(
        self, context: Float[Array, "L D"], image: Float[Array, "N D"], c: Float[Array, " D"]
    ) -> tuple[Float[Array, "L D"], Float[Array, "N D"]]:
        """Every block in turn, as `block_layout` runs them."""

        def step(
            block: _MMDiTBlock, carry: tuple[Float[Array, "L D"], Float[Array, "N D"]]
        ) -> tuple[Float[Array, "L D"], Float[Array, "N D"]]:
            context, image = carry
            return block(context, split_tokens(image), c, self.attention_settings)

        return self.block_layout.run(self.blocks, step, (context, image))

    def _patchify(self, x: Float[Array, "H W C"]) -> Float[Array, "N P"]:
        return patchify(x, self.patch)

    def _unpatchify(self, tokens: Float[Array, "N P"]) -> Float[Array, "H W C"]:
        return unpatchify(tokens, self.patch, self.image_size, self.channels)

    def _text(
        self, cond: MMDiTCondition | Int[Array, " context_length"]
    ) -> tuple[Float[Array, "context_length context_dim"], Float[Array, " pooled_dim"]]:
        """The context tokens and pooled vector of `cond`, checked, in the parameters' dtype."""
        dtype = self.pos_embed.value.dtype
        if self.vocab_size is None:
            if not isinstance(cond, dict) or set(cond) != {"context", "pooled"}:
                raise ValueError(
                    "`cond` must be a dict with keys 'context' and 'pooled' (an MMDiTCondition), "
                    f"got {jax.tree_util.tree_structure(cond)}."
                )
            check_text_shapes(dict(cond), self.context_length, self.context_dim, self.pooled_dim)
            return cond["context"].astype(dtype), cond["pooled"].astype(dtype)
        assert self.token_embed is not None and self.token_pos_embed is not None
        assert self.pooled_token_embed is not None
        if isinstance(cond, dict) or cond.shape != (self.context_length,):
            shape = None if isinstance(cond, dict) else cond.shape
            raise ValueError(
                f"`cond` must be token ids of shape ({self.context_length},), got {shape}."
            )
        context = jnp.take(self.token_embed, cond, axis=0, mode="clip") + self.token_pos_embed
        pooled = jnp.mean(jnp.take(self.pooled_token_embed, cond, axis=0, mode="clip"), axis=0)
        return context, pooled

    def __call__(
        self,
        x: Float[Array, "H W C"],
        t: Float[Array, ""],
        cond: MMDiTCondition | Int[Array, " context_length"],
    ) -> Float[Array, "H W C"]:
        """The velocity at one unbatched example.

        **Arguments:**

        - `x`: the latent, `[image_size, image_size, channels]`, channels-last.
        - `t`: the time, a scalar in `[0, 1]` (`t = 1` is noise).
        - `cond`: an `MMDiTCondition` (`context` `[context_length, context_dim]` and `pooled`
            `[pooled_dim]`), or if `vocab_size` is set, token ids `[context_length]`.

        **Returns:**

        The velocity, `[image_size, image_size, channels]`, in the dtype of `x`.

        **Raises:**

        - `ValueError`: naming `x`, `t` or `cond` when its shape or structure is wrong.
        """
        check_inputs(x, t, (self.image_size, self.image_size, self.channels))
        outer = self._outer_weights()
        context_in, pooled = outer._text(cond)
        dtype = outer.pos_embed.value.dtype
        c = joint_conditioning(outer.time_mlp, outer.pooled_mlp, t, pooled, dtype)
        # The positional features are fixed, as SD3's buffer.
        pos = jax.lax.stop_gradient(outer.pos_embed.value)
        image = dense(outer.patch_embed, outer._patchify(x.astype(dtype))) + pos
        context = dense(outer.context_embed, context_in)
        context, image = self._blocks(context, image, c)
        out = final_layer(outer.final_modulation, outer.final_proj, c, image)
        return self._unpatchify(out).astype(x.dtype)
