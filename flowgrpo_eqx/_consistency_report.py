"""The porting check's report: its lines (`CheckLine`), the verdict and table
(`ConsistencyReport`), the thresholds (`ConsistencyThresholds`), and the list `check_consistency`
adds its lines to (`ReportLines`)."""

import dataclasses
import math
from typing import Any, final

import equinox as eqx
import numpy as np


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

    The lines `check_consistency` measures, in order (a line is left out where it does not
    apply):

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


class ReportLines:
    """The report's lines, added as `check_consistency`'s steps measure them; `report()`
    makes the `ConsistencyReport`."""

    def __init__(self) -> None:
        self.lines: list[CheckLine] = []

    def add(
        self, name: str, value: float | int | str, threshold: str, passed: Any, detail: str = ""
    ) -> None:
        """A line (`CheckLine`'s fields; `passed` is made a `bool`)."""
        self.lines.append(CheckLine(name, value, threshold, bool(passed), detail))

    def at_most(self, name: str, value: float, limit: float, detail: str = "") -> None:
        """A line that passes when `value <= limit` (NaN fails)."""
        self.add(name, value, f"<= {limit:g}", value <= limit, detail)

    def none_of(self, name: str, found: list[str], detail: str) -> None:
        """A line that passes when `found` is empty; `detail` follows the names found."""
        self.add(name, len(found), "== 0", not found, detail)

    def report(self) -> ConsistencyReport:
        """The `ConsistencyReport` of the lines added so far."""
        return ConsistencyReport(tuple(self.lines))
