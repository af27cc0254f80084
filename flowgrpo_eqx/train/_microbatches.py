"""Microbatches of a training batch and the auxiliary outputs a loss gives (`Mean`s, `PerRow`s):
cut into microbatches, combined back, and read as metrics (`mean_values`)."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PyTree

from .._custom_types import Mean, PerRow


def mean_values(tree: PyTree[Any]) -> dict[str, Float[Array, ""]]:
    """Flatten an auxiliary PyTree of `Mean`s (and arrays) to `{name: scalar}`.

    A one-axis array (a statistic per step, as `StepRatios`) gives one scalar per entry,
    named `name/0`, `name/1`, ...; per-row outputs (`PerRow`, such as `Aux.log_probs`) are
    not metrics and are left out.
    """
    out: dict[str, Float[Array, ""]] = {}
    leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_mean_or_per_row)
    for path, leaf in leaves:
        if isinstance(leaf, PerRow):
            continue
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        value = leaf.value if isinstance(leaf, Mean) else jnp.asarray(leaf, jnp.float32)
        if value.ndim == 1:
            out.update({f"{name}/{index}": value[index] for index in range(value.shape[0])})
        else:
            out[name] = value
    return out


def is_mean_or_per_row(node: Any) -> bool:
    """Whether `node` is a `Mean` or a `PerRow` (a leaf of the aux, for `jax.tree` maps).

    **Arguments:**

    - `node`: a node of a PyTree.

    **Returns:**

    `True` for a `Mean` or a `PerRow`.
    """
    return isinstance(node, Mean | PerRow)


def combine_microbatches(leaf: Any, rows: int) -> Any:
    """One auxiliary output of `lax.scan`'s microbatches (leading axis) as one of the batch:
    a `Mean` summed as totals and counts, a `PerRow` put back in row order (microbatch `m`
    held rows `m, m + M, ...`), any other array summed."""
    if isinstance(leaf, Mean):
        return Mean(jnp.sum(leaf.total, axis=0), jnp.sum(leaf.count, axis=0))
    if isinstance(leaf, PerRow):
        value = jnp.swapaxes(leaf.value, 0, 1)
        return PerRow(value.reshape(rows, *value.shape[2:]))
    if not eqx.is_array(leaf):
        return leaf
    return jnp.sum(leaf, axis=0)


def split_microbatches(batch: Any, rows: int, parts: int) -> tuple[Any, Any]:
    """The batch's arrays cut into `parts` microbatches along a new leading axis: microbatch
    `m` holds rows `m, m + parts, ...` (each device keeps its own rows).

    **Arguments:**

    - `batch`: the update's batch.
    - `rows`: its rows (`leading_rows(batch)`).
    - `parts`: the trainer's `microbatches`.

    **Returns:**

    `(pieces, static)`: the arrays, each `[parts, rows / parts, ...]`, and the rest of the
    batch (`eqx.partition`), to `eqx.combine` with one microbatch.

    **Raises:**

    - `ValueError`: naming `microbatches`, if it does not divide the rows or an array of the
        batch lacks the leading row axis.
    """
    if rows % parts != 0:
        raise ValueError(f"`microbatches` ({parts}) must divide the batch's rows ({rows}).")
    size = rows // parts

    def split(leaf: Any) -> Any:
        if not eqx.is_array(leaf) or leaf.ndim == 0 or leaf.shape[0] != rows:
            raise ValueError(
                f"With `microbatches` ({parts}), every array of the batch must have the "
                f"leading row axis ({rows}); one has shape {jnp.shape(leaf)}."
            )
        # Microbatch m holds rows m, m + parts, ...: each device keeps its own rows.
        return jnp.swapaxes(leaf.reshape(size, parts, *leaf.shape[1:]), 0, 1)

    arrays, static = eqx.partition(batch, eqx.is_array)
    return jax.tree.map(split, arrays), static
