"""The conditioning of SD3's and FLUX's transformers: the linear embeddings of the latent's
tokens, the text and the time (and FLUX.1-dev's guidance scale), and the vector `c` that
modulates every block."""

from typing import Any, NamedTuple, final

import equinox as eqx
from jaxtyping import Array, Float, PRNGKeyArray

from ._init import init_linears
from ._joint import TIME_FEATURES, sd3_time_features
from ._layers import LinearPair, silu_mlp


@final
class JointEmbedders(NamedTuple):
    """The embedding layers of an SD3 or FLUX transformer, as `joint_embedders` draws them:
    the latent's tokens, the text tokens, the time MLP, the pooled text MLP and the guidance
    scale's MLP (`None` without one)."""

    tokens: eqx.nn.Linear
    context: eqx.nn.Linear
    time_mlp: LinearPair
    pooled_mlp: LinearPair
    guidance_mlp: LinearPair | None


def joint_embedders(
    token_dim: int,
    context_dim: int,
    pooled_dim: int,
    width: int,
    guidance: bool,
    *,
    key: PRNGKeyArray,
) -> JointEmbedders:
    """The embedding layers of an SD3 or FLUX transformer of token width `width`, with
    Equinox's default init, drawn in one `init_linears` in the order of `JointEmbedders`.

    **Arguments:**

    - `token_dim`: the features of a latent token (a patch, or FLUX's packed 2 x 2 pixels).
    - `context_dim`: the width of the text token states.
    - `pooled_dim`: the width of the pooled text embedding.
    - `width`: the token width.
    - `guidance`: whether to draw the guidance scale's MLP (FLUX.1-dev's `guidance_embeds`).
    - `key`: a JAX PRNG key.

    **Returns:**

    The `JointEmbedders`.
    """
    dims = [(token_dim, width), (context_dim, width)]
    dims += [(TIME_FEATURES, width), (width, width), (pooled_dim, width), (width, width)]
    if guidance:
        dims += [(TIME_FEATURES, width), (width, width)]
    linears = init_linears(dims, key=key)
    return JointEmbedders(
        linears[0],
        linears[1],
        (linears[2], linears[3]),
        (linears[4], linears[5]),
        (linears[6], linears[7]) if guidance else None,
    )


def joint_conditioning(
    time_mlp: LinearPair,
    pooled_mlp: LinearPair,
    t: Float[Array, ""],
    pooled: Float[Array, " P"],
    dtype: Any,
    guidance_mlp: LinearPair | None = None,
    guidance: Float[Array, ""] | None = None,
) -> Float[Array, " D"]:
    """The vector `c` that modulates every block, as diffusers'
    `CombinedTimestepTextProjEmbeddings` (with a guidance scale,
    `CombinedTimestepGuidanceTextProjEmbeddings`) computes it.

    **Arguments:**

    - `time_mlp`, `pooled_mlp`: the time's and the pooled text's MLPs.
    - `t`: the time, a scalar in `[0, 1]`.
    - `pooled`: the pooled text embedding, in `dtype`.
    - `dtype`: the dtype the time features are cast to (the parameters').
    - `guidance_mlp`, `guidance`: the guidance scale's MLP and the scale, both or neither.

    **Returns:**

    `time_mlp(features(t)) [+ guidance_mlp(features(guidance))] + pooled_mlp(pooled)`, with
    SD3's time features (`sd3_time_features`).
    """
    c = silu_mlp(time_mlp, sd3_time_features(t).astype(dtype))
    if guidance_mlp is not None and guidance is not None:
        c = c + silu_mlp(guidance_mlp, sd3_time_features(guidance).astype(dtype))
    return (c + silu_mlp(pooled_mlp, pooled))[0]
