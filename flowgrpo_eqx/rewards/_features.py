"""The normalised CLIP features the rewards compare, and the rewards' shared base."""

import abc

import equinox as eqx
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


class AbstractCLIPReward(eqx.Module):
    """A reward that compares a decoded image's CLIP features with a prompt's: each prompt is
    embedded once (`prompt_embedding`, carried in the rows), each image scored against its
    prompt's embedding (`__call__`) by a function of the two features' cosine (`of_cosine`).
    """

    model: eqx.AbstractVar[CLIPModel]

    def prompt_embedding(
        self, ids: Int[Array, " L"], attention_mask: Int[Array, " L"] | None = None
    ) -> Float[Array, " P"]:
        """One prompt's normalised text features.

        **Arguments:**

        - `ids`: the prompt's token ids (the CLIP tokenizer's, padded and truncated to 77).
        - `attention_mask`: the tokenizer's mask, or `None`.

        **Returns:**

        `[projection_dim]`, of unit length.
        """
        return text_embedding(self.model, ids, attention_mask)

    def __call__(
        self, image: Float[Array, "H W C"], prompt: Float[Array, " P"]
    ) -> Float[Array, ""]:
        """The score of one image for one prompt's embedding: `of_cosine` of the cosine of
        the image's and the prompt's normalised features.

        **Arguments:**

        - `image`: a decoded channels-last image in `[-1, 1]`.
        - `prompt`: the prompt's `prompt_embedding`.

        **Returns:**

        The score, a float32 scalar.
        """
        return self.of_cosine(jnp.dot(image_embedding(self.model, image), prompt))

    @abc.abstractmethod
    def of_cosine(self, cosine: Float[Array, ""]) -> Float[Array, ""]:
        """The score of an image whose normalised features have cosine `cosine` with its
        prompt's.

        **Arguments:**

        - `cosine`: the cosine, a float32 scalar in `[-1, 1]`.

        **Returns:**

        The score, a float32 scalar.
        """
