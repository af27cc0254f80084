"""`Buffer`: a model's fixed array, which training never updates."""

from collections.abc import Callable
from typing import Any, final

import equinox as eqx
import jax
from jaxtyping import Array, PyTree

from ._misc import present_mask


@final
class Buffer(eqx.Module):
    """A fixed array of a model (a PyTorch buffer): never trained, never weight-decayed.

    `Trainer.split_policy` puts every array inside a `Buffer` into the frozen part, whatever
    the trainable filter selects (`freeze_buffers`), so the optimizer holds no state for it
    and weight decay cannot shrink it. A model reads it as `jax.lax.stop_gradient(b.value)`.

    **Arguments:**

    - `value`: the array.
    """

    value: Array


def _is_buffer(node: Any) -> bool:
    return isinstance(node, Buffer)


def freeze_buffers(
    filter_spec: Callable[[Any], bool] | PyTree[Any], tree: PyTree[Any]
) -> PyTree[bool]:
    """`filter_spec` as a full tree of bools over `tree`, with every `Buffer`'s leaves False.

    **Arguments:**

    - `filter_spec`: an Equinox filter spec for `tree` (as `eqx.partition` takes it): a
        callable of a leaf, or a prefix tree of `tree` of bools and such callables.
    - `tree`: the PyTree it filters.

    **Returns:**

    A PyTree of bools shaped like `tree`, for `eqx.partition(tree, ...)`.

    **Raises:**

    - `ValueError`: naming `filter_spec` when one of its leaves is neither a bool nor a
        callable (Equinox's reading of the spec).
    """
    selected = present_mask(eqx.filter(tree, filter_spec))
    in_buffer = jax.tree.map(
        lambda node: jax.tree.map(lambda _: True, node) if _is_buffer(node) else False,
        tree,
        is_leaf=_is_buffer,
    )
    mask: PyTree[bool] = jax.tree.map(lambda keep, frozen: keep and not frozen, selected, in_buffer)
    return mask
