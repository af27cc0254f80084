"""The image autoencoder of SD3, SD3.5 and FLUX.1, as diffusers' `AutoencoderKL` computes it.

The module tree mirrors diffusers' state dict (`_mirror.py`): the leaf at
`encoder.down_blocks[0].resnets[1].norm1.weight` is the tensor
`encoder.down_blocks.0.resnets.1.norm1.weight`, and every weight keeps torch's layout (a
convolution's `[out, in, kh, kw]`), so a checkpoint loads by its keys alone. The images are
channels-last.
"""

from collections.abc import Sequence
from typing import Any, Literal, NamedTuple, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from .._inputs import AbstractAutoEncoder
from .._misc import check_int
from ._attention_settings import AttentionSettings, attend_to
from ._autoencoder import Conv, posterior_moments, sample_posterior
from ._images import check_image
from ._init import ones, zeros
from ._layers import (
    DEFAULT_ATTENTION,
    AbstractAttention,
    dense_in_input_dtype,
)


_EPS = 1e-6  # every GroupNorm of diffusers' AutoencoderKL


@final
class GroupNorm(eqx.Module):
    """GroupNorm over a channels-last image, statistics in float32, with an affine part.

    **Arguments:**

    - `groups`: the number of groups; divides `channels`.
    - `channels`: the channels.
    """

    weight: Float[Array, " C"]
    bias: Float[Array, " C"]
    groups: int = eqx.field(static=True)

    def __init__(self, groups: int, channels: int) -> None:
        self.weight = ones((channels,))
        self.bias = zeros((channels,))
        self.groups = groups

    def __call__(self, x: Float[Array, "H W C"]) -> Float[Array, "H W C"]:
        h, w, c = x.shape
        grouped = x.astype(jnp.float32).reshape(h, w, self.groups, c // self.groups)
        mean = jnp.mean(grouped, axis=(0, 1, 3), keepdims=True)
        var = jnp.mean(jnp.square(grouped - mean), axis=(0, 1, 3), keepdims=True)
        normed = ((grouped - mean) * jax.lax.rsqrt(var + _EPS)).reshape(h, w, c)
        out: Float[Array, "H W C"] = (
            normed * self.weight.astype(jnp.float32)[None, None, :]
            + self.bias.astype(jnp.float32)[None, None, :]
        ).astype(x.dtype)
        return out


@final
class ResnetBlock(eqx.Module):
    """diffusers' `ResnetBlock2D` without a time input: two GroupNorm-SiLU-convolutions and a
    residual (through a 1 x 1 convolution when the channels change).

    **Arguments:**

    - `in_channels`, `out_channels`: the channels.
    - `groups`: the GroupNorms' groups.
    - `key`: a JAX PRNG key for the initialisation.
    """

    norm1: GroupNorm
    conv1: Conv
    norm2: GroupNorm
    conv2: Conv
    conv_shortcut: Conv | None

    def __init__(
        self, in_channels: int, out_channels: int, groups: int, *, key: PRNGKeyArray
    ) -> None:
        k1, k2, k3 = jax.random.split(key, 3)
        self.norm1 = GroupNorm(groups, in_channels)
        self.conv1 = Conv(in_channels, out_channels, 3, key=k1)
        self.norm2 = GroupNorm(groups, out_channels)
        self.conv2 = Conv(out_channels, out_channels, 3, key=k2)
        self.conv_shortcut = (
            Conv(in_channels, out_channels, 1, key=k3) if in_channels != out_channels else None
        )

    def __call__(self, x: Float[Array, "H W C"]) -> Float[Array, "H W O"]:
        h = self.conv1(jax.nn.silu(self.norm1(x)))
        h = self.conv2(jax.nn.silu(self.norm2(h)))
        shortcut = x if self.conv_shortcut is None else self.conv_shortcut(x)
        out: Float[Array, "H W O"] = shortcut + h
        return out


@final
class SpatialAttention(eqx.Module):
    """The mid-block's attention (diffusers' `Attention` with one head as wide as the channels,
    a GroupNorm first and the input added back): every pixel attends to every pixel.

    **Arguments:**

    - `channels`: the channels.
    - `groups`: the GroupNorm's groups.
    - `key`: a JAX PRNG key for the initialisation.
    """

    group_norm: GroupNorm
    to_q: eqx.nn.Linear
    to_k: eqx.nn.Linear
    to_v: eqx.nn.Linear
    to_out: tuple[eqx.nn.Linear]

    def __init__(self, channels: int, groups: int, *, key: PRNGKeyArray) -> None:
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.group_norm = GroupNorm(groups, channels)
        self.to_q = eqx.nn.Linear(channels, channels, dtype=jnp.float32, key=kq)
        self.to_k = eqx.nn.Linear(channels, channels, dtype=jnp.float32, key=kk)
        self.to_v = eqx.nn.Linear(channels, channels, dtype=jnp.float32, key=kv)
        self.to_out = (eqx.nn.Linear(channels, channels, dtype=jnp.float32, key=ko),)

    def __call__(
        self, x: Float[Array, "H W C"], attention: AttentionSettings
    ) -> Float[Array, "H W C"]:
        h, w, c = x.shape
        tokens = self.group_norm(x).reshape(h * w, c)
        q, k, v = (
            dense_in_input_dtype(proj, tokens)[:, None, :]
            for proj in (self.to_q, self.to_k, self.to_v)
        )
        attended = attend_to(q, k, v, attention)
        out: Float[Array, "H W C"] = (
            dense_in_input_dtype(self.to_out[0], attended).reshape(h, w, c) + x
        )
        return out


@final
class MidBlock(eqx.Module):
    """diffusers' `UNetMidBlock2D` as the autoencoder has it: a resnet block, the attention
    (unless `mid_block_add_attention` is off), a resnet block.

    **Arguments:**

    - `channels`: the channels.
    - `groups`: the GroupNorms' groups.
    - `add_attention`: whether the attention is there.
    - `key`: a JAX PRNG key for the initialisation.
    """

    resnets: tuple[ResnetBlock, ResnetBlock]
    attentions: tuple[SpatialAttention, ...]

    def __init__(
        self, channels: int, groups: int, add_attention: bool, *, key: PRNGKeyArray
    ) -> None:
        k1, k2, k3 = jax.random.split(key, 3)
        self.resnets = (
            ResnetBlock(channels, channels, groups, key=k1),
            ResnetBlock(channels, channels, groups, key=k2),
        )
        self.attentions = (SpatialAttention(channels, groups, key=k3),) if add_attention else ()

    def __call__(
        self, x: Float[Array, "H W C"], attention: AttentionSettings
    ) -> Float[Array, "H W C"]:
        x = self.resnets[0](x)
        for attend in self.attentions:
            x = attend(x, attention)
        return self.resnets[1](x)


@final
class Resample(eqx.Module):
    """A downsampling (a stride-2 convolution) or upsampling (nearest 2x, then a convolution)
    step between two resolutions: diffusers' `Downsample2D` and `Upsample2D`.

    **Arguments:**

    - `channels`: the channels, kept.
    - `up`: whether it upsamples.
    - `key`: a JAX PRNG key for the initialisation.
    """

    conv: Conv
    up: bool = eqx.field(static=True)

    def __init__(self, channels: int, up: bool, *, key: PRNGKeyArray) -> None:
        self.conv = Conv(channels, channels, 3, stride=1 if up else 2, key=key)
        self.up = up

    def __call__(self, x: Float[Array, "H W C"]) -> Float[Array, "H2 W2 C"]:
        if self.up:
            x = jnp.repeat(jnp.repeat(x, 2, axis=0), 2, axis=1)
        return self.conv(x)


@final
class Level(eqx.Module):
    """One level of the encoder or the decoder: diffusers' `DownEncoderBlock2D` or
    `UpDecoderBlock2D`, resnet blocks then a resampling step (all but the last level), which
    diffusers names `downsamplers` in the one and `upsamplers` in the other.

    **Arguments:**

    - `in_channels`, `out_channels`: the channels.
    - `layers`: how many resnet blocks (the decoder's: the config's `layers_per_block + 1`).
    - `groups`: the GroupNorms' groups.
    - `resample`: `"down"` or `"up"` for the step that ends the level, `None` for none.
    - `key`: a JAX PRNG key for the initialisation.
    """

    resnets: tuple[ResnetBlock, ...]
    downsamplers: tuple[Resample, ...]
    upsamplers: tuple[Resample, ...]

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        layers: int,
        groups: int,
        resample: Literal["down", "up"] | None,
        *,
        key: PRNGKeyArray,
    ) -> None:
        keys = jax.random.split(key, layers + 1)
        self.resnets = tuple(
            ResnetBlock(in_channels if i == 0 else out_channels, out_channels, groups, key=keys[i])
            for i in range(layers)
        )
        step = () if resample is None else (Resample(out_channels, resample == "up", key=keys[-1]),)
        self.downsamplers = step if resample == "down" else ()
        self.upsamplers = step if resample == "up" else ()

    def __call__(self, x: Float[Array, "H W C"]) -> Float[Array, "H2 W2 O"]:
        layers: tuple[ResnetBlock | Resample, ...] = (
            *self.resnets,
            *self.downsamplers,
            *self.upsamplers,
        )
        for layer in layers:
            x = layer(x)
        return x


class LevelShape(NamedTuple):
    """What the encoder and the decoder share: their levels.

    - `block_out_channels`: the channels of each level (the encoder's order).
    - `layers`: resnet blocks per encoder level; the decoder's have one more.
    - `groups`: the GroupNorms' groups.
    - `mid_attention`: whether the mid-blocks have their attention.
    """

    block_out_channels: tuple[int, ...]
    layers: int
    groups: int
    mid_attention: bool


def _levels(
    channels: list[int],
    layers: int,
    groups: int,
    resample: Literal["down", "up"],
    keys: list[PRNGKeyArray],
) -> tuple[Level, ...]:
    """A level per entry of `channels`, from the channels of the level before (the first from
    its own), each but the last ending in a `resample` step."""
    last = len(channels) - 1
    return tuple(
        Level(channels[max(i - 1, 0)], out, layers, groups, resample if i < last else None, key=k)
        for i, (out, k) in enumerate(zip(channels, keys, strict=True))
    )


@final
class Encoder(eqx.Module):
    """diffusers' `Encoder` of `AutoencoderKL`: image to the posterior's mean and log-variance
    (`2 x latent_channels` channels at 1 / 2^(levels - 1) of the image's side).

    **Arguments:**

    - `in_channels`, `latent_channels`: the image's and the latent's channels.
    - `shape`: the levels.
    - `key`: a JAX PRNG key for the initialisation.
    """

    conv_in: Conv
    down_blocks: tuple[Level, ...]
    mid_block: MidBlock
    conv_norm_out: GroupNorm
    conv_out: Conv

    def __init__(
        self, in_channels: int, latent_channels: int, shape: LevelShape, *, key: PRNGKeyArray
    ) -> None:
        k_in, k_mid, k_out, *k_blocks = jax.random.split(key, 3 + len(shape.block_out_channels))
        channels = list(shape.block_out_channels)
        self.conv_in = Conv(in_channels, channels[0], 3, key=k_in)
        self.down_blocks = _levels(channels, shape.layers, shape.groups, "down", k_blocks)
        self.mid_block = MidBlock(channels[-1], shape.groups, shape.mid_attention, key=k_mid)
        self.conv_norm_out = GroupNorm(shape.groups, channels[-1])
        self.conv_out = Conv(channels[-1], 2 * latent_channels, 3, key=k_out)

    def __call__(
        self, x: Float[Array, "H W C"], attention: AttentionSettings
    ) -> Float[Array, "h w M"]:
        h = self.conv_in(x)
        for block in self.down_blocks:
            h = block(h)
        h = self.mid_block(h, attention)
        return self.conv_out(jax.nn.silu(self.conv_norm_out(h)))


@final
class Decoder(eqx.Module):
    """diffusers' `Decoder` of `AutoencoderKL`: latent to image.

    **Arguments:**

    - `latent_channels`, `out_channels`: the latent's and the image's channels.
    - `shape`: the levels (the encoder's; the decoder's run in reverse, with one more resnet
        block each).
    - `key`: a JAX PRNG key for the initialisation.
    """

    conv_in: Conv
    mid_block: MidBlock
    up_blocks: tuple[Level, ...]
    conv_norm_out: GroupNorm
    conv_out: Conv

    def __init__(
        self, latent_channels: int, out_channels: int, shape: LevelShape, *, key: PRNGKeyArray
    ) -> None:
        k_in, k_mid, k_out, *k_blocks = jax.random.split(key, 3 + len(shape.block_out_channels))
        channels = list(reversed(shape.block_out_channels))
        self.conv_in = Conv(latent_channels, channels[0], 3, key=k_in)
        self.mid_block = MidBlock(channels[0], shape.groups, shape.mid_attention, key=k_mid)
        self.up_blocks = _levels(channels, shape.layers + 1, shape.groups, "up", k_blocks)
        self.conv_norm_out = GroupNorm(shape.groups, channels[-1])
        self.conv_out = Conv(channels[-1], out_channels, 3, key=k_out)

    def __call__(
        self, z: Float[Array, "h w L"], attention: AttentionSettings
    ) -> Float[Array, "H W C"]:
        h = self.mid_block(self.conv_in(z), attention)
        for block in self.up_blocks:
            h = block(h)
        return self.conv_out(jax.nn.silu(self.conv_norm_out(h)))


_ONE_IMAGE = "It encodes one image: vmap it over a batch [N, H, W, C]."


def _check_vae(
    block_out_channels: Sequence[int], layers: int, groups: int, channels: dict[str, int]
) -> None:
    for name, value in {**channels, "layers_per_block": layers, "norm_num_groups": groups}.items():
        check_int(name, value, 1)
    if not block_out_channels or any(
        isinstance(c, bool) or not isinstance(c, int) or c < 1 or c % groups
        for c in block_out_channels
    ):
        raise ValueError(
            f"`block_out_channels` must be positive ints that `norm_num_groups` ({groups}) "
            f"divides, got {list(block_out_channels)!r}."
        )


@final
class AutoencoderKL(AbstractAutoEncoder):
    """The image autoencoder of SD3, SD3.5 and FLUX.1: diffusers' `AutoencoderKL`.

    On one unbatched channels-last image in `[-1, 1]` (`[H, W, 3]`) and one latent in the
    transformer's space (`[H / f, W / f, latent_channels]`, `f = 2^(levels - 1)`, 8 for the
    published models): `encode` gives the latent the pipelines train on, `(z - shift_factor) *
    scaling_factor` for `z` the posterior's mean or a sample of it; `decode` inverts that
    scaling and decodes, as the pipelines do before their image processor. vmap it over a
    batch. Computes in its parameters' dtype (GroupNorm statistics in float32) and returns the
    input's dtype.

    It is an `AbstractAutoEncoder`: passed as an objective's `autoencoder`, the rollout decodes
    its final latents with it on the device, in the program that samples them.

    `AutoencoderKL.sd3_config()` is SD3's and SD3.5's (16 latent channels); FLUX.1's
    (`flux_config()`) differs only in `scaling_factor` and `shift_factor`.
    `load_diffusers` reads a `vae/` folder into one.

    **Arguments:**

    - `in_channels`, `out_channels`: the image's channels (3).
    - `latent_channels`: the latent's channels (16).
    - `block_out_channels`: the channels of each level (`(128, 256, 512, 512)`).
    - `layers_per_block`: resnet blocks per encoder level; the decoder has one more.
    - `norm_num_groups`: the GroupNorms' groups (32).
    - `scaling_factor`, `shift_factor`: the latent space's scale and shift.
    - `mid_block_add_attention`: whether both mid-blocks have their attention.
    - `use_quant_conv`, `use_post_quant_conv`: whether 1 x 1 convolutions follow the encoder
        and precede the decoder (off in SD3 and FLUX, on in SD1/SDXL).
    - `attention`: how the mid-blocks' attention over every pixel is computed
        (`AbstractAttention`, as for `MMDiT`; `ChunkedAttention(chunk)` holds `chunk` rows of
        scores at a time).
    - `key`: a JAX PRNG key for the initialisation.

    **Raises:**

    - `ValueError`: naming the argument, when a size is not a positive int, a level's
        channels are not a multiple of `norm_num_groups`, or `attention` is not an
        `AbstractAttention`.
    """

    encoder: Encoder
    decoder: Decoder
    quant_conv: Conv | None
    post_quant_conv: Conv | None
    attention_settings: AttentionSettings
    latent_channels: int = eqx.field(static=True)
    levels: int = eqx.field(static=True)
    scaling_factor: float = eqx.field(static=True)
    shift_factor: float = eqx.field(static=True)

    def __init__(
        self,
        in_channels: int = 3,
        out_channels: int = 3,
        latent_channels: int = 4,
        block_out_channels: Sequence[int] = (8, 16),
        layers_per_block: int = 1,
        norm_num_groups: int = 4,
        scaling_factor: float = 1.0,
        shift_factor: float = 0.0,
        mid_block_add_attention: bool = True,
        use_quant_conv: bool = False,
        use_post_quant_conv: bool = False,
        attention: AbstractAttention = DEFAULT_ATTENTION,
        *,
        key: PRNGKeyArray,
    ) -> None:
        channels = dict(
            in_channels=in_channels, out_channels=out_channels, latent_channels=latent_channels
        )
        _check_vae(block_out_channels, layers_per_block, norm_num_groups, channels)
        k_enc, k_dec, k_q, k_pq = jax.random.split(key, 4)
        shape = LevelShape(
            tuple(block_out_channels), layers_per_block, norm_num_groups, mid_block_add_attention
        )
        self.encoder = Encoder(in_channels, latent_channels, shape, key=k_enc)
        self.decoder = Decoder(latent_channels, out_channels, shape, key=k_dec)
        width = 2 * latent_channels
        self.quant_conv = Conv(width, width, 1, key=k_q) if use_quant_conv else None
        self.post_quant_conv = (
            Conv(latent_channels, latent_channels, 1, key=k_pq) if use_post_quant_conv else None
        )
        self.attention_settings = AttentionSettings(attention)
        self.latent_channels = latent_channels
        self.levels = len(shape.block_out_channels)
        self.scaling_factor = float(scaling_factor)
        self.shift_factor = float(shift_factor)

    @classmethod
    def sd3_config(cls) -> dict[str, Any]:
        """The constructor arguments of SD3's and SD3.5's VAE (`vae/config.json` of
        `stabilityai/stable-diffusion-3.5-medium`: `block_out_channels [128, 256, 512, 512]`,
        `layers_per_block 2`, `latent_channels 16`, `norm_num_groups 32`, `scaling_factor
        1.5305`, `shift_factor 0.0609`, no quant convolutions).

        **Returns:**

        A dict of keyword arguments for `AutoencoderKL`.
        """
        return dict(
            in_channels=3,
            out_channels=3,
            latent_channels=16,
            block_out_channels=(128, 256, 512, 512),
            layers_per_block=2,
            norm_num_groups=32,
            scaling_factor=1.5305,
            shift_factor=0.0609,
        )

    @classmethod
    def flux_config(cls) -> dict[str, Any]:
        """The constructor arguments of FLUX.1's VAE (`black-forest-labs/FLUX.1-dev`'s
        `vae/config.json`): SD3's architecture with `scaling_factor 0.3611`, `shift_factor
        0.1159`.

        **Returns:**

        A dict of keyword arguments for `AutoencoderKL`.
        """
        return {**cls.sd3_config(), "scaling_factor": 0.3611, "shift_factor": 0.1159}

    def moments(
        self, image: Float[Array, "H W C"]
    ) -> tuple[Float[Array, "h w L"], Float[Array, "h w L"]]:
        """The posterior's mean and log-variance (clipped to `[-30, 20]`, as diffusers'
        `DiagonalGaussianDistribution` clips it), unscaled.

        **Arguments:**

        - `image`: `[H, W, in_channels]` in `[-1, 1]`; `H` and `W` multiples of the
            downsampling factor.

        **Returns:**

        `(mean, logvar)`, each `[H / f, W / f, latent_channels]` float32.

        **Raises:**

        - `ValueError`: naming `image` when it is not float (uint8 is refused: convert it
            with `x / 127.5 - 1`), not `[H, W, in_channels]`, empty, or its sides are not
            multiples of the factor.
        """
        factor = 2 ** (self.levels - 1)
        channels = self.encoder.conv_in.weight.shape[1]
        check_image("image", image, ("H", "W", "C"), channels, hint=_ONE_IMAGE)
        if image.shape[0] % factor or image.shape[1] % factor:
            raise ValueError(
                f"`image` must be [H, W, C] with H and W multiples of {factor}, got {image.shape}."
            )
        dtype = self.encoder.conv_in.weight.dtype
        h = self.encoder(image.astype(dtype), self.attention_settings)
        if self.quant_conv is not None:
            h = self.quant_conv(h)
        return posterior_moments(h, self.latent_channels)

    def encode(
        self, image: Float[Array, "H W C"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "h w L"]:
        """The latent of `image` in the transformer's space: the posterior's mean (`key`
        `None`) or a sample of it, shifted by `shift_factor` and scaled by `scaling_factor`.

        **Arguments:**

        - `image`: `[H, W, in_channels]` float in `[-1, 1]`.
        - `key`: a JAX PRNG key to sample the posterior; `None` for its mean.

        **Returns:**

        The latent, `[H / f, W / f, latent_channels]`, in the dtype of `image`.

        **Raises:**

        - `ValueError`: as `moments`.
        """
        z = sample_posterior(*self.moments(image), key)
        return ((z - self.shift_factor) * self.scaling_factor).astype(image.dtype)

    def decode(self, latent: Float[Array, "h w L"]) -> Float[Array, "H W C"]:
        """The image of a latent in the transformer's space (`latent / scaling_factor +
        shift_factor`, then the decoder), in `[-1, 1]` up to the decoder's overshoot.

        **Arguments:**

        - `latent`: `[h, w, latent_channels]`.

        **Returns:**

        The image, `[h f, w f, out_channels]`, in the dtype of `latent`.

        **Raises:**

        - `ValueError`: naming `latent` when it is not float, or not `[h, w,
            latent_channels]` with sides of at least 1.
        """
        check_image("latent", latent, ("h", "w", "L"), self.latent_channels, rule="float")
        dtype = self.decoder.conv_in.weight.dtype
        z = (latent.astype(jnp.float32) / self.scaling_factor + self.shift_factor).astype(dtype)
        if self.post_quant_conv is not None:
            z = self.post_quant_conv(z)
        return self.decoder(z, self.attention_settings).astype(latent.dtype)


def vae_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """`AutoencoderKL`'s arguments for a diffusers `AutoencoderKL` config.

    **Arguments:**

    - `config`: the parsed `config.json`.

    **Returns:**

    A dict of keyword arguments for `AutoencoderKL`.

    **Raises:**

    - `ValueError`: naming the config's field, for a block type, activation or option the
        module does not compute.
    """
    wanted = {
        "down_block_types": "DownEncoderBlock2D",
        "up_block_types": "UpDecoderBlock2D",
    }
    for field, kind in wanted.items():
        kinds = set(config.get(field, [kind]))
        if kinds != {kind}:
            raise ValueError(f"config `{field}` must be all {kind!r}, got {sorted(kinds)}.")
    if config.get("act_fn", "silu") != "silu":
        raise ValueError(f"config `act_fn` must be 'silu', got {config['act_fn']!r}.")
    for field in ("latents_mean", "latents_std"):
        if config.get(field) is not None:
            raise ValueError(
                f"config `{field}` must be None (per-channel latent statistics are not read "
                "by this autoencoder's pipelines), got a value."
            )
    return dict(
        in_channels=config.get("in_channels", 3),
        out_channels=config.get("out_channels", 3),
        latent_channels=config.get("latent_channels", 4),
        block_out_channels=tuple(config.get("block_out_channels", (64,))),
        layers_per_block=config.get("layers_per_block", 1),
        norm_num_groups=config.get("norm_num_groups", 32),
        scaling_factor=config.get("scaling_factor", 0.18215),
        shift_factor=config.get("shift_factor") or 0.0,
        mid_block_add_attention=bool(config.get("mid_block_add_attention", True)),
        use_quant_conv=bool(config.get("use_quant_conv", True)),
        use_post_quant_conv=bool(config.get("use_post_quant_conv", True)),
    )


def vae_config(model: AutoencoderKL) -> dict[str, Any]:
    """The diffusers config of `model`.

    **Arguments:**

    - `model`: the autoencoder.

    **Returns:**

    The `config.json` contents diffusers' `AutoencoderKL.from_pretrained` reads.
    """
    blocks = [int(c) for c in _block_channels(model)]
    return {
        "_class_name": "AutoencoderKL",
        "_diffusers_version": "0.31.0",
        "act_fn": "silu",
        "block_out_channels": blocks,
        "down_block_types": ["DownEncoderBlock2D"] * len(blocks),
        "up_block_types": ["UpDecoderBlock2D"] * len(blocks),
        "in_channels": int(model.encoder.conv_in.weight.shape[1]),
        "out_channels": int(model.decoder.conv_out.weight.shape[0]),
        "latent_channels": model.latent_channels,
        "layers_per_block": len(model.encoder.down_blocks[0].resnets),
        "norm_num_groups": model.encoder.conv_norm_out.groups,
        "scaling_factor": model.scaling_factor,
        "shift_factor": model.shift_factor,
        "mid_block_add_attention": bool(model.encoder.mid_block.attentions),
        "use_quant_conv": model.quant_conv is not None,
        "use_post_quant_conv": model.post_quant_conv is not None,
        "latents_mean": None,
        "latents_std": None,
        "force_upcast": True,
    }


def _block_channels(model: AutoencoderKL) -> list[int]:
    return [int(block.resnets[-1].conv2.weight.shape[0]) for block in model.encoder.down_blocks]
