"""Host-side group statistics: rewards stay float64 until the advantages are cast to float32."""

from typing import Any, Literal, TypeAlias

import numpy as np
import numpy.typing as npt

from ._misc import check_number, is_int


AdvantageStd: TypeAlias = Literal["group", "global", "group_unbiased", "global_unbiased"]
"""Which std normalises advantages, and how: each group's own (`"group"`) or the whole
batch's (`"global"`) population std plus 1e-4, as flow_grpo's `PerPromptStatTracker`; or the
same with the unbiased (Bessel, ddof 1) std plus 1e-8, torch's `x.std() + 1e-8`, as
DanceGRPO's group advantages (`"group_unbiased"`) and UniRL's `adv_use_global_std` for
Flow-DPPO (`"global_unbiased"`)."""

ADVANTAGE_STDS: tuple[AdvantageStd, ...] = ("group", "global", "group_unbiased", "global_unbiased")
"""Every `AdvantageStd`, in order."""


def default_eps(std: AdvantageStd) -> float:
    """The epsilon each `AdvantageStd` adds to its std as released: 1e-4 for `"group"` and
    `"global"` (flow_grpo), 1e-8 for the unbiased ones (DanceGRPO, UniRL).

    **Arguments:**

    - `std`: an `AdvantageStd`.

    **Returns:**

    The epsilon.
    """
    return 1e-8 if std in ("group_unbiased", "global_unbiased") else 1e-4


def std_ddof(std: AdvantageStd) -> int:
    """The delta degrees of freedom of `std`'s spread: 1 (Bessel) for the unbiased ones, else
    0 (population)."""
    return 1 if std in ("group_unbiased", "global_unbiased") else 0


def std_is_global(std: AdvantageStd) -> bool:
    """Whether `std`'s spread is the whole batch's rather than each group's."""
    return std in ("global", "global_unbiased")


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


def check_normalisation(name: str, rows: int, groups: int, eps: float | None, std: Any) -> None:
    """Raise a `ValueError` naming the argument unless `rows` scores can be normalised in
    groups of `groups` with `eps` and `std`.

    **Arguments:**

    - `name`: the scores' argument name.
    - `rows`: how many scores.
    - `groups`, `eps`, `std`: as `group_advantages`' (`eps` may be `None`).

    **Raises:**

    - `ValueError`: naming `groups` (not an int >= 2), `name` (no rows, or not a multiple of
        `groups`), `eps` (negative or not finite) or `std` (not `AdvantageStd`).
    """
    check_groups(groups)
    if rows == 0:
        raise ValueError(f"`{name}` holds no rows.")
    if rows % groups != 0:
        raise ValueError(f"`{name}` has {rows} rows, not a multiple of `groups`={groups}.")
    check_number("eps", eps, minimum=0, optional=True)
    check_std(std)


def check_std(std: Any) -> None:
    """Raise a `ValueError` naming `std` unless it is an `AdvantageStd`.

    **Arguments:**

    - `std`: the value to check.

    **Raises:**

    - `ValueError`: naming `std` and the choices.
    """
    if std not in ADVANTAGE_STDS:
        choices = ", ".join(repr(choice) for choice in ADVANTAGE_STDS)
        raise ValueError(f"`std` must be one of {choices}, got {std!r}.")


def group_advantages(
    rewards: npt.ArrayLike,
    groups: int,
    eps: float | None = None,
    std: AdvantageStd = "group",
) -> npt.NDArray[np.float32]:
    """Group-normalised advantages, as Flow-GRPO's `PerPromptStatTracker` computes them (or
    as DanceGRPO and UniRL's Flow-DPPO do, with the unbiased `std`s).

    Rows `p * groups, ..., p * groups + groups - 1` form group `p` (one source row repeated);
    rows are never merged by equal conditioning. In float64:
    `A = (r - mean_group) / (std + eps)` with the population std (ddof 0) of the group
    (`std="group"`) or of the whole batch (`std="global"`, flow_grpo's `global_std`; the
    mean is still per group), or the unbiased std (ddof 1) of the group
    (`"group_unbiased"`, DanceGRPO's `group_rewards.std() + 1e-8`) or of the batch
    (`"global_unbiased"`, UniRL's `adv_use_global_std`). The result is cast to float32.

    **Arguments:**

    - `rewards`: `[N]` scores; converted to float64 (pass float64 to keep full precision).
    - `groups`: the group size `G`, >= 2 (a group of one sample has advantage 0); `N` must
        be a multiple of it.
    - `eps`: added to the std; `None` (default) for the release's of `std`
        (`default_eps`: 1e-4, or 1e-8 for the unbiased ones).
    - `std`: `"group"` (default), `"global"`, `"group_unbiased"` or `"global_unbiased"`.

    **Returns:**

    `[N]` float32 advantages; exactly zero for every row of a constant group.

    **Raises:**

    - `ValueError`: naming the argument, for a bad shape, a group size that is not an int
        >= 2 or does not divide `N`, eps, std mode, or non-finite rewards.
    """
    result: npt.NDArray[np.float32] = _normalised(rewards, groups, eps, std).astype(np.float32)
    return result


def _normalised(
    rewards: npt.ArrayLike, groups: int, eps: float | None, std: AdvantageStd
) -> npt.NDArray[np.float64]:
    """`group_advantages` before its cast to float32."""
    values = np.asarray(rewards, dtype=np.float64)
    if values.ndim != 1:
        raise ValueError(f"`rewards` must have shape [N], got {values.shape}.")
    check_normalisation("rewards", values.shape[0], groups, eps, std)
    if not np.all(np.isfinite(values)):
        bad = np.flatnonzero(~np.isfinite(values)).tolist()
        raise ValueError(f"`rewards` has non-finite values at rows {bad}.")
    epsilon = default_eps(std) if eps is None else eps
    ddof = std_ddof(std)
    grouped = values.reshape(-1, groups)
    centred = grouped - grouped.mean(axis=1, keepdims=True)
    if std_is_global(std):
        spread = np.full((grouped.shape[0], 1), values.std(ddof=ddof))
    else:
        spread = grouped.std(axis=1, keepdims=True, ddof=ddof)
    with np.errstate(divide="ignore", invalid="ignore"):  # constant groups: set to 0 below
        advantages: npt.NDArray[np.float64] = centred / (spread + epsilon)
    constant = np.all(grouped == grouped[:, :1], axis=1)
    advantages[constant] = 0.0
    flat: npt.NDArray[np.float64] = advantages.reshape(-1)
    return flat


def per_reward_advantages(
    components: npt.ArrayLike,
    weights: npt.ArrayLike,
    groups: int,
    eps: float | None = None,
    std: AdvantageStd = "group",
) -> npt.NDArray[np.float32]:
    """Each reward normalised within its group first, then the weighted sum (float64).

    `A = sum_k w_k (r_k - mean_group(r_k)) / (std(r_k) + eps)` with the std of
    `group_advantages` (any `AdvantageStd`), every term in float64, cast to float32 at the
    end (`reward_advantages` gives the terms apart). A reward's scale and offset therefore do
    not matter, only its weight: each term is invariant to `r_k -> a r_k + b` with `a > 0`
    (exactly when `eps = 0`). A row's advantage is zero when every reward is constant in its
    group.

    **Arguments:**

    - `components`: `[R, N]` scores, one row per reward.
    - `weights`: `[R]` finite weights.
    - `groups`: the group size `G`, >= 2; `N` must be a multiple of it.
    - `eps`: added to each reward's std; `None` (default) for `std`'s release value
        (`default_eps`).
    - `std`: an `AdvantageStd`, `"group"` by default.

    **Returns:**

    `[N]` float32 advantages.

    **Raises:**

    - `ValueError`: naming the argument, for shapes that do not fit, non-finite weights, or
        what `group_advantages` rejects.
    """
    scores, factors = _terms(components, weights)
    total = np.zeros(scores.shape[1], dtype=np.float64)
    for factor, row in zip(factors, scores, strict=True):
        total += factor * _normalised(row, groups, eps, std)
    result: npt.NDArray[np.float32] = total.astype(np.float32)
    return result


def reward_advantages(
    components: npt.ArrayLike,
    groups: int,
    eps: float | None = None,
    std: AdvantageStd = "group",
) -> npt.NDArray[np.float32]:
    """Each reward's own group-normalised advantages, apart: the terms of
    `per_reward_advantages` before their weighted sum (DanceGRPO's multi-reward loss clips and
    sums each one's surrogate).

    **Arguments:**

    - `components`: `[R, N]` scores, one row per reward.
    - `groups`, `eps`, `std`: as `group_advantages`'.

    **Returns:**

    `[R, N]` float32 advantages, row `k` `group_advantages(components[k], groups, eps, std)`.

    **Raises:**

    - `ValueError`: naming the argument, for a `components` that is not `[R, N]`, or what
        `group_advantages` rejects.
    """
    scores = np.asarray(components, dtype=np.float64)
    if scores.ndim != 2:
        raise ValueError(f"`components` must have shape [R, N], got {scores.shape}.")
    result: npt.NDArray[np.float32] = np.stack(
        [_normalised(row, groups, eps, std) for row in scores]
    ).astype(np.float32)
    return result


def _terms(
    components: npt.ArrayLike, weights: npt.ArrayLike
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """`components` `[R, N]` and `weights` `[R]` in float64, checked."""
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
    return scores, factors
