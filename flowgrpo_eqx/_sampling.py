"""Rollout samplers: how a `FlowRollout` draws its trajectories and what it records.

A sampler is a type, not a switch: `SDESampler` samples an SDE and records transitions
(Flow-GRPO's batch), `ODESampler` integrates the probability-flow ODE and records the final
samples only (DiffusionNFT's batch). `FlowRollout` draws the starting noise, scores and
normalises; everything that depends on the kind of sampler is a method here.
"""

import abc
from collections.abc import Callable
from typing import Any, final

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray, PyTree

from ._custom_types import FinalSamples, Model, Transitions
from ._distributed import place_rows, row_sharding
from ._guided_flow import GuidedFlow
from ._misc import check_bool, is_int
from ._sde import AbstractSDE
from ._solver import AbstractSolver
from ._window import AbstractWindowSchedule


@final
class Generated(eqx.Module):
    """What one jit-compiled generation pass records (device arrays).

    **Arguments:**

    - `latents`, `next_latents`: `[N, K, *latent]` for the `K` recorded transitions (`None`
        with an `ODESampler`).
    - `log_probs`: `[N, K]` their mean-coordinate log densities (`None` with an
        `ODESampler`).
    - `final`: `[N, *latent]` the final latents at t = 0.
    - `samples`: `[N, *sample]` the decoded samples in [-1, 1].
    - `means`: `[N, K, *latent]` the means of their Gaussians, when the sampler records them
        (`SDESampler(record_means=True)`); `None` otherwise.
    - `steps`: `[N, K]` the grid index of each recorded transition, when rows record
        different ones (`DanceSampler`); `None` when every row records the same.
    """

    latents: Float[Array, " N K *latent"] | None
    next_latents: Float[Array, " N K *latent"] | None
    log_probs: Float[Array, " N K"] | None
    final: Float[Array, " N *latent"]
    samples: Float[Array, " N *sample"]
    means: Float[Array, " N K *latent"] | None = None
    steps: Int[Array, " N K"] | None = None


@final
class Draw(eqx.Module):
    """What one draw of a rollout samples, and where: what a sampler's `trajectory` (inside
    the compiled generation) and `batch` (on the host) receive.

    **Arguments:**

    - `flow`: the guided flow.
    - `policy`: the sampling model.
    - `rows`: `[N, ...]` conditioning rows on the device(s), already repeated per group.
    - `first`: the window's position (a window schedule's `first`: its first stochastic
        transition; 0 without a schedule), an int32 scalar: traced, so any value reuses one
        compilation.
    - `steps`: time points of the grid.
    - `mesh`: the data mesh the rows are split over, or `None` for the default device.
    """

    flow: GuidedFlow
    policy: Model
    rows: PyTree[Any]
    first: Int[Array, ""]
    steps: int = eqx.field(static=True)
    mesh: Mesh | None = eqx.field(static=True)

    @property
    def sharding(self) -> NamedSharding | None:
        """The rows' sharding over `mesh` (`None` without one)."""
        return None if self.mesh is None else row_sharding(self.mesh)

    def grid(self) -> Float[Array, " steps"]:
        """`[steps]` times from 1 to 0, `flow.process.timesteps(steps)`."""
        return self.flow.process.timesteps(self.steps)

    def place(self, host: PyTree[Any]) -> PyTree[Any]:
        """Host arrays with a leading row axis, placed as the rows are: row-sharded over
        `mesh`, or on the default device."""
        return place_rows(host, self.mesh)


class AbstractSampler(eqx.Module):
    """How a `FlowRollout` integrates the guided flow from noise and what it records.

    `FlowRollout` asks a sampler five things and knows nothing else about it: whether the
    rollout's settings suit it (`check_rollout`), how many transitions it records
    (`recorded_transitions`), where an epoch's recorded window starts (`window_start`), the
    trajectory itself inside the compiled generation (`trajectory`), and the batch it makes
    of a scored trajectory (`batch`). An objective that rescores recorded transitions asks
    two more: whether they are transitions of its SDE (`records_transitions_of`) and whether
    they carry their means (`records_means`).
    """

    @abc.abstractmethod
    def records_transitions_of(self, sde: AbstractSDE) -> bool:
        """Whether the batch is `Transitions` drawn with `sde` (by `GuidedFlow.transition`,
        the code an objective rescores them with), so that their log densities are the ones
        an objective of that `sde` reproduces.

        **Arguments:**

        - `sde`: the SDE the objective rescores with.

        **Returns:**

        `True` if the recorded transitions are that SDE's.
        """

    @abc.abstractmethod
    def records_means(self) -> bool:
        """Whether the recorded `Transitions` carry each transition's Gaussian mean
        (`Transitions.old_means`); `False` for a sampler that records no transitions."""

    @abc.abstractmethod
    def check_rollout(self, flow: GuidedFlow, steps: int, groups: int, shared_noise: bool) -> None:
        """Refuse rollout settings this sampler cannot honour.

        **Arguments:**

        - `flow`: the rollout's guided flow (its process gives the time grid).
        - `steps`, `groups`, `shared_noise`: the rollout's settings.

        **Raises:**

        - `ValueError`: naming the setting.
        """

    @abc.abstractmethod
    def recorded_transitions(self, steps: int) -> int:
        """`K`, the transitions recorded per sample on a `steps`-point grid (0: none)."""

    @abc.abstractmethod
    def window_start(self, epoch: int, steps: int, key: PRNGKeyArray) -> int:
        """The window's position (its first stochastic transition) in a collect in `epoch`
        with `key` (0 when fixed)."""

    @abc.abstractmethod
    def trajectory(
        self, draw: Draw, start: Float[Array, " N *latent"], key: PRNGKeyArray
    ) -> Generated:
        """Integrate from `start` at t = 1 to t = 0 and record (traced, inside the rollout's
        compiled generation).

        **Arguments:**

        - `draw`: the flow, policy, rows, grid and recorded window of this draw.
        - `start`: `[N, *latent]` starting noise.
        - `key`: the key of any noise drawn on the way.

        **Returns:**

        The `Generated` record.
        """

    @abc.abstractmethod
    def batch(
        self, draw: Draw, generated: Generated, advantages: npt.NDArray[np.float32]
    ) -> Transitions | FinalSamples:
        """The training batch of a scored draw (on the host).

        **Arguments:**

        - `draw`: the draw that `generated` recorded.
        - `generated`: what `trajectory` recorded.
        - `advantages`: `[N]` host float32 advantages.

        **Returns:**

        `Transitions` or `FinalSamples`, placed like the rows (`draw.place`).
        """


@final
class SDESampler(AbstractSampler):
    """Sample an SDE and record its transitions and their log densities: Flow-GRPO's rollout.

    Each recorded transition is drawn with the same code (`GuidedFlow.transition`) that
    `FlowGRPOObjective.log_probs` rescores with, so its `sde` must be the objective's (the
    objective refuses any other). The batch is `Transitions`; its mask keeps stochastic
    transitions of rows with a non-zero advantage (masked, not dropped: shapes stay static).

    **Arguments:**

    - `sde`: the SDE (`FlowSDE`, `CoefficientsPreservingSDE`).
    - `train_steps`: how many leading transitions to record; `None` (default) records all.
    - `window_schedule`: `None` (default) records the first `train_steps` transitions and
        leaves the stochastic ones to the SDE's `window`; or an `AbstractWindowSchedule`
        (`FixedWindow`, `RandomWindow`, `SlidingWindow`, `ProgressiveWindow`) that places,
        for each collect, up to `count` consecutive stochastic transitions (the others are
        ODE steps) and records `count` transitions from its `recorded_first` (those outside
        the window masked), or `RandomSteps`, which draws `count` separate ones and records
        them. The position is a traced value: moving it never recompiles. Needs
        `train_steps=None` and an `sde` with `window=None`.
    - `record_means`: if `True`, each recorded transition's Gaussian mean is kept as
        `Transitions.old_means`, which the released GRPO-Guard (`GRPOGuard`) needs for its
        drift term; `False` (default) records none (one latent-sized array less per
        transition).

    **Raises:**

    - `ValueError`: naming the argument, for an `sde` that is not an `AbstractSDE`, a
        `train_steps` below 1, or a `window_schedule` that is not a schedule or sits beside
        `train_steps` or the SDE's `window`; and, when a rollout checks it, a `train_steps`
        beyond the grid, a window longer than the trajectory, or a recorded range with no
        stochastic transition.
    """

    sde: AbstractSDE
    train_steps: int | None = None
    window_schedule: AbstractWindowSchedule | None = None
    record_means: bool = eqx.field(default=False, static=True)

    def __check_init__(self) -> None:
        if not isinstance(self.sde, AbstractSDE):
            raise ValueError(f"`sde` must be an AbstractSDE, got {self.sde!r}.")
        if self.train_steps is not None and not (
            is_int(self.train_steps) and self.train_steps >= 1
        ):
            raise ValueError(
                f"`train_steps` must be None or an int >= 1, got {self.train_steps!r}."
            )
        check_bool("record_means", self.record_means)
        if self.window_schedule is None:
            return
        if not isinstance(self.window_schedule, AbstractWindowSchedule):
            raise ValueError(
                "`window_schedule` must be None or an AbstractWindowSchedule, got "
                f"{self.window_schedule!r}."
            )
        if self.train_steps is not None:
            raise ValueError(
                "`train_steps` must be None with a `window_schedule` (its `count` transitions "
                f"are recorded), got {self.train_steps!r}."
            )
        if self.sde.window is not None:
            raise ValueError(
                "The `sde`'s `window` must be None with a `window_schedule` (the schedule "
                f"places the noise), got {self.sde.window!r}."
            )

    def check_rollout(self, flow: GuidedFlow, steps: int, groups: int, shared_noise: bool) -> None:
        del groups, shared_noise
        transitions = steps - 1
        if self.window_schedule is not None:
            self.window_schedule.check_fits(transitions)
            return
        if self.train_steps is not None and self.train_steps > transitions:
            raise ValueError(
                f"`train_steps` must be at most {transitions} (steps={steps} gives "
                f"{transitions} transitions), got {self.train_steps!r}."
            )
        grid = flow.process.timesteps(steps)
        recorded = self.recorded_transitions(steps)
        if not bool(jnp.any(self.sde.is_stochastic(grid[:recorded], grid[1 : recorded + 1]))):
            raise ValueError(
                f"`train_steps`={self.train_steps} records no stochastic transition under the "
                f"`sde` (window={self.sde.window}, noise_level={self.sde.noise_level})."
            )

    def records_transitions_of(self, sde: AbstractSDE) -> bool:
        return bool(eqx.tree_equal(self.sde, sde))

    def records_means(self) -> bool:
        return self.record_means

    def recorded_transitions(self, steps: int) -> int:
        if self.window_schedule is not None:
            return self.window_schedule.count
        return steps - 1 if self.train_steps is None else self.train_steps

    def window_start(self, epoch: int, steps: int, key: PRNGKeyArray) -> int:
        if self.window_schedule is None:
            return 0
        return self.window_schedule.first(epoch, steps - 1, key)

    def trajectory(
        self, draw: Draw, start: Float[Array, " N *latent"], key: PRNGKeyArray
    ) -> Generated:
        """One `lax.scan` over the grid recording `recorded_transitions(steps)` transitions.

        With a `window_schedule`, only its stochastic transitions (`stochastic_steps`: the
        window `first .. stop - 1`, or `RandomSteps`' chosen ones) draw noise and the whole
        trajectory is recorded, then its `count` recorded transitions (`recorded_steps`)
        taken out, both traced.
        """
        steps, first = draw.steps, draw.first
        recorded = self.recorded_transitions(steps)
        noise = step_noise(key, steps, start.shape[0], start.shape[1:], draw.sharding)
        path = SDEPath(draw.flow, self.sde, draw.policy, draw.rows, self.record_means)
        grid = draw.grid()
        if self.window_schedule is not None:
            transitions = steps - 1
            stochastic = self.window_schedule.stochastic_steps(first, transitions)
            chosen = self.window_schedule.recorded_steps(first, transitions)
            indices = jnp.arange(transitions)
            x, every = jax.lax.scan(
                path.windowed(stochastic), start, (grid[:-1], grid[1:], noise, indices)
            )
            recorded_arrays = jax.tree.map(lambda leaf: jnp.take(leaf, chosen, axis=0), every)
        else:
            head = (grid[:recorded], grid[1 : recorded + 1], noise[:recorded])
            x, recorded_arrays = jax.lax.scan(lambda x, xs: path.recording(x, xs), start, head)
            if recorded < steps - 1:
                tail = (grid[recorded:-1], grid[recorded + 1 :], noise[recorded:])
                x, _ = jax.lax.scan(lambda x, xs: path.silent(x, xs), x, tail)
        latents, next_latents, log_probs = recorded_arrays[:3]
        return Generated(
            latents=jnp.swapaxes(latents, 0, 1),
            next_latents=jnp.swapaxes(next_latents, 0, 1),
            log_probs=jnp.swapaxes(log_probs, 0, 1),
            final=x,
            samples=draw.flow.decode(x),
            means=jnp.swapaxes(recorded_arrays[3], 0, 1) if self.record_means else None,
        )

    def batch(
        self, draw: Draw, generated: Generated, advantages: npt.NDArray[np.float32]
    ) -> Transitions:
        """The `Transitions` batch; its mask keeps stochastic transitions (in the window,
        with a `window_schedule`) of rows with a non-zero advantage.

        **Raises:**

        - `ValueError`: if `generated` holds no transitions (it came from an `ODESampler`).
        """
        return transitions_batch(self.sde, draw, generated, advantages, self.window_schedule)


@final
class ODESampler(AbstractSampler):
    """Integrate the guided probability-flow ODE and record the final samples only:
    DiffusionNFT's rollout. The batch is `FinalSamples`, with the grid's start times.

    **Arguments:**

    - `solver`: the ODE solver (`Euler`, `Heun`).

    **Raises:**

    - `ValueError`: naming the argument, for a `solver` that is not an `AbstractSolver`; and,
        when a rollout checks it, `shared_noise` with `groups > 1` (a deterministic sampler
        from one shared start draws one sample per group, so every advantage would be 0).
    """

    solver: AbstractSolver

    def __check_init__(self) -> None:
        if not isinstance(self.solver, AbstractSolver):
            raise ValueError(f"`solver` must be an AbstractSolver, got {self.solver!r}.")

    def check_rollout(self, flow: GuidedFlow, steps: int, groups: int, shared_noise: bool) -> None:
        del flow, steps
        if shared_noise and groups > 1:
            raise ValueError(
                "`shared_noise` must be False with an ODESampler: a deterministic sampler "
                "from one shared start draws the same sample for the whole group, so every "
                "advantage would be 0."
            )

    def records_transitions_of(self, sde: AbstractSDE) -> bool:
        """`False`: the batch is `FinalSamples`, no transitions."""
        del sde
        return False

    def records_means(self) -> bool:
        return False

    def recorded_transitions(self, steps: int) -> int:
        del steps
        return 0

    def window_start(self, epoch: int, steps: int, key: PRNGKeyArray) -> int:
        del epoch, steps, key
        return 0

    def trajectory(
        self, draw: Draw, start: Float[Array, " N *latent"], key: PRNGKeyArray
    ) -> Generated:
        del key
        final = draw.flow.sample_latents(draw.policy, draw.rows, start, self.solver, draw.steps)
        return Generated(None, None, None, final=final, samples=draw.flow.decode(final))

    def batch(
        self, draw: Draw, generated: Generated, advantages: npt.NDArray[np.float32]
    ) -> FinalSamples:
        starts = np.asarray(draw.grid())[:-1]
        return FinalSamples(
            latents=generated.final,
            advantages=draw.place(np.asarray(advantages, np.float32)),
            cond=draw.rows,
            timesteps=draw.place(np.broadcast_to(starts, (len(advantages), starts.shape[0]))),
        )


def step_noise(
    step_key: PRNGKeyArray,
    steps: int,
    num: int,
    latent_shape: tuple[int, ...],
    sharding: NamedSharding | None,
) -> Float[Array, " steps_minus_one N *latent"]:
    """Every step's per-row noise, drawn from the per-step, per-row keys that a loop would
    split: the same values, but one batched draw (inside the scan body each draw cost two
    small rolled loops of tiny XLA ops per step on CPU)."""
    step_keys = jax.random.split(step_key, steps - 1)
    noise = jax.vmap(
        lambda k: jax.vmap(lambda r: jax.random.normal(r, latent_shape, jnp.float32))(
            jax.random.split(k, num)
        )
    )(step_keys)
    if sharding is not None:
        spec = PartitionSpec(None, *sharding.spec)  # type: ignore[no-untyped-call]
        per_step = NamedSharding(sharding.mesh, spec)
        noise = jax.lax.with_sharding_constraint(noise, per_step)  # type: ignore[no-untyped-call]
    noise_array: Array = noise
    return noise_array


class SDEPath(eqx.Module):
    """The scan bodies of an SDE trajectory: a step that records, one that does not, and
    one that draws noise only where a traced mask of the transitions allows. (Its methods
    reach `lax.scan` through closures: a bound method of a module holding tracers cannot
    be hashed.)"""

    flow: GuidedFlow
    sde: AbstractSDE
    policy: Model
    rows: PyTree[Any]
    record_means: bool = eqx.field(static=True)

    def transition(
        self, x: Array, t: Array, t_next: Array, z: Array, allowed: Array | None = None
    ) -> tuple[Array, Array, Array]:
        num = x.shape[0]
        times = jnp.full((num,), t, x.dtype)
        next_times = jnp.full((num,), t_next, x.dtype)
        allowed_rows = None if allowed is None else jnp.full((num,), allowed)
        mean, std = self.flow.transition(
            self.sde, self.policy, x, times, next_times, self.rows, allowed_rows
        )
        x_next = jax.vmap(self.sde.sample)(mean, std, z)
        log_prob = jax.vmap(self.sde.log_prob)(x_next, mean, std)
        return x_next, log_prob, mean

    def record(self, x: Array, x_next: Array, log_prob: Array, mean: Array) -> tuple[Array, ...]:
        return (x, x_next, log_prob, mean) if self.record_means else (x, x_next, log_prob)

    def recording(
        self, x: Array, inputs: tuple[Array, Array, Array]
    ) -> tuple[Array, tuple[Array, ...]]:
        t, t_next, z = inputs
        x_next, log_prob, mean = self.transition(x, t, t_next, z)
        return x_next, self.record(x, x_next, log_prob, mean)

    def silent(self, x: Array, inputs: tuple[Array, Array, Array]) -> tuple[Array, None]:
        t, t_next, z = inputs
        x_next, _, _ = self.transition(x, t, t_next, z)
        return x_next, None

    def windowed(
        self, stochastic: Bool[Array, " transitions"]
    ) -> Callable[[Array, tuple[Array, Array, Array, Array]], tuple[Array, tuple[Array, ...]]]:
        def step(
            x: Array, inputs: tuple[Array, Array, Array, Array]
        ) -> tuple[Array, tuple[Array, ...]]:
            t, t_next, z, index = inputs
            allowed = stochastic[index]
            x_next, log_prob, mean = self.transition(x, t, t_next, z, allowed)
            return x_next, self.record(x, x_next, log_prob, mean)

        return step


def transitions_batch(
    sde: AbstractSDE,
    draw: Draw,
    generated: Generated,
    advantages: npt.NDArray[np.float32],
    schedule: AbstractWindowSchedule | None,
) -> Transitions:
    """The `Transitions` batch of the recorded transitions (`SDESampler.batch`,
    `MixSampler.batch`): with a `schedule`, its `recorded_steps`, stochastic only where its
    `stochastic_steps` are."""
    if generated.latents is None or generated.next_latents is None or generated.log_probs is None:
        raise ValueError("`generated` holds no transitions: it came from an ODESampler.")
    num, recorded = generated.log_probs.shape
    grid, first = np.asarray(draw.grid()), int(draw.first)
    indices = np.arange(recorded)
    in_window = np.ones((recorded,), bool)
    if schedule is not None:
        transitions = grid.shape[0] - 1
        indices = np.asarray(schedule.recorded_steps(first, transitions))
        in_window = np.asarray(schedule.stochastic_steps(first, transitions))[indices]
    timesteps = np.broadcast_to(grid[indices], (num, recorded))
    next_timesteps = np.broadcast_to(grid[indices + 1], (num, recorded))
    stochastic = np.asarray(sde.is_stochastic(timesteps, next_timesteps)) & in_window
    return recorded_batch(draw, generated, timesteps, next_timesteps, stochastic, advantages)


def recorded_batch(
    draw: Draw,
    generated: Generated,
    timesteps: npt.NDArray[Any],
    next_timesteps: npt.NDArray[Any],
    stochastic: npt.NDArray[np.bool_],
    advantages: npt.NDArray[np.float32],
) -> Transitions:
    """The `Transitions` batch of a sampler's recorded transitions, their `[N, K]` times and
    which are stochastic given on the host: a transition is kept where it is stochastic and
    its row's advantage is not zero; the host arrays are placed as `draw` places rows.

    **Arguments:**

    - `draw`: the rollout's draw (its rows and their placement).
    - `generated`: what the sampler recorded (latents, log densities, means).
    - `timesteps`, `next_timesteps`: `[N, K]` each recorded transition's times.
    - `stochastic`: `[N, K]` which recorded transitions are stochastic.
    - `advantages`: `[N]` float32 advantages.

    **Returns:**

    The `Transitions` batch (its `old_means` the sampler's, where it recorded them).
    """
    assert generated.latents is not None and generated.next_latents is not None
    assert generated.log_probs is not None
    host_advantages = np.asarray(advantages, np.float32)
    placed = draw.place(
        {
            "timesteps": timesteps,
            "next_timesteps": next_timesteps,
            "mask": stochastic & (host_advantages != 0)[:, None],
            "advantages": host_advantages,
        }
    )
    return Transitions(
        latents=generated.latents,
        next_latents=generated.next_latents,
        timesteps=placed["timesteps"],
        next_timesteps=placed["next_timesteps"],
        old_log_probs=generated.log_probs,
        transition_mask=placed["mask"],
        advantages=placed["advantages"],
        cond=draw.rows,
        old_means=generated.means,
    )
