"""CLIP's text tower, as transformers' `CLIPTextModel` and `CLIPTextModelWithProjection`
compute it: the token and position embeddings, the causal transformer (`TextTransformer`),
its pooled end-of-text state and that state's projection (`CLIPTextModel`, `encode_text`,
which `CLIPModel` shares). Called on one prompt's token ids `[L]`, vmapped by the caller.
"""

from typing import NamedTuple, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._misc import check_int
from ._clip_encoder import Encoder, TowerShape
from ._layers import dense_in_input_dtype
from ._mirror import (
    Embedding,
    LayerNorm,
    check_token_ids,
)


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
        return encode_text(
            self.text_model,
            self.text_projection,
            self.eos_token_id,
            self.max_position_embeddings,
            ids,
            attention_mask,
        )


def encode_text(
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
