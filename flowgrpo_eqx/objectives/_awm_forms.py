"""AWM's choices, one small class each: how each example's error is weighted
(`AbstractAWMWeighting`), where the ratio is taken (`AbstractAWMRatio`), which times train
(`AbstractAWMTimes`) and how the KL is weighted over time (`AbstractAWMKLWeight`)."""

import abc
from typing import final

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._custom_types import (
    PerExample,
)
from .._misc import (
    check_number,
)
from ._final_samples import (
    row_mean,
)


class AbstractAWMWeighting(eqx.Module):
    """How AWM turns an example's flow-matching error `e` at time `t` into its
    log-likelihood surrogate (the release's `weighting`): `GHuberWeighting` (the released
    default), `HuberWeighting`, `TimeWeighting`, `TimeSquaredWeighting` or
    `UniformWeighting`."""

    @abc.abstractmethod
    def __call__(self, error: PerExample, t: PerExample) -> PerExample:
        """The surrogate of each example.

        **Arguments:**

        - `error`: `[F]` flow-matching errors `mean (v - (eps - x_0))^2`.
        - `t`: `[F]` their times.

        **Returns:**

        `[F]` log-likelihood surrogates.
        """


@final
class GHuberWeighting(AbstractAWMWeighting):
    """`-((e + 1e-10)^p - 1e-10^p) t / p`, <= 0: the release's `weighting='ghuber'`, its
    default.

    **Arguments:**

    - `power`: `p`, > 0 (default 0.25, the release's `ghuber_power`).

    **Raises:**

    - `ValueError`: naming `power`, if it is not a finite number > 0.
    """

    power: float = 0.25

    def __check_init__(self) -> None:
        check_number("power", self.power, minimum=0, include_minimum=False)

    def __call__(self, error: PerExample, t: PerExample) -> PerExample:
        p = self.power
        surrogate: PerExample = -((error + 1e-10) ** p - 1e-10**p) * t / p
        return surrogate


@final
class HuberWeighting(AbstractAWMWeighting):
    """`-(sqrt(e + 1e-10) - 1e-5) t`: the release's `weighting='huber'`."""

    def __call__(self, error: PerExample, t: PerExample) -> PerExample:
        return -(jnp.sqrt(error + 1e-10) - 1e-5) * t


@final
class TimeWeighting(AbstractAWMWeighting):
    """`-e t`, <= 0: the release's `weighting='t'`."""

    def __call__(self, error: PerExample, t: PerExample) -> PerExample:
        return -error * t


@final
class TimeSquaredWeighting(AbstractAWMWeighting):
    """`-e t^2`, <= 0: the release's `weighting='t**2'`."""

    def __call__(self, error: PerExample, t: PerExample) -> PerExample:
        return -error * t**2


@final
class UniformWeighting(AbstractAWMWeighting):
    """`-e`, <= 0: the release's `weighting='uniform'`."""

    def __call__(self, error: PerExample, t: PerExample) -> PerExample:
        return -error


class AbstractAWMRatio(eqx.Module):
    """Where AWM takes its policy ratio (the release's `loss_type`): `PerTimeRatio` (its
    default `'exp_first'`) or `PerRowRatio` (`'sum_first'`)."""

    @abc.abstractmethod
    def ratios(
        self, log_p: PerExample, old: PerExample, advantages: Float[Array, " N"], count: int
    ) -> tuple[Float[Array, " R"], Float[Array, " R"], Float[Array, " R"], int]:
        """The ratios' log-likelihoods, their old values and advantages, side by side.

        **Arguments:**

        - `log_p`, `old`: `[N T]` log-likelihood surrogates, rows repeated time-fastest.
        - `advantages`: `[N]` advantages.
        - `count`: `T`, the times per row.

        **Returns:**

        `(log_p, old, advantages, per)`: `[R]` each, one per ratio, and `per = R / N`, the
        ratios per row.
        """


@final
class PerTimeRatio(AbstractAWMRatio):
    """One ratio per (row, time): the release's `loss_type='exp_first'`, its default."""

    def ratios(
        self, log_p: PerExample, old: PerExample, advantages: Float[Array, " N"], count: int
    ) -> tuple[Float[Array, " R"], Float[Array, " R"], Float[Array, " R"], int]:
        return log_p, old, jnp.repeat(advantages, count), count


@final
class PerRowRatio(AbstractAWMRatio):
    """One ratio per row, from its mean log-likelihood over its times: the release's
    `loss_type='sum_first'`."""

    def ratios(
        self, log_p: PerExample, old: PerExample, advantages: Float[Array, " N"], count: int
    ) -> tuple[Float[Array, " R"], Float[Array, " R"], Float[Array, " R"], int]:
        return row_mean(log_p, count), row_mean(old, count), advantages, 1


def _strata_draws(start: int, top: int, strata: int, key: PRNGKeyArray) -> Int[Array, " S"]:
    """One uniform index in each of `strata` strata of `[start, top)`: the strata's bounds are
    `linspace(start, top, strata + 1)` truncated to ints, and with
    `u = jax.random.uniform(key, (strata,))` each index is `lower + int(u (upper - lower))`."""
    bounds = np.linspace(start, top, strata + 1).astype(np.int64)
    lower = jnp.asarray(bounds[:-1], jnp.int32)
    width = jnp.asarray(bounds[1:] - bounds[:-1], jnp.float32)
    u = jax.random.uniform(key, (strata,), jnp.float32)
    return lower + (u * width).astype(jnp.int32)


class AbstractAWMTimes(eqx.Module):
    """How AWM chooses its trained grid indices (the release's `time_type`), strata of
    `[start, int(K time_fraction))` of a grid of `K` start times: `DiscreteTimesWithoutInit`
    (`'discrete_wo_init'`, the GenEval and OCR default), `DiscreteTimes` (`'discrete'`,
    PickScore) or `DiscreteTimesWithInit` (`'discrete_with_init'`)."""

    @abc.abstractmethod
    def start(self) -> int:
        """The first index the strata may draw (0, or 1 to leave out pure noise)."""

    @abc.abstractmethod
    def indices(self, top: int, train_timesteps: int, key: PRNGKeyArray) -> Int[Array, " T"]:
        """The `T = train_timesteps` indices of one minibatch.

        **Arguments:**

        - `top`: `int(K time_fraction)`, the strata's end (exclusive), > `start()`.
        - `train_timesteps`: `T`.
        - `key`: draws the indices.

        **Returns:**

        `[T]` int32 indices.
        """


@final
class DiscreteTimesWithoutInit(AbstractAWMTimes):
    """One draw in each of `T` strata of `[1, int(K time_fraction))`, never the first start
    time (pure noise): the release's `time_type='discrete_wo_init'`, the GenEval and OCR
    default."""

    def start(self) -> int:
        return 1

    def indices(self, top: int, train_timesteps: int, key: PRNGKeyArray) -> Int[Array, " T"]:
        return _strata_draws(1, top, train_timesteps, key)


@final
class DiscreteTimes(AbstractAWMTimes):
    """One draw in each of `T` strata of `[0, int(K time_fraction))`: the release's
    `time_type='discrete'` (PickScore)."""

    def start(self) -> int:
        return 0

    def indices(self, top: int, train_timesteps: int, key: PRNGKeyArray) -> Int[Array, " T"]:
        return _strata_draws(0, top, train_timesteps, key)


@final
class DiscreteTimesWithInit(AbstractAWMTimes):
    """Index 0 and one draw in each of `T - 1` strata of `[1, int(K time_fraction))`: the
    release's `time_type='discrete_with_init'`."""

    def start(self) -> int:
        return 1

    def indices(self, top: int, train_timesteps: int, key: PRNGKeyArray) -> Int[Array, " T"]:
        drawn = _strata_draws(1, top, train_timesteps - 1, key)
        return jnp.concatenate([jnp.zeros((1,), jnp.int32), drawn])


class AbstractAWMKLWeight(eqx.Module):
    """How a velocity KL is weighted per example: `UniformKLWeight` (the released default)
    or `ELBOKLWeight`."""

    @abc.abstractmethod
    def __call__(self, kl: PerExample, t: PerExample) -> PerExample:
        """The weighted KL of each example.

        **Arguments:**

        - `kl`: `[F]` velocity KLs `mean (v - v')^2`.
        - `t`: `[F]` their times.

        **Returns:**

        `[F]` weighted KLs.
        """


@final
class UniformKLWeight(AbstractAWMKLWeight):
    """`mean (v - v')^2` as it is: the release's `'uniform'`, its default."""

    def __call__(self, kl: PerExample, t: PerExample) -> PerExample:
        return kl


@final
class ELBOKLWeight(AbstractAWMKLWeight):
    """`mean (v - v')^2 / (2 std^2)`, `std = 0.7 sqrt(t / (1 - min(t, 0.99)))`: the release's
    `'elbo'`."""

    def __call__(self, kl: PerExample, t: PerExample) -> PerExample:
        std = jnp.sqrt(t / (1 - jnp.clip(t, 0.0, 0.99))) * 0.7
        return kl / (2 * std**2)
