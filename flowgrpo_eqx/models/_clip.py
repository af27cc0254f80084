"""CLIP's text and image towers, as transformers' `CLIPTextModel`,
`CLIPTextModelWithProjection`, `CLIPVisionModelWithProjection` and `CLIPModel` compute them.

Each module's tree mirrors transformers' state dict (`_mirror.py`), so a checkpoint folder
loads by its keys alone (`load_clip`). The towers are called on one example (token ids `[L]`,
a channels-last image `[H, W, 3]` already resized and normalised) and vmapped by the caller.
"""

import math
import pathlib
from typing import Any, Literal, NamedTuple, TypeAlias, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from .._misc import check_int
from ._images import UNIT, check_image
from ._layers import dense_in_input_dtype, softmax_attention
from ._mirror import (
    Embedding,
    LayerNorm,
    check_token_ids,
    config_error,
    config_int,
    config_object,
    fill_from_state_dict,
    read_config_json,
    read_safetensors_folder,
    uniform_init,
)


Activation: TypeAlias = Literal["quick_gelu", "gelu"]
"""The feed-forward's activation (transformers' `hidden_act`): OpenAI's CLIP models take
`"quick_gelu"` (`x sigmoid(1.702 x)`), OpenCLIP's (bigG, ViT-H, PickScore) the exact
`"gelu"`."""

_ACTIVATIONS: tuple[Activation, ...] = ("quick_gelu", "gelu")


def _activate(x: Float[Array, "*S"], kind: Activation) -> Float[Array, "*S"]:
    if kind == "quick_gelu":
        out: Float[Array, "*S"] = x * jax.nn.sigmoid(1.702 * x)
        return out
    return jax.nn.gelu(x, approximate=False)


@final
class TowerShape(eqx.Module):
    """What every layer of one tower shares (transformers' `CLIPTextConfig` or
    `CLIPVisionConfig`).

    **Arguments:**

    - `width`: `hidden_size`.
    - `heads`: `num_attention_heads`, dividing `width`.
    - `mlp_width`: `intermediate_size`.
    - `layers`: `num_hidden_layers`.
    - `activation`: `hidden_act`.
    - `eps`: `layer_norm_eps`.

    **Raises:**

    - `ValueError`: naming the argument, when a size is not a positive int, `heads` does not
        divide `width`, or `activation` is not one of `Activation`'s.
    """

    width: int = eqx.field(static=True)
    heads: int = eqx.field(static=True)
    mlp_width: int = eqx.field(static=True)
    layers: int = eqx.field(static=True)
    activation: Activation = eqx.field(static=True)
    eps: float = eqx.field(static=True)

    def __check_init__(self) -> None:
        for name in ("width", "heads", "mlp_width", "layers"):
            check_int(name, getattr(self, name), 1)
        if self.width % self.heads:
            raise ValueError(f"`heads` ({self.heads}) must divide `width` ({self.width}).")
        if self.activation not in _ACTIVATIONS:
            raise ValueError(
                f"`activation` must be one of {_ACTIVATIONS}, got {self.activation!r}."
            )


@final
class SelfAttention(eqx.Module):
    """CLIP's multi-head self-attention (`q_proj`, `k_proj`, `v_proj`, `out_proj`), with an
    optional mask of the keys each query may see; softmax in float32.

    **Arguments:**

    - `shape`: the tower's shape.
    - `key`: a JAX PRNG key for the initialisation.
    """

    q_proj: eqx.nn.Linear
    k_proj: eqx.nn.Linear
    v_proj: eqx.nn.Linear
    out_proj: eqx.nn.Linear
    heads: int = eqx.field(static=True)

    def __init__(self, shape: TowerShape, *, key: PRNGKeyArray) -> None:
        kq, kk, kv, ko = jax.random.split(key, 4)
        width = shape.width
        self.q_proj = eqx.nn.Linear(width, width, dtype=jnp.float32, key=kq)
        self.k_proj = eqx.nn.Linear(width, width, dtype=jnp.float32, key=kk)
        self.v_proj = eqx.nn.Linear(width, width, dtype=jnp.float32, key=kv)
        self.out_proj = eqx.nn.Linear(width, width, dtype=jnp.float32, key=ko)
        self.heads = shape.heads

    def __call__(
        self, h: Float[Array, "S D"], allowed: Bool[Array, "S S"] | None
    ) -> Float[Array, "S D"]:
        seq, width = h.shape
        head_dim = width // self.heads

        def split(x: Float[Array, "S D"]) -> Float[Array, "heads S hd"]:
            return x.reshape(seq, self.heads, head_dim).transpose(1, 0, 2)

        q, k, v = (
            split(dense_in_input_dtype(linear, h))
            for linear in (self.q_proj, self.k_proj, self.v_proj)
        )
        scale = 1.0 / math.sqrt(head_dim)
        out = softmax_attention(q, k, v, scale=scale, allowed=allowed).reshape(seq, width)
        result: Float[Array, "S D"] = dense_in_input_dtype(self.out_proj, out)
        return result


@final
class MLP(eqx.Module):
    """CLIP's feed-forward: `fc2(activation(fc1(h)))`.

    **Arguments:**

    - `shape`: the tower's shape.
    - `key`: a JAX PRNG key for the initialisation.
    """

    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear
    activation: Activation = eqx.field(static=True)

    def __init__(self, shape: TowerShape, *, key: PRNGKeyArray) -> None:
        k1, k2 = jax.random.split(key)
        self.fc1 = eqx.nn.Linear(shape.width, shape.mlp_width, dtype=jnp.float32, key=k1)
        self.fc2 = eqx.nn.Linear(shape.mlp_width, shape.width, dtype=jnp.float32, key=k2)
        self.activation = shape.activation

    def __call__(self, h: Float[Array, "S D"]) -> Float[Array, "S D"]:
        out: Float[Array, "S D"] = dense_in_input_dtype(
            self.fc2, _activate(dense_in_input_dtype(self.fc1, h), self.activation)
        )
        return out


@final
class EncoderLayer(eqx.Module):
    """One pre-norm transformer layer (transformers' `CLIPEncoderLayer`).

    **Arguments:**

    - `shape`: the tower's shape.
    - `key`: a JAX PRNG key for the initialisation.
    """

    self_attn: SelfAttention
    layer_norm1: LayerNorm
    mlp: MLP
    layer_norm2: LayerNorm

    def __init__(self, shape: TowerShape, *, key: PRNGKeyArray) -> None:
        k_attn, k_mlp = jax.random.split(key)
        self.self_attn = SelfAttention(shape, key=k_attn)
        self.layer_norm1 = LayerNorm(shape.width, shape.eps)
        self.mlp = MLP(shape, key=k_mlp)
        self.layer_norm2 = LayerNorm(shape.width, shape.eps)

    def __call__(
        self, h: Float[Array, "S D"], allowed: Bool[Array, "S S"] | None
    ) -> Float[Array, "S D"]:
        h = h + self.self_attn(self.layer_norm1(h), allowed)
        out: Float[Array, "S D"] = h + self.mlp(self.layer_norm2(h))
        return out


@final
class Encoder(eqx.Module):
    """The tower's layers (transformers' `CLIPEncoder`).

    **Arguments:**

    - `shape`: the tower's shape.
    - `key`: a JAX PRNG key for the initialisation.
    """

    layers: tuple[EncoderLayer, ...]

    def __init__(self, shape: TowerShape, *, key: PRNGKeyArray) -> None:
        self.layers = tuple(EncoderLayer(shape, key=k) for k in jax.random.split(key, shape.layers))

    def __call__(
        self, h: Float[Array, "S D"], allowed: Bool[Array, "S S"] | None
    ) -> Float[Array, "states S D"]:
        """Every hidden state: the embeddings, then each layer's output (transformers'
        `hidden_states`)."""
        states = [h]
        for layer in self.layers:
            h = layer(h, allowed)
            states.append(h)
        return jnp.stack(states)


@final
class TextEmbeddings(eqx.Module):
    """Token and position embeddings of the text tower.

    **Arguments:**

    - `vocab_size`, `max_position_embeddings`, `width`: the sizes.
    - `key`: a JAX PRNG key for the initialisation.
    """

    token_embedding: Embedding
    position_embedding: Embedding

    def __init__(
        self, vocab_size: int, max_position_embeddings: int, width: int, *, key: PRNGKeyArray
    ) -> None:
        k_tok, k_pos = jax.random.split(key)
        self.token_embedding = Embedding(vocab_size, width, key=k_tok)
        self.position_embedding = Embedding(max_position_embeddings, width, key=k_pos)

    def __call__(self, ids: Int[Array, " L"]) -> Float[Array, "L D"]:
        positions = jnp.arange(ids.shape[0])
        out: Float[Array, "L D"] = self.token_embedding(ids) + self.position_embedding(positions)
        return out


class TextOutput(NamedTuple):
    """What the text tower gives for one prompt.

    - `hidden_states`: `[layers + 1, L, D]`, the embeddings then each layer's output, before
        the final norm (SD3 takes the penultimate, `hidden_states[-2]`).
    - `last_hidden_state`: `[L, D]`, the last layer's output after the final norm.
    - `pooled`: `[D]`, `last_hidden_state` at the end-of-text token.
    - `text_embeds`: `[projection_dim]`, `pooled` through `text_projection`, or `None` for a
        tower without one.
    """

    hidden_states: Float[Array, "states L D"]
    last_hidden_state: Float[Array, "L D"]
    pooled: Float[Array, " D"]
    text_embeds: Float[Array, " P"] | None


@final
class TextTransformer(eqx.Module):
    """transformers' `CLIPTextTransformer`: embeddings, causal layers, the final norm.

    **Arguments:**

    - `shape`: the tower's shape.
    - `vocab_size`, `max_position_embeddings`: the table sizes.
    - `key`: a JAX PRNG key for the initialisation.
    """

    embeddings: TextEmbeddings
    encoder: Encoder
    final_layer_norm: LayerNorm

    def __init__(
        self,
        shape: TowerShape,
        vocab_size: int,
        max_position_embeddings: int,
        *,
        key: PRNGKeyArray,
    ) -> None:
        k_emb, k_enc = jax.random.split(key)
        self.embeddings = TextEmbeddings(
            vocab_size, max_position_embeddings, shape.width, key=k_emb
        )
        self.encoder = Encoder(shape, key=k_enc)
        self.final_layer_norm = LayerNorm(shape.width, shape.eps)


@final
class CLIPTextModel(eqx.Module):
    """CLIP's text tower (transformers' `CLIPTextModel`, or `CLIPTextModelWithProjection` with
    `projection_dim`): the causal transformer over token ids, its pooled end-of-text state and
    that state's projection.

    SD3 and SD3.5 take two (CLIP-L, `quick_gelu`, and OpenCLIP bigG, `gelu`, both with
    projections); FLUX.1 takes CLIP-L's pooled state. `load_clip` reads a transformers folder.

    **Arguments:**

    - `shape`: the layers' shape (`TowerShape`).
    - `vocab_size`: the tokenizer's vocabulary (49408).
    - `max_position_embeddings`: the longest prompt (77).
    - `eos_token_id`: the end-of-text token; the pooled state is taken at the first one (at the
        largest id when it is 2, as transformers does for configs older than that field).
    - `projection_dim`: the projection's width, or `None` for a tower without one.
    - `key`: a JAX PRNG key for the initialisation.

    **Raises:**

    - `ValueError`: naming the argument, when a size is not a positive int.
    """

    text_model: TextTransformer
    text_projection: eqx.nn.Linear | None
    eos_token_id: int = eqx.field(static=True)
    max_position_embeddings: int = eqx.field(static=True)

    def __init__(
        self,
        shape: TowerShape,
        vocab_size: int = 49408,
        max_position_embeddings: int = 77,
        eos_token_id: int = 49407,
        projection_dim: int | None = None,
        *,
        key: PRNGKeyArray,
    ) -> None:
        check_int("vocab_size", vocab_size, 1)
        check_int("max_position_embeddings", max_position_embeddings, 1)
        k_model, k_proj = jax.random.split(key)
        self.text_model = TextTransformer(shape, vocab_size, max_position_embeddings, key=k_model)
        self.text_projection = (
            None
            if projection_dim is None
            else eqx.nn.Linear(
                shape.width, projection_dim, use_bias=False, dtype=jnp.float32, key=k_proj
            )
        )
        self.eos_token_id = eos_token_id
        self.max_position_embeddings = max_position_embeddings

    def __call__(
        self, ids: Int[Array, " L"], attention_mask: Int[Array, " L"] | None = None
    ) -> TextOutput:
        """The tower's states for one tokenized prompt.

        **Arguments:**

        - `ids`: the token ids, `[L]`, `1 <= L <= max_position_embeddings`, each in `[0,
            vocab_size)`.
        - `attention_mask`: 1 for the prompt's tokens, 0 for padding the queries may not see
            (as the tokenizer returns it); `None`: every token (the SD3 pipelines' call).

        **Returns:**

        A `TextOutput`.

        **Raises:**

        - `ValueError`: naming `ids` when it is not `[L]` integer ids with `1 <= L <=
            max_position_embeddings`, or (for concrete ids) holds an id outside `[0,
            vocab_size)`; naming `attention_mask` when it is not `[L]` of ints.
        - `EquinoxRuntimeError`: for a traced id outside `[0, vocab_size)`.
        """
        return _encode_text(
            self.text_model,
            self.text_projection,
            self.eos_token_id,
            self.max_position_embeddings,
            ids,
            attention_mask,
        )


def _encode_text(
    model: TextTransformer,
    projection: eqx.nn.Linear | None,
    eos_token_id: int,
    max_length: int,
    ids: Int[Array, " L"],
    attention_mask: Int[Array, " L"] | None,
) -> TextOutput:
    """The text tower's states for one prompt (`CLIPTextModel.__call__`)."""
    vocab_size = model.embeddings.token_embedding.weight.shape[0]
    ids = check_token_ids("ids", ids, vocab_size, attention_mask, max_length)
    length = ids.shape[0]
    allowed = jnp.tril(jnp.ones((length, length), jnp.bool_))
    if attention_mask is not None:
        allowed = allowed & (attention_mask[None, :] > 0)
    states = model.encoder(model.embeddings(ids), allowed)
    last = model.final_layer_norm(states[-1])
    end = jnp.argmax(ids) if eos_token_id == 2 else jnp.argmax(ids == eos_token_id)
    pooled = last[end]
    projected = None if projection is None else dense_in_input_dtype(projection, pooled)
    return TextOutput(states, last, pooled, projected)


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
        output = _encode_text(
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
