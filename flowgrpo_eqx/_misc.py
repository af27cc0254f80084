"""Small helpers the whole library shares: argument checks, row bookkeeping, copies, keys."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PyTree


def is_int(value: Any) -> bool:
    """Whether `value` is a Python or NumPy integer (and not a bool)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_int(name: str, value: Any, minimum: int, *, optional: bool = False) -> None:
    """Raise a `ValueError` naming `name` unless `value` is an int `>= minimum`.

    **Arguments:**

    - `name`: the argument's name, for the message.
    - `value`: the value to check.
    - `minimum`: the smallest allowed value.
    - `optional`: whether `None` is allowed too.

    **Raises:**

    - `ValueError`: naming the argument and what it got.
    """
    if optional and value is None:
        return
    if not (is_int(value) and value >= minimum):
        allowed = f"None or an int >= {minimum}" if optional else f"an int >= {minimum}"
        raise ValueError(f"`{name}` must be {allowed}, got {value!r}.")


def leading_rows(tree: PyTree[Any]) -> int:
    """The leading (row) size of the first array leaf of `tree`.

    **Raises:**

    - `ValueError`: if `tree` has no array leaves or its first leaf is a scalar.
    """
    leaves = jax.tree.leaves(tree)
    if not leaves or np.ndim(leaves[0]) == 0:
        raise ValueError(
            "The rows have no array leaves with a leading row axis; cannot count rows."
        )
    return int(np.shape(leaves[0])[0])


def tile_rows(tree: PyTree[Any], times: int) -> PyTree[Any]:
    """Whole copies of the rows one after another: `[N, ...] -> [times * N, ...]`.

    Row `i` of copy `c` lands at `c * N + i` (as `jnp.tile`), unlike `repeat_rows`.
    """
    return jax.tree.map(lambda leaf: jnp.concatenate([leaf] * times, axis=0), tree)


def repeat_rows(tree: PyTree[Any], times: int) -> PyTree[Any]:
    """Each row repeated in place on the host: row `p` becomes rows `p * times ... + times - 1`.

    This is how a source row becomes a group of `times` samples (as `np.repeat`).
    """
    return jax.tree.map(lambda leaf: np.repeat(np.asarray(leaf), times, axis=0), tree)


def select_rows(tree: PyTree[Any], indices: Any) -> PyTree[Any]:
    """Rows `indices` of every leaf, on the host."""
    return jax.tree.map(lambda leaf: np.asarray(leaf)[indices], tree)


def own_copy(tree: PyTree[Any]) -> PyTree[Any]:
    """Fresh buffers for every array, so that donating one tree frees nothing another holds."""
    return jax.tree.map(
        lambda leaf: jnp.array(leaf, copy=True) if eqx.is_array(leaf) else leaf, tree
    )


def is_typed_key(leaf: Any) -> bool:
    """Whether `leaf` is a typed PRNG key array (`jax.random.key`)."""
    return isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def keys_to_data(tree: PyTree[Any]) -> PyTree[Any]:
    """Typed PRNG keys replaced by their raw uint32 key data (serialisable, placeable)."""
    return jax.tree.map(lambda x: jax.random.key_data(x) if is_typed_key(x) else x, tree)


def data_to_keys(tree: PyTree[Any], like: PyTree[Any]) -> PyTree[Any]:
    """The inverse of `keys_to_data`: key data wrapped back into keys where `like` has keys."""

    def restore(loaded: Any, template: Any) -> Any:
        if is_typed_key(template):
            return jax.random.wrap_key_data(loaded, impl=jax.random.key_impl(template))
        return loaded

    return jax.tree.map(restore, tree, like)
