"""Where the stochastic window sits on the trajectory, epoch by epoch.

A schedule names, for each rollout, the first of `count` consecutive transitions that sample
noise and are trained; the others are deterministic (ODE) steps. The rollout passes that index
to its compiled generation as a traced value, so moving the window never recompiles.
"""

import abc
from typing import Literal, TypeAlias, final

import equinox as eqx
import jax
from jaxtyping import PRNGKeyArray

from ._misc import check_int


AtEnd: TypeAlias = Literal["clip", "restart"]
"""What a sliding window does once it reaches the last transitions: stay there, or restart
from the first one (MixGRPO's `roll_back`)."""


class AbstractWindowSchedule(eqx.Module):
    """The position of a window of `count` stochastic transitions, per epoch.

    **Raises:**

    - `ValueError`: naming `count` if it is not an int >= 1.
    """

    count: eqx.AbstractVar[int]

    def __check_init__(self) -> None:
        check_int("count", self.count, 1)

    @abc.abstractmethod
    def first(self, epoch: int, transitions: int, key: PRNGKeyArray) -> int:
        """The index of the window's first transition in this epoch's rollout.

        **Arguments:**

        - `epoch`: the epoch, counted from 1 (the trainer's numbering).
        - `transitions`: how many transitions the rollout's grid has (`steps - 1`).
        - `key`: this rollout's key, for schedules that draw the position.

        **Returns:**

        An int in `0 .. transitions - count`.
        """

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
    """MixGRPO's sliding window (arXiv:2507.21802): the window starts at the first transition
    and moves `stride` transitions later every `shift_every` epochs, so training follows the
    trajectory from noise towards data.

    Epoch `e` (from 1) uses `first = stride * ((e - 1) // shift_every)`; past the last position
    `transitions - count` the window stays there (`at_end="clip"`, MixGRPO's default) or
    starts again from 0 (`"restart"`, MixGRPO's `roll_back`).

    **Arguments:**

    - `count`: how many consecutive transitions are stochastic and trained.
    - `shift_every`: epochs between moves (MixGRPO's `iters_per_group`).
    - `stride`: transitions per move; 1 by default (MixGRPO's `prog_overlap_step`). The
        released scripts move the window by its length: `stride=count`.
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
