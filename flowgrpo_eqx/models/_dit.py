"""A small diffusion transformer (DiT) velocity network for images and token prompts."""

import math
from typing import Any, final

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._misc import check_int
from ._attention_settings import AttentionSettings
from ._init import init_linears, uniform_arrays, zero_linear
from ._layers import (
    DEFAULT_ATTENTION,
    QKV,
    WEIGHT_PRODUCT,
    AbstractAttention,
    check_inputs,
    dense,
    layer_norm,
    modulate,
    named,
    patchify,
    sinusoidal_time_features,
    unpatchify,
    zero_final_layer,
)
from ._stacked import AbstractAttentionModel, AbstractBlockLayout, BlockRemat, block_layout


_TIME_FEATURES = 64
_MLP_RATIO = 4


def _sincos_2d(grid: int, width: int) -> npt.NDArray[np.float32]:
    """Fixed 2D sin-cos features `[grid * grid, width]`, zero past `4 * (width // 4)` columns."""
    quarter = width // 4
    out = np.zeros((grid * grid, width), dtype=np.float32)
    if quarter == 0:
        return out
    freqs = 1.0 / (10_000.0 ** (np.arange(quarter, dtype=np.float64) / quarter))
    rows, cols = np.meshgrid(np.arange(grid), np.arange(grid), indexing="ij")
    row_args = rows.reshape(-1, 1) * freqs[None, :]
    col_args = cols.reshape(-1, 1) * freqs[None, :]
    out[:, : 4 * quarter] = np.concatenate(
        [np.sin(row_args), np.cos(row_args), np.sin(col_args), np.cos(col_args)], axis=1
    )
    return out


@final
class _DiTBlock(eqx.Module):
    """One adaLN-Zero transformer block: pre-LN self-attention and a GELU MLP.

    **Arguments:**

    - `width`: the token width.
    - `heads`: the number of attention heads; divides `width`.
    - `key`: a JAX PRNG key for the initialisation.
    """

    modulation: eqx.nn.Linear
    qkv: eqx.nn.Linear
    proj: eqx.nn.Linear
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear
    heads: int = eqx.field(static=True)

    def __init__(self, width: int, heads: int, *, key: PRNGKeyArray) -> None:
        self.heads = heads
        self.modulation = zero_linear(width, 6 * width, key=key)
        self.qkv, self.proj, self.fc1, self.fc2 = init_linears(
            [
                (width, 3 * width),
                (width, width),
                (width, _MLP_RATIO * width),
                (_MLP_RATIO * width, width),
            ],
            key=key,
        )

    def _attention(
        self, h: Float[Array, "S D"], attention: AttentionSettings
    ) -> Float[Array, "S D"]:
        seq, width = h.shape
        head_dim = width // self.heads
        assert self.qkv.bias is not None
        # Project straight to head-major `[3, heads, S, head_dim]` (no transposes of activations).
        weight = self.qkv.weight.reshape(3, self.heads, head_dim, width)
        bias = self.qkv.bias.reshape(3, self.heads, 1, head_dim)
        qkv = named(named(jnp.einsum("sd,thed->thse", h, weight), WEIGHT_PRODUCT) + bias, QKV)
        out = attention.attention.head_major(qkv).reshape(seq, width)
        projected: Float[Array, "S D"] = dense(self.proj, out)
        return projected

    def _mlp(self, h: Float[Array, "S D"]) -> Float[Array, "S D"]:
        out: Float[Array, "S D"] = dense(self.fc2, jax.nn.gelu(dense(self.fc1, h)))
        return out

    def __call__(
        self, h: Float[Array, "S D"], c: Float[Array, " D"], attention: AttentionSettings
    ) -> Float[Array, "S D"]:
        """Apply the block to the token sequence `h`, modulated by the vector `c`.

        **Arguments:**

        - `h`: the tokens, `[S, D]`.
        - `c`: the conditioning vector (time and prompt), `[D]`.
        - `attention`: how attention is computed.

        **Returns:**

        The updated tokens, `[S, D]`.
        """
        mod = named(self.modulation(jax.nn.silu(c)), WEIGHT_PRODUCT)
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = jnp.split(mod, 6)
        attended = self._attention(modulate(layer_norm(h), shift_a, scale_a), attention)
        h = h + gate_a[None, :] * attended
        h = h + gate_m[None, :] * self._mlp(modulate(layer_norm(h), shift_m, scale_m))
        return h


def _check_sizes(**sizes: Any) -> None:
    """Raise a `ValueError` naming the DiT argument whose size does not fit."""
    for name, value in sizes.items():
        check_int(name, value, 1)
    image_size, patch = sizes["image_size"], sizes["patch"]
    if image_size % patch != 0:
        raise ValueError(f"`patch` ({patch}) must divide `image_size` ({image_size}).")
    width, heads = sizes["width"], sizes["heads"]
    if width % heads != 0:
        raise ValueError(f"`heads` ({heads}) must divide `width` ({width}).")


@final
class DiT(AbstractAttentionModel):
    """A small diffusion transformer velocity network `v(x, t, cond)` for channels-last images.

    The image is cut into `patch x patch` patches, each linearly embedded and given a learned
    positional embedding (initialised to 2D sin-cos). The prompt's token ids are embedded (a
    token embedding plus a learned per-position embedding) and used twice:

    - flattened through an MLP into a vector that is added to the time embedding (sinusoidal
      features through an MLP); this vector drives the adaLN-Zero shift/scale/gate of every
      block and of the final layer;
    - prepended to the image tokens as extra sequence tokens ("in-context conditioning"), so
      self-attention can route per-position prompt information (which object goes where) to
      the spatial tokens. They are dropped at the output.

    Each block is pre-LN (no affine) self-attention and a GELU MLP (ratio 4), each with an
    adaLN-Zero residual gate. The final layer is adaLN then a linear map to `patch * patch *
    channels` per token, then unpatchify. The adaLN modulations and the final projection are
    zero-initialised, so the initial velocity is exactly 0.

    The last token id `vocab_size - 1` may serve as a null token for classifier-free guidance;
    it is an ordinary embedding row. Ids outside `[0, vocab_size)` are clipped into range.

    Computes in the dtype of its parameters and returns the dtype of `x`.

    **Memory.** `stacked=True` holds the blocks as one module whose arrays have a leading
    layer axis and iterates with `jax.lax.scan`, so the compiled program does not grow with
    `depth`; `remat` rematerialises each block for the backward pass (see `MMDiT`). Neither
    changes the function. The defaults (one module per block, no remat) keep the demo's
    programs, and so its results, exactly as they were.

    **Arguments:**

    - `image_size`: the height and width of the (square) image.
    - `channels`: the number of image channels.
    - `patch`: the patch size; divides `image_size`.
    - `width`: the token width.
    - `depth`: the number of transformer blocks.
    - `heads`: the number of attention heads; divides `width`.
    - `vocab_size`: the number of prompt token ids.
    - `prompt_length`: the number of prompt tokens.
    - `stacked`: whether the blocks are held stacked and scanned over (`blocks` is then one
        stacked block), or one module per block.
    - `remat`: what each block keeps for the backward pass, for every block or one per block
        (`BlockRemat`).
    - `attention`: how attention is computed (`AbstractAttention`, as for `MMDiT`);
        `PlainAttention()` (the default) runs as the DiT's own plain form, head-major
        throughout (`AbstractAttention.head_major`).
    - `key`: a JAX PRNG key for the initialisation.

    **Raises:**

    - `ValueError`: naming the argument, when a size is not a positive int, or `patch` does
        not divide `image_size`, or `heads` does not divide `width`, or `stacked` or
        `remat` is not one of its values, or `attention` is not an `AbstractAttention`.
    """

    patch_embed: eqx.nn.Linear
    pos_embed: Float[Array, "num_patches width"]
    time_mlp: tuple[eqx.nn.Linear, eqx.nn.Linear]
    token_embed: Float[Array, "vocab_size width"]
    prompt_pos_embed: Float[Array, "prompt_length width"]
    cond_mlp: tuple[eqx.nn.Linear, eqx.nn.Linear]
    blocks: tuple[_DiTBlock, ...]  # as `block_layout` holds them
    block_layout: AbstractBlockLayout
    attention_settings: AttentionSettings
    final_modulation: eqx.nn.Linear
    final_proj: eqx.nn.Linear
    image_size: int = eqx.field(static=True)
    channels: int = eqx.field(static=True)
    patch: int = eqx.field(static=True)
    width: int = eqx.field(static=True)
    depth: int = eqx.field(static=True)
    heads: int = eqx.field(static=True)
    vocab_size: int = eqx.field(static=True)
    prompt_length: int = eqx.field(static=True)

    def __init__(
        self,
        image_size: int = 16,
        channels: int = 3,
        patch: int = 2,
        width: int = 64,
        depth: int = 4,
        heads: int = 4,
        vocab_size: int = 8,
        prompt_length: int = 4,
        stacked: bool = False,
        remat: BlockRemat = None,
        attention: AbstractAttention = DEFAULT_ATTENTION,
        *,
        key: PRNGKeyArray,
    ) -> None:
        _check_sizes(
            image_size=image_size,
            channels=channels,
            patch=patch,
            width=width,
            depth=depth,
            heads=heads,
            vocab_size=vocab_size,
            prompt_length=prompt_length,
        )
        layout = block_layout(stacked, remat, ((0, depth),))
        self.image_size = image_size
        self.channels = channels
        self.patch = patch
        self.width = width
        self.depth = depth
        self.heads = heads
        self.vocab_size = vocab_size
        self.prompt_length = prompt_length
        self.block_layout = layout
        self.attention_settings = AttentionSettings(attention)

        # (Eager `jax.random` calls compile once per shape; `init_linears` and
        # `uniform_arrays` draw fixed-size chunks instead, so construction is quick.)
        grid = image_size // patch
        patch_dim = patch * patch * channels
        k_lin, k_emb, *k_blocks = (jax.random.fold_in(key, i) for i in range(2 + depth))
        (
            self.patch_embed,
            time_0,
            time_1,
            cond_0,
            cond_1,
        ) = init_linears(
            [
                (patch_dim, width),
                (_TIME_FEATURES, width),
                (width, width),
                (prompt_length * width, width),
                (width, width),
            ],
            key=k_lin,
        )
        self.time_mlp = (time_0, time_1)
        self.cond_mlp = (cond_0, cond_1)
        self.pos_embed = jax.device_put(_sincos_2d(grid, width))
        # Unit-variance embeddings (uniform on [-sqrt 3, sqrt 3)).
        self.token_embed, self.prompt_pos_embed = uniform_arrays(
            k_emb, [((vocab_size, width), math.sqrt(3)), ((prompt_length, width), math.sqrt(3))]
        )
        self.blocks = layout.hold([_DiTBlock(width, heads, key=k) for k in k_blocks])
        self.final_modulation, self.final_proj = zero_final_layer(width, patch_dim, key=key)

    @property
    def block_groups(self) -> tuple[tuple[int, int], ...]:
        """One group: every block has the same structure."""
        return ((0, self.depth),)

    def _blocks(self, h: Float[Array, "S D"], c: Float[Array, " D"]) -> Float[Array, "S D"]:
        """Every block in turn, as `block_layout` runs them."""

        def step(block: _DiTBlock, h: Float[Array, "S D"]) -> Float[Array, "S D"]:
            out: Float[Array, "S D"] = block(h, c, self.attention_settings)
            return out

        return self.block_layout.run(self.blocks, step, h)

    def _patchify(self, x: Float[Array, "H W C"]) -> Float[Array, "N P"]:
        return patchify(x, self.patch)

    def _unpatchify(self, tokens: Float[Array, "N P"]) -> Float[Array, "H W C"]:
        return unpatchify(tokens, self.patch, self.image_size, self.channels)

    def __call__(
        self,
        x: Float[Array, "H W C"],
        t: Float[Array, ""],
        cond: Int[Array, " L"],
    ) -> Float[Array, "H W C"]:
        """The velocity at one unbatched example.

        **Arguments:**

        - `x`: the image latent, `[image_size, image_size, channels]`, channels-last.
        - `t`: the time, a scalar in `[0, 1]` (`t = 1` is noise).
        - `cond`: the prompt's token ids, `[prompt_length]`, in `[0, vocab_size)`.

        **Returns:**

        The velocity, `[image_size, image_size, channels]`, in the dtype of `x`.

        **Raises:**

        - `ValueError`: naming `x`, `t` or `cond` when its shape is wrong.
        """
        check_inputs(x, t, (self.image_size, self.image_size, self.channels))
        if cond.shape != (self.prompt_length,):
            raise ValueError(f"`cond` must have shape ({self.prompt_length},), got {cond.shape}.")
        dtype = self.pos_embed.dtype

        # Conditioning vector: time embedding + pooled prompt embedding.
        time_in = sinusoidal_time_features(t.astype(dtype), _TIME_FEATURES)
        time_emb = self.time_mlp[1](jax.nn.silu(self.time_mlp[0](time_in)))
        prompt = jnp.take(self.token_embed, cond, axis=0, mode="clip") + self.prompt_pos_embed
        prompt_vec = self.cond_mlp[1](jax.nn.silu(self.cond_mlp[0](prompt.reshape(-1))))
        c = time_emb + prompt_vec

        # Sequence: in-context prompt tokens, then image patch tokens.
        image_tokens = dense(self.patch_embed, self._patchify(x.astype(dtype)))
        h = jnp.concatenate([prompt, image_tokens + self.pos_embed])
        h = self._blocks(h, c)
        h = h[self.prompt_length :]

        shift, scale = jnp.split(self.final_modulation(jax.nn.silu(c)), 2)
        out = dense(self.final_proj, modulate(layer_norm(h), shift, scale))
        return self._unpatchify(out).astype(x.dtype)
