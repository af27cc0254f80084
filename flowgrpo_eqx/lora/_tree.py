"""Tree surgery: putting adapters on a model, taking them off, and moving them or the frozen
base models in and out of any PyTree holding `LoraModel`s."""

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, PRNGKeyArray, PyTree

from .._misc import check_int, check_number, chunked_random_arrays
from ._model import LoraAdapter, LoraModel, ModelT, is_linear, require_lora_model


_T = TypeVar("_T")


def is_lora_model(node: Any) -> bool:
    return isinstance(node, LoraModel)


def linears_by_path(model: Any) -> dict[str, eqx.nn.Linear]:
    """Every `eqx.nn.Linear` in `model`, keyed by `keystr` of its key path, in tree order."""
    nodes, _ = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_linear)
    return {jax.tree_util.keystr(path): node for path, node in nodes if is_linear(node)}


def _selected_paths(model: Any, where: Callable[[Any], Any] | None) -> list[str]:
    """The key paths of the layers `where` selects (every `eqx.nn.Linear` when `None`)."""
    linears = linears_by_path(model)
    if where is None:
        if not linears:
            raise ValueError("`where` is None (every `eqx.nn.Linear`) but `model` has none.")
        return list(linears)
    if not callable(where):
        raise ValueError(f"`where` must be None or a callable, got {type(where).__name__}.")
    chosen = where(model)
    if is_linear(chosen):
        chosen = [chosen]
    elif not isinstance(chosen, Sequence):
        raise ValueError(
            "`where` must return an `eqx.nn.Linear` or a sequence of them, got "
            f"{type(chosen).__name__}."
        )
    if len(chosen) == 0:
        raise ValueError("`where` selects no layer.")
    for index, node in enumerate(chosen):
        if not is_linear(node):
            raise ValueError(
                f"`where` must select `eqx.nn.Linear` layers only; item {index} is a "
                f"{type(node).__name__}."
            )
    chosen_ids = {id(node) for node in chosen}
    paths = [path for path, node in linears.items() if id(node) in chosen_ids]
    found_ids = {id(linears[path]) for path in paths}
    if found_ids != chosen_ids:
        raise ValueError("`where` returned an `eqx.nn.Linear` that is not a layer of `model`.")
    return paths


def zeros(shape: tuple[int, ...], dtype: Any) -> Array:
    # (`jnp.zeros` compiles a program per shape when called eagerly; this does not.)
    zeros: Array = jax.device_put(np.zeros(shape, dtype=dtype))
    return zeros


def add(
    model: ModelT,
    rank: int,
    *,
    key: PRNGKeyArray,
    alpha: float | int | None = None,
    where: Callable[[ModelT], eqx.nn.Linear | Sequence[eqx.nn.Linear]] | None = None,
    dtype: Any = None,
) -> LoraModel[ModelT]:
    """Put low-rank adapters on some `eqx.nn.Linear` layers of `model`.

    Each selected layer with weight `W: [out, in]` gets `a: [rank, in]` drawn from
    `N(0, 1 / rank^2)` (PEFT's `init_lora_weights="gaussian"`, as the Flow-GRPO release
    uses) and `b: [out, rank]` of zeros, in the dtype of `W`. Since `b = 0`, the returned
    model computes exactly what `model` computes until `b` is trained. Layers built with
    `"scalar"` features (`W: [out, 1]` or `[1, in]`) work as any other. A layer of stacked
    blocks (`W: [layers, out, in]`, as `MMDiT(stacked=True)` holds them) gets one adapter
    per layer: `a: [layers, rank, in]`, `b: [layers, out, rank]`.

    **Arguments:**

    - `model`: any callable Equinox model (e.g. `model(x, t, cond) -> v`) without adapters.
    - `rank`: the rank of every adapter, an int >= 1.
    - `key`: a JAX PRNG key for drawing the `a` matrices.
    - `alpha`: the scale numerator: the update is `(alpha / rank) b @ a`. Defaults to
        `rank` (scale 1).
    - `where`: which layers to adapt: `None` for every `eqx.nn.Linear` in `model`, or a
        callable like `eqx.tree_at`'s `where`, returning one `eqx.nn.Linear` of `model` or a
        sequence of them, e.g. `lambda m: [block.qkv for block in m.blocks]`.
    - `dtype`: the adapters' dtype; `None` (the default) takes each layer's weight's. Float32
        adapters over a bfloat16 base keep the trained weights (and the optimizer's view of
        them) in float32, as PEFT's adapters over a half-precision model are; the merged
        weight is computed in the wider of the two and cast to the base's.

    **Returns:**

    A `LoraModel` holding `model` unchanged and one adapter per selected layer.

    **Raises:**

    - `ValueError`: naming `rank` (not an int >= 1), `alpha` (not a finite number > 0),
        `model` (it already has adapters) or `where` (not a callable, or selecting nothing,
        something that is not an `eqx.nn.Linear`, or a layer outside `model`, or a layer
        whose weight is not a floating-point matrix).
    """
    check_int("rank", rank, 1)
    alpha = float(rank) if alpha is None else alpha
    check_number("alpha", alpha, minimum=0, include_minimum=False)
    if has_adapters(model):
        raise ValueError("`model` already has adapters; add them to `lora.base(model)` instead.")
    paths = _selected_paths(model, where)
    linears = linears_by_path(model)
    shapes: list[tuple[int, ...]] = []
    dtypes: list[Any] = []
    for path in paths:
        weight = linears[path].weight
        if jnp.ndim(weight) < 2 or not jnp.issubdtype(weight.dtype, jnp.floating):
            raise ValueError(
                f"`where` selects the layer at {path}, whose weight is not a floating-point "
                f"matrix (shape {jnp.shape(weight)}, dtype {weight.dtype})."
            )
        shapes.append((*weight.shape[:-2], rank, weight.shape[-1]))
        dtypes.append(weight.dtype if dtype is None else jnp.dtype(dtype))
    draws = chunked_random_arrays(
        key, [(shape, 1.0 / rank) for shape in shapes], jax.random.normal, dtypes
    )
    adapters = tuple(
        LoraAdapter(a=draw, b=zeros((*linears[path].weight.shape[:-1], rank), adapter_dtype))
        for path, draw, adapter_dtype in zip(paths, draws, dtypes, strict=True)
    )
    return LoraModel(
        base=model, adapters=adapters, layer_paths=tuple(paths), rank=rank, alpha=float(alpha)
    )


def base(model: LoraModel[ModelT]) -> ModelT:
    """The base model, with the adapters switched off (its weights exactly as they were).

    **Arguments:**

    - `model`: a `LoraModel`.

    **Returns:**

    The base model.

    **Raises:**

    - `ValueError`: naming `model` when it is not a `LoraModel`.
    """
    require_lora_model(model, "model")
    return model.base


def has_adapters(model: Any) -> bool:
    """Whether any `LoraModel` occurs in the PyTree `model` (including `model` itself)."""
    nodes = jax.tree.leaves(model, is_leaf=is_lora_model)
    return any(is_lora_model(node) for node in nodes)


def adapter_filter(model: PyTree[Any]) -> PyTree[bool]:
    """A PyTree of bools shaped like `model`: `True` exactly on the adapters' `a` and `b`.

    Use it as the trainable filter (`eqx.partition(model, adapter_filter(model))`) so that
    only the adapters train and the base weights stay frozen. Works on any PyTree holding
    `LoraModel`s; all `False` when there is none.

    **Arguments:**

    - `model`: any PyTree, typically a `LoraModel`.

    **Returns:**

    The PyTree of bools.
    """

    def mark(node: Any) -> Any:
        if not is_lora_model(node):
            return False
        marked = jax.tree.map(lambda _: False, node)
        return eqx.tree_at(
            lambda m: m.adapters, marked, jax.tree.map(lambda _: True, node.adapters)
        )

    return jax.tree.map(mark, model, is_leaf=is_lora_model)


def adapters(model: _T) -> _T:
    """Only the adapter arrays of `model`: the same PyTree with every other leaf `None`.

    Small enough for frequent checkpoints, or for an exponential moving average of the
    adapters; put them back with `with_adapters`.

    **Arguments:**

    - `model`: any PyTree, typically a `LoraModel`.

    **Returns:**

    `eqx.filter(model, adapter_filter(model))`.
    """
    filtered: _T = eqx.filter(model, adapter_filter(model))
    return filtered


def with_adapters(model: _T, adapters: PyTree[Any]) -> _T:
    """`model` with its adapter arrays taken from `adapters`.

    **Arguments:**

    - `model`: a PyTree holding `LoraModel`s.
    - `adapters`: what `lora.adapters` returns for a model of the same structure, or such a
        model itself (only its adapter arrays are used).

    **Returns:**

    `model` with every adapter's `a` and `b` replaced.

    **Raises:**

    - `ValueError`: naming `model` when it has no adapters, or `adapters` when its structure,
        shapes or dtypes differ from `model`'s adapters.
    """
    if not has_adapters(model):
        raise ValueError("`model` has no adapters.")
    mask = adapter_filter(model)
    current = eqx.filter(model, mask)
    new = eqx.filter(adapters, adapter_filter(adapters))
    # (Treedefs compare the adapted layers, rank and alpha too: they are static fields.)
    new_structure: Any = jax.tree.structure(new)
    if new_structure != jax.tree.structure(current):
        raise ValueError(
            "`adapters` does not have the structure of `model`'s adapters (same layers, "
            "rank and alpha)."
        )
    for new_leaf, old_leaf in zip(jax.tree.leaves(new), jax.tree.leaves(current), strict=True):
        if jnp.shape(new_leaf) != jnp.shape(old_leaf) or new_leaf.dtype != old_leaf.dtype:
            raise ValueError(
                f"`adapters` holds a {new_leaf.dtype}{list(jnp.shape(new_leaf))} array where "
                f"`model` has {old_leaf.dtype}{list(jnp.shape(old_leaf))}."
            )
    combined: _T = eqx.combine(new, eqx.filter(model, mask, inverse=True))
    return combined


def without_adapters(tree: _T) -> _T:
    """`tree` with every `LoraModel` in it replaced by its base model (`lora.base`).

    The same policy with its adapters switched off: the KL reference of a policy with
    adapters. The base models' arrays are shared, not copied.

    **Arguments:**

    - `tree`: any PyTree, typically a `LoraModel`.

    **Returns:**

    `tree` without adapters; `tree` itself when it holds none.
    """
    switched_off: _T = jax.tree.map(
        lambda node: node.base if is_lora_model(node) else node, tree, is_leaf=is_lora_model
    )
    return switched_off


def _base_array_filter(tree: PyTree[Any]) -> PyTree[bool]:
    """`True` exactly on the arrays of every `LoraModel`'s base model in `tree`."""

    def mark(node: Any) -> Any:
        if not is_lora_model(node):
            return False
        marked = jax.tree.map(lambda _: False, node)
        return eqx.tree_at(lambda m: m.base, marked, jax.tree.map(eqx.is_array, node.base))

    return jax.tree.map(mark, tree, is_leaf=is_lora_model)


def without_bases(tree: _T) -> _T:
    """`tree` with the arrays of every `LoraModel`'s base model left out (set to `None`).

    What a checkpoint of a run that trains adapters needs to store: the adapters, and
    whatever else `tree` holds (an optimizer state, step counters, keys), but not the frozen
    base weights. Put the bases back with `with_bases`; record `fingerprint(base)` beside
    the checkpoint to check that they are the right ones.

    **Arguments:**

    - `tree`: any PyTree, e.g. a train state whose policy is a `LoraModel`.

    **Returns:**

    `tree` without base arrays; equal to `tree` when it holds no `LoraModel`.
    """
    stripped: _T = eqx.filter(tree, _base_array_filter(tree), inverse=True)
    return stripped


def with_bases(tree: _T, like: _T) -> _T:
    """`tree` (from `without_bases`) with the base models' arrays taken from `like`.

    **Arguments:**

    - `tree`: a PyTree that `without_bases` made, or one of its structure (e.g. restored
        from a checkpoint).
    - `like`: a PyTree of the full structure whose `LoraModel`s hold the base models.

    **Returns:**

    The full PyTree: `tree`'s arrays, with `like`'s base arrays in the `LoraModel`s.

    **Raises:**

    - `ValueError`: naming `tree` when its structure is not that of `without_bases(like)`.
    """
    bases = eqx.filter(like, _base_array_filter(like))
    expected: Any = jax.tree.structure(without_bases(like))
    if jax.tree.structure(tree) != expected:
        raise ValueError("`tree` does not have the structure of `without_bases(like)`.")
    combined: _T = eqx.combine(tree, bases)
    return combined
