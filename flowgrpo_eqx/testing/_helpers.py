"""Jit-compiled evaluations of an objective and tree comparisons, for property tests."""

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import numpy as np
import numpy.typing as npt
from jaxtyping import Array, PyTree

from .._custom_types import Mean, Step, Transitions
from .._misc import check_number
from ..objectives import AbstractFlowObjective, AbstractTransitionObjective, AbstractVariables


TRANSITION_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Transitions))
"""The field names of `Transitions`, in order."""


def _step() -> Step:
    return Step(index=0, key=jax.random.key(0))


@eqx.filter_jit
def loss_value_and_grad(
    objective: AbstractFlowObjective[Any], variables: AbstractVariables, batch: Any
) -> tuple[Array, Mean, Any, PyTree[Any]]:
    """The loss and its gradient with respect to the policy, jit-compiled, at step 0 with a
    fixed key (so that an objective that draws times or noise draws the same each call).

    **Arguments:**

    - `objective`: any objective (`AbstractFlowObjective`).
    - `variables`: its variables; the gradient is taken with respect to `variables.policy`.
    - `batch`: what its `loss` trains on (`Transitions` for Flow-GRPO).

    **Returns:**

    `(value, total, aux, gradient)`: `total.value`, the `Mean` itself, the auxiliary
    statistics and `d value / d policy`.
    """

    def value(policy: Any) -> tuple[Array, tuple[Mean, Any]]:
        total, aux = objective.loss(
            eqx.tree_at(lambda v: v.policy, variables, policy), batch, _step()
        )
        return total.value, (total, aux)

    (val, (total, aux)), grad = eqx.filter_value_and_grad(value, has_aux=True)(variables.policy)
    return val, total, aux, grad


@eqx.filter_jit
def loss_only(
    objective: AbstractFlowObjective[Any], variables: AbstractVariables, batch: Any
) -> tuple[Mean, Any]:
    """`objective.loss(variables, batch, step)`, jit-compiled, at the step of
    `loss_value_and_grad`."""
    return objective.loss(variables, batch, _step())


@eqx.filter_jit
def log_probs(
    objective: AbstractTransitionObjective[Any, Any],
    variables: AbstractVariables,
    batch: Transitions,
) -> Array:
    """`objective.log_probs(variables, batch)`, jit-compiled (an objective that rescores
    recorded transitions: `AbstractTransitionObjective`)."""
    return objective.log_probs(variables, batch)


def replace_fields(batch: Transitions, **fields: Any) -> Transitions:
    """A copy of `batch` with some fields replaced (and checked again by `Transitions`)."""
    values = {name: getattr(batch, name) for name in TRANSITION_FIELDS}
    values.update(fields)
    return Transitions(**values)


def map_rows(batch: Any, fn: Callable[[Any], Any]) -> Any:
    """Apply `fn` to every array of a batch (every field of `Transitions`, `cond` included;
    every array leaf of any other batch, whose leaves all have a leading row axis): row-axis
    operations such as a permutation or a duplication of the rows.

    **Arguments:**

    - `batch`: `Transitions`, or any objective's training batch.
    - `fn`: maps one array to another with the same trailing axes.

    **Returns:**

    A batch of the same type (`Transitions` checked again).
    """
    if isinstance(batch, Transitions):
        return replace_fields(
            batch, **{name: jax.tree.map(fn, getattr(batch, name)) for name in TRANSITION_FIELDS}
        )
    return jax.tree.map(lambda leaf: fn(leaf) if eqx.is_array(leaf) else leaf, batch)


def gradient_leaves(gradient: PyTree[Any]) -> list[npt.NDArray[Any]]:
    """The array leaves of a gradient as host arrays."""
    return [np.asarray(leaf) for leaf in jax.tree.leaves(eqx.filter(gradient, eqx.is_array))]


def all_finite(tree: PyTree[Any]) -> bool:
    """Whether every array entry of `tree` is finite."""
    return all(bool(np.all(np.isfinite(leaf))) for leaf in gradient_leaves(tree))


def assert_trees_close(
    got: PyTree[Any],
    want: PyTree[Any],
    rtol: float = 1e-4,
    atol: float = 1e-6,
    *,
    scale_floor: float = 1.0,
) -> None:
    """Leafwise closeness of two trees of arrays; `atol` is taken relative to the largest
    entry of `want`, since sums over transitions reorder and a float32 program's round-off
    in an entry is of the size of the terms summed into it, not of that entry.

    **Arguments:**

    - `got`, `want`: the trees; `want` sets the scale and `rtol`'s reference.
    - `rtol`: the tolerance relative to each entry of `want`.
    - `atol`: the tolerance relative to the scale.
    - `scale_floor`: the least scale: with the default 1, `atol` is absolute for trees
        whose entries are all below 1; a smaller floor keeps `atol` relative for small
        gradients.

    **Raises:**

    - `ValueError`: if `scale_floor` is negative.
    - `AssertionError`: naming the first leaf that differs.
    """
    check_number("scale_floor", scale_floor, minimum=0)
    want_leaves = gradient_leaves(want)
    got_leaves = gradient_leaves(got)
    assert len(got_leaves) == len(want_leaves), (len(got_leaves), len(want_leaves))
    scale = max([float(np.max(np.abs(w))) for w in want_leaves if w.size] + [scale_floor])
    for index, (g, w) in enumerate(zip(got_leaves, want_leaves, strict=True)):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol * scale, err_msg=f"leaf {index}")


def assert_trees_equal(got: PyTree[Any], want: PyTree[Any]) -> None:
    """Leafwise exact equality of two trees of arrays.

    **Raises:**

    - `AssertionError`: naming the first leaf that differs.
    """
    got_leaves = gradient_leaves(got)
    want_leaves = gradient_leaves(want)
    assert len(got_leaves) == len(want_leaves), (len(got_leaves), len(want_leaves))
    for index, (g, w) in enumerate(zip(got_leaves, want_leaves, strict=True)):
        np.testing.assert_array_equal(g, w, err_msg=f"leaf {index}")
