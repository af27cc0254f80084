"""The layers the transformers share: dense maps, adaLN, patches and attention."""

import abc
import functools
import math
from collections.abc import Callable
from typing import TypeAlias, TypeVar, final

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from .._misc import check_int
from ._init import zero_linear
from ._splash import ATTENTION_RESIDUALS, check_block, multi_device_axes, splash_attention


_LN_EPS = 1e-6

MASKED_SCORE = float(np.finfo(np.float32).min)
"""The float32 attention score of a key a query may not see (transformers' masking value)."""

Heads: TypeAlias = Float[Array, "S heads head_dim"]
"""The queries, keys or values of `S` tokens split into heads, `[S, heads, head_dim]`; also
attention's result for `S` queries, heads kept apart."""

KeyHeads: TypeAlias = Float[Array, "K heads head_dim"]
"""The keys or values of the `K` tokens that `S` queries attend to (`Heads`), split into
heads, `[K, heads, head_dim]`."""

LinearPair: TypeAlias = tuple[eqx.nn.Linear, eqx.nn.Linear]
"""The two linear maps of a two-layer MLP, in order."""


def layer_norm(h: Float[Array, "*S D"], eps: float = _LN_EPS) -> Float[Array, "*S D"]:
    """LayerNorm over the last axis, without an affine part (adaLN supplies scale and shift),
    with `eps` added to the variance."""
    mean = jnp.mean(h, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(h - mean), axis=-1, keepdims=True)
    return (h - mean) * jax.lax.rsqrt(var + eps)


def rms_norm(
    h: Float[Array, "*S H"], weight: Float[Array, " H"], eps: float = 1e-6
) -> Float[Array, "*S H"]:
    """RMSNorm over the last axis with a weight, as diffusers' `RMSNorm(eps=eps)` computes it:
    statistics in float32."""
    h32 = h.astype(jnp.float32)
    normed = h32 * jax.lax.rsqrt(jnp.mean(jnp.square(h32), axis=-1, keepdims=True) + eps)
    out: Float[Array, "*S H"] = normed.astype(weight.dtype) * weight.reshape(
        (1,) * (h.ndim - 1) + weight.shape
    )
    return out


def head_rms_norm(h: Heads, weight: Float[Array, " head_dim"], eps: float = 1e-6) -> Heads:
    """`rms_norm` of each head of `h`, `[S, heads, head_dim]`, with `weight`, `[head_dim]`:
    diffusers' `RMSNorm(head_dim, eps)` of the queries or keys split into heads (SD3's and
    FLUX's `norm_q`, `norm_k`), statistics and scaling in float32, then the weight in its
    dtype.

    Computed on the `[S, heads x head_dim]` layout the projections give: each head's mean
    square, and the spreading of its scale back over the head's features, are products with
    a block-diagonal 0/1 matrix at `"highest"` precision (float32 to the last bits). Reduced
    over its last axis, `[S, heads, 64]` (SD3's heads) leaves a TPU half-empty 128-lane rows
    to copy and reduce: on a TPU v5e that form took 128 ms of SD3.5-Medium's 1,136 ms
    training step, this one 43 ms of 1,024 (`docs/accelerators.md`).

    **Arguments:**

    - `h`: the queries or keys, `[S, heads, head_dim]`.
    - `weight`: the per-feature weight each head shares, `[head_dim]`.
    - `eps`: added to each head's mean square.

    **Returns:**

    The normalised heads, `[S, heads, head_dim]`, in `weight`'s dtype.
    """
    seq, heads, dim = h.shape
    flat = h.reshape(seq, heads * dim).astype(jnp.float32)
    groups = (jnp.arange(heads * dim)[:, None] // dim == jnp.arange(heads)[None, :]).astype(
        jnp.float32
    )
    highest = jax.lax.Precision.HIGHEST
    mean_square = jnp.dot(flat * flat, groups, precision=highest) / dim
    scale = jnp.dot(jax.lax.rsqrt(mean_square + eps), groups.T, precision=highest)
    normed = (flat * scale).astype(weight.dtype) * jnp.tile(weight, heads)[None, :]
    out: Heads = normed.reshape(seq, heads, dim)
    return out


def time_features(t: Float[Array, ""], dim: int) -> Float[Array, " dim"]:
    """diffusers' `Timesteps(dim, flip_sin_to_cos=True, downscale_freq_shift=0)` of the timestep
    `1000 t` for `t` in [0, 1], in float32: `[cos(1000 t f_k), sin(1000 t f_k)]` with
    `f_k = exp(-log(10^4) k / (dim / 2))`, each operation in diffusers' order, so the features
    agree to the last bit or so (SD3's, FLUX's and Wan's time embeddings start with them)."""
    half = dim // 2
    exponent = -math.log(10_000.0) * jnp.arange(half, dtype=jnp.float32) / half
    args = (1000.0 * t.astype(jnp.float32)) * jnp.exp(exponent)
    return jnp.concatenate([jnp.cos(args), jnp.sin(args)])


def modulate(
    h: Float[Array, "S D"], shift: Float[Array, " D"], scale: Float[Array, " D"]
) -> Float[Array, "S D"]:
    """adaLN's modulation of each token: `h * (1 + scale) + shift`."""
    return h * (1 + scale[None, :]) + shift[None, :]


def check_inputs(x: Array, t: Array, shape: tuple[int, ...]) -> None:
    """Raise a `ValueError` naming `x` unless its shape is `shape`, or `t` unless it is a
    scalar: the checks of a velocity network's `x` and `t`."""
    if x.shape != shape:
        raise ValueError(f"`x` must have shape {shape}, got {x.shape}.")
    if t.shape != ():
        raise ValueError(f"`t` must be a scalar, got shape {t.shape}.")


def dense(linear: eqx.nn.Linear, h: Float[Array, "S I"]) -> Float[Array, "S O"]:
    """Apply `linear` to each row of `h`, as one matmul with the rows as the leading axis.

    (`jax.vmap(linear)` gives an `[O, S]` matmul and a transpose, which is slower on CPU.)
    """
    out = named(h @ linear.weight.T, WEIGHT_PRODUCT)
    if linear.bias is not None:
        out = out + linear.bias[None, :]
    return out


def dense_in_input_dtype(linear: eqx.nn.Linear, x: Float[Array, "*S I"]) -> Float[Array, "*S O"]:
    """`linear` over the last axis of `x` of any rank, its weight and bias cast to `x`'s dtype
    first, as the autoencoder, CLIP and T5 apply their layers: a checkpoint kept in float32
    runs in the activations' dtype.

    **Arguments:**

    - `linear`: the layer, weight `[O, I]` (torch's layout).
    - `x`: the inputs, `[..., I]`.

    **Returns:**

    `[..., O]`, in `x`'s dtype.
    """
    out = x @ linear.weight.T.astype(x.dtype)
    if linear.bias is not None:
        out = out + linear.bias.astype(x.dtype).reshape((1,) * (x.ndim - 1) + (-1,))
    return out


def silu_mlp(mlp: LinearPair, h: Float[Array, " I"]) -> Float[Array, "1 D"]:
    """`Linear`, SiLU, `Linear` of one vector, as a row, `[1, D]`: diffusers' time and pooled
    text embeddings (`TimestepEmbedding`, `PixArtAlphaTextProjection(act_fn="silu")`)."""
    return dense(mlp[1], jax.nn.silu(dense(mlp[0], h[None])))


def zero_final_layer(width: int, out_features: int, *, key: PRNGKeyArray) -> LinearPair:
    """The zero-initialised linear maps of `final_layer`: the modulation (`width` to
    `2 * width`) and the projection (`width` to `out_features`)."""
    return zero_linear(width, 2 * width, key=key), zero_linear(width, out_features, key=key)


def final_layer(
    modulation: eqx.nn.Linear,
    proj: eqx.nn.Linear,
    c: Float[Array, " D"],
    h: Float[Array, "S D"],
) -> Float[Array, "S O"]:
    """The output layer of SD3's and FLUX's transformers: diffusers'
    `AdaLayerNormContinuous` of the tokens (`modulation(silu(c))` is scale, then shift), then
    the linear map `proj` of each token."""
    scale, shift = jnp.split(dense(modulation, jax.nn.silu(c)[None])[0], 2)
    return dense(proj, modulate(layer_norm(h), shift, scale))


def patchify(x: Float[Array, "H W C"], patch: int) -> Float[Array, "N P"]:
    """Cut a channels-last square image into `patch x patch` patches, row-major, flattened."""
    size, _, channels = x.shape
    grid = size // patch
    x = x.reshape(grid, patch, grid, patch, channels).transpose(0, 2, 1, 3, 4)
    return x.reshape(grid * grid, patch * patch * channels)


def unpatchify(
    tokens: Float[Array, "N P"], patch: int, image_size: int, channels: int
) -> Float[Array, "H W C"]:
    """The inverse of `patchify`."""
    grid = image_size // patch
    x = tokens.reshape(grid, grid, patch, patch, channels).transpose(0, 2, 1, 3, 4)
    return x.reshape(image_size, image_size, channels)


class AbstractAttention(eqx.Module):
    """How softmax attention is computed on one device. Every kind computes the same
    function (`plain_attention`'s); they differ in memory, speed and the platforms they run
    on (`docs/accelerators.md` compares them on a TPU). A kind holds no array, so it adds no
    leaf to a model.

    The kinds: `PlainAttention`, `CudnnAttention`, `ChunkedAttention`, `SplashAttention`,
    `AutoAttention`. Settings files and command lines name them (`"xla"`, `"cudnn"`,
    `"chunked"`, `"splash"`, `"auto"`: `attention_from_name`).
    """

    @abc.abstractmethod
    def __call__(self, q: Heads, k: KeyHeads, v: KeyHeads) -> Heads:
        """Softmax attention of `S` queries over `K` keys and values, scaled by
        `1 / sqrt(head_dim)`, heads kept apart.

        **Arguments:**

        - `q`: the queries, `[S, heads, head_dim]`.
        - `k`, `v`: the keys and values, `[K, heads, head_dim]`.

        **Returns:**

        The attended values, `[S, heads, head_dim]`.
        """

    @abc.abstractmethod
    def head_major(self, qkv: Float[Array, "3 heads S head_dim"]) -> Heads:
        """The same attention of queries, keys and values laid out heads first, as `DiT`
        projects them; the result is named `ATTENTION_RESIDUALS` for the remat policies.

        **Arguments:**

        - `qkv`: the queries, keys and values, `[3, heads, S, head_dim]`.

        **Returns:**

        The attended values, `[S, heads, head_dim]`.
        """

    @property
    @abc.abstractmethod
    def ring_chunk(self) -> int | None:
        """The queries ring attention folds at a time when a mesh's `"sequence"` axis splits
        the tokens (`None`: all at once)."""


def _head_major_by(attention: AbstractAttention, qkv: Float[Array, "3 heads S hd"]) -> Heads:
    """`attention` of head-major queries, keys and values, moved to `[S, heads, hd]` first."""
    q, k, v = (jnp.transpose(part, HEADS_FIRST) for part in qkv)
    return local_attention(q, k, v, attention)


@final
class PlainAttention(AbstractAttention):
    """Attention in its plain form in XLA, every score materialised (`plain_attention`, as
    `jax.nn.dot_product_attention`'s `"xla"` form computes it). Settings name it `"xla"`."""

    def __call__(self, q: Heads, k: KeyHeads, v: KeyHeads) -> Heads:
        return plain_attention(q, k, v)

    def head_major(self, qkv: Float[Array, "3 heads S head_dim"]) -> Heads:
        # The DiT's own plain form, head-major throughout (the demo's programs).
        q = qkv[0] * (1 / math.sqrt(qkv.shape[-1]))
        scores = jnp.einsum("hqe,hke->hqk", q, qkv[1])
        weights = jax.nn.softmax(scores, axis=-1)
        out: Heads = named(jnp.einsum("hqk,hke->qhe", weights, qkv[2]), ATTENTION_RESIDUALS)
        return out

    @property
    def ring_chunk(self) -> int | None:
        return None


@final
class CudnnAttention(AbstractAttention):
    """`jax.nn.dot_product_attention`'s cuDNN fused kernel (a GPU only, float16 or bfloat16
    inputs). Settings name it `"cudnn"`."""

    def __call__(self, q: Heads, k: KeyHeads, v: KeyHeads) -> Heads:
        return _cudnn_attention(q, k, v)

    def head_major(self, qkv: Float[Array, "3 heads S head_dim"]) -> Heads:
        return _head_major_by(self, qkv)

    @property
    def ring_chunk(self) -> int | None:
        return None


@final
class ChunkedAttention(AbstractAttention):
    """A memory-efficient form in JAX that materialises the scores of `chunk` queries at a
    time, in the forward and (each chunk recomputed) the backward pass. Settings name it
    `"chunked"`.

    **Arguments:**

    - `chunk`: the queries per chunk, at least 1.

    **Raises:**

    - `ValueError`: naming `chunk` when it is not an int >= 1.
    """

    chunk: int = eqx.field(default=512, static=True)

    def __check_init__(self) -> None:
        check_int("chunk", self.chunk, 1)

    def __call__(self, q: Heads, k: KeyHeads, v: KeyHeads) -> Heads:
        if q.shape[0] > self.chunk:
            return _chunked_attention(q, k, v, self.chunk)
        return plain_attention(q, k, v)

    def head_major(self, qkv: Float[Array, "3 heads S head_dim"]) -> Heads:
        return _head_major_by(self, qkv)

    @property
    def ring_chunk(self) -> int | None:
        return self.chunk


@final
class SplashAttention(AbstractAttention):
    """Pallas's splash attention kernel for TPUs (`splash_attention`): blocks of `block`
    queries and keys (the keys read up to 1,536 at a time), the scores never in HBM. Lowered
    for another platform the same kernel runs in Pallas's interpreter (exact, slow: tests).
    One device's attention: refused by name on a mesh of several devices. Settings name it
    `"splash"`.

    **Arguments:**

    - `block`: the queries and keys per block, a positive multiple of 128.

    **Raises:**

    - `ValueError`: naming `block` when it is not a positive multiple of 128.
    """

    block: int = eqx.field(default=512, static=True)

    def __check_init__(self) -> None:
        check_block("block", self.block)

    def __call__(self, q: Heads, k: KeyHeads, v: KeyHeads) -> Heads:
        return splash_attention(q, k, v, self.block)

    def head_major(self, qkv: Float[Array, "3 heads S head_dim"]) -> Heads:
        return _head_major_by(self, qkv)

    @property
    def ring_chunk(self) -> int | None:
        return None


@final
class AutoAttention(AbstractAttention):
    """The fastest kind the platform the program is lowered for has: `SplashAttention` of
    `block` on a TPU, `CudnnAttention` on a GPU for float16/bfloat16 inputs, `PlainAttention`
    otherwise (a CPU, float32 on a GPU, a mesh of several TPU devices, where the splash
    kernel cannot run yet). Settings name it `"auto"`.

    **Arguments:**

    - `block`: the splash kernel's queries and keys per block, a positive multiple of 128.

    **Raises:**

    - `ValueError`: naming `block` when it is not a positive multiple of 128.
    """

    block: int = eqx.field(default=512, static=True)

    def __check_init__(self) -> None:
        check_block("block", self.block)

    def __call__(self, q: Heads, k: KeyHeads, v: KeyHeads) -> Heads:
        return _fastest_attention(q, k, v, self.block)

    def head_major(self, qkv: Float[Array, "3 heads S head_dim"]) -> Heads:
        return _head_major_by(self, qkv)

    @property
    def ring_chunk(self) -> int | None:
        return None


ATTENTION_NAMES: tuple[str, ...] = ("xla", "cudnn", "chunked", "splash", "auto")
"""The names settings files and command lines give the attention kinds
(`attention_from_name`)."""


def attention_from_name(name: str, chunk: int = 512) -> AbstractAttention:
    """The attention kind a settings file or command line names.

    **Arguments:**

    - `name`: `"xla"` (`PlainAttention`), `"cudnn"` (`CudnnAttention`), `"chunked"`
        (`ChunkedAttention`), `"splash"` (`SplashAttention`) or `"auto"` (`AutoAttention`).
    - `chunk`: the queries per chunk of `"chunked"`, the block of `"splash"` and `"auto"`
        (a multiple of 128 for those); unused by the others.

    **Returns:**

    The attention.

    **Raises:**

    - `ValueError`: naming `attention` when `name` is none of those, or `attention_chunk`
        when `chunk` does not fit the kind.
    """
    if name not in ATTENTION_NAMES:
        raise ValueError(f"`attention` must be one of {ATTENTION_NAMES}, got {name!r}.")
    if name == "xla":
        return PlainAttention()
    if name == "cudnn":
        return CudnnAttention()
    check_int("attention_chunk", chunk, 1)
    if name == "chunked":
        return ChunkedAttention(chunk)
    check_block("attention_chunk", chunk)
    if name == "splash":
        return SplashAttention(chunk)
    return AutoAttention(chunk)


DEFAULT_ATTENTION = PlainAttention()
"""The models' default `attention`: the plain form."""


def local_attention(q: Heads, k: KeyHeads, v: KeyHeads, attention: AbstractAttention) -> Heads:
    """Multi-head attention of `S` queries over `K` keys and values held on one device,
    heads kept apart, `[S, heads, head_dim]`, as `attention` computes it.

    The queries, keys and values are named `"qkv"` and the result `"attention"`
    (`jax.ad_checkpoint.checkpoint_name`), for the remat policies that save them (`Remat`).
    """
    q, k, v = (named(x, QKV) for x in (q, k, v))
    # jax's attention mixes a half-precision query with its float32 logits internally, which
    # fails under `jax_numpy_dtype_promotion="strict"`; our own arithmetic stays strict.
    with jax.numpy_dtype_promotion("standard"):
        attended = attention(q, k, v)
    return named(attended, ATTENTION_RESIDUALS)


_HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _cudnn_attention(q: Heads, k: KeyHeads, v: KeyHeads) -> Heads:
    out: Heads = jax.nn.dot_product_attention(q, k, v, implementation="cudnn")
    return out


def _fastest_attention(q: Heads, k: KeyHeads, v: KeyHeads, block: int) -> Heads:
    """`AutoAttention`: splash on a TPU; cuDNN on a GPU for half-precision inputs; else
    plain. Chosen per platform as the program is lowered (`lax.platform_dependent`). On a
    mesh of several devices, where the splash kernel cannot run yet, a TPU takes the plain
    form."""
    branches: dict[str, Callable[[Array, Array, Array], Array]] = {}
    if not multi_device_axes():
        branches["tpu"] = functools.partial(splash_attention, block=block)
    # cuDNN's kernel refuses to be traced without a GPU, so its branch exists only with one.
    if jax.default_backend() == "gpu" and jnp.dtype(q.dtype) in _HALF:
        branches["cuda"] = _cudnn_attention
    out: Heads = jax.lax.platform_dependent(q, k, v, default=plain_attention, **branches)
    return out


_Named = TypeVar("_Named", bound=Array)


def named(x: _Named, name: str) -> _Named:
    """`x` named `name` for the remat policies (`jax.ad_checkpoint.checkpoint_name`); the
    identity otherwise."""
    out: _Named = checkpoint_name(x, name)  # type: ignore[no-untyped-call]
    return out


QKV = "qkv"
"""The name (`jax.ad_checkpoint.checkpoint_name`) of an attention's queries, keys and values,
which a remat policy may save (`SaveQKV`, `SaveAttention`)."""

WEIGHT_PRODUCT = "weight_product"
"""The name of a product of activations with a weight matrix (before its bias), which
`SaveDots` saves: every other product (attention's, the query-key norm's
block-diagonal sums in `head_rms_norm`) is recomputed in the backward pass."""

HEADS_FIRST = (1, 0, 2)
"""The axis order that moves the heads of `[S, heads, head_dim]` to the front."""


def plain_attention(q: Heads, k: KeyHeads, v: KeyHeads) -> Heads:
    """Softmax attention with every score materialised, `[S, heads, head_dim]`.

    What `jax.nn.dot_product_attention(q, k, v, implementation="xla")` computes, operation for
    operation: `softmax_attention` of the heads, scaled by `1 / sqrt(head_dim)`. The heads are
    moved to the front once, so each product is a plain batched matmul over heads;
    `jax.nn.dot_product_attention`'s grouped-query layout makes XLA's CPU backend run the
    same products about a third slower (`docs/performance.md`).
    """
    return softmax_attention(
        jnp.transpose(q, HEADS_FIRST),
        jnp.transpose(k, HEADS_FIRST),
        jnp.transpose(v, HEADS_FIRST),
        scale=1.0 / math.sqrt(q.shape[-1]),
    )


def softmax_attention(
    q: Float[Array, "heads S hd"],
    k: Float[Array, "heads K hd"],
    v: Float[Array, "heads K hd"],
    *,
    scale: float,
    allowed: Bool[Array, "S K"] | None = None,
    bias: Float[Array, "heads S K"] | None = None,
) -> Float[Array, "S heads hd"]:
    """The models' one softmax attention (the transformers', CLIP's and T5's), heads first.

    The scores `q k^T` (bfloat16 products accumulated in float32) times `scale`, plus `bias`
    (T5's relative positions), with the keys `allowed` does not allow set to the lowest
    float32 (CLIP's causal mask, a padding mask); the softmax in float32, cast to the values'
    dtype; the weighted sum of the values.

    **Arguments:**

    - `q`, `k`, `v`: `[heads, S, hd]` queries and `[heads, K, hd]` keys and values.
    - `scale`: the scores' factor (`1 / sqrt(hd)`; 1 for T5, which folds it into its weights).
    - `allowed`: `[S, K]`, which keys each query may see, or `None` for all.
    - `bias`: `[heads, S, K]` added to the scores, or `None`.

    **Returns:**

    `[S, heads, hd]`.
    """
    weights = jax.nn.softmax(_scores(q, k, scale, allowed, bias), axis=-1).astype(v.dtype)
    out: Float[Array, "S heads hd"] = jnp.einsum("nqk,nkh->qnh", weights, v)
    return out


def _scores(
    q: Float[Array, "heads S hd"],
    k: Float[Array, "heads K hd"],
    scale: float,
    allowed: Bool[Array, "S K"] | None = None,
    bias: Float[Array, "heads S K"] | None = None,
) -> Float[Array, "heads S K"]:
    """`softmax_attention`'s scores, in float32."""
    precision = jax.lax.DotAlgorithmPreset.BF16_BF16_F32 if q.dtype == jnp.bfloat16 else None
    scores = jnp.einsum(
        "nqh,nkh->nqk",
        q,
        k,
        precision=precision,
        # Written out, not `jnp.promote_types`, which refuses bfloat16 with float32 where a
        # caller runs under jax_numpy_dtype_promotion="strict".
        preferred_element_type=jnp.float64 if q.dtype == jnp.float64 else jnp.float32,
    )
    scaled: Float[Array, "heads S K"] = (scores * jnp.asarray(scale, jnp.float32)).astype(
        jnp.float32
    )
    if bias is not None:
        scaled = scaled + bias.astype(jnp.float32)
    if allowed is not None:
        scaled = jnp.where(allowed[None], scaled, MASKED_SCORE)
    return scaled


def attention_scores(q: Heads, k: KeyHeads) -> Float[Array, "heads S K"]:
    """The scaled attention scores `q k^T / sqrt(head_dim)` per head, in float32 (bfloat16
    products accumulated in float32), heads first: `plain_attention`'s and the ring's."""
    return _scores(
        jnp.transpose(q, HEADS_FIRST), jnp.transpose(k, HEADS_FIRST), 1.0 / math.sqrt(q.shape[-1])
    )


def _chunked_attention(q: Heads, k: KeyHeads, v: KeyHeads, chunk: int) -> Heads:
    """Attention over all keys for `chunk` queries at a time, each chunk rematerialised.

    Each query's softmax is over every key, as in the plain form, so the result is the
    same function; only `[heads, chunk, S]` scores exist at once, in the forward pass and
    (each chunk recomputed) in the backward pass. The queries are zero-padded to a multiple
    of `chunk` and the padding's outputs dropped.
    """

    @jax.checkpoint
    def one(queries: Float[Array, "chunk heads head_dim"]) -> Float[Array, "chunk heads hd"]:
        return plain_attention(queries, k, v)

    return merge_chunks(jax.lax.map(one, chunk_queries(q, chunk)), q.shape[0])


def chunk_queries(q: Heads, chunk: int) -> Float[Array, "pieces chunk heads head_dim"]:
    """The queries zero-padded to a multiple of `chunk` and cut into `chunk`-query pieces."""
    pieces = -(-q.shape[0] // chunk)
    padded = jnp.pad(q, ((0, pieces * chunk - q.shape[0]), (0, 0), (0, 0)))
    return padded.reshape(pieces, chunk, *q.shape[1:])


def merge_chunks(out: Float[Array, "pieces chunk heads head_dim"], length: int) -> Heads:
    """The per-piece results of `chunk_queries`' pieces as one sequence, padding dropped."""
    merged: Heads = out.reshape(-1, *out.shape[2:])[:length]
    return merged


def sinusoidal_time_features(
    t: Float[Array, ""],
    num_features: int,
    *,
    max_period: float = 10_000.0,
    time_scale: float = 1_000.0,
) -> Float[Array, " features"]:
    """Sinusoidal features of a scalar time, as in DDPM/DiT time embeddings.

    The time is first scaled by `time_scale` (so `t` in `[0, 1]` spans the usual `[0, 1000]`),
    then mapped to `[cos(s t f_0), ..., cos(s t f_{h-1}), sin(s t f_0), ..., sin(s t f_{h-1})]`
    with `h = num_features // 2` geometric frequencies `f_k = max_period ** (-k / h)`.

    **Arguments:**

    - `t`: the scalar time, `[]`.
    - `num_features`: how many features to return; a positive even int.
    - `max_period`: the longest period (in scaled time units) of the frequencies.
    - `time_scale`: the factor `t` is multiplied by first.

    **Returns:**

    The features, `[num_features]`, in the dtype of `t`.

    **Raises:**

    - `ValueError`: naming `num_features` when it is not a positive even int, or `t` when it
        is not a scalar.
    """
    check_int("num_features", num_features, 2)
    if num_features % 2 != 0:
        raise ValueError(f"`num_features` must be even, got {num_features}.")
    if jnp.ndim(t) != 0:
        raise ValueError(f"`t` must be a scalar, got shape {jnp.shape(t)}.")
    half = num_features // 2
    exponents = jnp.arange(half, dtype=t.dtype) / half
    freqs = jnp.exp(-math.log(max_period) * exponents)
    args = (time_scale * t) * freqs
    return jnp.concatenate([jnp.cos(args), jnp.sin(args)])
