"""Host-side group statistics: rewards stay float64 until the advantages are cast to float32."""

from typing import Literal, TypeAlias

import numpy as np
import numpy.typing as npt

from ._misc import check_int


AdvantageStd: TypeAlias = Literal["group", "global"]
"""Which std normalises advantages: each group's own, or the whole batch's."""


def group_advantages(
    rewards: npt.ArrayLike,
    groups: int,
    eps: float = 1e-4,
    std: AdvantageStd = "group",
) -> npt.NDArray[np.float32]:
    """Group-normalised advantages, as Flow-GRPO's `PerPromptStatTracker` computes them.

    Rows `p * groups, ..., p * groups + groups - 1` form group `p` (one source row repeated);
    rows are never merged by equal conditioning. In float64:
    `A = (r - mean_group) / (std + eps)` with the population std (ddof 0) of the group
    (`std="group"`) or of the whole batch (`std="global"`, the release's `global_std`; the
    mean is still per group). The result is cast to float32.

    **Arguments:**

    - `rewards`: `[N]` scores; converted to float64 (pass float64 to keep full precision).
    - `groups`: the group size `G`; `N` must be a multiple of it.
    - `eps`: added to the std, 1e-4 by default.
    - `std`: `"group"` (default) or `"global"`.

    **Returns:**

    `[N]` float32 advantages; exactly zero for every row of a constant group.

    **Raises:**

    - `ValueError`: naming the argument, for a bad shape, group size, eps, std mode, or
        non-finite rewards.
    """
    values = np.asarray(rewards, dtype=np.float64)
    if values.ndim != 1:
        raise ValueError(f"`rewards` must have shape [N], got {values.shape}.")
    check_int("groups", groups, 1)
    if values.shape[0] % groups != 0:
        raise ValueError(
            f"`rewards` has {values.shape[0]} rows, not a multiple of `groups`={groups}."
        )
    if not eps >= 0:
        raise ValueError(f"`eps` must be >= 0, got {eps!r}.")
    if std not in ("group", "global"):
        raise ValueError(f"`std` must be 'group' or 'global', got {std!r}.")
    if not np.all(np.isfinite(values)):
        bad = np.flatnonzero(~np.isfinite(values)).tolist()
        raise ValueError(f"`rewards` has non-finite values at rows {bad}.")
    grouped = values.reshape(-1, groups)
    centred = grouped - grouped.mean(axis=1, keepdims=True)
    if std == "group":
        spread = grouped.std(axis=1, keepdims=True)
    else:
        spread = np.full((grouped.shape[0], 1), values.std())
    advantages: npt.NDArray[np.float64] = centred / (spread + eps)
    constant = np.all(grouped == grouped[:, :1], axis=1)
    advantages[constant] = 0.0
    result: npt.NDArray[np.float32] = advantages.reshape(-1).astype(np.float32)
    return result
