"""Linear layers and random arrays as the models initialise them."""

import math
from collections.abc import Sequence

import equinox as eqx
import jax
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from .._misc import chunked_random_arrays


def _uniform_chunk(key: PRNGKeyArray, shape: tuple[int]) -> Float[Array, " chunk"]:
    return jax.random.uniform(key, shape, minval=-1.0, maxval=1.0)


def uniform_arrays(
    key: PRNGKeyArray, specs: Sequence[tuple[tuple[int, ...], float]]
) -> list[Float[Array, "..."]]:
    """Independent `U[-scale, scale)` float32 arrays, one per `(shape, scale)` in `specs`,
    drawn as fixed-size chunks (`chunked_random_arrays`), so that eager construction compiles
    one RNG program for every model and configuration."""
    return chunked_random_arrays(key, specs, _uniform_chunk)


def _linear_from(
    weight: Float[Array, "out in"], bias: Float[Array, " out"], *, key: PRNGKeyArray
) -> eqx.nn.Linear:
    """An `eqx.nn.Linear` holding the given `weight` and `bias` (its own init is never run)."""
    out_features, in_features = weight.shape
    abstract = eqx.filter_eval_shape(eqx.nn.Linear, in_features, out_features, key=key)
    linear: eqx.nn.Linear = eqx.tree_at(lambda m: (m.weight, m.bias), abstract, (weight, bias))
    return linear


def init_linears(dims: Sequence[tuple[int, int]], *, key: PRNGKeyArray) -> list[eqx.nn.Linear]:
    """`eqx.nn.Linear(in, out)` for each `(in, out)`, with Equinox's default init.

    Weight and bias are `U[-1/sqrt(in), 1/sqrt(in))`, drawn by `uniform_arrays`.
    """
    specs: list[tuple[tuple[int, ...], float]] = []
    for in_features, out_features in dims:
        limit = 1.0 / math.sqrt(in_features)
        specs += [((out_features, in_features), limit), ((out_features,), limit)]
    arrays = uniform_arrays(key, specs)
    return [_linear_from(arrays[2 * i], arrays[2 * i + 1], key=key) for i in range(len(dims))]


def ones(shape: tuple[int, ...]) -> Float[Array, "..."]:
    """Float32 ones (a norm's initial scale), made on the host and put on the device, so that
    eager construction compiles no program for them."""
    out: Float[Array, "..."] = jax.device_put(np.ones(shape, dtype=np.float32))
    return out


def zeros(shape: tuple[int, ...]) -> Float[Array, "..."]:
    """Float32 zeros (a norm's initial shift, a zero-initialised layer), as `ones` makes them."""
    out: Float[Array, "..."] = jax.device_put(np.zeros(shape, dtype=np.float32))
    return out


def zero_linear(in_features: int, out_features: int, *, key: PRNGKeyArray) -> eqx.nn.Linear:
    """An `eqx.nn.Linear(in_features, out_features)` with zero weight and bias."""
    return _linear_from(zeros((out_features, in_features)), zeros((out_features,)), key=key)
