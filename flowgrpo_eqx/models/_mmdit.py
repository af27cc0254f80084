"""An SD3-style multimodal diffusion transformer (MMDiT) velocity network."""

import math
from typing import Any, TypedDict, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._misc import check_int
from ._dit import _dense, _layer_norm, _modulate, _sincos_2d, patchify, unpatchify
from ._mlp import (
    _init_linears,
    _uniform_arrays,
    _zero_linear,
    sinusoidal_time_features,
)


_TIME_FEATURES = 256


class MMDiTCondition(TypedDict):
    """The text conditioning of one example for `MMDiT`, as a text encoder gives it.

    A plain `dict` at runtime, so a batch of them is a dict of arrays with a leading row axis
    and `InputSpec(select=("context", "pooled"), ...)` picks it out of a row.

    - `context`: the per-token embeddings, `[context_length, context_dim]` (in SD3 the CLIP-L
        and CLIP-G penultimate states, zero-padded to 4096 and concatenated with T5-XXL's along
        the sequence: 77 + 77 tokens).
    - `pooled`: the pooled embedding, `[pooled_dim]` (in SD3 CLIP-L's and CLIP-G's pooled
        outputs concatenated: 768 + 1280 = 2048).
    """

    context: Float[Array, "context_length context_dim"]
    pooled: Float[Array, " pooled_dim"]


@final
class _Stream(eqx.Module):
    """One stream's weights (text or image) in one MMDiT block.

    `pre_only` keeps only what the joint attention needs from this stream (its adaLN shift and
    scale and its QKV): SD3's last block does this for the text stream, whose output is unused.

    **Arguments:**

    - `width`: the token width.
    - `heads`: the number of attention heads; divides `width`.
    - `mlp_ratio`: the MLP hidden width over `width`.
    - `pre_only`: whether to keep only the adaLN shift and scale and the QKV.
    - `key`: a JAX PRNG key for the initialisation.
    """

    modulation: eqx.nn.Linear
    qkv: eqx.nn.Linear
    proj: eqx.nn.Linear | None
    fc1: eqx.nn.Linear | None
    fc2: eqx.nn.Linear | None
    heads: int = eqx.field(static=True)
    pre_only: bool = eqx.field(static=True)

    def __init__(
        self, width: int, heads: int, mlp_ratio: int, pre_only: bool, *, key: PRNGKeyArray
    ) -> None:
        self.heads = heads
        self.pre_only = pre_only
        self.modulation = _zero_linear(width, (2 if pre_only else 6) * width, key=key)
        dims = [(width, 3 * width)]
        if not pre_only:
            dims += [(width, width), (width, mlp_ratio * width), (mlp_ratio * width, width)]
        linears = _init_linears(dims, key=key)
        self.qkv = linears[0]
        if pre_only:
            self.proj = self.fc1 = self.fc2 = None
        else:
            self.proj, self.fc1, self.fc2 = linears[1:]

    def qkv_heads(
        self, h: Float[Array, "S D"], mod: Float[Array, "M D"]
    ) -> Float[Array, "3 S heads head_dim"]:
        """The queries, keys and values of the adaLN-modulated tokens, split into heads."""
        seq, width = h.shape
        qkv = _dense(self.qkv, _modulate(_layer_norm(h), mod[0], mod[1]))
        return qkv.reshape(seq, 3, self.heads, width // self.heads).transpose(1, 0, 2, 3)

    def residual(
        self, h: Float[Array, "S D"], attended: Float[Array, "S D"], mod: Float[Array, "M D"]
    ) -> Float[Array, "S D"]:
        """The gated attention and MLP residuals added to the tokens (unchanged if pre-only)."""
        if self.proj is None or self.fc1 is None or self.fc2 is None:
            return h
        _, _, gate_a, shift_m, scale_m, gate_m = mod
        h = h + gate_a[None, :] * _dense(self.proj, attended)
        hidden = jax.nn.gelu(_dense(self.fc1, _modulate(_layer_norm(h), shift_m, scale_m)))
        out: Float[Array, "S D"] = h + gate_m[None, :] * _dense(self.fc2, hidden)
        return out


@final
class _MMDiTBlock(eqx.Module):
    """One MMDiT block: per-stream adaLN-Zero and weights, one joint attention over both.

    **Arguments:**

    - `width`: the token width.
    - `heads`: the number of attention heads; divides `width`.
    - `mlp_ratio`: the MLP hidden width over `width`.
    - `context_pre_only`: whether the text stream is pre-only (SD3's last block).
    - `key`: a JAX PRNG key for the initialisation.
    """

    context: _Stream
    image: _Stream

    def __init__(
        self,
        width: int,
        heads: int,
        mlp_ratio: int,
        context_pre_only: bool,
        *,
        key: PRNGKeyArray,
    ) -> None:
        k_context, k_image = jax.random.split(key)
        self.context = _Stream(width, heads, mlp_ratio, context_pre_only, key=k_context)
        self.image = _Stream(width, heads, mlp_ratio, False, key=k_image)

    def __call__(
        self,
        context: Float[Array, "L D"],
        image: Float[Array, "N D"],
        c: Float[Array, " D"],
    ) -> tuple[Float[Array, "L D"], Float[Array, "N D"]]:
        """Apply the block to both token streams, modulated by the vector `c`.

        **Arguments:**

        - `context`: the text tokens, `[L, D]`.
        - `image`: the image tokens, `[N, D]`.
        - `c`: the conditioning vector (time and pooled text), `[D]`.

        **Returns:**

        The updated `(context, image)` tokens; `context` is returned unchanged by a block whose
        text stream is pre-only.
        """
        width = c.shape[0]
        silu_c = jax.nn.silu(c)
        mod_context = self.context.modulation(silu_c).reshape(-1, width)
        mod_image = self.image.modulation(silu_c).reshape(-1, width)
        qkv = jnp.concatenate(
            [self.context.qkv_heads(context, mod_context), self.image.qkv_heads(image, mod_image)],
            axis=1,
        )
        attended = jax.nn.dot_product_attention(qkv[0], qkv[1], qkv[2])
        attended = attended.reshape(attended.shape[0], width)
        length = context.shape[0]
        return (
            self.context.residual(context, attended[:length], mod_context),
            self.image.residual(image, attended[length:], mod_image),
        )


@final
class MMDiT(eqx.Module):
    """An SD3-style multimodal diffusion transformer velocity network `v(x, t, cond)`.

    The MMDiT of Stable Diffusion 3 (Esser et al. 2024, arXiv:2403.03206) on one unbatched
    channels-last latent. Two token streams, each with its own weights:

    - image: the latent cut into `patch x patch` patches, each linearly embedded, plus fixed
        2D sin-cos positional features;
    - text: the context token embeddings, linearly mapped to the token width.

    Every block modulates each stream with its own adaLN-Zero (shift, scale, gate for the
    attention and for the MLP) from one conditioning vector `c = time_mlp(t) + pooled_mlp(
    pooled)`, projects each stream to queries, keys and values with its own weights, runs one
    joint attention (`jax.nn.dot_product_attention`) over the concatenated `[text; image]`
    sequence, and splits the result back for each stream's own output projection and GELU MLP.
    The final layer is adaLN on the image tokens and a linear map to `patch * patch *
    channels` per token, then unpatchify. The adaLN modulations and the final projection are
    zero-initialised, so every block is the identity at init and the initial velocity is
    exactly 0.

    As in SD3, the last block's text stream is pre-only: it supplies keys and values (and
    queries, whose outputs are unused) but has no output projection or MLP. What differs from
    SD3: the linear layers keep Equinox's default uniform init (SD3 uses Xavier uniform); the
    positional features are the `DiT`'s 2D sin-cos features for this grid, not cropped from
    SD3's 192 x 192 table; and there is no QK-norm,
    no MMDiT-X self-attention branch (SD3.5) and no skip-layer or ControlNet hooks.

    `cond` is an `MMDiTCondition` dict `{"context": [context_length, context_dim], "pooled":
    [pooled_dim]}`, as a text encoder gives it. If `vocab_size` is given, `cond` is instead a
    `[context_length]` array of token ids in `[0, vocab_size)` (ids outside are clipped) and
    the model embeds them itself: context = a token table plus a learned per-position table,
    and pooled = the mean over tokens of a second token table. This stands in for a text
    encoder in small tests and demos.

    `MMDiT.sd3_medium_config()` gives the SD3-Medium sizes (about 2.03 billion parameters).
    Computes in the dtype of its parameters and returns the dtype of `x`.

    **Arguments:**

    - `image_size`: the height and width of the (square) latent.
    - `channels`: the number of latent channels.
    - `patch`: the patch size; divides `image_size`.
    - `depth`: the number of blocks.
    - `width`: the token width; `None` means SD3's `64 * depth`.
    - `heads`: the number of attention heads, dividing `width`; `None` means SD3's `depth`.
    - `mlp_ratio`: the MLP hidden width over `width`.
    - `context_length`: the number of text tokens.
    - `context_dim`: the width of the text token embeddings.
    - `pooled_dim`: the width of the pooled text embedding.
    - `vocab_size`: `None` for float text embeddings as `cond`, or the number of token ids
        for token-id `cond`.
    - `key`: a JAX PRNG key for the initialisation.

    **Raises:**

    - `ValueError`: naming the argument, when a size is not a positive int, or `patch` does
        not divide `image_size`, or `heads` does not divide `width`.
    """

    patch_embed: eqx.nn.Linear
    pos_embed: Float[Array, "num_patches width"]
    context_embed: eqx.nn.Linear
    time_mlp: tuple[eqx.nn.Linear, eqx.nn.Linear]
    pooled_mlp: tuple[eqx.nn.Linear, eqx.nn.Linear]
    token_embed: Float[Array, "vocab_size context_dim"] | None
    token_pos_embed: Float[Array, "context_length context_dim"] | None
    pooled_token_embed: Float[Array, "vocab_size pooled_dim"] | None
    blocks: tuple[_MMDiTBlock, ...]
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
        *,
        key: PRNGKeyArray,
    ) -> None:
        check_int("depth", depth, 1)
        width = 64 * depth if width is None else width
        heads = depth if heads is None else heads
        for name, value in (
            ("image_size", image_size),
            ("channels", channels),
            ("patch", patch),
            ("width", width),
            ("heads", heads),
            ("mlp_ratio", mlp_ratio),
            ("context_length", context_length),
            ("context_dim", context_dim),
            ("pooled_dim", pooled_dim),
        ):
            check_int(name, value, 1)
        if vocab_size is not None:
            check_int("vocab_size", vocab_size, 1)
        if image_size % patch != 0:
            raise ValueError(f"`patch` ({patch}) must divide `image_size` ({image_size}).")
        if width % heads != 0:
            raise ValueError(f"`heads` ({heads}) must divide `width` ({width}).")
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

        grid = image_size // patch
        patch_dim = patch * patch * channels
        k_lin, k_emb, k_final, *k_blocks = (jax.random.fold_in(key, i) for i in range(3 + depth))
        (
            self.patch_embed,
            self.context_embed,
            time_0,
            time_1,
            pooled_0,
            pooled_1,
        ) = _init_linears(
            [
                (patch_dim, width),
                (context_dim, width),
                (_TIME_FEATURES, width),
                (width, width),
                (pooled_dim, width),
                (width, width),
            ],
            key=k_lin,
        )
        self.time_mlp = (time_0, time_1)
        self.pooled_mlp = (pooled_0, pooled_1)
        self.pos_embed = jax.device_put(_sincos_2d(grid, width))
        if vocab_size is None:
            self.token_embed = self.token_pos_embed = self.pooled_token_embed = None
        else:
            # Unit-variance embeddings (uniform on [-sqrt 3, sqrt 3)).
            unit = math.sqrt(3)
            self.token_embed, self.token_pos_embed, self.pooled_token_embed = _uniform_arrays(
                k_emb,
                [
                    ((vocab_size, context_dim), unit),
                    ((context_length, context_dim), unit),
                    ((vocab_size, pooled_dim), unit),
                ],
            )
        self.blocks = tuple(
            _MMDiTBlock(width, heads, mlp_ratio, i == depth - 1, key=k)
            for i, k in enumerate(k_blocks)
        )
        self.final_modulation = _zero_linear(width, 2 * width, key=k_final)
        self.final_proj = _zero_linear(width, patch_dim, key=k_final)

    @classmethod
    def sd3_medium_config(cls) -> dict[str, Any]:
        """The constructor arguments of SD3-Medium's MMDiT (about 2.03 billion parameters).

        Depth 24, so width `64 * 24 = 1536` and 24 heads; patch 2 on the 128 x 128 x 16
        latents of 1024 x 1024 images; 154 text tokens (77 CLIP + 77 T5) of width 4096;
        pooled width 2048; MLP ratio 4. Use as `MMDiT(**MMDiT.sd3_medium_config(), key=key)`,
        or under `eqx.filter_eval_shape` to inspect it without allocating it.

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
        )

    def _patchify(self, x: Float[Array, "H W C"]) -> Float[Array, "N P"]:
        return patchify(x, self.patch)

    def _unpatchify(self, tokens: Float[Array, "N P"]) -> Float[Array, "H W C"]:
        return unpatchify(tokens, self.patch, self.image_size, self.channels)

    def _text(
        self, cond: MMDiTCondition | Int[Array, " context_length"]
    ) -> tuple[Float[Array, "context_length context_dim"], Float[Array, " pooled_dim"]]:
        """The context tokens and pooled vector of `cond`, checked, in the parameters' dtype."""
        dtype = self.pos_embed.dtype
        if self.vocab_size is None:
            if not isinstance(cond, dict) or set(cond) != {"context", "pooled"}:
                raise ValueError(
                    "`cond` must be a dict with keys 'context' and 'pooled' (an MMDiTCondition), "
                    f"got {jax.tree_util.tree_structure(cond)}."
                )
            want = (self.context_length, self.context_dim)
            if cond["context"].shape != want:
                raise ValueError(
                    f"`cond['context']` must have shape {want}, got {cond['context'].shape}."
                )
            if cond["pooled"].shape != (self.pooled_dim,):
                raise ValueError(
                    f"`cond['pooled']` must have shape ({self.pooled_dim},), "
                    f"got {cond['pooled'].shape}."
                )
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
        want = (self.image_size, self.image_size, self.channels)
        if x.shape != want:
            raise ValueError(f"`x` must have shape {want}, got {x.shape}.")
        if t.shape != ():
            raise ValueError(f"`t` must be a scalar, got shape {t.shape}.")
        context_in, pooled = self._text(cond)
        dtype = self.pos_embed.dtype

        time_in = sinusoidal_time_features(t.astype(dtype), _TIME_FEATURES)
        c = self.time_mlp[1](jax.nn.silu(self.time_mlp[0](time_in)))
        c = c + self.pooled_mlp[1](jax.nn.silu(self.pooled_mlp[0](pooled)))

        # The positional features are fixed, as SD3's buffer.
        pos = jax.lax.stop_gradient(self.pos_embed)
        image = _dense(self.patch_embed, self._patchify(x.astype(dtype))) + pos
        context = _dense(self.context_embed, context_in)
        for block in self.blocks:
            context, image = block(context, image, c)

        shift, scale = jnp.split(self.final_modulation(jax.nn.silu(c)), 2)
        out = _dense(self.final_proj, _modulate(_layer_norm(image), shift, scale))
        return self._unpatchify(out).astype(x.dtype)
