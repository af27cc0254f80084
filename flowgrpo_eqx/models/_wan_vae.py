"""Wan 2.1's video autoencoder, as diffusers' `AutoencoderKLWan` computes it.

The module tree mirrors diffusers' state dict (`_mirror.py`): the leaf at
`decoder.up_blocks[1].upsamplers[0].time_conv.weight` is the tensor
`decoder.up_blocks.1.upsamplers.0.time_conv.weight`, and every weight keeps torch's layout (a
causal 3D convolution's `[out, in, kt, kh, kw]`, a spatial resampling's `[out, in, kh, kw]`, an
RMS norm's `gamma` `[C, 1, 1, 1]`), so a checkpoint loads by its keys alone. The videos are
channels-last, `[F, H, W, C]`.

Time is causal. Every 3-tap convolution over time reads its frame and the two before it, zeros
before the first frame. The temporal resampling treats the first frame apart: the encoder's
time downsampling keeps frame 0 and convolves (stride 2, no padding) the windows ending at
frames 2, 4, ...; the decoder's time upsampling passes frame 0 through and turns each later
frame into two with a causal convolution over the later frames alone (frame 0 is not in their
past). diffusers computes this chunk by chunk, carrying each convolution's last input frames
in a cache: the encoder reads the first frame alone, then four frames at a time, and the
decoder one latent frame at a time. Every other step is per frame (RMS norms, the attention,
the spatial resampling), so that is the function of the whole sequence computed here in one
pass, and `decode(latent, chunk=n)` (or `encode`'s) computes it again chunk by chunk with the
same cache, holding one chunk's activations at a time.
"""

from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeAlias, final

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from .._inputs import AbstractAutoEncoder
from .._misc import check_int, check_number
from ._attention_settings import AttentionSettings, attend_to
from ._autoencoder import Conv, posterior_moments, sample_posterior
from ._images import check_image
from ._init import ones
from ._layers import DEFAULT_ATTENTION, AbstractAttention
from ._mirror import uniform_init


_PAST = 2  # the past frames of a 3-tap causal convolution (diffusers' CACHE_T)
_NORM_EPS = 1e-12  # torch.nn.functional.normalize's
_FRAME_GROUP = 4  # the frames diffusers' encoder reads per step after the first

Cache: TypeAlias = tuple[Any, ...]
"""What a module carries from one chunk of frames to the next: nested tuples of the last input
frames of each causal convolution (`[2, H, W, C]`, the strided time downsampling's `[1, H, W,
C]`), `()` for a module without one."""

ResampleMode: TypeAlias = Literal["upsample2d", "upsample3d", "downsample2d", "downsample3d"]

# diffusers' `AutoencoderKLWan` defaults: `Wan-AI/Wan2.1-T2V-1.3B-Diffusers`'s vae/config.json.
_WAN21_MEAN = (
    -0.7571,
    -0.7089,
    -0.9113,
    0.1075,
    -0.1745,
    0.9653,
    -0.1517,
    1.5508,
    0.4134,
    -0.0715,
    0.5517,
    -0.3632,
    -0.1922,
    -0.9497,
    0.2503,
    -0.2921,
)
_WAN21_STD = (
    2.8184,
    1.4541,
    2.3275,
    2.6558,
    1.2196,
    1.7708,
    2.6052,
    2.0743,
    3.2687,
    2.1526,
    2.8652,
    1.5579,
    1.6382,
    1.1253,
    2.8251,
    1.9160,
)


@final
class CausalConv3d(eqx.Module):
    """diffusers' `WanCausalConv3d` on a channels-last video: valid in time (the caller puts the
    past frames in front, `causal`), padded in space to keep the size, with a torch-layout
    kernel.

    **Arguments:**

    - `in_channels`, `out_channels`: the channels.
    - `kernel`: the kernel's `(kt, kh, kw)`: `(3, 3, 3)`, `(1, 1, 1)` or `(3, 1, 1)`.
    - `key`: a JAX PRNG key for the initialisation.
    """

    weight: Float[Array, "out in kt kh kw"]
    bias: Float[Array, " out"]

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel: tuple[int, int, int],
        *,
        key: PRNGKeyArray,
    ) -> None:
        k_w, k_b = jax.random.split(key)
        fan_in = in_channels * kernel[0] * kernel[1] * kernel[2]
        self.weight = uniform_init(k_w, (out_channels, in_channels, *kernel), fan_in)
        self.bias = uniform_init(k_b, (out_channels,), fan_in)

    def __call__(
        self, x: Float[Array, "T H W I"], time_stride: int = 1
    ) -> Float[Array, "T2 H W O"]:
        kh, kw = self.weight.shape[3], self.weight.shape[4]
        out = jax.lax.conv_general_dilated(
            x[None],
            self.weight.astype(x.dtype),
            window_strides=(time_stride, 1, 1),
            padding=((0, 0), (kh // 2, kh // 2), (kw // 2, kw // 2)),
            dimension_numbers=("NDHWC", "OIDHW", "NDHWC"),
        )[0]
        result: Float[Array, "T2 H W O"] = out + self.bias.astype(x.dtype)[None, None, None, :]
        return result

    def causal(
        self, x: Float[Array, "T H W I"], past: Float[Array, "2 H W I"] | None
    ) -> tuple[Float[Array, "T H W O"], Float[Array, "2 H W I"]]:
        """The 3-tap causal convolution of `x` after `past`, and the last two frames read.

        **Arguments:**

        - `x`: the frames.
        - `past`: the two frames before them; `None` for zeros (the video's start).

        **Returns:**

        `(out, past)`: one output frame per frame of `x`, and the past of the next frames.
        """
        if past is None:
            past = jnp.zeros((_PAST, *x.shape[1:]), x.dtype)
        joined = jnp.concatenate([past, x])
        return self(joined), joined[-_PAST:]


@final
class RMSNorm(eqx.Module):
    """diffusers' `WanRMS_norm` without a bias, over the channels: `x / max(|x|, 1e-12) *
    sqrt(C) * gamma`, computed in float32. `gamma` keeps torch's shape, `[C, 1, 1, 1]`
    (`images=False`) or `[C, 1, 1]` (`images=True`, the attention's).

    **Arguments:**

    - `channels`: the channels.
    - `images`: the layout of `gamma`.
    """

    gamma: Float[Array, "C ..."]

    def __init__(self, channels: int, images: bool) -> None:
        shape = (channels, 1, 1) if images else (channels, 1, 1, 1)
        self.gamma = ones(shape)

    def __call__(self, x: Float[Array, "*S C"]) -> Float[Array, "*S C"]:
        x32 = x.astype(jnp.float32)
        norm = jnp.sqrt(jnp.sum(jnp.square(x32), axis=-1, keepdims=True))
        channels = x.shape[-1]
        gamma = self.gamma.astype(jnp.float32).reshape((1,) * (x.ndim - 1) + (channels,))
        out: Float[Array, "*S C"] = (
            x32 / jnp.maximum(norm, _NORM_EPS) * (channels**0.5) * gamma
        ).astype(x.dtype)
        return out


@final
class ResidualBlock(eqx.Module):
    """diffusers' `WanResidualBlock`: two RMS-norm-SiLU-causal-convolutions and a residual
    (through a 1 x 1 x 1 convolution when the channels change).

    **Arguments:**

    - `in_channels`, `out_channels`: the channels.
    - `key`: a JAX PRNG key for the initialisation.
    """

    norm1: RMSNorm
    conv1: CausalConv3d
    norm2: RMSNorm
    conv2: CausalConv3d
    conv_shortcut: CausalConv3d | None

    def __init__(self, in_channels: int, out_channels: int, *, key: PRNGKeyArray) -> None:
        k1, k2, k3 = jax.random.split(key, 3)
        self.norm1 = RMSNorm(in_channels, images=False)
        self.conv1 = CausalConv3d(in_channels, out_channels, (3, 3, 3), key=k1)
        self.norm2 = RMSNorm(out_channels, images=False)
        self.conv2 = CausalConv3d(out_channels, out_channels, (3, 3, 3), key=k2)
        self.conv_shortcut = (
            CausalConv3d(in_channels, out_channels, (1, 1, 1), key=k3)
            if in_channels != out_channels
            else None
        )

    def step(
        self, x: Float[Array, "T H W I"], cache: Cache | None
    ) -> tuple[Float[Array, "T H W O"], Cache]:
        """The block on frames `x` after those `cache` carries (`None`: the video's start).

        **Returns:**

        `(out, cache)`: the frames and the cache for the next ones.
        """
        past1, past2 = (None, None) if cache is None else cache
        shortcut = x if self.conv_shortcut is None else self.conv_shortcut(x)
        h, past1 = self.conv1.causal(jax.nn.silu(self.norm1(x)), past1)
        h, past2 = self.conv2.causal(jax.nn.silu(self.norm2(h)), past2)
        out: Float[Array, "T H W O"] = shortcut + h
        return out, (past1, past2)


@final
class AttentionBlock(eqx.Module):
    """diffusers' `WanAttentionBlock`: within each frame, every pixel attends to every pixel
    (one head as wide as the channels, an RMS norm first, 1 x 1 convolutions for the queries,
    keys and values and the output, the input added back).

    **Arguments:**

    - `channels`: the channels.
    - `key`: a JAX PRNG key for the initialisation.
    """

    norm: RMSNorm
    to_qkv: Conv
    proj: Conv

    def __init__(self, channels: int, *, key: PRNGKeyArray) -> None:
        k_qkv, k_proj = jax.random.split(key)
        self.norm = RMSNorm(channels, images=True)
        self.to_qkv = Conv(channels, 3 * channels, 1, key=k_qkv)
        self.proj = Conv(channels, channels, 1, key=k_proj)

    def __call__(
        self, x: Float[Array, "T H W C"], attention: AttentionSettings
    ) -> Float[Array, "T H W C"]:
        _, h, w, c = x.shape

        def frame(image: Float[Array, "H W C"]) -> Float[Array, "H W C"]:
            qkv = self.to_qkv(self.norm(image)).reshape(h * w, 3 * c)
            q, k, v = (qkv[:, i * c : (i + 1) * c][:, None, :] for i in range(3))
            return self.proj(attend_to(q, k, v, attention).reshape(h, w, c))

        out: Float[Array, "T H W C"] = jax.vmap(frame)(x) + x
        return out


@final
class Resample(eqx.Module):
    """diffusers' `WanResample`: a spatial 2x step (`downsample2d`: zero-padded on the right
    and bottom, a stride-2 3 x 3 convolution; `upsample2d`: nearest 2x, a 3 x 3 convolution to
    half the channels), for the `3d` modes with a step in time too (`time_conv`: after the
    spatial step, a stride-2 convolution over frames 0, 2, 4, ... keeping frame 0; before it,
    a causal convolution to twice the channels that makes two frames of each frame after
    frame 0).

    **Arguments:**

    - `channels`: the input channels.
    - `mode`: `"downsample2d"`, `"downsample3d"`, `"upsample2d"` or `"upsample3d"`.
    - `key`: a JAX PRNG key for the initialisation.
    """

    resample: tuple[None, Conv]
    time_conv: CausalConv3d | None
    mode: ResampleMode = eqx.field(static=True)

    def __init__(self, channels: int, mode: ResampleMode, *, key: PRNGKeyArray) -> None:
        k_conv, k_time = jax.random.split(key)
        up = mode.startswith("up")
        out = channels // 2 if up else channels
        # Index 1, as torch's `nn.Sequential(ZeroPad2d | Upsample, Conv2d)` names it.
        self.resample = (None, Conv(channels, out, 3, stride=1 if up else 2, key=k_conv))
        if mode == "upsample3d":
            self.time_conv = CausalConv3d(channels, 2 * channels, (3, 1, 1), key=k_time)
        elif mode == "downsample3d":
            self.time_conv = CausalConv3d(channels, channels, (3, 1, 1), key=k_time)
        else:
            self.time_conv = None
        self.mode = mode

    def _spatial(self, x: Float[Array, "T H W C"]) -> Float[Array, "T H2 W2 O"]:
        if self.mode.startswith("up"):
            x = jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)
        out: Float[Array, "T H2 W2 O"] = jax.vmap(self.resample[1])(x)
        return out

    def step(
        self, x: Float[Array, "T H W C"], cache: Cache | None
    ) -> tuple[Float[Array, "T2 H2 W2 O"], Cache]:
        """The step on frames `x` after those `cache` carries (`None`: the video's start,
        whose first frame is treated apart).

        **Returns:**

        `(out, cache)`: the frames and the cache for the next ones.
        """
        if self.time_conv is None:
            return self._spatial(x), ()
        start = cache is None
        if self.mode == "upsample3d":
            head, rest = (x[:1], x[1:]) if start else (x[:0], x)
            past = jnp.zeros((_PAST, *x.shape[1:]), x.dtype) if cache is None else cache[0]
            joined = jnp.concatenate([past, rest])
            if rest.shape[0]:
                doubled = self.time_conv(joined)
                r, h, w, c2 = doubled.shape
                pairs = doubled.reshape(r, h, w, 2, c2 // 2).transpose(0, 3, 1, 2, 4)
                x = jnp.concatenate([head, pairs.reshape(2 * r, h, w, c2 // 2)])
            else:
                x = head
            return self._spatial(x), (joined[-_PAST:],)
        x = self._spatial(x)
        if cache is None:
            head, past, rest = x[:1], x[:1], x[1:]
        else:
            head, past, rest = x[:0], cache[0], x
        joined = jnp.concatenate([past, rest])
        if rest.shape[0]:
            x = jnp.concatenate([head, self.time_conv(joined, time_stride=2)])
        else:
            x = head
        return x, (joined[-1:],)


@final
class MidBlock(eqx.Module):
    """diffusers' `WanMidBlock`: a residual block, the attention, a residual block.

    **Arguments:**

    - `channels`: the channels.
    - `key`: a JAX PRNG key for the initialisation.
    """

    attentions: tuple[AttentionBlock]
    resnets: tuple[ResidualBlock, ResidualBlock]

    def __init__(self, channels: int, *, key: PRNGKeyArray) -> None:
        k1, k2, k3 = jax.random.split(key, 3)
        self.attentions = (AttentionBlock(channels, key=k3),)
        self.resnets = (
            ResidualBlock(channels, channels, key=k1),
            ResidualBlock(channels, channels, key=k2),
        )

    def step(
        self, x: Float[Array, "T H W C"], cache: Cache | None, attention: AttentionSettings
    ) -> tuple[Float[Array, "T H W C"], Cache]:
        """The block on frames `x` after those `cache` carries (`None`: the video's start).

        **Returns:**

        `(out, cache)`: the frames and the cache for the next ones.
        """
        first, second = (None, None) if cache is None else cache
        x, first = self.resnets[0].step(x, first)
        x = self.attentions[0](x, attention)
        x, second = self.resnets[1].step(x, second)
        return x, (first, second)


@final
class UpBlock(eqx.Module):
    """diffusers' `WanUpBlock`: residual blocks, then (all but the last block) a `Resample`
    upsampling to half the channels.

    **Arguments:**

    - `in_channels`, `out_channels`: the channels.
    - `layers`: how many residual blocks (the config's `num_res_blocks + 1`).
    - `mode`: the upsampling's mode, `None` for none.
    - `key`: a JAX PRNG key for the initialisation.
    """

    resnets: tuple[ResidualBlock, ...]
    upsamplers: tuple[Resample, ...]

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        layers: int,
        mode: ResampleMode | None,
        *,
        key: PRNGKeyArray,
    ) -> None:
        keys = jax.random.split(key, layers + 1)
        self.resnets = tuple(
            ResidualBlock(in_channels if i == 0 else out_channels, out_channels, key=keys[i])
            for i in range(layers)
        )
        self.upsamplers = () if mode is None else (Resample(out_channels, mode, key=keys[-1]),)

    def step(
        self, x: Float[Array, "T H W C"], cache: Cache | None
    ) -> tuple[Float[Array, "T2 H2 W2 O"], Cache]:
        """The block on frames `x` after those `cache` carries (`None`: the video's start).

        **Returns:**

        `(out, cache)`: the frames and the cache for the next ones.
        """
        layers: tuple[ResidualBlock | Resample, ...] = (*self.resnets, *self.upsamplers)
        caches: Cache = (None,) * len(layers) if cache is None else cache
        carried = []
        for layer, past in zip(layers, caches, strict=True):
            x, past = layer.step(x, past)
            carried.append(past)
        return x, tuple(carried)


@final
class Encoder3d(eqx.Module):
    """diffusers' `WanEncoder3d`: video to the posterior's mean and log-variance.

    **Arguments:**

    - `in_channels`: the video's channels.
    - `dim`: the first level's channels (the config's `base_dim`).
    - `out_channels`: the output's channels (twice the latent's).
    - `dim_mult`: each level's channels over `dim`.
    - `num_res_blocks`: residual blocks per level.
    - `temperal_downsample`: for each level but the last, whether it halves time too.
    - `key`: a JAX PRNG key for the initialisation.
    """

    conv_in: CausalConv3d
    down_blocks: tuple[ResidualBlock | Resample, ...]
    mid_block: MidBlock
    norm_out: RMSNorm
    conv_out: CausalConv3d

    def __init__(
        self,
        in_channels: int,
        dim: int,
        out_channels: int,
        dim_mult: Sequence[int],
        num_res_blocks: int,
        temperal_downsample: Sequence[bool],
        *,
        key: PRNGKeyArray,
    ) -> None:
        dims = [dim * m for m in (1, *dim_mult)]
        k_in, k_mid, k_out, k_blocks = jax.random.split(key, 4)
        keys = iter(jax.random.split(k_blocks, len(dim_mult) * (num_res_blocks + 1)))
        self.conv_in = CausalConv3d(in_channels, dims[0], (3, 3, 3), key=k_in)
        layers: list[ResidualBlock | Resample] = []
        for i, (width_in, width) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
            for _ in range(num_res_blocks):
                layers.append(ResidualBlock(width_in, width, key=next(keys)))
                width_in = width
            if i != len(dim_mult) - 1:
                mode: ResampleMode = "downsample3d" if temperal_downsample[i] else "downsample2d"
                layers.append(Resample(width, mode, key=next(keys)))
        self.down_blocks = tuple(layers)
        self.mid_block = MidBlock(dims[-1], key=k_mid)
        self.norm_out = RMSNorm(dims[-1], images=False)
        self.conv_out = CausalConv3d(dims[-1], out_channels, (3, 3, 3), key=k_out)

    def step(
        self, x: Float[Array, "T H W C"], cache: Cache | None, attention: AttentionSettings
    ) -> tuple[Float[Array, "t h w M"], Cache]:
        """The encoder on frames `x` after those `cache` carries (`None`: the video's start).

        **Returns:**

        `(out, cache)`: the frames and the cache for the next ones.
        """
        count = len(self.down_blocks)
        caches: Cache = (None,) * (count + 3) if cache is None else cache
        h, past = self.conv_in.causal(x, caches[0])
        carried: list[Any] = [past]
        for layer, layer_cache in zip(self.down_blocks, caches[1 : count + 1], strict=True):
            h, layer_cache = layer.step(h, layer_cache)
            carried.append(layer_cache)
        h, mid = self.mid_block.step(h, caches[count + 1], attention)
        out, past = self.conv_out.causal(jax.nn.silu(self.norm_out(h)), caches[count + 2])
        return out, (*carried, mid, past)


@final
class Decoder3d(eqx.Module):
    """diffusers' `WanDecoder3d` (Wan 2.1's, `is_residual=False`): latent to video.

    **Arguments:**

    - `dim`: the last level's channels over its `dim_mult` (the config's `decoder_base_dim`,
        else `base_dim`).
    - `z_dim`: the latent's channels.
    - `out_channels`: the video's channels.
    - `dim_mult`: each level's channels over `dim`, in the encoder's order.
    - `num_res_blocks`: the encoder's residual blocks per level (each up block has one more).
    - `temperal_upsample`: for each up block but the last, whether it doubles time too (the
        encoder's `temperal_downsample` reversed).
    - `key`: a JAX PRNG key for the initialisation.
    """

    conv_in: CausalConv3d
    mid_block: MidBlock
    up_blocks: tuple[UpBlock, ...]
    norm_out: RMSNorm
    conv_out: CausalConv3d

    def __init__(
        self,
        dim: int,
        z_dim: int,
        out_channels: int,
        dim_mult: Sequence[int],
        num_res_blocks: int,
        temperal_upsample: Sequence[bool],
        *,
        key: PRNGKeyArray,
    ) -> None:
        dims = [dim * m for m in (dim_mult[-1], *reversed(dim_mult))]
        k_in, k_mid, k_out, *k_blocks = jax.random.split(key, 3 + len(dim_mult))
        self.conv_in = CausalConv3d(z_dim, dims[0], (3, 3, 3), key=k_in)
        self.mid_block = MidBlock(dims[0], key=k_mid)
        blocks = []
        for i, (width_in, width) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
            mode: ResampleMode | None = None
            if i != len(dim_mult) - 1:
                mode = "upsample3d" if temperal_upsample[i] else "upsample2d"
            # Each upsampling halves the channels: the next block reads half its input's.
            width_in = width_in // 2 if i > 0 else width_in
            blocks.append(UpBlock(width_in, width, num_res_blocks + 1, mode, key=k_blocks[i]))
        self.up_blocks = tuple(blocks)
        self.norm_out = RMSNorm(dims[-1], images=False)
        self.conv_out = CausalConv3d(dims[-1], out_channels, (3, 3, 3), key=k_out)

    def step(
        self, z: Float[Array, "t h w L"], cache: Cache | None, attention: AttentionSettings
    ) -> tuple[Float[Array, "T H W C"], Cache]:
        """The decoder on latent frames `z` after those `cache` carries (`None`: the video's
        start).

        **Returns:**

        `(out, cache)`: the frames and the cache for the next ones.
        """
        count = len(self.up_blocks)
        caches: Cache = (None,) * (count + 3) if cache is None else cache
        h, past = self.conv_in.causal(z, caches[0])
        h, mid = self.mid_block.step(h, caches[1], attention)
        carried: list[Any] = [past, mid]
        for block, block_cache in zip(self.up_blocks, caches[2 : count + 2], strict=True):
            h, block_cache = block.step(h, block_cache)
            carried.append(block_cache)
        out, past = self.conv_out.causal(jax.nn.silu(self.norm_out(h)), caches[count + 2])
        return out, (*carried, past)


def _in_chunks(
    step: Callable[[Array, Cache | None], tuple[Array, Cache]], x: Array, size: int
) -> Array:
    """`step` over the first frame of `x`, then over `size` frames at a time (a scan), then
    over what is left, each time with the cache the one before left."""
    first, cache = step(x[:1], None)
    rest = x[1:]
    whole = rest.shape[0] // size
    parts = [first]
    if whole:
        groups = rest[: whole * size].reshape(whole, size, *rest.shape[1:])

        def body(carry: Cache, group: Array) -> tuple[Cache, Array]:
            out, carry = step(group, carry)
            return carry, out

        cache, outs = jax.lax.scan(body, cache, groups)
        parts.append(outs.reshape(-1, *outs.shape[2:]))
    if rest.shape[0] % size:
        last, _ = step(rest[whole * size :], cache)
        parts.append(last)
    return jnp.concatenate(parts)


def _check_floats(name: str, values: Sequence[float], count: int, positive: bool) -> None:
    if isinstance(values, (str, bytes)) or len(values) != count:
        raise ValueError(f"`{name}` must be {count} numbers (`z_dim`), got {values!r}.")
    for value in values:
        check_number(name, value, minimum=0 if positive else None, include_minimum=False)


@final
class AutoencoderKLWan(AbstractAutoEncoder):
    """Wan 2.1's video autoencoder: diffusers' `AutoencoderKLWan` (`is_residual=False`).

    On one unbatched channels-last video in `[-1, 1]` (`[F, H, W, 3]`, `F = 1 + 4k` frames)
    and one latent in the transformer's space (`[1 + (F - 1) / t, H / s, W / s, z_dim]`, `t =
    2^(temporal downsamplings)` and `s = 2^(levels - 1)`, 4 and 8 for the published model):
    `encode` gives the latent the Wan pipelines give the transformer, `(z - latents_mean) * (1 /
    latents_std)` per channel for `z` the posterior's mean or a sample of it (the normalisation
    `WanImageToVideoPipeline` applies to its condition); `decode` inverts it as
    `WanPipeline.__call__` does before decoding (`latent / (1 / latents_std) + latents_mean`,
    both in float32), decodes, and clamps to `[-1, 1]` as diffusers' `decode` does. vmap it over
    a batch. Computes in its parameters' dtype (RMS norms in float32) and returns the input's
    dtype.

    The result is diffusers' chunked computation (the encoder reading the first frame, then
    four at a time, the decoder one latent frame at a time, through a cache of each causal
    convolution's last input frames) computed over the whole sequence at once; with `chunk`,
    `decode` and `encode` compute it chunk by chunk with that cache instead, the same function
    holding one chunk's activations at a time (for a frame count that would not fit a device
    at once).

    `AutoencoderKLWan.wan_2_1_config()` is the published Wan 2.1 VAE's (used by the 1.3B and
    14B text-to-video models). `load_diffusers` reads a `vae/` folder into one.

    **Arguments:**

    - `base_dim`: the first level's channels (96).
    - `z_dim`: the latent's channels (16).
    - `dim_mult`: each level's channels over `base_dim` (`(1, 2, 4, 4)`).
    - `num_res_blocks`: residual blocks per encoder level; the decoder has one more (2).
    - `temperal_downsample`: for each level but the last, whether the encoder halves time
        there too (diffusers' spelling; `(False, True, True)`); at most two, as diffusers'
        encoder reads four frames at a time. The decoder doubles time in reverse order.
    - `latents_mean`, `latents_std`: the latent space's per-channel statistics, `z_dim` each
        (`latents_std` positive); `None` for 0 and 1.
    - `decoder_base_dim`: the decoder's `base_dim`; `None` for `base_dim`.
    - `in_channels`, `out_channels`: the video's channels (3).
    - `attention`: how the mid-blocks' attention over each frame's pixels is computed
        (`AbstractAttention`, as for `MMDiT`; `ChunkedAttention(chunk)` holds `chunk` rows of
        scores at a time).
    - `key`: a JAX PRNG key for the initialisation.

    **Raises:**

    - `ValueError`: naming the argument, when a size is not a positive int, `dim_mult` is not
        positive ints, `temperal_downsample` is not one bool per level but the last or has
        more than two, `latents_mean` or `latents_std` is not `z_dim` finite numbers
        (positive for `latents_std`), or `attention` is not an `AbstractAttention`.
    """

    encoder: Encoder3d
    quant_conv: CausalConv3d
    post_quant_conv: CausalConv3d
    decoder: Decoder3d
    attention_settings: AttentionSettings
    base_dim: int = eqx.field(static=True)
    decoder_base_dim: int | None = eqx.field(static=True)
    z_dim: int = eqx.field(static=True)
    dim_mult: tuple[int, ...] = eqx.field(static=True)
    num_res_blocks: int = eqx.field(static=True)
    temperal_downsample: tuple[bool, ...] = eqx.field(static=True)
    latents_mean: tuple[float, ...] = eqx.field(static=True)
    latents_std: tuple[float, ...] = eqx.field(static=True)

    def __init__(
        self,
        base_dim: int = 8,
        z_dim: int = 4,
        dim_mult: Sequence[int] = (1, 2),
        num_res_blocks: int = 1,
        temperal_downsample: Sequence[bool] = (True,),
        latents_mean: Sequence[float] | None = None,
        latents_std: Sequence[float] | None = None,
        decoder_base_dim: int | None = None,
        in_channels: int = 3,
        out_channels: int = 3,
        attention: AbstractAttention = DEFAULT_ATTENTION,
        *,
        key: PRNGKeyArray,
    ) -> None:
        sizes = dict(
            base_dim=base_dim,
            z_dim=z_dim,
            num_res_blocks=num_res_blocks,
            in_channels=in_channels,
            out_channels=out_channels,
        )
        for name, value in sizes.items():
            check_int(name, value, 1)
        check_int("decoder_base_dim", decoder_base_dim, 1, optional=True)
        if (
            isinstance(dim_mult, (str, bytes))
            or not dim_mult
            or any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in dim_mult)
        ):
            raise ValueError(f"`dim_mult` must be positive ints, got {dim_mult!r}.")
        levels = len(dim_mult)
        if (
            isinstance(temperal_downsample, (str, bytes))
            or len(temperal_downsample) != levels - 1
            or any(not isinstance(t, (bool, np.bool_)) for t in temperal_downsample)
            or sum(bool(t) for t in temperal_downsample) > 2
        ):
            raise ValueError(
                f"`temperal_downsample` must be {levels - 1} bools (one per level of `dim_mult` "
                "but the last), at most two true (diffusers' encoder reads four frames at a "
                f"time), got {temperal_downsample!r}."
            )
        mean = (0.0,) * z_dim if latents_mean is None else latents_mean
        std = (1.0,) * z_dim if latents_std is None else latents_std
        _check_floats("latents_mean", mean, z_dim, positive=False)
        _check_floats("latents_std", std, z_dim, positive=True)
        self.attention_settings = AttentionSettings(attention)
        k_enc, k_dec, k_q, k_pq = jax.random.split(key, 4)
        downsample = tuple(bool(t) for t in temperal_downsample)
        self.encoder = Encoder3d(
            in_channels,
            base_dim,
            2 * z_dim,
            dim_mult,
            num_res_blocks,
            downsample,
            key=k_enc,
        )
        self.quant_conv = CausalConv3d(2 * z_dim, 2 * z_dim, (1, 1, 1), key=k_q)
        self.post_quant_conv = CausalConv3d(z_dim, z_dim, (1, 1, 1), key=k_pq)
        self.decoder = Decoder3d(
            base_dim if decoder_base_dim is None else decoder_base_dim,
            z_dim,
            out_channels,
            dim_mult,
            num_res_blocks,
            downsample[::-1],
            key=k_dec,
        )
        self.base_dim = base_dim
        self.decoder_base_dim = decoder_base_dim
        self.z_dim = z_dim
        self.dim_mult = tuple(dim_mult)
        self.num_res_blocks = num_res_blocks
        self.temperal_downsample = downsample
        self.latents_mean = tuple(float(m) for m in mean)
        self.latents_std = tuple(float(s) for s in std)

    @classmethod
    def wan_2_1_config(cls) -> dict[str, Any]:
        """The constructor arguments of Wan 2.1's VAE (diffusers' `AutoencoderKLWan` defaults,
        which are `Wan-AI/Wan2.1-T2V-1.3B-Diffusers`'s `vae/config.json`: `base_dim 96`,
        `z_dim 16`, `dim_mult [1, 2, 4, 4]`, `num_res_blocks 2`, `temperal_downsample [False,
        True, True]`, no attention between the levels, and the 16 channels' `latents_mean` and
        `latents_std`), 126,892,531 parameters.

        **Returns:**

        A dict of keyword arguments for `AutoencoderKLWan`.
        """
        return dict(
            base_dim=96,
            z_dim=16,
            dim_mult=(1, 2, 4, 4),
            num_res_blocks=2,
            temperal_downsample=(False, True, True),
            latents_mean=_WAN21_MEAN,
            latents_std=_WAN21_STD,
            decoder_base_dim=None,
            in_channels=3,
            out_channels=3,
        )

    @property
    def spatial_factor(self) -> int:
        """How many times smaller the latent's height and width are than the video's."""
        return int(2 ** (len(self.dim_mult) - 1))

    @property
    def temporal_factor(self) -> int:
        """How many more frames than the latent's (past the first) the video has."""
        return int(2 ** sum(self.temperal_downsample))

    def _statistics(self) -> tuple[Float[Array, "1 1 1 L"], Float[Array, "1 1 1 L"]]:
        """`latents_mean` and `1 / latents_std` as the pipelines compute them, in float32."""
        mean = np.asarray(self.latents_mean, np.float32)
        inverse = np.float32(1.0) / np.asarray(self.latents_std, np.float32)
        return jnp.asarray(mean)[None, None, None, :], jnp.asarray(inverse)[None, None, None, :]

    def moments(
        self, video: Float[Array, "F H W C"], *, chunk: int | None = None
    ) -> tuple[Float[Array, "f h w L"], Float[Array, "f h w L"]]:
        """The posterior's mean and log-variance (clipped to `[-30, 20]`, as diffusers'
        `DiagonalGaussianDistribution` clips it), not normalised.

        **Arguments:**

        - `video`: `[F, H, W, in_channels]` in `[-1, 1]`; `F = 1 + 4k` (diffusers' encoder
            reads the first frame, then groups of four, and leaves out any other frames), `H`
            and `W` multiples of `spatial_factor`.
        - `chunk`: `None` to encode the whole video at once; else the frames encoded per step
            after the first, a multiple of 4 (diffusers encodes 4), each step carrying the
            causal cache: the same result, one chunk's activations at a time.

        **Returns:**

        `(mean, logvar)`, each `[1 + (F - 1) / temporal_factor, H / spatial_factor, W /
        spatial_factor, z_dim]` float32.

        **Raises:**

        - `ValueError`: naming `video` when it is not float (uint8 is refused: convert it
            with `x / 127.5 - 1`) or its shape is not that, or `chunk` when it is not a
            positive multiple of 4.
        """
        factor = self.spatial_factor
        channels = self.encoder.conv_in.weight.shape[1]
        check_image(
            "video",
            video,
            ("F", "H", "W", "C"),
            channels,
            hint="It encodes one video: vmap it over a batch [N, F, H, W, C].",
        )
        if (
            (video.shape[0] - 1) % _FRAME_GROUP
            or video.shape[1] % factor
            or video.shape[2] % factor
        ):
            raise ValueError(
                f"`video` must be [F, H, W, {channels}] with F - 1 a multiple of 4 and H and W "
                f"multiples of {factor}, got {video.shape}."
            )
        check_int("chunk", chunk, 1, optional=True)
        if chunk is not None and chunk % _FRAME_GROUP:
            raise ValueError(f"`chunk` must be None or a multiple of 4, got {chunk}.")
        dtype = self.encoder.conv_in.weight.dtype
        x = video.astype(dtype)
        settings = self.attention_settings

        def step(frames: Array, cache: Cache | None) -> tuple[Array, Cache]:
            return self.encoder.step(frames, cache, settings)

        h = step(x, None)[0] if chunk is None else _in_chunks(step, x, chunk)
        return posterior_moments(self.quant_conv(h), self.z_dim)

    def encode(
        self,
        video: Float[Array, "F H W C"],
        *,
        key: PRNGKeyArray | None = None,
        chunk: int | None = None,
    ) -> Float[Array, "f h w L"]:
        """The latent of `video` in the transformer's space: the posterior's mean (`key`
        `None`) or a sample of it, normalised per channel, `(z - latents_mean) * (1 /
        latents_std)`.

        **Arguments:**

        - `video`: `[F, H, W, in_channels]` in `[-1, 1]`, `F = 1 + 4k`.
        - `key`: a JAX PRNG key to sample the posterior; `None` for its mean.
        - `chunk`: as `moments`'s.

        **Returns:**

        The latent, `[1 + (F - 1) / temporal_factor, H / spatial_factor, W / spatial_factor,
        z_dim]`, in the dtype of `video`.

        **Raises:**

        - `ValueError`: as `moments`.
        """
        z = sample_posterior(*self.moments(video, chunk=chunk), key)
        latents_mean, inverse_std = self._statistics()
        return ((z - latents_mean) * inverse_std).astype(video.dtype)

    def decode(
        self, latent: Float[Array, "f h w L"], *, chunk: int | None = None
    ) -> Float[Array, "F H W C"]:
        """The video of a latent in the transformer's space: `latent / (1 / latents_std) +
        latents_mean`, then the decoder, clamped to `[-1, 1]`.

        **Arguments:**

        - `latent`: `[f, h, w, z_dim]`.
        - `chunk`: `None` to decode the whole latent at once; else the latent frames decoded
            per step after the first (diffusers decodes one), each step carrying the causal
            cache: the same result, one chunk's activations at a time.

        **Returns:**

        The video, `[1 + (f - 1) temporal_factor, h spatial_factor, w spatial_factor,
        out_channels]`, in the dtype of `latent`.

        **Raises:**

        - `ValueError`: naming `latent` when it is not float or not `[f, h, w, z_dim]` with
            sides of at least 1, or `chunk` when it is not a positive int.
        """
        check_image("latent", latent, ("f", "h", "w", "L"), self.z_dim, rule="float")
        check_int("chunk", chunk, 1, optional=True)
        latents_mean, inverse_std = self._statistics()
        dtype = self.decoder.conv_in.weight.dtype
        z = (latent.astype(jnp.float32) / inverse_std + latents_mean).astype(dtype)
        z = self.post_quant_conv(z)
        settings = self.attention_settings

        def step(frames: Array, cache: Cache | None) -> tuple[Array, Cache]:
            return self.decoder.step(frames, cache, settings)

        video = step(z, None)[0] if chunk is None else _in_chunks(step, z, chunk)
        return jnp.clip(video, -1.0, 1.0).astype(latent.dtype)


def wan_vae_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """`AutoencoderKLWan`'s arguments for a diffusers `AutoencoderKLWan` config.

    `dropout` is read and left out (diffusers' inference does not apply it), and so are
    `scale_factor_temporal` and `scale_factor_spatial` (the pipelines' frame and pixel factors,
    which the architecture fixes; `save_diffusers` writes the architecture's).

    **Arguments:**

    - `config`: the parsed `config.json`.

    **Returns:**

    A dict of keyword arguments for `AutoencoderKLWan`.

    **Raises:**

    - `ValueError`: naming the config's field, for what the module does not compute: Wan
        2.2's `is_residual` blocks, a `patch_size`, or `attn_scales` (attention between the
        encoder's levels, which diffusers' own encoder cannot run).
    """
    if config.get("is_residual", False):
        raise ValueError(
            "config `is_residual` must be false (Wan 2.2's residual up and down blocks are not "
            f"computed here), got {config['is_residual']!r}."
        )
    if config.get("patch_size") is not None:
        raise ValueError(
            f"config `patch_size` must be None (Wan 2.1's), got {config['patch_size']!r}."
        )
    if list(config.get("attn_scales", [])):
        raise ValueError(
            "config `attn_scales` must be empty (diffusers' encoder cannot run an attention "
            f"between its levels), got {config['attn_scales']!r}."
        )
    defaults = AutoencoderKLWan.wan_2_1_config()
    return dict(
        base_dim=config.get("base_dim", defaults["base_dim"]),
        z_dim=config.get("z_dim", defaults["z_dim"]),
        dim_mult=tuple(config.get("dim_mult", defaults["dim_mult"])),
        num_res_blocks=config.get("num_res_blocks", defaults["num_res_blocks"]),
        temperal_downsample=tuple(
            config.get("temperal_downsample", defaults["temperal_downsample"])
        ),
        latents_mean=config.get("latents_mean", defaults["latents_mean"]),
        latents_std=config.get("latents_std", defaults["latents_std"]),
        decoder_base_dim=config.get("decoder_base_dim"),
        in_channels=config.get("in_channels", 3),
        out_channels=config.get("out_channels", 3),
    )


def wan_vae_config(model: AutoencoderKLWan) -> dict[str, Any]:
    """The diffusers config of `model`.

    **Arguments:**

    - `model`: the autoencoder.

    **Returns:**

    The `config.json` contents diffusers' `AutoencoderKLWan.from_pretrained` reads.
    """
    return {
        "_class_name": "AutoencoderKLWan",
        "_diffusers_version": "0.33.0",
        "attn_scales": [],
        "base_dim": model.base_dim,
        "decoder_base_dim": model.decoder_base_dim,
        "dim_mult": list(model.dim_mult),
        "dropout": 0.0,
        "in_channels": int(model.encoder.conv_in.weight.shape[1]),
        "is_residual": False,
        "latents_mean": list(model.latents_mean),
        "latents_std": list(model.latents_std),
        "num_res_blocks": model.num_res_blocks,
        "out_channels": int(model.decoder.conv_out.weight.shape[0]),
        "patch_size": None,
        "scale_factor_spatial": model.spatial_factor,
        "scale_factor_temporal": model.temporal_factor,
        "temperal_downsample": list(model.temperal_downsample),
        "z_dim": model.z_dim,
    }
