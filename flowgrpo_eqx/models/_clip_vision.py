"""CLIP's image tower, as transformers' `CLIPVisionTransformer` computes it (the patches'
and class token's embeddings, the pre-norm, the layers, the post-norm of the class token),
and what the CLIP image processor makes of an image (`clip_pixels`). Called on one
channels-last image `[H, W, 3]`, vmapped by the caller; `CLIPModel` holds the tower with its
projection.
"""

from typing import final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from .._misc import check_int
from ._clip_encoder import Encoder, TowerShape
from ._images import UNIT, check_image
from ._mirror import (
    Embedding,
    LayerNorm,
    uniform_init,
)


@final
class PatchEmbedding(eqx.Module):
    """The patches' embedding: a convolution without bias whose stride is its kernel, held in
    torch's `[D, C, p, p]` layout.

    **Arguments:**

    - `weight`: the kernel.
    """

    weight: Float[Array, "D C p p"]


@final
class VisionEmbeddings(eqx.Module):
    """The class token, the patches' linear embedding (a convolution without bias, in torch's
    `[D, 3, p, p]` layout) and the position table.

    **Arguments:**

    - `width`: the tower's width.
    - `image_size`, `patch_size`, `channels`: the image's side, the patch's side, channels.
    - `key`: a JAX PRNG key for the initialisation.
    """

    class_embedding: Float[Array, " D"]
    patch_embedding: PatchEmbedding
    position_embedding: Embedding
    patch_size: int = eqx.field(static=True)

    def __init__(
        self, width: int, image_size: int, patch_size: int, channels: int, *, key: PRNGKeyArray
    ) -> None:
        k_cls, k_patch, k_pos = jax.random.split(key, 3)
        self.class_embedding = jax.random.normal(k_cls, (width,), jnp.float32)
        fan_in = channels * patch_size * patch_size
        self.patch_embedding = PatchEmbedding(
            uniform_init(k_patch, (width, channels, patch_size, patch_size), fan_in)
        )
        patches = (image_size // patch_size) ** 2
        self.position_embedding = Embedding(patches + 1, width, key=k_pos)
        self.patch_size = patch_size

    def __call__(self, pixels: Float[Array, "H W C"]) -> Float[Array, "tokens D"]:
        side, _, channels = pixels.shape
        grid, p = side // self.patch_size, self.patch_size
        patches = pixels.reshape(grid, p, grid, p, channels).transpose(0, 2, 4, 1, 3)
        weight = self.patch_embedding.weight
        flat = patches.reshape(grid * grid, channels * p * p)
        embedded = flat @ weight.reshape(weight.shape[0], -1).T.astype(flat.dtype)
        tokens = jnp.concatenate([self.class_embedding.astype(flat.dtype)[None], embedded])
        out: Float[Array, "tokens D"] = tokens + self.position_embedding.weight.astype(flat.dtype)
        return out


@final
class VisionTransformer(eqx.Module):
    """transformers' `CLIPVisionTransformer`: embeddings, the pre-norm (`pre_layrnorm`, as
    transformers spells it), the layers, the post-norm of the class token.

    **Arguments:**

    - `shape`: the tower's shape.
    - `image_size`, `patch_size`, `channels`: the image's geometry.
    - `key`: a JAX PRNG key for the initialisation.
    """

    embeddings: VisionEmbeddings
    pre_layrnorm: LayerNorm
    encoder: Encoder
    post_layernorm: LayerNorm

    def __init__(
        self,
        shape: TowerShape,
        image_size: int,
        patch_size: int,
        channels: int,
        *,
        key: PRNGKeyArray,
    ) -> None:
        k_emb, k_enc = jax.random.split(key)
        self.embeddings = VisionEmbeddings(shape.width, image_size, patch_size, channels, key=k_emb)
        self.pre_layrnorm = LayerNorm(shape.width, shape.eps)
        self.encoder = Encoder(shape, key=k_enc)
        self.post_layernorm = LayerNorm(shape.width, shape.eps)

    def __call__(self, pixels: Float[Array, "H W C"]) -> Float[Array, " D"]:
        """The pooled state: the class token's last state, post-normed."""
        states = self.encoder(self.pre_layrnorm(self.embeddings(pixels)), None)
        return self.post_layernorm(states[-1][0])


def clip_pixels(
    images: Float[Array, "H W C"],
    size: int,
    mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073),
    std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711),
) -> Float[Array, "size size C"]:
    """What the CLIP image processor makes of one image in `[0, 1]`, in JAX: quantised to
    8 bits as a PIL image would be, resized so its shorter side is `size` (bicubic with
    antialiasing), centre-cropped to `size x size`, normalised by `mean` and `std`.

    An image already `size x size` is not resampled, so its pixels are the processor's
    exactly. A resized one differs from PIL's bicubic, which resamples the 8-bit image,
    rounds its result to 8 bits and treats the border otherwise: on uniform noise, a third of
    an 8-bit step on average and up to 14 steps at the border (`tests/test_clip.py`). Decode
    at the tower's size to score exactly as the processor would.

    **Arguments:**

    - `images`: one channels-last image, float in `[0, 1]`, with as many channels as `mean`
        (3).
    - `size`: the tower's `image_size`.
    - `mean`, `std`: the normalisation (OpenAI's CLIP statistics by default, which OpenCLIP
        and PickScore's processor use too).

    **Returns:**

    `[size, size, C]` float32.

    **Raises:**

    - `ValueError`: naming `images` when it is not float (uint8 is refused: convert it with
        `x / 255`), not `[H, W, C]` with `C` the channels of `mean`, or has an empty side;
        naming `size` when it is not a positive int, or `std` when it is not as long as
        `mean`.
    """
    check_int("size", size, 1)
    if len(std) != len(mean):
        raise ValueError(f"`std` must have as many entries as `mean` ({len(mean)}), got {std}.")
    check_image(
        "images",
        images,
        ("H", "W", "C"),
        len(mean),
        rule=UNIT,
        hint="It processes one image: vmap it over a batch; score a video's frames one by one.",
    )
    quantised = jnp.round(jnp.clip(images.astype(jnp.float32), 0.0, 1.0) * 255.0) / 255.0
    height, width, channels = quantised.shape
    if min(height, width) != size:
        # The processor's sizes: the shorter side `size`, the longer `int(size * long / short)`.
        short, long = min(height, width), max(height, width)
        other = int(size * long / short)
        shape = (size, other, channels) if height <= width else (other, size, channels)
        quantised = jax.image.resize(quantised, shape, "bicubic", antialias=True)
    top = (quantised.shape[0] - size) // 2
    left = (quantised.shape[1] - size) // 2
    cropped = quantised[top : top + size, left : left + size]
    shift = jnp.asarray(mean, jnp.float32)[None, None, :]
    scale_by = jnp.asarray(std, jnp.float32)[None, None, :]
    out: Float[Array, "size size C"] = (cropped - shift) / scale_by
    return out
