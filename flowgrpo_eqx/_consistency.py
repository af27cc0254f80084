"""`check_consistency`: the porting check, one collect and one update on a user's setup.

What goes wrong when a model is ported to an RL objective is rarely loud: rescored log densities
drift from the rollout's (dropout left on, a low-precision model, a different SDE), the
on-policy ratio is not 1, masked garbage leaks into the gradient, part of the model does not
train. Each line of the report measures one of these on the user's own objective, rollout,
variables and rows, against a documented threshold.
"""

import dataclasses
import math
from typing import Any, final

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jaxtyping import Array, PRNGKeyArray, PyTree

from ._custom_types import FinalSamples, RolloutInfo, Step, Transitions
from ._misc import leading_rows, repeat_rows
from ._rollout import FlowRollout
from .objectives import AbstractRLObjective, AbstractTransitionObjective, AbstractVariables, Rescore
from .rewards import RewardError, reward_name
from .train import Trainer


@final
@dataclasses.dataclass(frozen=True)
class CheckLine:
    """One line of a `ConsistencyReport` (immutable; its texts are free text, not modes).

    **Arguments:**

    - `name`: what is checked.
    - `value`: what was measured (a number, or a short text such as a dtype).
    - `threshold`: the condition the value must meet, as text (`"<= 1e-06"`).
    - `passed`: whether it met it.
    - `detail`: what the value is over, or what went wrong and where.
    """

    name: str
    value: float | int | str
    threshold: str
    passed: bool
    detail: str = ""


def _format_value(value: float | int | str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return str(int(value))
    number = float(value)
    if number == 0.0:
        return "0"
    if not math.isfinite(number):
        return str(number)
    if 1e-3 <= abs(number) < 1e4:
        return f"{number:.7g}"
    return f"{number:.3e}"


@final
class ConsistencyReport(eqx.Module):
    """The porting check's verdict: one `CheckLine` per measured property.

    `str(report)` (or `report.table()`) is an aligned text table; `report.passed` is whether
    every line passed.

    **Arguments:**

    - `lines`: the checked lines, in the order they were measured.
    """

    lines: tuple[CheckLine, ...]

    @property
    def passed(self) -> bool:
        """Whether every line passed (and there is at least one)."""
        return bool(self.lines) and all(line.passed for line in self.lines)

    @property
    def failed(self) -> tuple[CheckLine, ...]:
        """The lines that did not pass."""
        return tuple(line for line in self.lines if not line.passed)

    def line(self, name: str) -> CheckLine:
        """The line called `name`.

        **Raises:**

        - `KeyError`: naming the line, when the report has none of that name.
        """
        for line in self.lines:
            if line.name == name:
                return line
        raise KeyError(f"No line {name!r}; lines: {[line.name for line in self.lines]}.")

    def table(self) -> str:
        """The report as an aligned text table, one row per line and a closing verdict."""
        header = ("check", "value", "threshold", "verdict", "detail")
        rows = [
            (
                line.name,
                _format_value(line.value),
                line.threshold,
                "pass" if line.passed else "FAIL",
                line.detail,
            )
            for line in self.lines
        ]
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(4)]

        def render(row: tuple[str, ...]) -> str:
            cells = [row[i].ljust(widths[i]) for i in range(4)]
            return "  ".join([*cells, row[4]]).rstrip()

        rule = "  ".join("-" * width for width in widths) + "  ------"
        passed = sum(line.passed for line in self.lines)
        verdict = "PASSED" if self.passed else "FAILED"
        closing = f"{verdict}: {passed} of {len(self.lines)} checks passed."
        return "\n".join([render(header), rule, *(render(row) for row in rows), closing])

    def __str__(self) -> str:
        return self.table()


@final
class ConsistencyThresholds(eqx.Module):
    """The thresholds of `check_consistency`; every one may be overridden.

    The defaults suit a float32 model on one device, where rescoring repeats the rollout's
    arithmetic on other batch shapes and differs from it by a few float32 ulps (about 1e-7 on
    log densities of order 1).

    **Arguments:**

    - `log_prob_gap`: the largest allowed `|rescored - recorded|` log density of a kept
        transition, and of their mean (1e-6).
    - `ratio`: the largest allowed `|r - 1|` of the first update's policy ratio: its mean,
        minimum and maximum over kept transitions (1e-6).
    - `clip_fraction`: the largest allowed fraction of clipped ratios in the first update (0).
    - `kl`: the largest allowed KL to the reference at initialisation, when `beta > 0`
        (1e-7; the policy and the reference are the same weights, so it is 0 exactly unless
        the model is not a function of its inputs).
    - `masked_change`: the largest allowed change of the loss and of the gradient (relative
        to the largest clean gradient entry) when masked entries hold NaN or inf (1e-6; a
        leak shows as NaN or as a change of order one).
    - `rollout_difference`: the largest allowed difference between two collects with the
        same key, over every array of the batch (0: identical).

    **Raises:**

    - `ValueError`: naming the threshold, for a negative or non-numeric one.
    """

    log_prob_gap: float = 1e-6
    ratio: float = 1e-6
    clip_fraction: float = 0.0
    kl: float = 1e-7
    masked_change: float = 1e-6
    rollout_difference: float = 0.0

    def __check_init__(self) -> None:
        for name in (
            "log_prob_gap",
            "ratio",
            "clip_fraction",
            "kl",
            "masked_change",
            "rollout_difference",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"`{name}` must be a number >= 0, got {value!r}.")


# ------------------------------------------------------------------------------------------
# Jit-compiled pieces.


@eqx.filter_jit
def _rescore(
    objective: AbstractTransitionObjective[Any, Any],
    variables: AbstractVariables,
    batch: Transitions,
) -> Array:
    return objective.log_probs(variables, batch)


@eqx.filter_jit
def _loss_and_gradient(
    objective: AbstractRLObjective[Any, Any],
    trainer: Trainer,
    variables: AbstractVariables,
    batch: Any,
    step: Step,
) -> tuple[Array, Any, PyTree[Any]]:
    """The loss value, its auxiliary output and the gradient with respect to the trainer's
    trainable arrays."""
    trainable, frozen = trainer.split_policy(variables.policy)

    def value(params: PyTree[Any]) -> tuple[Array, Any]:
        policy = eqx.combine(params, frozen)
        total, aux = objective.loss(eqx.tree_at(lambda v: v.policy, variables, policy), batch, step)
        return total.value, aux

    (loss, aux), gradient = eqx.filter_value_and_grad(value, has_aux=True)(trainable)
    return loss, aux, gradient


# ------------------------------------------------------------------------------------------
# Host-side helpers.


def _arrays_by_path(tree: PyTree[Any], prefix: str) -> dict[str, npt.NDArray[Any]]:
    """Every array leaf of `tree` as a host copy, keyed by its path."""
    leaves = jax.tree_util.tree_leaves_with_path(eqx.filter(tree, eqx.is_array))
    return {prefix + jax.tree_util.keystr(path): np.array(leaf) for path, leaf in leaves}


def _named(paths: list[str], limit: int = 4) -> str:
    shown = ", ".join(paths[:limit])
    return shown + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


def _largest_difference(first: PyTree[Any], second: PyTree[Any]) -> float:
    """The largest absolute difference between two trees of arrays (inf where they disagree
    in structure, shape or a non-float entry; NaN on one side only counts as inf)."""
    first_leaves, first_def = jax.tree.flatten(first)
    second_leaves, second_def = jax.tree.flatten(second)
    if str(first_def) != str(second_def):
        return math.inf
    largest = 0.0
    for a, b in zip(first_leaves, second_leaves, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape or a.dtype != b.dtype:
            return math.inf
        if not np.issubdtype(a.dtype, np.inexact):
            if not np.array_equal(a, b):
                return math.inf
            continue
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        same = (a64 == b64) | (np.isnan(a64) & np.isnan(b64))
        if np.any(~same & ~np.isfinite(a64 - b64)):
            return math.inf
        if a.size:
            largest = max(largest, float(np.max(np.where(same, 0.0, np.abs(a64 - b64)))))
    return largest


def _poisoned_pair(
    objective: AbstractTransitionObjective[Any, Any], batch: Transitions
) -> tuple[Transitions, Transitions, int] | None:
    """A clean batch with more transitions masked out, the same batch with NaN and inf in
    every masked entry, and how many entries were poisoned; `None` when no masking leaves
    a kept transition beside a masked one."""
    mask = np.asarray(batch.transition_mask)
    stochastic = np.asarray(objective.sde.is_stochastic(batch.timesteps, batch.next_timesteps))
    n, k = mask.shape
    rows, columns = np.indices((n, k))
    checker = (rows + columns) % 2 == 1
    last_row = rows == n - 1
    chosen = None
    for drop in (checker | last_row, checker, last_row, np.zeros_like(mask)):
        new_mask = mask & ~drop
        if np.any(new_mask & stochastic) and np.any(~new_mask):
            chosen = new_mask
            break
    if chosen is None:
        return None
    masked = ~chosen
    masked_rows = np.all(masked, axis=1)

    def poison(value: Array, where: npt.NDArray[np.bool_], bad: float) -> Array:
        host = np.array(value)
        host[where] = bad
        return jnp.asarray(host)

    clean = eqx.tree_at(lambda b: b.transition_mask, batch, jnp.asarray(chosen))
    advantages = np.asarray(batch.advantages)
    advantage_where = masked if advantages.ndim == 2 else masked_rows

    def poison_condition(leaf: Any) -> Any:
        if not jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
            return leaf
        return poison(leaf, masked_rows, math.nan)

    poisoned = eqx.tree_at(
        lambda b: (
            b.latents,
            b.next_latents,
            b.timesteps,
            b.next_timesteps,
            b.old_log_probs,
            b.transition_mask,
            b.advantages,
            b.cond,
        ),
        batch,
        (
            poison(batch.latents, masked, math.nan),
            poison(batch.next_latents, masked, math.inf),
            poison(batch.timesteps, masked, -math.inf),
            poison(batch.next_timesteps, masked, math.nan),
            poison(batch.old_log_probs, masked, math.inf),
            jnp.asarray(chosen),
            poison(batch.advantages, advantage_where, math.nan),
            jax.tree.map(poison_condition, batch.cond),
        ),
    )
    if batch.old_means is not None:
        poisoned = eqx.tree_at(
            lambda b: b.old_means, poisoned, poison(batch.old_means, masked, math.nan)
        )
    return clean, poisoned, int(masked.sum())


def _relative_change(changed: float, scale: float) -> float:
    return changed / max(scale, 1e-30) if math.isfinite(changed) else math.inf


# ------------------------------------------------------------------------------------------
# The check, one step per group of lines.


class _Lines:
    """The report's lines, added as the steps measure them."""

    def __init__(self) -> None:
        self.lines: list[CheckLine] = []

    def add(
        self, name: str, value: float | int | str, threshold: str, passed: Any, detail: str = ""
    ) -> None:
        self.lines.append(CheckLine(name, value, threshold, bool(passed), detail))

    def at_most(self, name: str, value: float, limit: float, detail: str = "") -> None:
        """A line that passes when `value <= limit` (NaN fails)."""
        self.add(name, value, f"<= {limit:g}", value <= limit, detail)

    def none_of(self, name: str, found: list[str], detail: str) -> None:
        """A line that passes when `found` is empty; `detail` follows the names found."""
        self.add(name, len(found), "== 0", not found, detail)

    def report(self) -> ConsistencyReport:
        return ConsistencyReport(tuple(self.lines))


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

    The lines, in order (a line is left out where it does not apply):

    - `reward shape`, `reward dtype`, `reward finite`, `reward repeatable`: the reward,
        called directly on decoded samples of the sampling policy, returns `[N]` float64
        finite scores, the same ones when called again on the same samples.
    - `rollout reproducible`: two collects with the same key give identical batches.
    - For an `AbstractTransitionObjective` (Flow-GRPO, Flow-DPPO, DanceGRPO), whose loss
        rescores the recorded transitions:
        - `kept transitions`: at least one transition counts (masked in and stochastic; a
            reward that ties every group keeps none).
        - `log-prob gap max`, `log-prob gap mean`: `|objective.log_probs - old_log_probs|`
            over the kept transitions: rescoring must reproduce the rollout's log densities.
        - `ratio min`, `ratio max` (from the rescored log densities): exactly 1 on-policy.

        Any other objective trains on what its rollout sampled, not on recorded log
        densities: one line, `transition checks`, says that they do not apply, and why.
    - `loss finite`: the first update's loss is finite.
    - `ratio mean`, `clip fraction`, `KL at init`: where the objective's loss reports a
        `ratio`, a `clipfrac` or a `kl` metric, the first update's are 1, 0 and 0 (the
        policy is its own old policy and reference at first).
    - `masked NaN/inf: loss`, `masked NaN/inf: gradient`: where the objective trains on
        the `Transitions` themselves, NaN and inf written into masked entries (and into the
        float conditioning of wholly masked rows) change neither.
    - `zero-gradient arrays`: every trainable array of the policy gets a finite, non-zero
        gradient; the offending array paths are named.
    - `frozen arrays changed`: one `Trainer.update` leaves the frozen part of the policy and
        every other field of the variables (a KL reference, an EMA, an old policy) exactly
        as they were.

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
    if not isinstance(objective, AbstractRLObjective):
        raise ValueError(f"`objective` must be an AbstractRLObjective, got {objective!r}.")
    if not isinstance(rollout, FlowRollout):
        raise ValueError(f"`rollout` must be a FlowRollout, got {rollout!r}.")
    objective.rollout_sampler(rollout.sampler)
    limits = ConsistencyThresholds() if thresholds is None else thresholds
    trainer = Trainer(objective) if trainer is None else trainer
    collect_key, init_key, step_key = jax.random.split(key, 3)
    if variables is None:
        variables = objective.init(init_key)
    lines = _Lines()
    sampling_policy = objective.sampling_policy(variables)
    _check_reward(rollout, sampling_policy, rows, collect_key, lines)
    try:
        collected, info = _check_rollout_reproducible(
            rollout, sampling_policy, rows, collect_key, limits, lines
        )
    except RewardError as error:
        lines.add("rollout collect", "raised", "no error", False, str(error))
        return lines.report()
    log_ratio = None
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
    state = trainer.init(init_key, variables)
    batch = _training_batch(objective, trainer, state, collected, info)
    start = state.variables
    must_stay = _frozen_arrays(trainer, start)
    step = Step(index=0, key=step_key)
    _, _, gradient = _loss_and_gradient(objective, trainer, start, batch, step)
    gradient_arrays = _arrays_by_path(gradient, "policy")
    new_state, metrics = trainer.update(state, batch)
    _check_first_update(metrics, limits, lines)
    if isinstance(objective, AbstractTransitionObjective) and isinstance(batch, Transitions):
        _check_masked_entries(objective, trainer, variables, batch, step_key, limits, lines)
    _check_gradient_reach(gradient_arrays, lines)
    _check_frozen_arrays(must_stay, _frozen_arrays(trainer, new_state.variables), lines)
    return lines.report()


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
    lines: _Lines,
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
    lines: _Lines,
) -> tuple[Transitions | FinalSamples, RolloutInfo]:
    """`rollout reproducible`: two collects with one key; returns the first.

    **Raises:**

    - `RewardError`: from the collect, which the caller reports.
    """
    collected, info = rollout.collect(policy, rows, key)
    again, again_info = rollout.collect(policy, rows, key)
    difference = max(
        _largest_difference(collected, again),
        _largest_difference(info.rewards, again_info.rewards),
    )
    lines.at_most(
        "rollout reproducible",
        difference,
        limits.rollout_difference,
        "largest difference between two collects with the same key (batch and rewards)",
    )
    return collected, info


def _check_kept_transitions(
    objective: AbstractTransitionObjective[Any, Any], batch: Transitions, lines: _Lines
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
    lines: _Lines,
) -> npt.NDArray[np.float64]:
    """`log-prob gap max`, `log-prob gap mean`: rescoring reproduces the rollout's log
    densities; returns the kept transitions' `rescored - recorded`."""
    rescored = np.asarray(_rescore(objective, variables, batch), np.float64)
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
    log_ratio: npt.NDArray[np.float64], limits: ConsistencyThresholds, lines: _Lines
) -> None:
    """`ratio min`, `ratio max`: the rescored log densities' ratios to the recorded ones."""
    ratio_min = float(np.exp(np.min(log_ratio))) if log_ratio.size else math.nan
    ratio_max = float(np.exp(np.max(log_ratio))) if log_ratio.size else math.nan
    ratio_rule = f"|r - 1| <= {limits.ratio:g}"
    lines.add("ratio min", ratio_min, ratio_rule, abs(ratio_min - 1.0) <= limits.ratio)
    lines.add("ratio max", ratio_max, ratio_rule, abs(ratio_max - 1.0) <= limits.ratio)


def _check_first_update(
    metrics: dict[str, Any], limits: ConsistencyThresholds, lines: _Lines
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
    lines: _Lines,
) -> None:
    """`masked NaN/inf: loss`, `masked NaN/inf: gradient`: NaN and inf in masked entries
    change neither."""
    names = ("masked NaN/inf: loss", "masked NaN/inf: gradient")
    pair = _poisoned_pair(objective, batch)
    if pair is None:
        for name in names:
            lines.add(name, "untested", f"<= {limits.masked_change:g}", False, "no entry to mask")
        return
    clean, poisoned, count = pair
    step = Step(index=0, key=key)
    clean_loss, _, clean_gradient = _loss_and_gradient(objective, trainer, variables, clean, step)
    bad_loss, _, bad_gradient = _loss_and_gradient(objective, trainer, variables, poisoned, step)
    loss_change = _relative_change(
        _largest_difference(bad_loss, clean_loss), abs(float(clean_loss))
    )
    clean_scale = max(
        [float(np.max(np.abs(g))) for g in jax.tree.leaves(clean_gradient) if np.size(g)] + [0.0]
    )
    gradient_change = _relative_change(
        _largest_difference(bad_gradient, clean_gradient), clean_scale
    )
    detail = f"{count} masked entries hold NaN/inf; relative change"
    lines.at_most(names[0], loss_change, limits.masked_change, detail)
    lines.at_most(
        names[1], gradient_change, limits.masked_change, detail + " (to the largest gradient entry)"
    )


def _check_gradient_reach(gradient_arrays: dict[str, npt.NDArray[Any]], lines: _Lines) -> None:
    """`zero-gradient arrays`: every trainable array gets a finite, non-zero gradient."""
    dead = [
        path
        for path, g in gradient_arrays.items()
        if g.size and (not np.all(np.isfinite(g)) or not np.any(g != 0))
    ]
    lines.none_of(
        "zero-gradient arrays",
        dead,
        (f"no gradient (or non-finite): {_named(dead)}; " if dead else "")
        + f"of {len(gradient_arrays)} trainable arrays",
    )


def _frozen_arrays(trainer: Trainer, variables: AbstractVariables) -> dict[str, npt.NDArray[Any]]:
    """What one update must not change: the frozen part of the policy, and every other
    field of the variables (the optimizer writes `policy` alone)."""
    arrays = _arrays_by_path(trainer.split_policy(variables.policy)[1], "policy")
    for field in dataclasses.fields(variables):
        if field.name != "policy":
            arrays.update(_arrays_by_path(getattr(variables, field.name), field.name))
    return arrays


def _check_frozen_arrays(
    before: dict[str, npt.NDArray[Any]], after: dict[str, npt.NDArray[Any]], lines: _Lines
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
        (f"changed by one update: {_named(changed)}; " if changed else "")
        + f"of {len(before)} frozen arrays (the policy's and the other variables')",
    )
