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
from ._process import RectifiedFlow, UniformGrid
from ._sde import AbstractSDE
from ._solver import AbstractSolver, Euler
from ._window import AbstractWindowSchedule, RandomSteps


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
        return _transitions_batch(self.sde, draw, generated, advantages, self.window_schedule)


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


@final
class MixSampler(AbstractSampler):
    """MixGRPO's rollout (github `Tencent-Hunyuan/MixGRPO`, `fastvideo/utils/sampling_utils.py`
    `run_sample_step`, `sample_strategy="progressive"`, `dpm_apply_strategy="post"`): ODE
    steps (the `sde`'s deterministic transition, Euler's) before a window of up to `count`
    stochastic transitions placed by `window_schedule`, which are recorded exactly as
    `SDESampler(sde, window_schedule=...)` records them; after the window, `solver` runs on
    the rest of the grid, compressed for MixGRPO-Flash.

    With `compress_ratio` set, the grid after the window's last transition `l` (of `T`) is
    rebuilt as released: `n = int(max((T - l) r, 1))` points evenly from `u = 1 - (l + 1) / T`
    to 0, each shifted as the process's grid is (so `r = 1` keeps every step, up to rounding);
    with `n = 1` the release stops there, before t = 0, and so does this sampler. A solver
    with a state starts from its state after the window's last step (the release's
    `DPMState` keeps the data prediction of every step), at the cost of one more velocity
    evaluation. A window with no stochastic transition (`ProgressiveWindow`'s last
    position, or one the SDE's `window` removes whole) is read as `l = -1`: `solver` runs
    from t = 1 over the whole grid, compressed to `int(max((T + 1) r, 1))` points from 1 to
    0 (the release's formula; the release itself fails there, `last_false_index` being
    `None`). MixGRPO is `MixSampler(sde, ProgressiveWindow(4, shift_every=25))`;
    MixGRPO-Flash `MixSampler(sde, ProgressiveWindow(4, shift_every=20),
    solver=DPMSolverPP2M(), compress_ratio=0.4)`, Flash* the same with `stride=0` and
    `compress_ratio=0.2`.

    **Arguments:**

    - `sde`: the SDE of the window (the objective's). Its own `window` may end the noise
        before the scheduled window does; the transitions it cuts are recorded but masked,
        and `solver` takes over after the last stochastic one, as the release's
        `last_false_index`. (The release's own cut, `max_timesteps = T - 2`, is
        `ProgressiveWindow`'s `end_margin`.)
    - `window_schedule`: where the window sits, epoch by epoch (`ProgressiveWindow` as
        released).
    - `solver`: the ODE solver after the window; `Euler()` (default) as MixGRPO's.
    - `compress_ratio`: `None` (default) keeps the grid after the window; a float in (0, 1]
        rebuilds it with that ratio (needs a `RectifiedFlow` with `grid=UniformGrid()`).
    - `record_means`: as `SDESampler`'s.

    **Raises:**

    - `ValueError`: naming the argument, for an `sde` or `window_schedule` or `solver` of the
        wrong type, a `RandomSteps` schedule (no window), or a `compress_ratio` outside
        (0, 1]; and, when
        a rollout checks it, a window longer than the trajectory or a `compress_ratio` with
        another process.
    """

    sde: AbstractSDE
    window_schedule: AbstractWindowSchedule
    solver: AbstractSolver = Euler()
    compress_ratio: float | None = eqx.field(default=None, static=True)
    record_means: bool = eqx.field(default=False, static=True)

    def __check_init__(self) -> None:
        for name, value, kind in (
            ("sde", self.sde, AbstractSDE),
            ("window_schedule", self.window_schedule, AbstractWindowSchedule),
            ("solver", self.solver, AbstractSolver),
        ):
            if not isinstance(value, kind):
                raise ValueError(f"`{name}` must be an {kind.__name__}, got {value!r}.")
        if isinstance(self.window_schedule, RandomSteps):
            raise ValueError(
                "`window_schedule` must place a window (the solver takes over after its last "
                f"step), got {self.window_schedule!r}, whose steps are separate: sample those "
                "with an SDESampler."
            )
        ratio = self.compress_ratio
        if ratio is not None and not (isinstance(ratio, float) and 0 < ratio <= 1):
            raise ValueError(f"`compress_ratio` must be None or a float in (0, 1], got {ratio!r}.")
        check_bool("record_means", self.record_means)

    def check_rollout(self, flow: GuidedFlow, steps: int, groups: int, shared_noise: bool) -> None:
        del groups, shared_noise
        self.window_schedule.check_fits(steps - 1)
        process = flow.process
        if self.compress_ratio is not None and not (
            isinstance(process, RectifiedFlow) and isinstance(process.grid, UniformGrid)
        ):
            raise ValueError(
                "`compress_ratio` needs a RectifiedFlow with grid=UniformGrid() (the release "
                f"shifts the rebuilt grid as it does), got {process!r}."
            )

    def records_transitions_of(self, sde: AbstractSDE) -> bool:
        """Whether `sde` is the window's: the transitions it records are drawn as
        `SDESampler`'s are."""
        return bool(eqx.tree_equal(self.sde, sde))

    def records_means(self) -> bool:
        return self.record_means

    def recorded_transitions(self, steps: int) -> int:
        return self.window_schedule.count

    def window_start(self, epoch: int, steps: int, key: PRNGKeyArray) -> int:
        return self.window_schedule.first(epoch, steps - 1, key)

    def trajectory(
        self, draw: Draw, start: Float[Array, " N *latent"], key: PRNGKeyArray
    ) -> Generated:
        """One `lax.scan` up to the window's last stochastic transition (skipping, by
        `lax.cond`, every step after it), `count` transitions sliced out at the schedule's
        traced `recorded_first`, then a `lax.fori_loop` of `solver` over the (compressed)
        rest of the grid, its length read from a table per window position."""
        schedule = self.window_schedule
        steps, first, count = draw.steps, draw.first, schedule.count
        transitions = steps - 1
        noise = step_noise(key, steps, start.shape[0], start.shape[1:], draw.sharding)
        path = SDEPath(draw.flow, self.sde, draw.policy, draw.rows, self.record_means)
        grid = draw.grid()
        with jax.ensure_compile_time_eval():  # the grid is static: its tables are built once
            host_grid = np.asarray(draw.grid())
            lasts = _last_stochastic(self.sde, host_grid, schedule)
        last = jnp.asarray(lasts)[first]
        windowed = path.windowed(schedule.stochastic_steps(first, transitions))

        def body(x: Array, inputs: tuple[Array, Array, Array, Array]) -> tuple[Array, Any]:
            skipped = jax.eval_shape(windowed, x, inputs)[1]

            def skip(x: Array) -> tuple[Array, Any]:
                return x, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), skipped)

            out: tuple[Array, Any] = jax.lax.cond(
                inputs[3] <= last, lambda x: windowed(x, inputs), skip, x
            )
            return out

        indices = jnp.arange(transitions)
        x, every = jax.lax.scan(body, start, (grid[:-1], grid[1:], noise, indices))
        recorded_first = schedule.recorded_first(first, transitions)
        recorded = jax.tree.map(
            lambda leaf: jax.lax.dynamic_slice_in_dim(leaf, recorded_first, count, axis=0), every
        )
        final = self._after_window(draw, x, every[0], last, host_grid)
        return Generated(
            latents=jnp.swapaxes(recorded[0], 0, 1),
            next_latents=jnp.swapaxes(recorded[1], 0, 1),
            log_probs=jnp.swapaxes(recorded[2], 0, 1),
            final=final,
            samples=draw.flow.decode(final),
            means=jnp.swapaxes(recorded[3], 0, 1) if self.record_means else None,
        )

    def _after_window(
        self,
        draw: Draw,
        x: Array,
        latents: Array,
        last: Array,
        host_grid: npt.NDArray[np.float32],
    ) -> Array:
        """Run `solver` from the window's last stochastic transition `last` over the rest of
        the grid (`latents`: every transition's starting latents; `last = -1`: no stochastic
        transition, the whole grid from `x` at t = 1)."""
        process = draw.flow.process
        shift = process.shift if isinstance(process, RectifiedFlow) else 1.0
        table, lengths = _post_grids(host_grid, self.compress_ratio, shift)
        times, length = jnp.asarray(table)[last + 1], jnp.asarray(lengths)[last + 1]
        rows = x.shape[0]
        grid = jnp.asarray(host_grid)

        def velocity(y: Array, t: Array) -> Array:
            return draw.flow.velocity(draw.policy, y, jnp.full((rows,), t, y.dtype), draw.rows)

        def after_last(operand: None) -> Any:
            # The state after the window's last step, run deterministically (its result
            # unused).
            x_last, t_last = latents[last], grid[last]
            return self.solver.step(
                velocity, x_last, t_last, times[0], self.solver.init(x_last, t_last)
            )[1]

        def from_start(operand: None) -> Any:
            return self.solver.init(x, times[0])

        state = jax.lax.cond(last >= 0, after_last, from_start, None)

        def step(j: Array, carry: tuple[Array, Any]) -> tuple[Array, Any]:
            y, s = carry
            return self.solver.step(velocity, y, times[j], times[j + 1], s)

        final: Array = jax.lax.fori_loop(0, length - 1, step, (x, state))[0]
        return final

    def batch(
        self, draw: Draw, generated: Generated, advantages: npt.NDArray[np.float32]
    ) -> Transitions:
        """The `Transitions` batch of the window, as `SDESampler`'s."""
        return _transitions_batch(self.sde, draw, generated, advantages, self.window_schedule)


def _last_stochastic(
    sde: AbstractSDE, grid: npt.NDArray[np.float32], schedule: AbstractWindowSchedule
) -> npt.NDArray[np.int32]:
    """For every window position `f` in `0 .. T` (entry `f`), the last transition of the
    window `f .. stop - 1` (`stop` the schedule's `stochastic_stop`) that `sde` makes
    stochastic (its `window` may end the noise before the scheduled window does), or -1 if
    none is."""
    transitions = grid.shape[0] - 1
    stochastic = np.asarray(sde.is_stochastic(grid[:-1], grid[1:]))
    lasts = np.full((transitions + 1,), -1, np.int32)
    for first in range(transitions + 1):
        stop = min(int(schedule.stochastic_stop(first, transitions)), transitions)
        inside = [i for i in range(first, stop) if stochastic[i]]
        if inside:
            lasts[first] = inside[-1]
    return lasts


def _post_grids(
    grid: npt.NDArray[np.float32], ratio: float | None, shift: float
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int32]]:
    """For every window end `l` in `-1 .. T - 1` (row `l + 1`; -1: no window), the grid after
    the window (padded with 0) and its number of points: `grid[l + 1:]`, or with `ratio` the
    release's rebuilt grid (`run_sample_step`, lines 44-54: `n = int(max((T - l) ratio, 1))`
    points evenly from `u = linspace(1, 0, T + 1)[l + 1]` to 0, then
    `sd3_time_shift(shift, u)`, lines 9-10), computed in float64."""
    transitions = grid.shape[0] - 1
    table = np.zeros((transitions + 1, transitions + 1), np.float32)
    lengths = np.ones((transitions + 1,), np.int32)
    for last in range(-1, transitions):
        if ratio is None:
            rest = grid[last + 1 :]
        else:
            n = int(max((transitions - last) * ratio, 1))
            u = np.linspace(1.0 - (last + 1) / transitions, 0.0, n)
            rest = (shift * u / (1 + (shift - 1) * u)).astype(np.float32)
        table[last + 1, : rest.shape[0]] = rest
        lengths[last + 1] = rest.shape[0]
    return table, lengths


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


def _transitions_batch(
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
