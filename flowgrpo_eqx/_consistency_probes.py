"""What the porting check measures with: a jit-compiled rescore and loss-and-gradient, and
host-side helpers (arrays by path, the largest difference of two trees, a batch with NaN and
inf in its masked entries)."""

import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jaxtyping import Array, PyTree

from ._custom_types import Step, Transitions
from .objectives import AbstractRLObjective, AbstractTransitionObjective, AbstractVariables
from .train import Trainer


@eqx.filter_jit
def rescore(
    objective: AbstractTransitionObjective[Any, Any],
    variables: AbstractVariables,
    batch: Transitions,
) -> Array:
    """`objective.log_probs(variables, batch)`, jit-compiled.

    **Arguments:**

    - `objective`: the objective that rescores.
    - `variables`: its variables.
    - `batch`: the recorded transitions.

    **Returns:**

    `[N, K]` rescored log densities.
    """
    return objective.log_probs(variables, batch)


@eqx.filter_jit
def loss_and_gradient(
    objective: AbstractRLObjective[Any, Any],
    trainer: Trainer,
    variables: AbstractVariables,
    batch: Any,
    step: Step,
) -> tuple[Array, Any, PyTree[Any]]:
    """The loss value, its auxiliary output and the gradient with respect to the trainer's
    trainable arrays, jit-compiled.

    **Arguments:**

    - `objective`: the objective whose loss is differentiated.
    - `trainer`: splits the policy into its trainable and frozen parts.
    - `variables`: the objective's variables.
    - `batch`: the training batch.
    - `step`: the training step.

    **Returns:**

    `(loss, aux, gradient)`, the gradient over the trainable part of `variables.policy`.
    """
    trainable, frozen = trainer.split_policy(variables.policy)

    def value(params: PyTree[Any]) -> tuple[Array, Any]:
        policy = eqx.combine(params, frozen)
        total, aux = objective.loss(eqx.tree_at(lambda v: v.policy, variables, policy), batch, step)
        return total.value, aux

    (loss, aux), gradient = eqx.filter_value_and_grad(value, has_aux=True)(trainable)
    return loss, aux, gradient


def arrays_by_path(tree: PyTree[Any], prefix: str) -> dict[str, npt.NDArray[Any]]:
    """Every array leaf of `tree` as a host copy, keyed by its path.

    **Arguments:**

    - `tree`: a PyTree.
    - `prefix`: put before each path (`"policy"`).

    **Returns:**

    `{prefix + path: host array}`.
    """
    leaves = jax.tree_util.tree_leaves_with_path(eqx.filter(tree, eqx.is_array))
    return {prefix + jax.tree_util.keystr(path): np.array(leaf) for path, leaf in leaves}


def named(paths: list[str], limit: int = 4) -> str:
    """The first `limit` of `paths`, comma-separated, and how many more there are.

    **Arguments:**

    - `paths`: the names.
    - `limit`: how many to show.

    **Returns:**

    `"a, b, c, d and 3 more"`.
    """
    shown = ", ".join(paths[:limit])
    return shown + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


def largest_difference(first: PyTree[Any], second: PyTree[Any]) -> float:
    """The largest absolute difference between two trees of arrays.

    **Arguments:**

    - `first`, `second`: trees of arrays.

    **Returns:**

    The largest `|first - second|` over their float entries (NaN on both sides equal); inf
    where they disagree in structure, shape, dtype or a non-float entry, or where NaN or inf
    is on one side only.
    """
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


def poisoned_pair(
    objective: AbstractTransitionObjective[Any, Any], batch: Transitions
) -> tuple[Transitions, Transitions, int] | None:
    """A batch with more transitions masked out, clean and poisoned.

    **Arguments:**

    - `objective`: the objective, whose SDE says which transitions are stochastic.
    - `batch`: the training batch.

    **Returns:**

    `(clean, poisoned, count)`: the batch with more transitions masked out, the same batch
    with NaN and inf in every masked entry (and in the float conditioning of wholly masked
    rows), and how many entries were poisoned; `None` when no masking leaves a kept
    transition beside a masked one.
    """
    chosen = more_masked(objective, batch)
    if chosen is None:
        return None
    clean = eqx.tree_at(lambda b: b.transition_mask, batch, jnp.asarray(chosen))
    return clean, poisoned_copy(batch, chosen), int((~chosen).sum())


def more_masked(
    objective: AbstractTransitionObjective[Any, Any], batch: Transitions
) -> npt.NDArray[np.bool_] | None:
    """The batch's transition mask with more transitions masked out: a checkerboard and the
    last row, or either, or none, the first that keeps a stochastic transition beside a
    masked one.

    **Arguments:**

    - `objective`: the objective, whose SDE says which transitions are stochastic.
    - `batch`: the training batch.

    **Returns:**

    `[N, K]` the new mask, or `None` when none of them qualifies.
    """
    mask = np.asarray(batch.transition_mask)
    stochastic = np.asarray(objective.sde.is_stochastic(batch.timesteps, batch.next_timesteps))
    n, k = mask.shape
    rows, columns = np.indices((n, k))
    checker = (rows + columns) % 2 == 1
    last_row = rows == n - 1
    for drop in (checker | last_row, checker, last_row, np.zeros_like(mask)):
        new_mask: npt.NDArray[np.bool_] = mask & ~drop
        if np.any(new_mask & stochastic) and np.any(~new_mask):
            return new_mask
    return None


def poisoned_copy(batch: Transitions, chosen: npt.NDArray[np.bool_]) -> Transitions:
    """`batch` masked by `chosen`, with NaN and inf written into every masked entry and into
    the float conditioning of wholly masked rows.

    **Arguments:**

    - `batch`: the training batch.
    - `chosen`: `[N, K]` the transitions that stay kept.

    **Returns:**

    The poisoned `Transitions`.
    """
    masked = ~chosen
    masked_rows = np.all(masked, axis=1)

    def poison(value: Array, where: npt.NDArray[np.bool_], bad: float) -> Array:
        host = np.array(value)
        host[where] = bad
        return jnp.asarray(host)

    advantages = np.asarray(batch.advantages)
    advantage_where = masked if advantages.ndim == 2 else masked_rows

    def poison_condition(leaf: Any) -> Any:
        if not jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
            return leaf
        return poison(leaf, masked_rows, math.nan)

    poisoned: Transitions = eqx.tree_at(
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
    return poisoned


def relative_change(changed: float, scale: float) -> float:
    """`changed / scale` (`scale` at least 1e-30), inf when `changed` is not finite.

    **Arguments:**

    - `changed`: an absolute change.
    - `scale`: what it is relative to.

    **Returns:**

    The relative change.
    """
    return changed / max(scale, 1e-30) if math.isfinite(changed) else math.inf
