"""A conditional MLP velocity network on flat latents."""

from typing import final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from .._misc import check_int
from ._init import init_linears
from ._layers import check_inputs, sinusoidal_time_features


def silu(x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
    """SiLU (swish), `x * sigmoid(x)`, the activation of `MLPVelocity`'s hidden layers.

    On a CPU it is written as `x * (1 + tanh(x / 2)) / 2`, the same function: XLA's CPU `tanh`
    is a cheap rational approximation while its `logistic` is not; timed beside a large matmul
    on a 2-core CPU, a wide MLP's value-and-grad went from about 0.82 to 0.86 of the matmul's
    FLOP/s. Elsewhere it is `jax.nn.silu`: a TPU's float32 `tanh` is the coarser of the two
    (the `tanh` form's value was 2.2e-5 of `max(1, |x|)` from the float64 statement on a v5e,
    `jax.nn.silu`'s 6.1e-7). The choice is made when the program is lowered for its platform
    (`jax.lax.platform_dependent`). On a CPU it agrees with the float64 statement to float32
    resolution relative to `max(1, |x|)`; for `x` below about -17 it returns 0 where the
    exact value is smaller than `2e-6` in magnitude.

    **Arguments:**

    - `x`: any float array.

    **Returns:**

    `silu(x)`, same shape and dtype.
    """
    out: Float[Array, "*shape"] = jax.lax.platform_dependent(
        x, cpu=_silu_by_tanh, default=jax.nn.silu
    )
    return out


def _silu_by_tanh(x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
    return x * (0.5 + 0.5 * jnp.tanh(0.5 * x))


@final
class MLPVelocity(eqx.Module):
    """A conditional MLP velocity network `v(x, t, cond)` on flat latents.

    The input `[x, sinusoidal_time_features(t), cond]` goes through `depth` hidden layers
    (each `Linear` then `silu`; the first maps the input to `hidden`, the other `depth - 1` are
    `hidden x hidden`), then a `Linear` back to `latent_dim`. At a wide `hidden` the FLOPs are
    dominated by the `hidden x hidden` matmuls.

    Computes in the dtype of its parameters and returns the dtype of `x`.

    **Arguments:**

    - `latent_dim`: the size of the flat latent `x`.
    - `cond_dim`: the size of the float condition vector (0 for an unconditional model).
    - `hidden`: the width of the hidden layers.
    - `depth`: the number of hidden `Linear` layers (each followed by SiLU), at least 1.
    - `time_features`: how many sinusoidal time features; a positive even int.
    - `key`: a JAX PRNG key for the initialisation.

    **Raises:**

    - `ValueError`: naming the argument, when a size is not a valid int.
    """

    layers: tuple[eqx.nn.Linear, ...]
    out: eqx.nn.Linear
    latent_dim: int = eqx.field(static=True)
    cond_dim: int = eqx.field(static=True)
    hidden: int = eqx.field(static=True)
    depth: int = eqx.field(static=True)
    time_features: int = eqx.field(static=True)

    def __init__(
        self,
        latent_dim: int,
        cond_dim: int,
        hidden: int = 512,
        depth: int = 4,
        time_features: int = 64,
        *,
        key: PRNGKeyArray,
    ) -> None:
        check_int("latent_dim", latent_dim, 1)
        check_int("cond_dim", cond_dim, 0)
        check_int("hidden", hidden, 1)
        check_int("depth", depth, 1)
        check_int("time_features", time_features, 2)
        if time_features % 2 != 0:
            raise ValueError(f"`time_features` must be even, got {time_features}.")
        self.latent_dim = latent_dim
        self.cond_dim = cond_dim
        self.hidden = hidden
        self.depth = depth
        self.time_features = time_features

        in_size = latent_dim + time_features + cond_dim
        dims = [(in_size, hidden)] + [(hidden, hidden)] * (depth - 1) + [(hidden, latent_dim)]
        linears = init_linears(dims, key=key)
        self.layers = tuple(linears[:-1])
        self.out = linears[-1]

    def __call__(
        self,
        x: Float[Array, " latent_dim"],
        t: Float[Array, ""],
        cond: Float[Array, " cond_dim"],
    ) -> Float[Array, " latent_dim"]:
        """The velocity at one unbatched example.

        **Arguments:**

        - `x`: the latent, `[latent_dim]`.
        - `t`: the time, a scalar in `[0, 1]` (`t = 1` is noise).
        - `cond`: the condition vector, `[cond_dim]`.

        **Returns:**

        The velocity, `[latent_dim]`, in the dtype of `x`.

        **Raises:**

        - `ValueError`: naming `x`, `t` or `cond` when its shape is wrong.
        """
        check_inputs(x, t, (self.latent_dim,))
        if cond.shape != (self.cond_dim,):
            raise ValueError(f"`cond` must have shape ({self.cond_dim},), got {cond.shape}.")
        dtype = self.out.weight.dtype
        features = sinusoidal_time_features(t.astype(dtype), self.time_features)
        h = jnp.concatenate([x.astype(dtype), features, cond.astype(dtype)])
        for layer in self.layers:
            h = silu(layer(h))
        v: Float[Array, " latent_dim"] = self.out(h)
        return v.astype(x.dtype)
