"""Host-side group statistics: rewards stay float64 until the advantages are cast to float32."""

from typing import Any, Literal, TypeAlias

import numpy as np
import numpy.typing as npt

from ._misc import check_number, is_int


AdvantageStd: TypeAlias = Literal["group", "global"]
"""Which std normalises advantages: each group's own, or the whole batch's."""

RewardCombination: TypeAlias = Literal["sum", "normalize_each"]
"""How a `WeightedReward`'s terms become advantages: normalise their weighted sum within
each group (`"sum"`), or normalise each term within its group and then take the weighted sum
(`"normalize_each"`, Flow-Factory's per-reward normalisation)."""


def check_groups(groups: int) -> None:
    """Raise a `ValueError` naming `groups` unless it is an int `>= 2`.

    A group of one sample is its own mean: its advantage is 0 by construction, so a group
    size of 1 would train nothing.

    **Arguments:**

    - `groups`: the group size `G`.

    **Raises:**

    - `ValueError`: naming `groups`, and why, unless it is an int `>= 2`.
    """
    if not (is_int(groups) and groups >= 2):
        raise ValueError(
            f"`groups` must be an int >= 2, got {groups!r}: advantages are relative to the "
            "group, and a group of one sample has advantage 0 (nothing would be learned)."
        )


def check_normalisation(name: str, rows: int, groups: int, eps: float, std: Any) -> None:
    """Raise a `ValueError` naming the argument unless `rows` scores can be normalised in
    groups of `groups` with `eps` and `std`.

    **Arguments:**

    - `name`: the scores' argument name.
    - `rows`: how many scores.
    - `groups`, `eps`, `std`: as `group_advantages`'.

    **Raises:**

    - `ValueError`: naming `groups` (not an int >= 2), `name` (no rows, or not a multiple of
        `groups`), `eps` (negative or not finite) or `std` (not `AdvantageStd`).
    """
    check_groups(groups)
    if rows == 0:
        raise ValueError(f"`{name}` holds no rows.")
    if rows % groups != 0:
        raise ValueError(f"`{name}` has {rows} rows, not a multiple of `groups`={groups}.")
    check_number("eps", eps, minimum=0)
    if std not in ("group", "global"):
        raise ValueError(f"`std` must be 'group' or 'global', got {std!r}.")


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
    - `groups`: the group size `G`, >= 2 (a group of one sample has advantage 0); `N` must
        be a multiple of it.
    - `eps`: added to the std, 1e-4 by default.
    - `std`: `"group"` (default) or `"global"`.

    **Returns:**

    `[N]` float32 advantages; exactly zero for every row of a constant group.

    **Raises:**

    - `ValueError`: naming the argument, for a bad shape, a group size that is not an int
        >= 2 or does not divide `N`, eps, std mode, or non-finite rewards.
    """
    result: npt.NDArray[np.float32] = _normalised(rewards, groups, eps, std).astype(np.float32)
    return result


def _normalised(
    rewards: npt.ArrayLike, groups: int, eps: float, std: AdvantageStd
) -> npt.NDArray[np.float64]:
    """`group_advantages` before its cast to float32."""
    values = np.asarray(rewards, dtype=np.float64)
    if values.ndim != 1:
        raise ValueError(f"`rewards` must have shape [N], got {values.shape}.")
    check_normalisation("rewards", values.shape[0], groups, eps, std)
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
    flat: npt.NDArray[np.float64] = advantages.reshape(-1)
    return flat


def per_reward_advantages(
    components: npt.ArrayLike,
    weights: npt.ArrayLike,
    groups: int,
    eps: float = 1e-4,
    std: AdvantageStd = "group",
) -> npt.NDArray[np.float32]:
    """Each reward normalised within its group first, then the weighted sum (float64).

    `A = sum_k w_k (r_k - mean_group(r_k)) / (std(r_k) + eps)` with the std of
    `group_advantages` (`std="group"` or `"global"`), every term in float64, cast to float32
    at the end. A reward's scale and offset therefore do not matter, only its weight: each
    term is invariant to `r_k -> a r_k + b` with `a > 0` (exactly when `eps = 0`). A row's
    advantage is zero when every reward is constant in its group.

    **Arguments:**

    - `components`: `[R, N]` scores, one row per reward.
    - `weights`: `[R]` finite weights.
    - `groups`: the group size `G`, >= 2; `N` must be a multiple of it.
    - `eps`: added to each reward's std, 1e-4 by default.
    - `std`: `"group"` (default) or `"global"`.

    **Returns:**

    `[N]` float32 advantages.

    **Raises:**

    - `ValueError`: naming the argument, for shapes that do not fit, non-finite weights, or
        what `group_advantages` rejects.
    """
    scores = np.asarray(components, dtype=np.float64)
    factors = np.asarray(weights, dtype=np.float64)
    if scores.ndim != 2:
        raise ValueError(f"`components` must have shape [R, N], got {scores.shape}.")
    if factors.shape != (scores.shape[0],):
        raise ValueError(
            f"`weights` must have shape [R] = ({scores.shape[0]},), got {factors.shape}."
        )
    if not np.all(np.isfinite(factors)):
        raise ValueError(f"`weights` must be finite, got {factors.tolist()}.")
    total = np.zeros(scores.shape[1], dtype=np.float64)
    for factor, row in zip(factors, scores, strict=True):
        total += factor * _normalised(row, groups, eps, std)
    result: npt.NDArray[np.float32] = total.astype(np.float32)
    return result
