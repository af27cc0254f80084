"""Deterministic ODE solvers for evaluation sampling, with a state carried between steps."""

import abc
from collections.abc import Callable
from typing import Any, TypeAlias, final

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool

from ._custom_types import Latents, Scalar


VelocityFn = Callable[[Latents, Scalar], Latents]
SolverState: TypeAlias = Any
"""What a solver carries from one step to the next (a PyTree): `None` for the one-step
solvers."""


class AbstractSolver(eqx.Module):
    """One step of the probability-flow ODE `dx/dt = v(x, t)` from `t` to `t_next`, with a
    state carried between steps (as diffrax's `AbstractSolver.init` and `step` do): a
    one-step solver's state is `None`, a multistep solver's holds its earlier evaluations.

    A caller integrating over a grid calls `init` once at the grid's first time and threads
    the state through `step` (as `GuidedFlow.sample_latents` does in its `lax.scan`).
    """

    @abc.abstractmethod
    def init(self, x: Latents, t: Scalar) -> SolverState:
        """The state before the first step.

        **Arguments:**

        - `x`: the states at the grid's first time (for their shape and dtype).
        - `t`: the grid's first time.

        **Returns:**

        The solver's state, a PyTree of fixed structure, shapes and dtypes (`None` for a
        one-step solver).
        """

    @abc.abstractmethod
    def step(
        self, velocity: VelocityFn, x: Latents, t: Scalar, t_next: Scalar, state: SolverState
    ) -> tuple[Latents, SolverState]:
        """Advance the batch `x` from time `t` to `t_next`.

        **Arguments:**

        - `velocity`: the (guided) velocity field on a batch, `velocity(x, t)`.
        - `x`: the states at time `t`.
        - `t`, `t_next`: the interval's ends.
        - `state`: what `init` or the previous `step` returned.

        **Returns:**

        The states at `t_next`, and the state for the next step.
        """


@final
class Euler(AbstractSolver):
    """Explicit Euler, one velocity evaluation per step: `step` is `x + v(x, t) (t_next - t)`.
    Stateless: its state is `None`."""

    def init(self, x: Latents, t: Scalar) -> None:
        return None

    def step(
        self, velocity: VelocityFn, x: Latents, t: Scalar, t_next: Scalar, state: None
    ) -> tuple[Latents, None]:
        return x + velocity(x, t) * (t_next - t), None


@final
class Heun(AbstractSolver):
    """Heun's second-order method, two velocity evaluations per step: `step` is the trapezoid
    `x + (v(x, t) + v(x + v(x, t) dt, t_next)) dt / 2` with `dt = t_next - t`, of the
    velocities at `(x, t)` and at the Euler prediction at `t_next`. Stateless: its state is
    `None`.

    At `t_next = 0` it still evaluates the velocity there; rectified-flow velocities are
    defined at the data end, so no special case is needed.
    """

    def init(self, x: Latents, t: Scalar) -> None:
        return None

    def step(
        self, velocity: VelocityFn, x: Latents, t: Scalar, t_next: Scalar, state: None
    ) -> tuple[Latents, None]:
        dt = t_next - t
        v_start = velocity(x, t)
        predicted = x + v_start * dt
        v_end = velocity(predicted, t_next)
        return x + 0.5 * (v_start + v_end) * dt, None


class MultistepState(eqx.Module):
    """The state of `DPMSolverPP2M`: the previous step's data prediction and time.

    **Arguments:**

    - `data`: `[N, *latent]` the data prediction `x - t v` at the previous step's start.
    - `time`: that step's start time.
    - `filled`: whether there was a previous step (`False` before the first).
    """

    data: Latents
    time: Scalar
    filled: Bool[Array, ""]


def _log_snr(t: Array) -> Array:
    """`lambda = log(alpha / sigma)` with `alpha = 1 - t`, `sigma = t`."""
    return jnp.log1p(-t) - jnp.log(t)


@final
class DPMSolverPP2M(AbstractSolver):
    """DPM-Solver++(2M), the midpoint form, for rectified flow: a multistep solver of second
    order with one velocity evaluation per step, as MixGRPO-Flash's release runs it after
    its window (`fastvideo/utils/sampling_utils.py`, `dpm_step` with
    `dpm_algorithm_type="dpmsolver++"`, `dpm_solver_order=2`, `dpm_solver_type="midpoint"`).

    With `alpha = 1 - t`, `sigma = t`, the log-SNR `lambda = log(alpha / sigma)`, the data
    prediction `m = x - t v(x, t)` and `h = lambda(t_next) - lambda(t)`, a step is

    `x_next = (sigma_next / sigma) x - alpha_next (exp(-h) - 1) (m + D1 / 2)`,
    `D1 = (h / h_prev) (m - m_prev)`, `h_prev = lambda(t) - lambda(t_prev)`,

    where `m_prev` is the data prediction at the previous step's start `t_prev`. The first
    step (no `m_prev`) and the step to `t_next = 0` are first order (`D1 = 0`; the release's
    `lower_order_nums < 1` and `lower_order_final`): the first-order step is exactly Euler's.
    A previous step from `t_prev = 1` has `h_prev = inf`, so `D1 = 0` there too, as in the
    release. Its state is a `MultistepState`.
    """

    def init(self, x: Latents, t: Scalar) -> MultistepState:
        time = jnp.asarray(t)
        return MultistepState(jnp.zeros_like(x), time, jnp.asarray(False))

    def step(
        self, velocity: VelocityFn, x: Latents, t: Scalar, t_next: Scalar, state: MultistepState
    ) -> tuple[Latents, MultistepState]:
        data = x - t * velocity(x, t)
        # exp(-h) = (alpha sigma_next) / (sigma alpha_next), finite at t = 1 and t_next = 0.
        decay = ((1 - t) * t_next) / (t * (1 - t_next))
        second = state.filled & (t_next > 0) & (state.time < 1) & (state.time > t)
        # Inputs kept where every log is finite, so that no NaN is made and masked.
        safe_t = jnp.where(second, t, 0.5)
        safe_next = jnp.where(second, t_next, 0.25)
        safe_prev = jnp.where(second, state.time, 0.75)
        h = _log_snr(safe_next) - _log_snr(safe_t)
        h_prev = _log_snr(safe_t) - _log_snr(safe_prev)
        ratio = jnp.where(second, h / h_prev, 0)
        corrected = data + 0.5 * ratio * (data - state.data)
        x_next = (t_next / t) * x - (1 - t_next) * (decay - 1) * corrected
        new = MultistepState(
            data.astype(state.data.dtype), jnp.asarray(t, state.time.dtype), jnp.asarray(True)
        )
        return x_next.astype(x.dtype), new
