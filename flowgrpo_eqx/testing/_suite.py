"""Every invariant that applies to an objective, chosen by its abstract class, run on one
of its training batches; what does not apply is reported by name."""

import dataclasses
from collections.abc import Callable
from typing import Any, final

import jax.numpy as jnp
import numpy as np

from ..objectives import AbstractRLObjective, AbstractTransitionObjective, AbstractVariables
from ..train import Trainer
from ._helpers import replace_fields
from ._invariants import (
    assert_advantages_group_normalised,
    assert_denominator_is_kept_count,
    assert_duplication_doubles_total,
    assert_loss_finite,
    assert_masked_entries_inert,
    assert_row_permutation_invariant,
    assert_unchanged_policy_ratio_one,
    assert_update_leaves_frozen,
    assert_zero_advantages_zero_gradient,
    recorded_transitions,
    with_transitions,
)
from ._strategies import CollectedBatch


EVERY_OBJECTIVE: tuple[str, ...] = (
    "loss finite",
    "advantages group-normalised",
    "update leaves frozen arrays",
)
"""The invariants `check_objective_invariants` runs on every `AbstractRLObjective`."""

TRANSITION_OBJECTIVE: tuple[str, ...] = (
    "zero advantages, zero gradient",
    "denominator is the kept count",
    "masked entries inert",
    "unchanged policy ratio one",
    "row permutation invariant",
    "duplication doubles total",
)
"""The invariants it runs on an `AbstractTransitionObjective` only (those that read the kept
set, the recorded log densities, or a loss that draws nothing per row)."""


@final
@dataclasses.dataclass(frozen=True)
class InvariantReport:
    """What `check_objective_invariants` ran.

    **Arguments:**

    - `objective`: the objective's class name.
    - `checked`: the invariants that held, in order.
    - `not_applicable`: `(name, why)` for each invariant that does not apply.
    """

    objective: str
    checked: tuple[str, ...]
    not_applicable: tuple[tuple[str, str], ...]


def _checkered(objective: AbstractTransitionObjective[Any, Any], batch: Any) -> Any:
    """`batch` with every other transition masked out (a rollout masks few or none), so that
    the mask rules are tested on masked entries; the whole mask where that keeps none."""
    transitions = recorded_transitions(batch)
    mask = np.asarray(transitions.transition_mask)
    rows, columns = np.indices(mask.shape)
    thinned = mask & ((rows + columns) % 2 == 0)
    candidate = replace_fields(transitions, transition_mask=jnp.asarray(thinned))
    if not np.any(np.asarray(objective.kept(candidate))):
        return batch
    return with_transitions(batch, candidate)


def check_objective_invariants(
    objective: AbstractRLObjective[Any, Any],
    variables: AbstractVariables,
    sample: CollectedBatch,
    *,
    trainer: Trainer | None = None,
) -> InvariantReport:
    """Run every invariant that applies to `objective` on one training batch.

    Every `AbstractRLObjective` gets `EVERY_OBJECTIVE`; an `AbstractTransitionObjective`
    (Flow-GRPO, Flow-DPPO, DanceGRPO: its loss rescores recorded transitions) also gets
    `TRANSITION_OBJECTIVE`; its mask rules run with every other transition masked out. For
    any other objective those are reported as not applicable,
    naming its class.

    **Arguments:**

    - `objective`: any `AbstractRLObjective`.
    - `variables`: its variables at `init` (the zero-advantage invariant needs the policy
        equal to its reference and old policy).
    - `sample`: one of its batches (`collected_batch`, `training_batches`), collected with
        `variables`.
    - `trainer`: the `Trainer` whose update is checked; `Trainer(objective)` when `None`.

    **Returns:**

    The `InvariantReport`.

    **Raises:**

    - `ValueError`: naming `objective`, if it is not an `AbstractRLObjective`.
    - `AssertionError`: naming the first invariant that fails, and why.
    """
    if not isinstance(objective, AbstractRLObjective):
        raise ValueError(f"`objective` must be an AbstractRLObjective, got {objective!r}.")
    batch = sample.batch
    checks: list[tuple[str, Callable[[], None]]] = [
        ("loss finite", lambda: assert_loss_finite(objective, variables, batch)),
        ("advantages group-normalised", lambda: assert_advantages_group_normalised(sample)),
    ]
    not_applicable: list[tuple[str, str]] = []
    if isinstance(objective, AbstractTransitionObjective):
        rows = int(np.shape(sample.collected.advantages)[0])
        reverse = np.arange(rows)[::-1]
        masked = _checkered(objective, batch)
        checks += [
            (
                "zero advantages, zero gradient",
                lambda: assert_zero_advantages_zero_gradient(objective, variables, batch),
            ),
            (
                "denominator is the kept count",
                lambda: assert_denominator_is_kept_count(objective, variables, masked),
            ),
            (
                "masked entries inert",
                lambda: assert_masked_entries_inert(objective, variables, masked),
            ),
            (
                "unchanged policy ratio one",
                lambda: assert_unchanged_policy_ratio_one(objective, variables, batch),
            ),
            (
                "row permutation invariant",
                lambda: assert_row_permutation_invariant(objective, variables, batch, reverse),
            ),
            (
                "duplication doubles total",
                lambda: assert_duplication_doubles_total(objective, variables, batch),
            ),
        ]
    else:
        why = (
            f"{type(objective).__name__} is no AbstractTransitionObjective: it trains on what "
            "its rollout sampled, with no recorded transitions, kept set or policy ratio"
        )
        not_applicable += [(name, why) for name in TRANSITION_OBJECTIVE]
    # Last: the update donates the state's buffers.
    checks.append(
        (
            "update leaves frozen arrays",
            lambda: assert_update_leaves_frozen(objective, variables, batch, trainer=trainer),
        )
    )
    checked: list[str] = []
    for name, check in checks:
        try:
            check()
        except AssertionError as error:
            raise AssertionError(f"{type(objective).__name__}: {name}: {error}") from error
        checked.append(name)
    return InvariantReport(type(objective).__name__, tuple(checked), tuple(not_applicable))
