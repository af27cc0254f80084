"""MixGRPO's rollout sampler (`MixSampler`): ODE steps before a moving window of recorded
SDE transitions, and a solver, on a compressed grid for MixGRPO-Flash, after it."""

from typing import Any, final

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jaxtyping import Array, Float, PRNGKeyArray

from ._custom_types import Transitions
from ._guided_flow import GuidedFlow
from ._misc import check_bool
from ._process import RectifiedFlow, UniformGrid
from ._sampling import (
    AbstractSampler,
    Draw,
    Generated,
    SDEPath,
    step_noise,
    transitions_batch,
)
from ._sde import AbstractSDE
from ._solver import AbstractSolver, Euler
from ._window import AbstractWindowSchedule, RandomSteps


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
        return transitions_batch(self.sde, draw, generated, advantages, self.window_schedule)


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
