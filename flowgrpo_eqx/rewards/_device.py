"""A per-sample score computed on the device, as a `FlowReward`."""

from collections.abc import Callable
from typing import Any, final

import equinox as eqx
import jax
import jax.numpy as jnp
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

        - `samples`: `[N, *sample]`, float in [-1, 1], `N >= 1`.
        - `rows`: the rows, one per sample.

        **Returns:**

        `[N]` float64.

        **Raises:**

        - `ValueError`: naming `samples` when it is not a float array (uint8 is refused:
            convert it with `x / 127.5 - 1`) of at least one sample; naming `rows` when it
            has no entry `key`, or the entry (or row) whose leading axis is not `N`; and
            whatever `score` refuses of one sample (naming its argument).
        """
        dtype = getattr(samples, "dtype", None)
        shape = tuple(getattr(samples, "shape", ()))
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(
                f"`samples` must be float in [-1, 1]; convert uint8 with x / 127.5 - 1, got "
                f"{dtype if dtype is not None else type(samples).__name__}."
            )
        if not shape or shape[0] < 1:
            raise ValueError(f"`samples` must be [N, *sample] with N >= 1, got shape {shape}.")
        condition = rows
        where = "rows"
        if self.key is not None:
            if not isinstance(rows, dict) or self.key not in rows:
                raise ValueError(f"`rows` must hold the entry {self.key!r} for this reward.")
            condition = rows[self.key]
            where = f"rows[{self.key!r}]"
        for path, leaf in jax.tree_util.tree_leaves_with_path(condition):
            leading = tuple(getattr(leaf, "shape", ()))[:1]
            if leading != shape[:1]:
                name = where + jax.tree_util.keystr(path)
                raise ValueError(
                    f"`{name}` must have one row per sample, [N = {shape[0]}, ...], got shape "
                    f"{tuple(getattr(leaf, 'shape', ()))}."
                )
        scores = self._batched(jax.device_put(samples), jax.device_put(condition))
        out: npt.NDArray[np.float64] = np.asarray(scores, np.float64)
        return out
