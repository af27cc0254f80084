"""The T5 encoder (SD3's, SD3.5's and FLUX.1's third text encoder), as transformers'
`T5EncoderModel` computes it.

The module tree mirrors transformers' state dict (`_mirror.py`): `shared`, then
`encoder.block[i].layer[0]` (self-attention, with the relative position table in the first
block only) and `encoder.block[i].layer[1]` (the feed-forward), then `encoder.final_layer_norm`.
Called on one prompt's token ids and vmapped by the caller.
"""

import math
import pathlib
from typing import Any, Literal, TypeAlias, final

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._misc import check_int
from ._init import ones
from ._layers import MASKED_SCORE, dense_in_input_dtype, rms_norm, softmax_attention
from ._mirror import (
    Embedding,
    check_token_ids,
    config_error,
    config_int,
    fill_from_state_dict,
    read_config_json,
    read_safetensors_folder,
)


FeedForward: TypeAlias = Literal["gated-gelu", "relu"]
"""T5's feed-forward (transformers' `feed_forward_proj`): v1.1's `"gated-gelu"` (`wo(gelu(wi_0
h) * wi_1 h)`, tanh GELU) or the original `"relu"` (`wo(relu(wi h))`)."""

_FEED_FORWARDS: tuple[FeedForward, ...] = ("gated-gelu", "relu")


@final
class RMSNorm(eqx.Module):
    """T5's layer norm: no mean, no bias; statistics in float32.

    **Arguments:**

    - `width`: the width.
    - `eps`: added to the mean square.
    """

    weight: Float[Array, " D"]
    eps: float = eqx.field(static=True)

    def __init__(self, width: int, eps: float) -> None:
        self.weight = ones((width,))
        self.eps = eps

    def __call__(self, h: Float[Array, "L D"]) -> Float[Array, "L D"]:
        return rms_norm(h, self.weight, self.eps).astype(h.dtype)


def relative_position_buckets(length: int, num_buckets: int, max_distance: int) -> np.ndarray:
    """Each query's bucket of each key's position relative to it, as T5's bidirectional
    encoder buckets them (transformers' `_relative_position_bucket`): half the buckets for
    keys after the query, each half exact below `num_buckets / 4` and logarithmic up to
    `max_distance`.

    **Arguments:**

    - `length`: the sequence's length.
    - `num_buckets`, `max_distance`: the config's `relative_attention_num_buckets` and
        `relative_attention_max_distance`.

    **Returns:**

    `[length, length]` int32.
    """
    relative = np.arange(length)[None, :] - np.arange(length)[:, None]
    half = num_buckets // 2
    buckets = (relative > 0).astype(np.int64) * half
    distance = np.abs(relative)
    exact = half // 2
    # The logarithmic buckets, for distances of at least `exact` (below it, the exact ones).
    far = np.maximum(distance, exact).astype(np.float32)
    large = exact + (np.log(far / exact) / math.log(max_distance / exact) * (half - exact)).astype(
        np.int64
    )
    large = np.minimum(large, half - 1)
    result: np.ndarray = (buckets + np.where(distance < exact, distance, large)).astype(np.int32)
    return result


@final
class SelfAttention(eqx.Module):
    """T5's self-attention: `q`, `k`, `v`, `o` without biases, no scaling of the scores, a
    learned bias per head and relative-position bucket (`relative_attention_bias`, held by the
    first block and shared by the others).

    **Arguments:**

    - `width`, `heads`, `head_dim`: `d_model`, `num_heads`, `d_kv`.
    - `num_buckets`: the relative-position buckets, for the block that holds the table; `None`
        for the others.
    - `key`: a JAX PRNG key for the initialisation.
    """

    q: eqx.nn.Linear
    k: eqx.nn.Linear
    v: eqx.nn.Linear
    o: eqx.nn.Linear
    relative_attention_bias: Embedding | None
    heads: int = eqx.field(static=True)

    def __init__(
        self,
        width: int,
        heads: int,
        head_dim: int,
        num_buckets: int | None,
        *,
        key: PRNGKeyArray,
    ) -> None:
        kq, kk, kv, ko, kb = jax.random.split(key, 5)
        inner = heads * head_dim
        self.q = eqx.nn.Linear(width, inner, use_bias=False, dtype=jnp.float32, key=kq)
        self.k = eqx.nn.Linear(width, inner, use_bias=False, dtype=jnp.float32, key=kk)
        self.v = eqx.nn.Linear(width, inner, use_bias=False, dtype=jnp.float32, key=kv)
        self.o = eqx.nn.Linear(inner, width, use_bias=False, dtype=jnp.float32, key=ko)
        self.relative_attention_bias = (
            None if num_buckets is None else Embedding(num_buckets, heads, key=kb)
        )
        self.heads = heads

    def __call__(
        self, h: Float[Array, "L D"], bias: Float[Array, "heads L L"]
    ) -> Float[Array, "L D"]:
        length = h.shape[0]

        def split(x: Float[Array, "L I"]) -> Float[Array, "heads L hd"]:
            return x.reshape(length, self.heads, -1).transpose(1, 0, 2)

        q, k, v = (split(dense_in_input_dtype(linear, h)) for linear in (self.q, self.k, self.v))
        # T5 folds the 1 / sqrt(head_dim) into its query weights: its scores are not scaled.
        out = softmax_attention(q, k, v, scale=1.0, bias=bias).reshape(length, -1)
        result: Float[Array, "L D"] = dense_in_input_dtype(self.o, out)
        return result


@final
class AttentionLayer(eqx.Module):
    """`layer[0]` of a T5 block: the norm, the self-attention, the residual.

    **Arguments:**

    - `SelfAttention`: the attention.
    - `layer_norm`: the norm before it.
    """

    SelfAttention: SelfAttention
    layer_norm: RMSNorm

    def __call__(
        self, h: Float[Array, "L D"], bias: Float[Array, "heads L L"]
    ) -> Float[Array, "L D"]:
        out: Float[Array, "L D"] = h + self.SelfAttention(self.layer_norm(h), bias)
        return out


@final
class DenseReluDense(eqx.Module):
    """T5's feed-forward, gated (`wi_0`, `wi_1`, `wo`) or not (`wi`, `wo`).

    **Arguments:**

    - `width`, `ff_width`: `d_model`, `d_ff`.
    - `kind`: the `FeedForward`.
    - `key`: a JAX PRNG key for the initialisation.
    """

    wi_0: eqx.nn.Linear | None
    wi_1: eqx.nn.Linear | None
    wi: eqx.nn.Linear | None
    wo: eqx.nn.Linear

    def __init__(self, width: int, ff_width: int, kind: FeedForward, *, key: PRNGKeyArray) -> None:
        k0, k1, ko = jax.random.split(key, 3)
        gated = kind == "gated-gelu"
        self.wi_0 = (
            eqx.nn.Linear(width, ff_width, use_bias=False, dtype=jnp.float32, key=k0)
            if gated
            else None
        )
        self.wi_1 = (
            eqx.nn.Linear(width, ff_width, use_bias=False, dtype=jnp.float32, key=k1)
            if gated
            else None
        )
        self.wi = (
            None
            if gated
            else eqx.nn.Linear(width, ff_width, use_bias=False, dtype=jnp.float32, key=k0)
        )
        self.wo = eqx.nn.Linear(ff_width, width, use_bias=False, dtype=jnp.float32, key=ko)

    def __call__(self, h: Float[Array, "L D"]) -> Float[Array, "L D"]:
        if self.wi_0 is not None and self.wi_1 is not None:
            hidden = jax.nn.gelu(
                dense_in_input_dtype(self.wi_0, h), approximate=True
            ) * dense_in_input_dtype(self.wi_1, h)
        else:
            assert self.wi is not None
            hidden = jax.nn.relu(dense_in_input_dtype(self.wi, h))
        out: Float[Array, "L D"] = dense_in_input_dtype(self.wo, hidden)
        return out


@final
class FeedForwardLayer(eqx.Module):
    """`layer[1]` of a T5 block: the norm, the feed-forward, the residual.

    **Arguments:**

    - `DenseReluDense`: the feed-forward.
    - `layer_norm`: the norm before it.
    """

    DenseReluDense: DenseReluDense
    layer_norm: RMSNorm

    def __call__(self, h: Float[Array, "L D"]) -> Float[Array, "L D"]:
        out: Float[Array, "L D"] = h + self.DenseReluDense(self.layer_norm(h))
        return out


@final
class Block(eqx.Module):
    """One T5 encoder block: `layer = (attention, feed-forward)`.

    **Arguments:**

    - `layer`: the two layers.
    """

    layer: tuple[AttentionLayer, FeedForwardLayer]


@final
class Stack(eqx.Module):
    """The encoder's blocks and final norm (transformers' `T5Stack`).

    **Arguments:**

    - `block`: the blocks.
    - `final_layer_norm`: the last norm.
    """

    block: tuple[Block, ...]
    final_layer_norm: RMSNorm


@final
class T5Encoder(eqx.Module):
    """T5's encoder (transformers' `T5EncoderModel`): token ids to their states.

    SD3 and SD3.5 take T5 v1.1 XXL's states of 256 tokens (`T5Encoder.v1_1_xxl_config()`),
    FLUX.1 of 512. `load_t5` reads a transformers folder (a pipeline's `text_encoder_3/`).

    **Arguments:**

    - `vocab_size`, `width`, `ff_width`, `heads`, `head_dim`, `layers`: `vocab_size`,
        `d_model`, `d_ff`, `num_heads`, `d_kv`, `num_layers`.
    - `feed_forward`: `feed_forward_proj` (`FeedForward`).
    - `num_buckets`, `max_distance`: the relative positions' buckets.
    - `eps`: `layer_norm_epsilon`.
    - `per_layer_position_bias`: whether every block has its own relative-position table
        (umT5, Wan 2.1's text encoder: transformers' `UMT5EncoderModel`) rather than the
        first block's serving all (T5).
    - `key`: a JAX PRNG key for the initialisation.

    **Raises:**

    - `ValueError`: naming the argument, when a size is not a positive int or
        `feed_forward` is not one of `FeedForward`'s.
    """

    shared: Embedding
    encoder: Stack
    num_buckets: int = eqx.field(static=True)
    max_distance: int = eqx.field(static=True)

    def __init__(
        self,
        vocab_size: int = 64,
        width: int = 32,
        ff_width: int = 48,
        heads: int = 4,
        head_dim: int = 8,
        layers: int = 2,
        feed_forward: FeedForward = "gated-gelu",
        num_buckets: int = 32,
        max_distance: int = 128,
        eps: float = 1e-6,
        per_layer_position_bias: bool = False,
        *,
        key: PRNGKeyArray,
    ) -> None:
        sizes = dict(
            vocab_size=vocab_size,
            width=width,
            ff_width=ff_width,
            heads=heads,
            head_dim=head_dim,
            layers=layers,
            num_buckets=num_buckets,
            max_distance=max_distance,
        )
        for name, value in sizes.items():
            check_int(name, value, 1)
        if feed_forward not in _FEED_FORWARDS:
            raise ValueError(
                f"`feed_forward` must be one of {_FEED_FORWARDS}, got {feed_forward!r}."
            )
        k_emb, *k_blocks = jax.random.split(key, 1 + layers)
        self.shared = Embedding(vocab_size, width, key=k_emb)
        blocks = []
        for i, k in enumerate(k_blocks):
            k_attn, k_ff = jax.random.split(k)
            buckets = num_buckets if i == 0 or per_layer_position_bias else None
            attention = SelfAttention(width, heads, head_dim, buckets, key=k_attn)
            dense = DenseReluDense(width, ff_width, feed_forward, key=k_ff)
            layer = (
                AttentionLayer(attention, RMSNorm(width, eps)),
                FeedForwardLayer(dense, RMSNorm(width, eps)),
            )
            blocks.append(Block(layer))
        self.encoder = Stack(tuple(blocks), RMSNorm(width, eps))
        self.num_buckets = num_buckets
        self.max_distance = max_distance

    @classmethod
    def v1_1_xxl_config(cls) -> dict[str, Any]:
        """The constructor arguments of T5 v1.1 XXL's encoder (`google/t5-v1_1-xxl`, as SD3's
        `text_encoder_3/config.json` has it: `d_model 4096`, `d_ff 10240`, `num_heads 64`,
        `d_kv 64`, `num_layers 24`, `vocab_size 32128`, `gated-gelu`).

        **Returns:**

        A dict of keyword arguments for `T5Encoder`.
        """
        return dict(
            vocab_size=32128,
            width=4096,
            ff_width=10240,
            heads=64,
            head_dim=64,
            layers=24,
            feed_forward="gated-gelu",
        )

    def __call__(
        self, ids: Int[Array, " L"], attention_mask: Int[Array, " L"] | None = None
    ) -> Float[Array, "L D"]:
        """The encoder's last states (after the final norm) of one prompt's token ids.

        **Arguments:**

        - `ids`: the token ids, `[L]`, `L >= 1`, each in `[0, vocab_size)`.
        - `attention_mask`: 1 for the prompt's tokens, 0 for padding no query may see;
            `None`: every token (the SD3 and FLUX pipelines' call).

        **Returns:**

        `[L, width]`.

        **Raises:**

        - `ValueError`: naming `ids` when it is not `[L]` integer ids with `L >= 1`, or (for
            concrete ids) holds an id outside `[0, vocab_size)`; naming `attention_mask`
            when it is not `[L]` of ints.
        - `EquinoxRuntimeError`: for a traced id outside `[0, vocab_size)`.
        """
        ids = check_token_ids("ids", ids, self.shared.weight.shape[0], attention_mask)
        buckets = jnp.asarray(
            relative_position_buckets(ids.shape[0], self.num_buckets, self.max_distance)
        )

        def position_bias(table: Embedding) -> Float[Array, "heads L L"]:
            bias = jnp.transpose(table.weight[buckets], (2, 0, 1)).astype(jnp.float32)
            if attention_mask is not None:
                bias = jnp.where(attention_mask[None, None, :] > 0, bias, MASKED_SCORE)
            return bias

        first = self.encoder.block[0].layer[0].SelfAttention.relative_attention_bias
        assert first is not None
        bias = position_bias(first)
        h = self.shared(ids).astype(self.shared.weight.dtype)
        for block in self.encoder.block:
            attention, feed_forward = block.layer
            own = attention.SelfAttention.relative_attention_bias
            if own is not None and own is not first:
                bias = position_bias(own)
            h = feed_forward(attention(h, bias))
        return self.encoder.final_layer_norm(h)


def load_t5(path: str | pathlib.Path, *, dtype: Any = None) -> T5Encoder:
    """Read a transformers `T5EncoderModel` or `UMT5EncoderModel` (config `model_type`
    `"umt5"`: Wan 2.1's text encoder) folder (`config.json` and `model.safetensors`, or
    shards) into a `T5Encoder`.

    **Arguments:**

    - `path`: the folder (a pipeline's `text_encoder_3/`).
    - `dtype`: the parameters' dtype; `None` keeps the checkpoint's.

    **Returns:**

    The `T5Encoder`.

    **Raises:**

    - `ValueError`: naming `path` when the folder has no `config.json`; naming the config
        file when it is not a JSON object (binary, not JSON), lacks a size the encoder needs
        (`vocab_size`, `d_model`, `d_ff`, `num_heads`, `d_kv`, `num_layers`) or gives one
        that is not a positive int, or names what the module does not compute (another
        feed-forward); naming the weights file when it is missing, empty, truncated or
        damaged; or listing what of the checkpoint does not fit.
    """
    folder = pathlib.Path(path)
    config = read_config_json(folder, "a transformers T5EncoderModel or UMT5EncoderModel folder")
    file = folder / "config.json"
    umt5 = config.get("model_type") == "umt5"
    feed_forward = config.get("feed_forward_proj", "relu")
    if feed_forward not in _FEED_FORWARDS:
        raise ValueError(
            f"{file}: `feed_forward_proj` must be one of {_FEED_FORWARDS}, got {feed_forward!r}."
        )
    arguments = {
        argument: config_int(config, name, file)
        for argument, name in (
            ("vocab_size", "vocab_size"),
            ("width", "d_model"),
            ("ff_width", "d_ff"),
            ("heads", "num_heads"),
            ("head_dim", "d_kv"),
            ("layers", "num_layers"),
        )
    }
    arguments["num_buckets"] = config_int(config, "relative_attention_num_buckets", file, 32)
    arguments["max_distance"] = config_int(config, "relative_attention_max_distance", file, 128)
    eps = config.get("layer_norm_epsilon", 1e-6)
    tensors = read_safetensors_folder(folder, "model.safetensors")
    # The token table is tied: written as `shared.weight`, `encoder.embed_tokens.weight` or both.
    table = tensors.pop("encoder.embed_tokens.weight", None)
    if "shared.weight" not in tensors and table is not None:
        tensors["shared.weight"] = table
    try:
        model = eqx.filter_eval_shape(
            lambda key: T5Encoder(
                **arguments,
                feed_forward=feed_forward,
                eps=eps,
                per_layer_position_bias=umt5,
                key=key,
            ),
            jax.random.key(0),
        )
    except ValueError as error:
        raise config_error(file, error) from None
    loaded: T5Encoder = fill_from_state_dict(model, tensors, dtype, "T5Encoder")
    return loaded
