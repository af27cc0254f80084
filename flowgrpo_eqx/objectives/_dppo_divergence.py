"""Flow-DPPO's divergence: the std its per-transition KL divides by (`AbstractKLStd` and its
forms) and the mask of the transitions that diverged too far (`divergence_mask`)."""

import abc
from typing import final

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float

from .._custom_types import (
    Scalar,
)
from .._misc import check_number
from .._sde import AbstractSDE, compute_dtype


def divergence_mask(
    kl: Float[ArrayLike, " *shape"],
    ratio: Float[ArrayLike, " *shape"],
    advantage: Float[ArrayLike, " *shape"],
    kl_threshold: float | Float[ArrayLike, ""],
) -> Bool[Array, " *shape"]:
    """Flow-DPPO's asymmetric divergence mask: which policy terms it drops.

    A term is dropped when its KL to the old policy is at least the threshold AND its ratio
    has already moved in the direction its advantage pushes: `r > 1` with `A > 0`, or `r < 1`
    with `A < 0`. A term under the threshold always counts, and so does a corrective one
    (`A > 0` with `r < 1`, `A < 0` with `r > 1`) whatever its KL. A larger KL never
    un-drops a term.

    **Arguments:**

    - `kl`: each term's KL to the old policy.
    - `ratio`: each term's policy ratio `r`.
    - `advantage`: each term's advantage `A`.
    - `kl_threshold`: the threshold `delta`.

    **Returns:**

    Bools, `True` where the term is dropped: `(kl >= delta) & ((r > 1 & A > 0) | (r < 1 &
    A < 0))`.
    """
    kl, ratio, advantage = jnp.asarray(kl), jnp.asarray(ratio), jnp.asarray(advantage)
    pushing = ((ratio > 1.0) & (advantage > 0)) | ((ratio < 1.0) & (advantage < 0))
    return (kl >= kl_threshold) & pushing


class AbstractKLStd(eqx.Module):
    """The std `s` Flow-DPPO's KL divides the squared mean shift by, `mean_coords (mu_theta -
    mu_old)^2 / (2 s^2)`: a variant per source (`ReleasedKLStd`, `TransitionKLStd`,
    `UnitKLStd`)."""

    @abc.abstractmethod
    def __call__(
        self, sde: AbstractSDE, t: Scalar, t_next: Scalar, transition_std: Scalar
    ) -> Scalar:
        """The KL's std for one transition `t -> t_next`.

        **Arguments:**

        - `sde`: the objective's SDE.
        - `t`, `t_next`: the transition's times.
        - `transition_std`: the SDE's own std of the transition (0 when deterministic).

        **Returns:**

        The scalar std, in `transition_std`'s dtype; `transition_std` where that is 0 (a
        deterministic transition has no KL).
        """


@final
class ReleasedKLStd(AbstractKLStd):
    """The release's KL std (UniRL `unirl/algorithms/flowdppo.py`, `_compute_sigma_t`, lines
    342-368): the Flow-SDE formula recomputed from the grid whatever the sampler,
    `sqrt(t / (1 - min(t, sigma_max))) a sqrt(t - t_next)`, `a` the SDE's `noise_level` (the
    release's `eta`). At `t = 1` its clamp makes it `10 a sqrt(1 - t_next)` where the
    transition's own std is `a` (the release's transition, like `FlowSDE`, guards with
    `t* = t_next`), so the first step's KL is `100 (1 - t_next)` times smaller than the
    transition's std would make it (1/3.57 on SD3's grid of 10 steps); every other step of a
    `FlowSDE` gets its own std.

    **Arguments:**

    - `sigma_max`: the clamp, 0.99 as released.

    **Raises:**

    - `ValueError`: naming `sigma_max` unless it is a number in (0, 1).
    """

    sigma_max: float = 0.99

    def __check_init__(self) -> None:
        check_number(
            "sigma_max",
            self.sigma_max,
            minimum=0,
            maximum=1,
            include_minimum=False,
            include_maximum=False,
        )

    def __call__(
        self, sde: AbstractSDE, t: Scalar, t_next: Scalar, transition_std: Scalar
    ) -> Scalar:
        dtype = compute_dtype(jnp.asarray(transition_std).dtype, jnp.asarray(t).dtype)
        t = jnp.asarray(t, dtype)
        t_next = jnp.asarray(t_next, dtype)
        level = jnp.sqrt(t / (1 - jnp.minimum(t, self.sigma_max))) * sde.noise_level
        std = level * jnp.sqrt(-(t_next - t))
        return jnp.where(transition_std > 0, std, jnp.asarray(transition_std, dtype))


@final
class TransitionKLStd(AbstractKLStd):
    """The transition's own std `s` (the SDE's, mathematics §2): the exact Gaussian KL at every
    step, the first included. This is the fix of the release's open pull request #38
    (`fix(flowdppo): align KL sigma_t with SDE transition at sigma==1`, then `derive KL
    sigma_t from each SDE strategy`, `SDEStrategy.transition_std`), not the released code."""

    def __call__(
        self, sde: AbstractSDE, t: Scalar, t_next: Scalar, transition_std: Scalar
    ) -> Scalar:
        del sde, t, t_next
        return jnp.asarray(transition_std)


@final
class UnitKLStd(AbstractKLStd):
    """1: the squared mean shift over 2 alone, the release's `add_kl_coefficient: false`
    (`_compute_sigma_t` returns ones, lines 353-354)."""

    def __call__(
        self, sde: AbstractSDE, t: Scalar, t_next: Scalar, transition_std: Scalar
    ) -> Scalar:
        del sde, t, t_next
        std = jnp.asarray(transition_std)
        return jnp.where(std > 0, jnp.ones_like(std), std)
