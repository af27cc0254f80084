"""`check_consistency`: the porting check, one collect and one update on a user's setup.

What goes wrong when a model is ported to an RL objective is rarely loud: rescored log densities
drift from the rollout's (dropout left on, a low-precision model, a different SDE), the
on-policy ratio is not 1, masked garbage leaks into the gradient, part of the model does not
train. Each line of the report measures one of these on the user's own objective, rollout,
variables and rows, against a documented threshold.
"""

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jaxtyping import PRNGKeyArray, PyTree

from ._consistency_probes import (
    arrays_by_path,
    largest_difference,
    loss_and_gradient,
    named,
    poisoned_pair,
    relative_change,
    rescore,
)
from ._consistency_report import ConsistencyReport, ConsistencyThresholds, ReportLines
from ._custom_types import FinalSamples, RolloutInfo, Step, Transitions
from ._misc import leading_rows, repeat_rows
from ._rollout import FlowRollout
from .objectives import AbstractRLObjective, AbstractTransitionObjective, AbstractVariables, Rescore
from .rewards import RewardError, reward_name
from .train import Trainer


# ------------------------------------------------------------------------------------------
# The check, one step per group of lines.


def check_consistency(
    objective: AbstractRLObjective[Any, Any],
    rollout: FlowRollout,
    variables: AbstractVariables | None,
    rows: PyTree[Any],
    key: PRNGKeyArray,
    *,
    trainer: Trainer | None = None,
    thresholds: ConsistencyThresholds | None = None,
) -> ConsistencyReport:
    """Run one collect and one update on a setup and report what a port commonly breaks.

    The report's lines, in order, are those `ConsistencyReport` lists.

    Runs in one process; every step is the library's own (`rollout.collect`,
    `objective.training_batch`, `Trainer.rescore` when the batch asks for it,
    `objective.log_probs`, `objective.loss`, `Trainer.update`).

    **Arguments:**

    - `objective`: the `AbstractRLObjective` to check.
    - `rollout`: the `FlowRollout` that collects for it (normally over the same objective).
    - `variables`: the variables to start from, or `None` for `objective.init(key)`.
    - `rows`: the source rows of one rollout, `[P, ...]` host leaves.
    - `key`: the PRNG key of the collect and the update.
    - `trainer`: the `Trainer` whose update is checked (its `trainable` filter decides which
        arrays must get a gradient); `Trainer(objective)` when `None`.
    - `thresholds`: `ConsistencyThresholds()` when `None`.

    **Returns:**

    The `ConsistencyReport`; `print(report)` shows the table, `report.passed` the verdict.

    **Raises:**

    - `ValueError`: if `objective` is not an `AbstractRLObjective`, `rollout` not a
        `FlowRollout`, or the rollout's sampler not one the objective trains on
        (`rollout_sampler`).
    """
    _check_arguments(objective, rollout)
    limits = ConsistencyThresholds() if thresholds is None else thresholds
    trainer = Trainer(objective) if trainer is None else trainer
    collect_key, init_key, step_key = jax.random.split(key, 3)
    if variables is None:
        variables = objective.init(init_key)
    lines = ReportLines()
    sampling_policy = objective.sampling_policy(variables)
    _check_reward(rollout, sampling_policy, rows, collect_key, lines)
    try:
        collected, info = _check_rollout_reproducible(
            rollout, sampling_policy, rows, collect_key, limits, lines
        )
    except RewardError as error:
        lines.add("rollout collect", "raised", "no error", False, str(error))
        return lines.report()
    _check_transitions(objective, variables, collected, limits, lines)
    _check_update(
        objective, trainer, variables, (collected, info), (init_key, step_key), limits, lines
    )
    return lines.report()


def _check_arguments(objective: Any, rollout: Any) -> None:
    """Refuse an `objective` that is not an `AbstractRLObjective`, a `rollout` that is not a
    `FlowRollout`, or a rollout's sampler the objective does not train on."""
    if not isinstance(objective, AbstractRLObjective):
        raise ValueError(f"`objective` must be an AbstractRLObjective, got {objective!r}.")
    if not isinstance(rollout, FlowRollout):
        raise ValueError(f"`rollout` must be a FlowRollout, got {rollout!r}.")
    objective.rollout_sampler(rollout.sampler)


def _check_transitions(
    objective: AbstractRLObjective[Any, Any],
    variables: AbstractVariables,
    collected: Transitions | FinalSamples,
    limits: ConsistencyThresholds,
    lines: ReportLines,
) -> None:
    """The lines on the recorded transitions of an `AbstractTransitionObjective` (kept
    transitions, log-prob gap, ratio range), or one saying they do not apply."""
    if isinstance(objective, AbstractTransitionObjective):
        transitions = _recorded(collected)
        kept = _check_kept_transitions(objective, transitions, lines)
        log_ratio = _check_log_prob_gap(objective, variables, transitions, kept, limits, lines)
        _add_ratio_range(log_ratio, limits, lines)
    else:
        lines.add(
            "transition checks",
            "not applicable",
            "n/a",
            True,
            f"{type(objective).__name__} trains on what its rollout sampled, not on recorded "
            "transitions: no log densities to rescore",
        )


def _check_update(
    objective: AbstractRLObjective[Any, Any],
    trainer: Trainer,
    variables: AbstractVariables,
    collect: tuple[Transitions | FinalSamples, RolloutInfo],
    keys: tuple[PRNGKeyArray, PRNGKeyArray],
    limits: ConsistencyThresholds,
    lines: ReportLines,
) -> None:
    """The lines on the first update: its metrics, masked entries, the gradient's reach and
    the frozen arrays. `collect` is the rollout's `(collected, info)`, `keys` the
    `(init_key, step_key)`."""
    (collected, info), (init_key, step_key) = collect, keys
    state = trainer.init(init_key, variables)
    batch = _training_batch(objective, trainer, state, collected, info)
    start = state.variables
    must_stay = _frozen_arrays(trainer, start)
    step = Step(index=0, key=step_key)
    _, _, gradient = loss_and_gradient(objective, trainer, start, batch, step)
    gradient_arrays = arrays_by_path(gradient, "policy")
    new_state, metrics = trainer.update(state, batch)
    _check_first_update(metrics, limits, lines)
    if isinstance(objective, AbstractTransitionObjective) and isinstance(batch, Transitions):
        _check_masked_entries(objective, trainer, variables, batch, step_key, limits, lines)
    _check_gradient_reach(gradient_arrays, lines)
    _check_frozen_arrays(must_stay, _frozen_arrays(trainer, new_state.variables), lines)


def _recorded(collected: Transitions | FinalSamples) -> Transitions:
    """The rollout's `Transitions`.

    **Raises:**

    - `ValueError`: naming `rollout`, when it recorded final samples only.
    """
    if not isinstance(collected, Transitions):
        raise ValueError(f"`rollout` recorded no transitions, got {type(collected).__name__}.")
    return collected


def _training_batch(
    objective: AbstractRLObjective[Any, Any],
    trainer: Trainer,
    state: Any,
    collected: Transitions | FinalSamples,
    info: RolloutInfo,
) -> Any:
    """The batch the first update trains on, as the epoch loop builds it: the objective's
    `training_batch`, rescored by the trainer over all its rows when it asks to be."""
    requested = objective.training_batch(collected, info)
    if not isinstance(requested, Rescore):
        return requested
    every_row = jnp.arange(leading_rows(requested.batch))
    return trainer.rescore(state, requested, [every_row])


def _check_reward(
    rollout: FlowRollout,
    policy: Any,
    rows: PyTree[Any],
    key: PRNGKeyArray,
    lines: ReportLines,
) -> None:
    """`reward shape`, `reward dtype`, `reward finite`, `reward repeatable` (or `reward
    call` when it raises): the reward called directly on the sampling policy's decoded
    samples."""
    host_rows = repeat_rows(rows, rollout.groups)
    generated = rollout.generate(policy, jax.tree.map(jnp.asarray, host_rows), key)
    samples = np.asarray(generated.samples)
    num = int(samples.shape[0])
    reward = rollout.reward
    name = reward_name(reward)
    try:
        raw = reward(samples, host_rows)
        again = reward(samples, host_rows)
    except Exception as error:  # noqa: BLE001 - reported as a failed line
        detail = f"{name}: {type(error).__name__}: {error}"
        lines.add("reward call", "raised", "no error", False, detail)
        return
    values = np.asarray(raw)
    repeated = np.asarray(again)
    lines.add(
        "reward shape",
        str(values.shape),
        f"[N] = ({num},)",
        values.shape == (num,),
        f"{name} on {num} decoded samples",
    )
    lines.add(
        "reward dtype",
        str(values.dtype),
        "float64",
        values.dtype == np.float64,
        "as returned; lower precision is lost before the group statistics",
    )
    numeric = np.issubdtype(values.dtype, np.number)
    finite = bool(numeric and np.all(np.isfinite(values.astype(np.float64))))
    lines.add("reward finite", "yes" if finite else "no", "all finite", finite)
    same = values.shape == repeated.shape and bool(
        np.array_equal(values, repeated, equal_nan=numeric)
    )
    lines.add(
        "reward repeatable",
        "yes" if same else "no",
        "same scores twice",
        same,
        "the same samples scored twice",
    )


def _check_rollout_reproducible(
    rollout: FlowRollout,
    policy: Any,
    rows: PyTree[Any],
    key: PRNGKeyArray,
    limits: ConsistencyThresholds,
    lines: ReportLines,
) -> tuple[Transitions | FinalSamples, RolloutInfo]:
    """`rollout reproducible`: two collects with one key; returns the first.

    **Raises:**

    - `RewardError`: from the collect, which the caller reports.
    """
    collected, info = rollout.collect(policy, rows, key)
    again, again_info = rollout.collect(policy, rows, key)
    difference = max(
        largest_difference(collected, again),
        largest_difference(info.rewards, again_info.rewards),
    )
    lines.at_most(
        "rollout reproducible",
        difference,
        limits.rollout_difference,
        "largest difference between two collects with the same key (batch and rewards)",
    )
    return collected, info


def _check_kept_transitions(
    objective: AbstractTransitionObjective[Any, Any], batch: Transitions, lines: ReportLines
) -> npt.NDArray[np.bool_]:
    """`kept transitions`: at least one transition counts; returns the kept mask `[N, K]`."""
    kept = np.asarray(objective.kept(batch))
    count = int(kept.sum())
    lines.add(
        "kept transitions",
        count,
        ">= 1",
        count >= 1,
        f"of {kept.size} recorded; masked in (non-zero advantage) and stochastic",
    )
    return kept


def _check_log_prob_gap(
    objective: AbstractTransitionObjective[Any, Any],
    variables: AbstractVariables,
    batch: Transitions,
    kept: npt.NDArray[np.bool_],
    limits: ConsistencyThresholds,
    lines: ReportLines,
) -> npt.NDArray[np.float64]:
    """`log-prob gap max`, `log-prob gap mean`: rescoring reproduces the rollout's log
    densities; returns the kept transitions' `rescored - recorded`."""
    rescored = np.asarray(rescore(objective, variables, batch), np.float64)
    recorded = np.asarray(batch.old_log_probs, np.float64)
    log_ratio = (rescored - recorded)[kept]
    gap = np.abs(log_ratio)
    gap_max = float(np.max(gap)) if gap.size else math.nan
    gap_mean = float(np.mean(gap)) if gap.size else math.nan
    where = ""
    if gap.size and not gap_max <= limits.log_prob_gap:
        row, column = np.argwhere(kept)[int(np.nanargmax(np.where(np.isnan(gap), np.inf, gap)))]
        where = f"; worst at row {row}, transition {column}"
    lines.at_most(
        "log-prob gap max",
        gap_max,
        limits.log_prob_gap,
        f"|rescored - recorded| over kept transitions{where}",
    )
    lines.at_most(
        "log-prob gap mean",
        gap_mean,
        limits.log_prob_gap,
        "mean |rescored - recorded| over kept transitions",
    )
    return log_ratio


def _add_ratio_range(
    log_ratio: npt.NDArray[np.float64], limits: ConsistencyThresholds, lines: ReportLines
) -> None:
    """`ratio min`, `ratio max`: the rescored log densities' ratios to the recorded ones."""
    ratio_min = float(np.exp(np.min(log_ratio))) if log_ratio.size else math.nan
    ratio_max = float(np.exp(np.max(log_ratio))) if log_ratio.size else math.nan
    ratio_rule = f"|r - 1| <= {limits.ratio:g}"
    lines.add("ratio min", ratio_min, ratio_rule, abs(ratio_min - 1.0) <= limits.ratio)
    lines.add("ratio max", ratio_max, ratio_rule, abs(ratio_max - 1.0) <= limits.ratio)


def _check_first_update(
    metrics: dict[str, Any], limits: ConsistencyThresholds, lines: ReportLines
) -> None:
    """`loss finite`, and `ratio mean`, `clip fraction`, `KL at init` where the loss reports
    `ratio`, `clipfrac` and `kl`: the first update is on-policy."""
    loss = float(metrics["loss"])
    lines.add(
        "loss finite",
        loss,
        "finite",
        math.isfinite(loss),
        "the first update's loss",
    )
    if "ratio" in metrics:
        ratio_mean = float(metrics["ratio"])
        lines.add(
            "ratio mean",
            ratio_mean,
            f"|r - 1| <= {limits.ratio:g}",
            abs(ratio_mean - 1.0) <= limits.ratio,
            "the first update's mean policy ratio",
        )
    if "clipfrac" in metrics:
        lines.at_most(
            "clip fraction",
            float(metrics["clipfrac"]),
            limits.clip_fraction,
            "the first update's fraction of clipped ratios",
        )
    if "kl" in metrics:
        lines.at_most(
            "KL at init",
            float(metrics["kl"]),
            limits.kl,
            "the first update's KL (to the reference or the old policy: the same weights at "
            "initialisation)",
        )


def _check_masked_entries(
    objective: AbstractTransitionObjective[Any, Any],
    trainer: Trainer,
    variables: AbstractVariables,
    batch: Transitions,
    key: PRNGKeyArray,
    limits: ConsistencyThresholds,
    lines: ReportLines,
) -> None:
    """`masked NaN/inf: loss`, `masked NaN/inf: gradient`: NaN and inf in masked entries
    change neither."""
    names = ("masked NaN/inf: loss", "masked NaN/inf: gradient")
    pair = poisoned_pair(objective, batch)
    if pair is None:
        for name in names:
            lines.add(name, "untested", f"<= {limits.masked_change:g}", False, "no entry to mask")
        return
    clean, poisoned, count = pair
    step = Step(index=0, key=key)
    clean_loss, _, clean_gradient = loss_and_gradient(objective, trainer, variables, clean, step)
    bad_loss, _, bad_gradient = loss_and_gradient(objective, trainer, variables, poisoned, step)
    loss_change = relative_change(largest_difference(bad_loss, clean_loss), abs(float(clean_loss)))
    clean_scale = max(
        [float(np.max(np.abs(g))) for g in jax.tree.leaves(clean_gradient) if np.size(g)] + [0.0]
    )
    gradient_change = relative_change(largest_difference(bad_gradient, clean_gradient), clean_scale)
    detail = f"{count} masked entries hold NaN/inf; relative change"
    lines.at_most(names[0], loss_change, limits.masked_change, detail)
    lines.at_most(
        names[1], gradient_change, limits.masked_change, detail + " (to the largest gradient entry)"
    )


def _check_gradient_reach(gradient_arrays: dict[str, npt.NDArray[Any]], lines: ReportLines) -> None:
    """`zero-gradient arrays`: every trainable array gets a finite, non-zero gradient."""
    dead = [
        path
        for path, g in gradient_arrays.items()
        if g.size and (not np.all(np.isfinite(g)) or not np.any(g != 0))
    ]
    lines.none_of(
        "zero-gradient arrays",
        dead,
        (f"no gradient (or non-finite): {named(dead)}; " if dead else "")
        + f"of {len(gradient_arrays)} trainable arrays",
    )


def _frozen_arrays(trainer: Trainer, variables: AbstractVariables) -> dict[str, npt.NDArray[Any]]:
    """What one update must not change: the frozen part of the policy, and every other
    field of the variables (the optimizer writes `policy` alone)."""
    arrays = arrays_by_path(trainer.split_policy(variables.policy)[1], "policy")
    for field in dataclasses.fields(variables):
        if field.name != "policy":
            arrays.update(arrays_by_path(getattr(variables, field.name), field.name))
    return arrays


def _check_frozen_arrays(
    before: dict[str, npt.NDArray[Any]], after: dict[str, npt.NDArray[Any]], lines: ReportLines
) -> None:
    """`frozen arrays changed`: one update left the frozen arrays exactly as they were."""
    changed = [
        path
        for path, array in before.items()
        if path not in after or not np.array_equal(array, after[path], equal_nan=True)
    ]
    lines.none_of(
        "frozen arrays changed",
        changed,
        (f"changed by one update: {named(changed)}; " if changed else "")
        + f"of {len(before)} frozen arrays (the policy's and the other variables')",
    )
