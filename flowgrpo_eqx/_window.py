"""Where the stochastic window sits on the trajectory, epoch by epoch.

A schedule names, for each rollout, the window's position `first`: the first of at most
`count` consecutive transitions that sample noise and are trained; the others are
deterministic (ODE) steps. The rollout records `count` transitions from `recorded_first`
(`first`, unless the window sits too near the end for `count` to fit) and makes stochastic
those before `stochastic_stop` (`first + count`, unless the schedule cuts the window). It
passes `first` to its compiled generation as a traced value, so moving the window never
recompiles. `RandomSteps` is no window: its `first` codes a set of separate transitions
(bit `i` for transition `i`), which `stochastic_steps` and `recorded_steps` read, as they read
any schedule's window.
"""

import abc
import numbers
from typing import Literal, TypeAlias, final

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int, PRNGKeyArray

from ._misc import check_int


AtEnd: TypeAlias = Literal["clip", "restart"]
"""What a moving window does once it reaches the end of the trajectory: stay there
(`"clip"`) or start again from the first transition (`"restart"`, MixGRPO's `roll_back`).
Where the end is, and what the window holds there, is each schedule's: `SlidingWindow` keeps
all its `count` transitions; `ProgressiveWindow`, as MixGRPO's release, cuts the window short
of its end and its last position holds none."""


class AbstractWindowSchedule(eqx.Module):
    """The position of a window of at most `count` stochastic transitions, per epoch.

    **Raises:**

    - `ValueError`: naming `count` if it is not an int >= 1.
    """

    count: eqx.AbstractVar[int]

    def __check_init__(self) -> None:
        check_int("count", self.count, 1)

    @abc.abstractmethod
    def first(self, epoch: int, transitions: int, key: PRNGKeyArray) -> int:
        """The window's position in this epoch's rollout: its first transition.

        **Arguments:**

        - `epoch`: the epoch, counted from 1 (the trainer's numbering).
        - `transitions`: how many transitions the rollout's grid has (`steps - 1`).
        - `key`: this rollout's key, for schedules that draw the position.

        **Returns:**

        An int in `0 .. transitions - count` (`ProgressiveWindow`: up to its last position,
        `transitions - end_margin`).
        """

    def recorded_first(self, first: Int[Array, ""] | int, transitions: int) -> Int[Array, ""]:
        """The first of the `count` transitions the rollout records for a window at `first`
        (traced or not): `first` itself, for every schedule whose window fits whole.

        **Arguments:**

        - `first`: the window's position (`first`'s result).
        - `transitions`: how many transitions the rollout's grid has.

        **Returns:**

        An int32 scalar in `0 .. transitions - count`.
        """
        del transitions
        return jnp.asarray(first, jnp.int32)

    def stochastic_stop(self, first: Int[Array, ""] | int, transitions: int) -> Int[Array, ""]:
        """One past the window's last stochastic transition for a window at `first` (traced
        or not): `first + count`, for every schedule that does not cut its window.

        **Arguments:**

        - `first`: the window's position (`first`'s result).
        - `transitions`: how many transitions the rollout's grid has.

        **Returns:**

        An int32 scalar `stop`, `first <= stop <= first + count`: the window is
        transitions `first .. stop - 1`, empty when `stop == first`.
        """
        del transitions
        return jnp.asarray(first, jnp.int32) + self.count

    def stochastic_steps(
        self, first: Int[Array, ""] | int, transitions: int
    ) -> Bool[Array, " transitions"]:
        """Which transitions sample noise (and are trained) for the position `first` (traced
        or not): the window `first .. stochastic_stop - 1`, for every schedule but
        `RandomSteps`.

        **Arguments:**

        - `first`: the position (`first`'s result).
        - `transitions`: how many transitions the rollout's grid has.

        **Returns:**

        `[transitions]` bools.
        """
        indices = jnp.arange(transitions)
        stop = self.stochastic_stop(first, transitions)
        return (indices >= jnp.asarray(first, jnp.int32)) & (indices < stop)

    def recorded_steps(self, first: Int[Array, ""] | int, transitions: int) -> Int[Array, " count"]:
        """The `count` transitions the rollout records for the position `first` (traced or
        not), in order: `recorded_first + 0 .. count - 1`, for every schedule but
        `RandomSteps`.

        **Arguments:**

        - `first`: the position (`first`'s result).
        - `transitions`: how many transitions the rollout's grid has.

        **Returns:**

        `[count]` int32 indices of the grid's transitions.
        """
        start = self.recorded_first(first, transitions)
        return start + jnp.arange(self.count, dtype=jnp.int32)

    def window(self, epoch: int, transitions: int, key: PRNGKeyArray) -> tuple[int, int]:
        """The transitions this epoch's rollout makes stochastic and trains (before the SDE's
        own `window`, if it has one, removes any).

        **Arguments:**

        - `epoch`, `transitions`, `key`: as for `first`.

        **Returns:**

        `(first, stop)`: transitions `first .. stop - 1`; none when `stop == first`.

        **Raises:**

        - `ValueError`: as `first`.
        """
        first = self.first(epoch, transitions, key)
        return first, int(self.stochastic_stop(first, transitions))

    def check_fits(self, transitions: int) -> None:
        """Raise unless `count` transitions fit on a grid of `transitions`.

        **Arguments:**

        - `transitions`: how many transitions the rollout's grid has.

        **Raises:**

        - `ValueError`: naming `count`, if it is longer than the trajectory.
        """
        if self.count > transitions:
            raise ValueError(
                f"`count`={self.count} stochastic transitions do not fit on a trajectory of "
                f"{transitions} transitions."
            )


@final
class FixedWindow(AbstractWindowSchedule):
    """The same window every epoch: transitions `start .. start + count - 1`, so `first` is
    `start`.

    **Arguments:**

    - `count`: how many consecutive transitions are stochastic and trained.
    - `start`: the first of them; 0 (the first transition, Flow-GRPO-Fast's choice) by default.

    **Raises:**

    - `ValueError`: naming the argument, for a `count` < 1 or a negative `start`; from
        `first`, naming `count` if it is longer than the trajectory, or `start` if the window
        runs past the last transition.
    """

    count: int
    start: int = 0

    def __check_init__(self) -> None:
        check_int("start", self.start, 0)

    def first(self, epoch: int, transitions: int, key: PRNGKeyArray) -> int:
        self.check_fits(transitions)
        if self.start + self.count > transitions:
            raise ValueError(
                f"`start`={self.start} with `count`={self.count} runs past the trajectory's "
                f"{transitions} transitions."
            )
        return self.start


@final
class RandomWindow(AbstractWindowSchedule):
    """A window placed uniformly at random for each rollout (Flow-GRPO-Fast's random branch
    point, MixGRPO's `random` strategy): the first index is uniform on
    `0 .. transitions - count`, drawn from the rollout's key, so a run is reproducible and a
    resumed run draws what the uninterrupted one would have.

    **Arguments:**

    - `count`: how many consecutive transitions are stochastic and trained.

    **Raises:**

    - `ValueError`: naming `count` if it is not an int >= 1, or, from `first`, if it is
        longer than the trajectory.
    """

    count: int

    def first(self, epoch: int, transitions: int, key: PRNGKeyArray) -> int:
        self.check_fits(transitions)
        draw = jax.random.randint(
            jax.random.fold_in(key, 0x57A7), (), 0, transitions - self.count + 1
        )
        return int(draw)


@final
class SlidingWindow(AbstractWindowSchedule):
    """A whole window that starts at the first transition and moves `stride` transitions
    later every `shift_every` epochs, so training follows the trajectory from noise towards
    data, always on `count` transitions.

    Epoch `e` (from 1) uses `first = stride * ((e - 1) // shift_every)`; past the last
    position where the whole window fits, `transitions - count`, the window stays there
    (`at_end="clip"`) or starts again from 0 once its next position would not fit
    (`"restart"`).

    This is not MixGRPO's released schedule, which moves one transition at a time, cuts the
    window short of the trajectory's last two transitions and ends on an empty window:
    that is `ProgressiveWindow`.

    **Arguments:**

    - `count`: how many consecutive transitions are stochastic and trained.
    - `shift_every`: epochs between moves.
    - `stride`: transitions per move; 1 by default.
    - `at_end`: `"clip"` (default) or `"restart"`.

    **Raises:**

    - `ValueError`: naming the argument, for a `count`, `shift_every` or `stride` < 1, or an
        unknown `at_end`; from `first`, naming `count` if it is longer than the trajectory,
        or `epoch` if it is not an int >= 1.
    """

    count: int
    shift_every: int
    stride: int = 1
    at_end: AtEnd = "clip"

    def __check_init__(self) -> None:
        check_int("shift_every", self.shift_every, 1)
        check_int("stride", self.stride, 1)
        if self.at_end not in ("clip", "restart"):
            raise ValueError(f"`at_end` must be 'clip' or 'restart', got {self.at_end!r}.")

    def first(self, epoch: int, transitions: int, key: PRNGKeyArray) -> int:
        self.check_fits(transitions)
        check_int("epoch", epoch, 1)
        last = transitions - self.count
        moves = (epoch - 1) // self.shift_every
        if self.at_end == "clip":
            return min(self.stride * moves, last)
        positions = last // self.stride + 1
        return self.stride * (moves % positions)


@final
class ProgressiveWindow(AbstractWindowSchedule):
    """MixGRPO's window as released (github `Tencent-Hunyuan/MixGRPO`,
    `fastvideo/utils/grpo_states.py` `GRPOTrainingStates` with
    `sample_strategy="progressive"`, built by `fastvideo/train_grpo_flux.py` lines 915-928
    and stepped at lines 945-947), the schedule of the three released scripts
    (`scripts/finetune/finetune_flux_grpo_MixGRPO*.sh`).

    The release keeps a window start `c`, 0 at first. Each iteration (one rollout and its
    update: an epoch here, so epoch `e` is the release's iteration `e - 1`) trains
    transitions `c .. min(c + count, M) - 1` with `M = transitions - end_margin` (its
    `max_timesteps = sampling_steps - 2`; `get_current_timesteps`, lines 141-148), then
    counts the iteration, and after `shift_every` of them moves `c` by `stride` (lines
    85-94); once `c > M` it restarts from 0 (`roll_back`, lines 95-97 and 136-139) or is
    clipped to `M` (lines 98-99). With `m = (e - 1) // shift_every` moves, epoch `e`'s
    position is

    - `c = 0` for `stride = 0` (the window never moves: MixGRPO-Flash*);
    - `c = stride * (m mod P)`, `P = M // stride + 1` positions, with `at_end="restart"`;
    - `c = min(stride * m, M)` with `at_end="clip"`.

    The window holds `count` transitions while `c + count <= M`, fewer after (cut by `M`),
    and none at `c = M`: an empty window, where every step of the rollout is deterministic
    and its batch trains nothing (every transition masked: the loss is 0 with zero
    gradients; the optimizer still takes its step, so AdamW's momentum and weight decay
    still move the weights). Without `roll_back` the window stays empty from then on. The
    release cannot run an empty window: `train_one_step` reads `ratio`, set only inside the
    loop over the window, after that loop (`train_grpo_flux.py` line 612), and with
    MixGRPO-Flash's `dpm_apply_strategy="post"` `run_sample_step` first computes with
    `last_false_index = None` (`sampling_utils.py` line 44). Its scripts never reach one in
    their 300 steps: with 25 transitions, stride 1 and roll-back, `c = M = 23` from
    iteration `23 shift_every` (575 for MixGRPO, 460 for Flash).

    `first` is `c`; the rollout records `count` transitions from `min(c, transitions -
    count)` (`recorded_first`): those outside the window are deterministic and masked.

    As released: MixGRPO `ProgressiveWindow(4, shift_every=25)`, MixGRPO-Flash
    `ProgressiveWindow(4, shift_every=20)`, MixGRPO-Flash* `ProgressiveWindow(4,
    shift_every=20, stride=0)`, each on 25 transitions (`prog_overlap` on with
    `prog_overlap_step` 1, 1 and 0, `roll_back` on).

    **Arguments:**

    - `count`: the window's length, `group_size` (4 in the scripts).
    - `shift_every`: epochs between moves, `iters_per_group` (25; 20 for Flash and Flash*).
    - `stride`: transitions per move; 1 by default. The release's `prog_overlap_step` with
        `prog_overlap` on (1 in MixGRPO and Flash, 0 in Flash*); `count` is `prog_overlap`
        off.
    - `at_end`: `"restart"` (default; `roll_back`, on in the scripts) or `"clip"`.
    - `end_margin`: the trajectory's last transitions no window reaches; 2 by default, the
        release's `max_timesteps = sampling_steps - 2` (`train_grpo_flux.py` line 919).

    **Raises:**

    - `ValueError`: naming the argument, for a `count` or `shift_every` < 1, a `stride` or
        `end_margin` < 0, or an unknown `at_end`; from `first` (and when a rollout checks
        the schedule), naming `count` if it is longer than the trajectory, `end_margin` if
        it leaves no transition, or `epoch` if it is not an int >= 1.
    """

    count: int
    shift_every: int
    stride: int = 1
    at_end: AtEnd = "restart"
    end_margin: int = 2

    def __check_init__(self) -> None:
        check_int("shift_every", self.shift_every, 1)
        check_int("stride", self.stride, 0)
        check_int("end_margin", self.end_margin, 0)
        if self.at_end not in ("clip", "restart"):
            raise ValueError(f"`at_end` must be 'clip' or 'restart', got {self.at_end!r}.")

    def check_fits(self, transitions: int) -> None:
        """Raise unless `count` transitions fit on a grid of `transitions` and `end_margin`
        leaves at least one.

        **Arguments:**

        - `transitions`: how many transitions the rollout's grid has.

        **Raises:**

        - `ValueError`: naming `count` or `end_margin`.
        """
        super().check_fits(transitions)
        if self.end_margin >= transitions:
            raise ValueError(
                f"`end_margin`={self.end_margin} leaves no transition of the trajectory's "
                f"{transitions} to a window."
            )

    def first(self, epoch: int, transitions: int, key: PRNGKeyArray) -> int:
        self.check_fits(transitions)
        check_int("epoch", epoch, 1)
        if self.stride == 0:
            return 0
        last = transitions - self.end_margin
        moves = (epoch - 1) // self.shift_every
        if self.at_end == "clip":
            return min(self.stride * moves, last)
        return self.stride * (moves % (last // self.stride + 1))

    def recorded_first(self, first: Int[Array, ""] | int, transitions: int) -> Int[Array, ""]:
        """`min(first, transitions - count)`: where `count` transitions still fit."""
        return jnp.minimum(jnp.asarray(first, jnp.int32), transitions - self.count)

    def stochastic_stop(self, first: Int[Array, ""] | int, transitions: int) -> Int[Array, ""]:
        """`min(first + count, transitions - end_margin)`: the release's cut."""
        stop = jnp.asarray(first, jnp.int32) + self.count
        return jnp.minimum(stop, transitions - self.end_margin)


@final
class RandomSteps(AbstractWindowSchedule):
    """Separate SDE steps drawn at random for each rollout, the ODE elsewhere: UniRL's sparse
    SDE schedule (github `Tencent-Hunyuan/UniRL`, `unirl/utils/scheduler_utils.py`
    `AllSDEScheduler` with `num_sde_steps`, resolved per rollout by
    `DiffusionSamplingParams.resolve_sde_indices(rollout_id)`), Flow-DPPO's released rollout
    (`examples/diffusion/sd3_flowdppo.yaml`: 3 of the first 5 of 10 steps,
    `RandomSteps(3, fraction=(0.0, 0.5))`).

    With `T` transitions, the pool is transitions `int(T start) .. int(T stop) - 1`
    (`normalize_timestep_fraction`); epoch `e` (the release's rollout `e - 1`) draws
    `np.random.default_rng(e - 1).choice(pool, count, replace=False)`, exactly the release's
    draw: the same steps for every row of the rollout, and for every run whatever its seed
    (the release keys them by the rollout's index alone). With `count` equal to the pool's
    size the whole pool is taken every rollout. The chosen transitions sample noise, are
    recorded (in order: `recorded_steps`) and trained; every other transition is an ODE
    (Euler) step, as the release's `eta = 0` steps.

    `first` is the chosen set as a bit mask (bit `i` for transition `i`, so the pool must end
    by transition 30), which is also what `RolloutInfo.window_start` reports. It is no
    window: a `MixSampler` refuses it, and `recorded_first`, `stochastic_stop` and `window`
    raise.

    **Arguments:**

    - `count`: how many transitions are stochastic and trained per rollout (the release's
        `num_sde_steps`).
    - `fraction`: `(start, stop)` in `[0, 1]`, `start <= stop`: the pool's bounds as fractions
        of the trajectory (the release's `timestep_fraction`); `(0.0, 1.0)` by default.

    **Raises:**

    - `ValueError`: naming the argument, for a `count` < 1 or a `fraction` that is not two
        numbers with `0 <= start <= stop <= 1`; from `first` (and when a rollout checks the
        schedule), naming `count` if the pool holds fewer transitions, or `fraction` if the
        pool reaches past transition 30; naming `epoch` if it is not an int >= 1.
    """

    count: int
    fraction: tuple[float, float] = (0.0, 1.0)

    def __check_init__(self) -> None:
        fraction = self.fraction
        if not (
            isinstance(fraction, tuple)
            and len(fraction) == 2
            and all(isinstance(x, numbers.Real) and not isinstance(x, bool) for x in fraction)
            and 0.0 <= fraction[0] <= fraction[1] <= 1.0
        ):
            raise ValueError(
                "`fraction` must be a pair (start, stop) of numbers with 0 <= start <= stop "
                f"<= 1, got {fraction!r}."
            )

    def pool(self, transitions: int) -> range:
        """The transitions the steps are drawn from: `int(T start) .. int(T stop) - 1` for
        `T = transitions`, as the release's `_effective_start` and `_effective_end`."""
        start, stop = self.fraction
        return range(int(transitions * float(start)), int(transitions * float(stop)))

    def check_fits(self, transitions: int) -> None:
        """Raise unless `count` transitions fit in the pool and the pool fits a bit mask.

        **Arguments:**

        - `transitions`: how many transitions the rollout's grid has.

        **Raises:**

        - `ValueError`: naming `count` or `fraction`.
        """
        pool = self.pool(transitions)
        if self.count > len(pool):
            raise ValueError(
                f"`count`={self.count} steps do not fit in the pool of `fraction`="
                f"{self.fraction} on a trajectory of {transitions} transitions (transitions "
                f"{pool.start} .. {pool.stop - 1}, {len(pool)} of them)."
            )
        if pool.stop > 31:
            raise ValueError(
                f"`fraction`={self.fraction} reaches transition {pool.stop - 1} of "
                f"{transitions}; the chosen steps are a 31-bit mask, so the pool must end by "
                "transition 30."
            )

    def steps(self, epoch: int, transitions: int) -> tuple[int, ...]:
        """The transitions epoch `epoch` samples with noise and trains, in order: the
        release's `AllSDEScheduler.get_sde_indices(epoch - 1)`.

        **Arguments:**

        - `epoch`: the epoch, from 1.
        - `transitions`: how many transitions the rollout's grid has.

        **Returns:**

        `count` increasing transition indices.

        **Raises:**

        - `ValueError`: as `first`.
        """
        self.check_fits(transitions)
        check_int("epoch", epoch, 1)
        pool = list(self.pool(transitions))
        if self.count >= len(pool):
            return tuple(pool)
        chosen = np.random.default_rng(epoch - 1).choice(pool, size=self.count, replace=False)
        return tuple(sorted(int(i) for i in chosen))

    def first(self, epoch: int, transitions: int, key: PRNGKeyArray) -> int:
        """The chosen steps (`steps`) as a bit mask; `key` is unused (the release keys the
        draw by the rollout's index alone)."""
        del key
        return sum(1 << i for i in self.steps(epoch, transitions))

    def stochastic_steps(
        self, first: Int[Array, ""] | int, transitions: int
    ) -> Bool[Array, " transitions"]:
        """The bits of `first`: transition `i` is stochastic where bit `i` is set."""
        bits = jnp.right_shift(
            jnp.asarray(first, jnp.int32), jnp.arange(transitions, dtype=jnp.int32)
        )
        return (bits & 1).astype(bool)

    def recorded_steps(self, first: Int[Array, ""] | int, transitions: int) -> Int[Array, " count"]:
        """The set bits of `first`, in increasing order."""
        chosen = self.stochastic_steps(first, transitions)
        indices: Int[Array, " count"] = jnp.nonzero(chosen, size=self.count)[0].astype(jnp.int32)
        return indices

    def recorded_first(self, first: Int[Array, ""] | int, transitions: int) -> Int[Array, ""]:
        """Refused: the steps are separate (`recorded_steps`).

        **Raises:**

        - `ValueError`: always.
        """
        raise ValueError(_NO_WINDOW)

    def stochastic_stop(self, first: Int[Array, ""] | int, transitions: int) -> Int[Array, ""]:
        """Refused: the steps are separate (`stochastic_steps`).

        **Raises:**

        - `ValueError`: always.
        """
        raise ValueError(_NO_WINDOW)


_NO_WINDOW = (
    "RandomSteps draws separate transitions, not a window: read them with `stochastic_steps` "
    "and `recorded_steps`."
)
