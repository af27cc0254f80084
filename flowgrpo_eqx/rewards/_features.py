"""The normalised CLIP features the rewards compare, and the rewards' shared base."""

import abc

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ..models import CLIPModel, clip_pixels
from ..models._images import check_image


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


_ONE_IMAGE = (
    "A reward scores one image: vmap it over a batch [N, H, W, C] (`DeviceReward` does); "
    "score a video [F, H, W, C] by its frames."
)


def image_embedding(model: CLIPModel, image: Float[Array, "H W C"]) -> Float[Array, " P"]:
    """One decoded image's projected features, of unit length, in float32: the image in
    `[-1, 1]` mapped to `[0, 1]` and put through the CLIP image processor (`clip_pixels`).

    **Arguments:**

    - `model`: the CLIP model.
    - `image`: a channels-last image, float in `[-1, 1]`.

    **Returns:**

    `[projection_dim]`.

    **Raises:**

    - `ValueError`: naming `image` when it is not float (uint8 is refused: convert it with
        `x / 127.5 - 1`) or not one `[H, W, C]` image of the tower's channels.
    """
    channels = model.vision_model.embeddings.patch_embedding.weight.shape[1]
    check_image("image", image, ("H", "W", "C"), channels, hint=_ONE_IMAGE)
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

        - `image`: a decoded channels-last image, float in `[-1, 1]`.
        - `prompt`: the prompt's `prompt_embedding`, `[projection_dim]` float.

        **Returns:**

        The score, a float32 scalar.

        **Raises:**

        - `ValueError`: naming `image` when it is not float (uint8 is refused: convert it
            with `x / 127.5 - 1`) or not one `[H, W, C]` image of the tower's channels (a
            video `[F, H, W, C]` is refused: score its frames); naming `prompt` when it is
            not a float `[projection_dim]` embedding.
        """
        width = self.model.text_projection.weight.shape[0]
        dtype = getattr(prompt, "dtype", None)
        shape = tuple(getattr(prompt, "shape", ()))
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating) or shape != (width,):
            raise ValueError(
                f"`prompt` must be one prompt's float embedding [{width}] (`prompt_embedding`), "
                f"got shape {shape} of {dtype}."
            )
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
