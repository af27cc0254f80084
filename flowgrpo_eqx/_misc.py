"""Small helpers the whole library shares: argument checks, row bookkeeping, copies, keys."""

import math
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray, PyTree


def is_int(value: Any) -> bool:
    """Whether `value` is a Python or NumPy integer (and not a bool).

    **Arguments:**

    - `value`: anything.

    **Returns:**

    `True` for an `int` or NumPy integer that is not a bool.
    """
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


def check_bool(name: str, value: Any, *, optional: bool = False) -> None:
    """Raise a `ValueError` naming `name` unless `value` is a bool.

    **Arguments:**

    - `name`: the argument's name, for the message.
    - `value`: the value to check.
    - `optional`: whether `None` is allowed too.

    **Raises:**

    - `ValueError`: `"`name` must be a bool[ or None], got <value>."`.
    """
    if optional and value is None:
        return
    if not isinstance(value, bool):
        allowed = "a bool or None" if optional else "a bool"
        raise ValueError(f"`{name}` must be {allowed}, got {value!r}.")


def check_number(
    name: str,
    value: Any,
    *,
    minimum: int | float | None = None,
    maximum: int | float | None = None,
    include_minimum: bool = True,
    include_maximum: bool = True,
    optional: bool = False,
) -> None:
    """Raise a `ValueError` naming `name` unless `value` is a finite real number in range.

    Python and NumPy ints and floats are numbers; bools, NaN and infinities are not.

    **Arguments:**

    - `name`: the argument's name, for the message.
    - `value`: the value to check.
    - `minimum`, `maximum`: the bounds, or `None` for none.
    - `include_minimum`, `include_maximum`: whether the bound itself is allowed.
    - `optional`: whether `None` is allowed too.

    **Raises:**

    - `ValueError`: `"`name` must be [None or ]a finite number <range>, got <value>."`, the
        range written `> 0`, `>= 0`, `< 1`, `<= 1` or `in [0, 1)`.
    """
    if optional and value is None:
        return
    number = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, (bool, np.bool_)
    )
    if number and math.isfinite(value):
        above = minimum is None or value > minimum or (include_minimum and value == minimum)
        below = maximum is None or value < maximum or (include_maximum and value == maximum)
        if above and below:
            return
    if minimum is not None and maximum is not None:
        left, right = "[" if include_minimum else "(", "]" if include_maximum else ")"
        bounds = f" in {left}{minimum}, {maximum}{right}"
    elif minimum is not None:
        bounds = f" {'>=' if include_minimum else '>'} {minimum}"
    elif maximum is not None:
        bounds = f" {'<=' if include_maximum else '<'} {maximum}"
    else:
        bounds = ""
    allowed = f"{'None or ' if optional else ''}a finite number{bounds}"
    raise ValueError(f"`{name}` must be {allowed}, got {value!r}.")


def check_mode(name: str, value: Any, modes: Any) -> None:
    """Raise a `ValueError` naming `name` unless `value` is one of a `Literal`'s modes.

    **Arguments:**

    - `name`: the argument's name, for the message.
    - `value`: the value to check.
    - `modes`: the `Literal` type alias of the allowed modes.

    **Raises:**

    - `ValueError`: `"`name` must be one of <modes>, got <value>."`.
    """
    allowed = modes.__args__
    if value not in allowed:
        listed = ", ".join(repr(mode) for mode in allowed)
        raise ValueError(f"`{name}` must be one of {listed}, got {value!r}.")


def check_leading_rows(
    owner: str, field: str, tree: PyTree[Any], rows: int, *, rows_name: str = "N"
) -> None:
    """Raise a `ValueError` naming the leaf of `tree` whose leading axis is not `rows` long.

    **Arguments:**

    - `owner`: the class holding the field, e.g. `"FinalSamples"`.
    - `field`: the field holding `tree`, e.g. `"cond"`.
    - `tree`: a PyTree of arrays, each `[rows, ...]`.
    - `rows`: the expected leading size.
    - `rows_name`: the letter the docstrings give that size, e.g. `"N"` or `"B"`.

    **Raises:**

    - `ValueError`: `"<owner>.<field><path> has shape <shape>, expected a leading axis of
        size <rows_name> = <rows>."`, for the first leaf that is a scalar or has another
        leading size.
    """
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if jnp.ndim(leaf) == 0 or jnp.shape(leaf)[0] != rows:
            raise ValueError(
                f"{owner}.{field}{jax.tree_util.keystr(path)} has shape {jnp.shape(leaf)}, "
                f"expected a leading axis of size {rows_name} = {rows}."
            )


def check_source_rows(name: str, rows: PyTree[Any]) -> int:
    """Raise a `ValueError` naming `name` unless `rows` holds one or more rows: array leaves
    that all share one non-zero leading size.

    **Arguments:**

    - `name`: the argument's name, for the message, e.g. `"rows"`.
    - `rows`: a PyTree of `[P, ...]` arrays.

    **Returns:**

    `P`, the number of rows.

    **Raises:**

    - `ValueError`: naming `name`, if `rows` has no array leaves or a scalar one; naming
        `name` and the leaf, if a leaf's leading size differs from the first leaf's; and if
        the rows are empty (`P = 0`: sampling, scoring or training on no rows is always a
        caller's mistake).
    """
    leaves = jax.tree_util.tree_leaves_with_path(rows)
    if not leaves:
        raise ValueError(f"`{name}` has no array leaves; expected [P, ...] arrays of P rows.")
    first_path, _ = leaves[0]
    sizes = {}
    for path, leaf in leaves:
        shape = np.shape(leaf)
        where = f"`{name}`{jax.tree_util.keystr(path)}"
        if not shape:
            raise ValueError(f"{where} is a scalar; expected a leading axis of P rows.")
        sizes[where] = shape[0]
    first = f"`{name}`{jax.tree_util.keystr(first_path)}"
    count = sizes[first]
    for where, size in sizes.items():
        if size != count:
            raise ValueError(
                f"{where} has {size} rows on its leading axis, but {first} has {count}: "
                f"every leaf of `{name}` must share one leading axis of P rows."
            )
    if count == 0:
        raise ValueError(f"`{name}` is empty (every leaf has 0 rows); expected at least one row.")
    return int(count)


_RANDOM_CHUNK = 1 << 16


def chunked_random_arrays(
    key: PRNGKeyArray,
    specs: Sequence[tuple[tuple[int, ...], float]],
    sample: Callable[[PRNGKeyArray, tuple[int]], Float[Array, " chunk"]],
    dtypes: Sequence[Any] | None = None,
) -> list[Array]:
    """Independent random arrays, one per `(shape, scale)` in `specs`, drawn as fixed-size
    chunks and sliced.

    Chunk `i` is `sample(fold_in(key, i), (65536,))`; the chunks, one after another, are cut
    into the arrays in order, each reshaped, multiplied by its scale and cast to its dtype.
    Eagerly, every distinct random shape costs an XLA compilation (a second or so on a small
    CPU), so this keeps eager construction to one compiled RNG program for every model and
    configuration, with the slicing in NumPy. Under a trace (`jit`, `vmap`, `eval_shape`) the
    chunks are one `vmap`ped draw, to the same values, so tracing stays quick at any size.

    **Arguments:**

    - `key`: the PRNG key.
    - `specs`: `(shape, scale)` of each array.
    - `sample`: draws one chunk, e.g. `jax.random.normal`.
    - `dtypes`: each array's dtype; float32 for every one when `None`.

    **Returns:**

    The arrays, in the order of `specs`.
    """
    sizes = [math.prod(shape) for shape, _ in specs]
    num_chunks = max(1, -(-sum(sizes) // _RANDOM_CHUNK))

    def chunk(i: int | Int[Array, ""]) -> Float[Array, " chunk"]:
        return sample(jax.random.fold_in(key, i), (_RANDOM_CHUNK,))

    first = chunk(0)
    traced = isinstance(first, jax.core.Tracer)
    if traced:
        # One batched draw (the same bits as the loop below): tracing a billion-parameter
        # model chunk by chunk would take tens of seconds.
        flat: Any = jax.vmap(chunk)(jnp.arange(num_chunks)).reshape(-1)
    else:
        chunks = [first] + [chunk(i) for i in range(1, num_chunks)]
        flat = np.concatenate([np.asarray(c) for c in chunks])
    arrays: list[Array] = []
    offset = 0
    for (shape, scale), size, dtype in zip(
        specs, sizes, dtypes or [np.float32] * len(specs), strict=True
    ):
        piece = flat[offset : offset + size].reshape(shape)
        if traced:
            arrays.append((piece * scale).astype(dtype))
        else:
            arrays.append(jax.device_put((piece * np.float32(scale)).astype(dtype)))
        offset += size
    return arrays


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


def stop_gradient_arrays(tree: PyTree[Any]) -> PyTree[Any]:
    """`tree` with `jax.lax.stop_gradient` on every float array (other leaves as they are)."""
    dynamic, static = eqx.partition(tree, eqx.is_inexact_array)
    return eqx.combine(jax.lax.stop_gradient(dynamic), static)


def present_mask(tree: PyTree[Any]) -> PyTree[bool]:
    """Where a filtered tree (`eqx.filter`, `eqx.partition`) has a leaf.

    **Arguments:**

    - `tree`: a tree with `None` in the places a filter left out.

    **Returns:**

    A tree of bools of the unfiltered structure: `True` at a leaf, `False` at a `None`.
    """
    return jax.tree.map(lambda leaf: leaf is not None, tree, is_leaf=lambda x: x is None)


def zero_rows_unless(rows: Bool[Array, " N"], leaf: Array) -> Array:
    """A float leaf with its rows outside `rows` zeroed; other leaves as they are.

    **Arguments:**

    - `rows`: `[N]` bools, the rows to keep.
    - `leaf`: an array whose leading axis is the `N` rows.

    **Returns:**

    `leaf`, zero in the rows not kept when it is a float array.
    """
    if not jnp.issubdtype(leaf.dtype, jnp.inexact):
        return leaf
    mask = rows.reshape(rows.shape + (1,) * (leaf.ndim - 1))
    return jnp.where(mask, leaf, jnp.zeros((), leaf.dtype))


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
