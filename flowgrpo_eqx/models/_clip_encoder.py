"""What CLIP's text and image towers share (`_clip_text.py`, `_clip_vision.py`): the
tower's shape (`TowerShape`), its pre-norm transformer layers (`SelfAttention`, `MLP`,
`EncoderLayer`) and their stack (`Encoder`), each mirroring transformers' state dict
(`_mirror.py`).
"""

import math
from typing import Literal, TypeAlias, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from .._misc import check_int
from ._layers import dense_in_input_dtype, softmax_attention
from ._mirror import (
    LayerNorm,
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
