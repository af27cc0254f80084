"""CLIP's text and image towers, as transformers' `CLIPTextModel`,
`CLIPTextModelWithProjection`, `CLIPVisionModelWithProjection` and `CLIPModel` compute them.

Each module's tree mirrors transformers' state dict (`_mirror.py`), so a checkpoint folder
loads by its keys alone (`load_clip`). The towers are called on one example (token ids `[L]`,
a channels-last image `[H, W, 3]` already resized and normalised) and vmapped by the caller.
What both towers share is in `_clip_encoder.py`, the text tower in `_clip_text.py`, the image
tower and `clip_pixels` in `_clip_vision.py`; this module holds `CLIPModel` and `load_clip`.
"""

import pathlib
from typing import Any, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._misc import check_int
from ._clip_encoder import (
    MLP as MLP,
    Activation as Activation,
    Encoder as Encoder,
    EncoderLayer as EncoderLayer,
    SelfAttention as SelfAttention,
    TowerShape as TowerShape,
)
from ._clip_text import (
    CLIPTextModel as CLIPTextModel,
    TextEmbeddings as TextEmbeddings,
    TextOutput as TextOutput,
    TextTransformer as TextTransformer,
    encode_text,
)
from ._clip_vision import (
    PatchEmbedding as PatchEmbedding,
    VisionEmbeddings as VisionEmbeddings,
    VisionTransformer as VisionTransformer,
    clip_pixels as clip_pixels,
)
from ._images import check_image
from ._layers import dense_in_input_dtype
from ._mirror import (
    config_error,
    config_int,
    config_object,
    fill_from_state_dict,
    read_config_json,
    read_safetensors_folder,
)


@final
class CLIPModel(eqx.Module):
    """Both CLIP towers with their projections and the learned temperature (transformers'
    `CLIPModel`): PickScore, CLIP score and HPS-style rewards compare the two embeddings.

    **Arguments:**

    - `text`: the text tower's shape; `vocab_size`, `max_position_embeddings`, `eos_token_id`
        as `CLIPTextModel`'s.
    - `vision`: the image tower's shape; `image_size`, `patch_size`, `channels` its geometry.
    - `projection_dim`: the shared embedding's width.
    - `logit_scale_init`: the temperature's log (2.6592, `log(1 / 0.07)`).
    - `key`: a JAX PRNG key for the initialisation.

    **Raises:**

    - `ValueError`: naming the argument, when a size is not a positive int or `patch_size`
        does not divide `image_size`.
    """

    text_model: TextTransformer
    vision_model: VisionTransformer
    text_projection: eqx.nn.Linear
    visual_projection: eqx.nn.Linear
    logit_scale: Float[Array, ""]
    eos_token_id: int = eqx.field(static=True)
    image_size: int = eqx.field(static=True)

    def __init__(
        self,
        text: TowerShape,
        vision: TowerShape,
        projection_dim: int,
        vocab_size: int = 49408,
        max_position_embeddings: int = 77,
        eos_token_id: int = 49407,
        image_size: int = 224,
        patch_size: int = 14,
        channels: int = 3,
        logit_scale_init: float = 2.6592,
        *,
        key: PRNGKeyArray,
    ) -> None:
        for name, value in dict(
            projection_dim=projection_dim,
            image_size=image_size,
            patch_size=patch_size,
            channels=channels,
        ).items():
            check_int(name, value, 1)
        if image_size % patch_size:
            raise ValueError(
                f"`patch_size` ({patch_size}) must divide `image_size` ({image_size})."
            )
        k_text, k_vision, k_tp, k_vp = jax.random.split(key, 4)
        self.text_model = TextTransformer(text, vocab_size, max_position_embeddings, key=k_text)
        self.vision_model = VisionTransformer(
            vision, image_size, patch_size, channels, key=k_vision
        )
        self.text_projection = eqx.nn.Linear(
            text.width, projection_dim, use_bias=False, dtype=jnp.float32, key=k_tp
        )
        self.visual_projection = eqx.nn.Linear(
            vision.width, projection_dim, use_bias=False, dtype=jnp.float32, key=k_vp
        )
        self.logit_scale = jnp.asarray(logit_scale_init, jnp.float32)
        self.eos_token_id = eos_token_id
        self.image_size = image_size

    def text_features(
        self, ids: Int[Array, " L"], attention_mask: Int[Array, " L"] | None = None
    ) -> Float[Array, " P"]:
        """transformers' `get_text_features`: the projected pooled text state.

        **Arguments:**

        - `ids`: token ids, `[L]`.
        - `attention_mask`: the tokenizer's mask, or `None`.

        **Returns:**

        `[projection_dim]`.

        **Raises:**

        - `ValueError`, `EquinoxRuntimeError`: as `CLIPTextModel.__call__`'s.
        """
        max_length = self.text_model.embeddings.position_embedding.weight.shape[0]
        output = encode_text(
            self.text_model,
            None,
            self.eos_token_id,
            max_length,
            ids,
            attention_mask,
        )
        embeds: Float[Array, " P"] = dense_in_input_dtype(self.text_projection, output.pooled)
        return embeds

    def image_features(self, pixels: Float[Array, "H W C"]) -> Float[Array, " P"]:
        """transformers' `get_image_features`: the projected pooled image state.

        **Arguments:**

        - `pixels`: `[image_size, image_size, channels]`, resized and normalised as the
            CLIP image processor does (`clip_pixels`).

        **Returns:**

        `[projection_dim]`.

        **Raises:**

        - `ValueError`: naming `pixels` when it is not float or its shape is not the
            tower's.
        """
        want = (self.image_size, self.image_size)
        channels = self.vision_model.embeddings.patch_embedding.weight.shape[1]
        check_image("pixels", pixels, ("H", "W", "C"), channels, rule="float (`clip_pixels`)")
        if pixels.shape[:2] != want:
            raise ValueError(
                f"`pixels` must be [{want[0]}, {want[1]}, {channels}], got {pixels.shape}."
            )
        out: Float[Array, " P"] = dense_in_input_dtype(
            self.visual_projection, self.vision_model(pixels)
        )
        return out


def _tower_shape(config: dict[str, Any], file: pathlib.Path, where: str = "") -> TowerShape:
    """A tower's shape from its config (`where`: the field holding it, `"text_config."`)."""
    try:
        return TowerShape(
            config_int(config, where + "hidden_size", file),
            config_int(config, where + "num_attention_heads", file),
            config_int(config, where + "intermediate_size", file),
            config_int(config, where + "num_hidden_layers", file),
            config.get("hidden_act", "quick_gelu"),
            config.get("layer_norm_eps", 1e-5),
        )
    except ValueError as error:
        raise config_error(file, error) from None


_IGNORED = ("position_ids",)


def load_clip(path: str | pathlib.Path, *, dtype: Any = None) -> CLIPTextModel | CLIPModel:
    """Read a transformers CLIP folder (`config.json` and `model.safetensors`, or shards): a
    `CLIPTextModel` or `CLIPTextModelWithProjection` folder (a pipeline's `text_encoder/`)
    into a `CLIPTextModel`, a `CLIPModel` folder (PickScore's, OpenAI's) into a `CLIPModel`.

    **Arguments:**

    - `path`: the folder.
    - `dtype`: the parameters' dtype; `None` keeps the checkpoint's.

    **Returns:**

    The `CLIPTextModel` or `CLIPModel`.

    **Raises:**

    - `ValueError`: naming `path` when the folder has no `config.json` or its
        `architectures` is none of those; naming the config file when it is not a JSON
        object (binary, not JSON) or lacks a field the model needs (`text_config`,
        `hidden_size`, ...) or gives one of the wrong type; naming the weights file when it
        is missing, empty, truncated or damaged (or the one command that converts a `.bin`
        checkpoint); or when the checkpoint does not fit the config (every unused key,
        missing leaf and wrong shape listed).
    """
    folder = pathlib.Path(path)
    config = read_config_json(folder, "a transformers CLIP folder")
    file = folder / "config.json"
    architectures = config.get("architectures")
    architecture = architectures[0] if isinstance(architectures, list) and architectures else ""
    if architecture in ("CLIPTextModel", "CLIPTextModelWithProjection"):
        with_projection = architecture == "CLIPTextModelWithProjection"
        shape = _tower_shape(config, file)
        text_sizes = dict(
            vocab_size=config_int(config, "vocab_size", file, 49408),
            max_position_embeddings=config_int(config, "max_position_embeddings", file, 77),
            eos_token_id=config_int(config, "eos_token_id", file, 2, minimum=0),
        )
        projection = config_int(config, "projection_dim", file, 512) if with_projection else None
        tensors = read_safetensors_folder(folder, "model.safetensors")
        if not any(key.startswith("text_model.") for key in tensors):
            # transformers 5 writes a `CLIPTextModel`'s keys without the `text_model.` that
            # the published checkpoints (and its own `CLIPTextModelWithProjection`) have.
            tensors = {f"text_model.{key}": value for key, value in tensors.items()}
        model: CLIPTextModel | CLIPModel = eqx.filter_eval_shape(
            lambda key: CLIPTextModel(shape, **text_sizes, projection_dim=projection, key=key),
            jax.random.key(0),
        )
    elif architecture == "CLIPModel":
        text = config_object(config, "text_config", file)
        vision = config_object(config, "vision_config", file)
        text_shape = _tower_shape(text, file, "text_config.")
        vision_shape = _tower_shape(vision, file, "vision_config.")
        sizes = dict(
            projection_dim=config_int(config, "projection_dim", file, 512),
            vocab_size=config_int(text, "text_config.vocab_size", file, 49408),
            max_position_embeddings=config_int(
                text, "text_config.max_position_embeddings", file, 77
            ),
            eos_token_id=config_int(text, "text_config.eos_token_id", file, 2, minimum=0),
            image_size=config_int(vision, "vision_config.image_size", file, 224),
            patch_size=config_int(vision, "vision_config.patch_size", file, 32),
            channels=config_int(vision, "vision_config.num_channels", file, 3),
        )
        tensors = read_safetensors_folder(folder, "model.safetensors")
        try:
            model = eqx.filter_eval_shape(
                lambda key: CLIPModel(text_shape, vision_shape, **sizes, key=key), jax.random.key(0)
            )
        except ValueError as error:
            raise config_error(file, error) from None
    else:
        raise ValueError(
            f"`path` ({folder}): config `architectures` must be CLIPTextModel, "
            f"CLIPTextModelWithProjection or CLIPModel, got {architecture!r}."
        )
    loaded: CLIPTextModel | CLIPModel = fill_from_state_dict(
        model, tensors, dtype, type(model).__name__, _IGNORED
    )
    return loaded
