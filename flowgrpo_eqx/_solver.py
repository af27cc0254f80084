"""Deterministic ODE solvers for evaluation sampling."""

import abc
from collections.abc import Callable
from typing import final

import equinox as eqx

from ._custom_types import Latents, Scalar


VelocityFn = Callable[[Latents, Scalar], Latents]


class AbstractSolver(eqx.Module):
    """One step of the probability-flow ODE `dx/dt = v(x, t)` from `t` to `t_next`."""

    @abc.abstractmethod
    def step(self, velocity: VelocityFn, x: Latents, t: Scalar, t_next: Scalar) -> Latents:
        """Advance the batch `x` from time `t` to `t_next`.

        **Arguments:**

        - `velocity`: the (guided) velocity field on a batch, `velocity(x, t)`.
        - `x`: the states at time `t`.
        - `t`, `t_next`: the interval's ends.

        **Returns:**

        The states at `t_next`.
        """


@final
class Euler(AbstractSolver):
    """Explicit Euler, one velocity evaluation per step: `step` is `x + v(x, t) (t_next - t)`."""

    def step(self, velocity: VelocityFn, x: Latents, t: Scalar, t_next: Scalar) -> Latents:
        return x + velocity(x, t) * (t_next - t)


@final
class Heun(AbstractSolver):
    """Heun's second-order method, two velocity evaluations per step: `step` is the trapezoid
    `x + (v(x, t) + v(x + v(x, t) dt, t_next)) dt / 2` with `dt = t_next - t`, of the
    velocities at `(x, t)` and at the Euler prediction at `t_next`.

    At `t_next = 0` it still evaluates the velocity there; rectified-flow velocities are
    defined at the data end, so no special case is needed.
    """

    def step(self, velocity: VelocityFn, x: Latents, t: Scalar, t_next: Scalar) -> Latents:
        dt = t_next - t
        v_start = velocity(x, t)
        predicted = x + v_start * dt
        v_end = velocity(predicted, t_next)
        return x + 0.5 * (v_start + v_end) * dt
