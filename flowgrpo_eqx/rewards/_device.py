"""A per-sample score computed on the device, as a `FlowReward`."""

from collections.abc import Callable
from typing import Any, final

import equinox as eqx
import jax
import numpy as np
import numpy.typing as npt


@final
class DeviceReward:
    """A reward computed on the accelerator by a per-sample `score(sample, condition)`,
    compiled once and vmapped, usable wherever a `FlowReward` is (`FlowRollout`, weighted
    sums with host rewards).

    It puts the samples and the rows' `key` entry on the default device, scores them in one
    program and returns the scores as float64 on the host (the group statistics stay in
    float64 whatever the backend has).

    **Arguments:**

    - `score`: `score(sample, condition) -> scalar` on one unbatched sample (an `eqx.Module`
        such as `PickScore`, or a function).
    - `key`: the entry of the rows that holds each sample's condition (a prompt's embedding),
        or `None` to pass the whole row.
    - `name`: the reward's name in metrics and errors.

    **Raises:**

    - `ValueError`: naming `score` when it is not callable.
    """

    def __init__(
        self, score: Callable[[Any, Any], Any], key: str | None = None, name: str = "device"
    ) -> None:
        if not callable(score):
            raise ValueError(f"`score` must be callable, got {score!r}.")
        self.score = score
        self.key = key
        self.name = name
        self._batched = eqx.filter_jit(eqx.filter_vmap(score))

    def __call__(self, samples: npt.NDArray[Any], rows: Any) -> npt.NDArray[np.float64]:
        """The scores of a batch.

        **Arguments:**

        - `samples`: `[N, *sample]` in [-1, 1].
        - `rows`: the rows, one per sample.

        **Returns:**

        `[N]` float64.

        **Raises:**

        - `ValueError`: naming `rows` when it has no entry `key`.
        """
        condition = rows
        if self.key is not None:
            if not isinstance(rows, dict) or self.key not in rows:
                raise ValueError(f"`rows` must hold the entry {self.key!r} for this reward.")
            condition = rows[self.key]
        scores = self._batched(jax.device_put(samples), jax.device_put(condition))
        out: npt.NDArray[np.float64] = np.asarray(scores, np.float64)
        return out
