"""The normalised CLIP features the rewards compare."""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ..models import CLIPModel, clip_pixels


def text_embedding(
    model: CLIPModel, ids: Int[Array, " L"], attention_mask: Int[Array, " L"] | None
) -> Float[Array, " P"]:
    """One prompt's projected text features, of unit length, in float32.

    **Arguments:**

    - `model`: the CLIP model.
    - `ids`: the prompt's token ids.
    - `attention_mask`: the tokenizer's mask, or `None`.

    **Returns:**

    `[projection_dim]`.
    """
    features = model.text_features(ids, attention_mask).astype(jnp.float32)
    out: Float[Array, " P"] = features / jnp.linalg.norm(features)
    return out


def image_embedding(model: CLIPModel, image: Float[Array, "H W C"]) -> Float[Array, " P"]:
    """One decoded image's projected features, of unit length, in float32: the image in
    `[-1, 1]` mapped to `[0, 1]` and put through the CLIP image processor (`clip_pixels`).

    **Arguments:**

    - `model`: the CLIP model.
    - `image`: a channels-last image in `[-1, 1]`.

    **Returns:**

    `[projection_dim]`.
    """
    pixels = clip_pixels((image.astype(jnp.float32) + 1.0) / 2.0, model.image_size)
    features = model.image_features(pixels.astype(model.logit_scale.dtype)).astype(jnp.float32)
    out: Float[Array, " P"] = features / jnp.linalg.norm(features)
    return out
