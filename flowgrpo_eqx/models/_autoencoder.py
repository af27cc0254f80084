"""What the image and the video autoencoders share: the 2D convolution with a torch-layout
kernel, and the diagonal Gaussian posterior their encoders give (diffusers'
`DiagonalGaussianDistribution`)."""

from typing import final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from ._mirror import uniform_init


@final
class Conv(eqx.Module):
    """A 2D convolution of a channels-last image with a torch-layout kernel.

    **Arguments:**

    - `in_channels`, `out_channels`: the channels.
    - `size`: the kernel's side (1 or 3).
    - `stride`: 1, or 2 for a downsampling convolution (padded on the right and bottom by
        one, as diffusers' `Downsample2D` with `padding=0` pads).
    - `key`: a JAX PRNG key for the initialisation.
    """

    weight: Float[Array, "out in kh kw"]
    bias: Float[Array, " out"]
    stride: int = eqx.field(static=True)

    def __init__(
        self, in_channels: int, out_channels: int, size: int, stride: int = 1, *, key: PRNGKeyArray
    ) -> None:
        k_w, k_b = jax.random.split(key)
        fan_in = in_channels * size * size
        self.weight = uniform_init(k_w, (out_channels, in_channels, size, size), fan_in)
        self.bias = uniform_init(k_b, (out_channels,), fan_in)
        self.stride = stride

    def __call__(self, x: Float[Array, "H W C"]) -> Float[Array, "H2 W2 O"]:
        side = self.weight.shape[-1]
        if self.stride == 2:
            padding = ((0, 1), (0, 1))
        else:
            padding = ((side // 2, side // 2), (side // 2, side // 2))
        out = jax.lax.conv_general_dilated(
            x[None],
            self.weight.astype(x.dtype),
            window_strides=(self.stride, self.stride),
            padding=padding,
            dimension_numbers=("NHWC", "OIHW", "NHWC"),
        )[0]
        result: Float[Array, "H2 W2 O"] = out + self.bias.astype(x.dtype)[None, None, :]
        return result


def posterior_moments(
    h: Float[Array, "*S M"], channels: int
) -> tuple[Float[Array, "*S L"], Float[Array, "*S L"]]:
    """The posterior's mean and log-variance of an encoder's output `h` (the mean's `channels`
    channels, then the log-variance's), in float32, the log-variance clipped to `[-30, 20]` as
    diffusers' `DiagonalGaussianDistribution` clips it.

    **Arguments:**

    - `h`: the encoder's output, `2 * channels` channels last.
    - `channels`: the latent's channels.

    **Returns:**

    `(mean, logvar)`, each with `channels` channels.
    """
    h = h.astype(jnp.float32)
    return h[..., :channels], jnp.clip(h[..., channels:], -30.0, 20.0)


def sample_posterior(
    mean: Float[Array, "*S L"], logvar: Float[Array, "*S L"], key: PRNGKeyArray | None
) -> Float[Array, "*S L"]:
    """The posterior's mean, or a sample of it: `mean + exp(logvar / 2) * N(0, 1)`.

    **Arguments:**

    - `mean`, `logvar`: the posterior's moments, float32 (`posterior_moments`).
    - `key`: a JAX PRNG key to sample; `None` for the mean.

    **Returns:**

    The latent, float32, unscaled.
    """
    if key is None:
        return mean
    sample: Float[Array, "*S L"] = mean + jnp.exp(0.5 * logvar) * jax.random.normal(
        key, mean.shape, jnp.float32
    )
    return sample
