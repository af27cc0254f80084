"""Low-rank adapters (LoRA) for any Equinox model built from `eqx.nn.Linear` layers.

`add(model, rank, key=...)` returns a `LoraModel`: the untouched base model plus one
`LoraAdapter` (`a: [rank, in]`, `b: [out, rank]`) per selected `eqx.nn.Linear`. Calling it
calls the base model with each selected layer's weight replaced by
`W + (alpha / rank) b @ a`, so the base model runs its own code unchanged, whether it calls
its layers or reads their `weight` directly. `b` starts at zero, so a fresh `LoraModel`
computes exactly what the base model computes.

Train only the adapters with `adapter_filter(model)` as the trainable filter (the library's
`Trainer` does so by default for a policy with adapters); `base(model)` is the frozen base
(the adapters switched off, the KL reference), `merge(model)` a plain model with the adapters
folded in. `without_bases`/`with_bases` leave the frozen base out of checkpoints and put it
back; `save_adapters`/`load_adapters` write and read the adapters alone, with the base
model's `fingerprint`.
"""

import hashlib
import json
import math
import os
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar, final

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray, PyTree

from ._files import atomic_file


_Model = TypeVar("_Model", bound=Callable[..., Any])
_T = TypeVar("_T")

_FORMAT = "flowgrpo_eqx.lora/1"
_CHUNK = 1 << 16


@final
class LoraAdapter(eqx.Module):
    """The low-rank update `b @ a` of one `eqx.nn.Linear` weight `[out, in]`.

    **Arguments:**

    - `a`: `[rank, in]`.
    - `b`: `[out, rank]`.
    """

    a: Float[Array, "rank in"]
    b: Float[Array, "out rank"]


@final
class LoraModel(eqx.Module, Generic[_Model]):
    """A base model with low-rank adapters on some of its `eqx.nn.Linear` layers.

    Built by `add` (or `load_adapters`). Called with any arguments, it calls `merge(self)`
    with them: the base model whose selected layers hold `W + (alpha / rank) b @ a`.

    **Arguments:**

    - `base`: the base model, left as it was.
    - `adapters`: one `LoraAdapter` per adapted layer, in the order of `layer_paths`.
    - `layer_paths`: where each adapted layer sits in `base`, as `jax.tree_util.keystr`
        writes its key path (e.g. `.blocks[0].qkv`).
    - `rank`: the rank of every adapter.
    - `alpha`: the adapters' scale numerator; the update is `(alpha / rank) b @ a`.

    **Raises:**

    - `ValueError`: naming `rank`, `alpha` or `adapters` when they do not fit together.
    """

    base: _Model
    adapters: tuple[LoraAdapter, ...]
    layer_paths: tuple[str, ...] = eqx.field(static=True)
    rank: int = eqx.field(static=True)
    alpha: float = eqx.field(static=True)

    def __check_init__(self) -> None:
        _check_rank(self.rank)
        _check_alpha(self.alpha)
        if len(self.adapters) != len(self.layer_paths):
            raise ValueError(
                f"`adapters` has {len(self.adapters)} entries for "
                f"{len(self.layer_paths)} layer paths."
            )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the base model, with the adapters folded into its weights.

        **Arguments:**

        Whatever the base model's `__call__` takes, e.g. `(x, t, cond)`.

        **Returns:**

        What the base model returns.
        """
        return merge(self)(*args, **kwargs)


def _check_rank(rank: int) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"`rank` must be an int >= 1, got {rank!r}.")


def _check_alpha(alpha: float | int) -> None:
    if (
        isinstance(alpha, bool)
        or not isinstance(alpha, int | float)
        or not math.isfinite(alpha)
        or alpha <= 0
    ):
        raise ValueError(f"`alpha` must be a finite number > 0, got {alpha!r}.")


def _is_linear(node: Any) -> bool:
    return isinstance(node, eqx.nn.Linear)


def _is_lora_model(node: Any) -> bool:
    return isinstance(node, LoraModel)


def _linears_by_path(model: Any) -> dict[str, eqx.nn.Linear]:
    """Every `eqx.nn.Linear` in `model`, keyed by `keystr` of its key path, in tree order."""
    nodes, _ = jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_linear)
    return {jax.tree_util.keystr(path): node for path, node in nodes if _is_linear(node)}


def _selected_paths(model: Any, where: Callable[[Any], Any] | None) -> list[str]:
    """The key paths of the layers `where` selects (every `eqx.nn.Linear` when `None`)."""
    linears = _linears_by_path(model)
    if where is None:
        if not linears:
            raise ValueError("`where` is None (every `eqx.nn.Linear`) but `model` has none.")
        return list(linears)
    if not callable(where):
        raise ValueError(f"`where` must be None or a callable, got {type(where).__name__}.")
    chosen = where(model)
    if _is_linear(chosen):
        chosen = [chosen]
    elif not isinstance(chosen, Sequence):
        raise ValueError(
            "`where` must return an `eqx.nn.Linear` or a sequence of them, got "
            f"{type(chosen).__name__}."
        )
    if len(chosen) == 0:
        raise ValueError("`where` selects no layer.")
    for index, node in enumerate(chosen):
        if not _is_linear(node):
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


def _normal_arrays(
    key: PRNGKeyArray, shapes: Sequence[tuple[int, int]], dtypes: Sequence[Any], std: float
) -> list[Array]:
    """Independent `N(0, std^2)` arrays, one per `(shape, dtype)`, drawn as fixed-size chunks.

    Eagerly, every distinct random shape costs an XLA compilation; drawing `[_CHUNK]`-sized
    chunks (`fold_in(key, i)`) and slicing them in NumPy needs one compiled program for
    every model. Under a trace it is traced as usual, to the same values.
    """
    sizes = [math.prod(shape) for shape in shapes]
    num_chunks = max(1, -(-sum(sizes) // _CHUNK))
    chunks = [jax.random.normal(jax.random.fold_in(key, i), (_CHUNK,)) for i in range(num_chunks)]
    try:
        flat: Any = np.concatenate([np.asarray(chunk) for chunk in chunks])
        eager = True
    except jax.errors.TracerArrayConversionError:
        flat = jnp.concatenate(chunks)
        eager = False
    arrays: list[Array] = []
    offset = 0
    for shape, size, dtype in zip(shapes, sizes, dtypes, strict=True):
        piece = flat[offset : offset + size].reshape(shape) * std
        arrays.append(jax.device_put(piece.astype(dtype)) if eager else piece.astype(dtype))
        offset += size
    return arrays


def _zeros(shape: tuple[int, ...], dtype: Any) -> Array:
    # (`jnp.zeros` compiles a program per shape when called eagerly; this does not.)
    zeros: Array = jax.device_put(np.zeros(shape, dtype=dtype))
    return zeros


def add(
    model: _Model,
    rank: int,
    *,
    key: PRNGKeyArray,
    alpha: float | int | None = None,
    where: Callable[[_Model], eqx.nn.Linear | Sequence[eqx.nn.Linear]] | None = None,
) -> LoraModel[_Model]:
    """Put low-rank adapters on some `eqx.nn.Linear` layers of `model`.

    Each selected layer with weight `W: [out, in]` gets `a: [rank, in]` drawn from
    `N(0, 1 / rank^2)` (PEFT's `init_lora_weights="gaussian"`, as the Flow-GRPO release
    uses) and `b: [out, rank]` of zeros, in the dtype of `W`. Since `b = 0`, the returned
    model computes exactly what `model` computes until `b` is trained. Layers built with
    `"scalar"` features (`W: [out, 1]` or `[1, in]`) work as any other.

    **Arguments:**

    - `model`: any callable Equinox model (e.g. `model(x, t, cond) -> v`) without adapters.
    - `rank`: the rank of every adapter, an int >= 1.
    - `key`: a JAX PRNG key for drawing the `a` matrices.
    - `alpha`: the scale numerator: the update is `(alpha / rank) b @ a`. Defaults to
        `rank` (scale 1).
    - `where`: which layers to adapt: `None` for every `eqx.nn.Linear` in `model`, or a
        callable like `eqx.tree_at`'s `where`, returning one `eqx.nn.Linear` of `model` or a
        sequence of them, e.g. `lambda m: [block.qkv for block in m.blocks]`.

    **Returns:**

    A `LoraModel` holding `model` unchanged and one adapter per selected layer.

    **Raises:**

    - `ValueError`: naming `rank` (not an int >= 1), `alpha` (not a finite number > 0),
        `model` (it already has adapters) or `where` (not a callable, or selecting nothing,
        something that is not an `eqx.nn.Linear`, or a layer outside `model`, or a layer
        whose weight is not a floating-point matrix).
    """
    _check_rank(rank)
    alpha = float(rank) if alpha is None else alpha
    _check_alpha(alpha)
    if has_adapters(model):
        raise ValueError("`model` already has adapters; add them to `lora.base(model)` instead.")
    paths = _selected_paths(model, where)
    linears = _linears_by_path(model)
    shapes: list[tuple[int, int]] = []
    dtypes: list[Any] = []
    for path in paths:
        weight = linears[path].weight
        if jnp.ndim(weight) != 2 or not jnp.issubdtype(weight.dtype, jnp.floating):
            raise ValueError(
                f"`where` selects the layer at {path}, whose weight is not a floating-point "
                f"matrix (shape {jnp.shape(weight)}, dtype {weight.dtype})."
            )
        shapes.append((rank, weight.shape[1]))
        dtypes.append(weight.dtype)
    draws = _normal_arrays(key, shapes, dtypes, std=1.0 / rank)
    adapters = tuple(
        LoraAdapter(a=draw, b=_zeros((linears[path].weight.shape[0], rank), dtype))
        for path, draw, dtype in zip(paths, draws, dtypes, strict=True)
    )
    return LoraModel(
        base=model, adapters=adapters, layer_paths=tuple(paths), rank=rank, alpha=float(alpha)
    )


def _require_lora_model(model: Any, name: str) -> None:
    if not isinstance(model, LoraModel):
        raise ValueError(
            f"`{name}` must be a `LoraModel` (see `lora.add`), got {type(model).__name__}."
        )


def merge(model: LoraModel[_Model]) -> _Model:
    """The base model with the adapters folded into its weights.

    Each adapted layer's weight becomes `W + (alpha / rank) b @ a` (the product `b @ a` at
    full float32 precision), cast to the dtype of `W`. The result has the structure of the
    base model: it serialises into it and needs nothing from this module to run.

    **Arguments:**

    - `model`: a `LoraModel`.

    **Returns:**

    A plain model of the base model's type.

    **Raises:**

    - `ValueError`: naming `model` when it is not a `LoraModel`.
    """
    _require_lora_model(model, "model")
    by_path = dict(zip(model.layer_paths, model.adapters, strict=True))
    scale = model.alpha / model.rank

    def fold(path: tuple[Any, ...], node: Any) -> Any:
        adapter = by_path.get(jax.tree_util.keystr(path)) if _is_linear(node) else None
        if adapter is None:
            return node
        weight = node.weight
        update = jnp.matmul(adapter.b, adapter.a, precision=jax.lax.Precision.HIGHEST)
        return eqx.tree_at(
            lambda layer: layer.weight, node, (weight + scale * update).astype(weight.dtype)
        )

    merged: _Model = jax.tree_util.tree_map_with_path(fold, model.base, is_leaf=_is_linear)
    return merged


def base(model: LoraModel[_Model]) -> _Model:
    """The base model, with the adapters switched off (its weights exactly as they were).

    **Arguments:**

    - `model`: a `LoraModel`.

    **Returns:**

    The base model.

    **Raises:**

    - `ValueError`: naming `model` when it is not a `LoraModel`.
    """
    _require_lora_model(model, "model")
    return model.base


def has_adapters(model: Any) -> bool:
    """Whether any `LoraModel` occurs in the PyTree `model` (including `model` itself)."""
    nodes = jax.tree.leaves(model, is_leaf=_is_lora_model)
    return any(_is_lora_model(node) for node in nodes)


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
        if not _is_lora_model(node):
            return False
        marked = jax.tree.map(lambda _: False, node)
        return eqx.tree_at(
            lambda m: m.adapters, marked, jax.tree.map(lambda _: True, node.adapters)
        )

    return jax.tree.map(mark, model, is_leaf=_is_lora_model)


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
        lambda node: node.base if _is_lora_model(node) else node, tree, is_leaf=_is_lora_model
    )
    return switched_off


def _base_array_filter(tree: PyTree[Any]) -> PyTree[bool]:
    """`True` exactly on the arrays of every `LoraModel`'s base model in `tree`."""

    def mark(node: Any) -> Any:
        if not _is_lora_model(node):
            return False
        marked = jax.tree.map(lambda _: False, node)
        return eqx.tree_at(lambda m: m.base, marked, jax.tree.map(eqx.is_array, node.base))

    return jax.tree.map(mark, tree, is_leaf=_is_lora_model)


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


def fingerprint(base_model: Any) -> str:
    """A stable hash of a model's arrays, to tell which base model adapters belong to.

    The SHA-256 of, for every array leaf in tree order, its key path, dtype, shape and bytes
    (C order, little-endian as stored); the first 16 hex digits. Equal for equal weights,
    whatever the device; Python scalars, functions and static fields are not hashed.

    **Arguments:**

    - `base_model`: a model without adapters (e.g. `lora.base(model)`).

    **Returns:**

    16 lowercase hex digits.

    **Raises:**

    - `ValueError`: naming `base_model` when it holds adapters.
    """
    if has_adapters(base_model):
        raise ValueError("`base_model` holds adapters; fingerprint `lora.base(model)` instead.")
    digest = hashlib.sha256()
    leaves, _ = jax.tree_util.tree_flatten_with_path(base_model)
    for path, leaf in leaves:
        if not eqx.is_array(leaf):
            continue
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        values = np.ascontiguousarray(np.asarray(leaf))
        header = f"{jax.tree_util.keystr(path)}|{values.dtype.str}|{values.shape}\n"
        digest.update(header.encode())
        digest.update(values.tobytes())
    return digest.hexdigest()[:16]


def save_adapters(path: str | os.PathLike[str], model: LoraModel[Any]) -> None:
    """Write only the adapters of `model`, with what is needed to put them back, atomically.

    The file is one JSON line (format, the base model's `fingerprint`, `rank`, `alpha`, and
    each adapted layer's key path, shapes and dtype) followed by the adapter arrays as
    `eqx.tree_serialise_leaves` writes them.

    **Arguments:**

    - `path`: the file to write (its folder is created if missing).
    - `model`: a `LoraModel`.

    **Raises:**

    - `ValueError`: naming `model` when it is not a `LoraModel`.
    """
    _require_lora_model(model, "model")
    header = {
        "format": _FORMAT,
        "fingerprint": fingerprint(model.base),
        "rank": model.rank,
        "alpha": model.alpha,
        "layers": [
            {
                "path": layer_path,
                "a_shape": list(adapter.a.shape),
                "b_shape": list(adapter.b.shape),
                "dtype": str(adapter.a.dtype),
            }
            for layer_path, adapter in zip(model.layer_paths, model.adapters, strict=True)
        ],
    }
    with atomic_file(path) as handle:
        handle.write(json.dumps(header).encode() + b"\n")
        eqx.tree_serialise_leaves(handle, model.adapters)


def load_adapters(path: str | os.PathLike[str], base_model: _Model) -> LoraModel[_Model]:
    """Put adapters written by `save_adapters` onto `base_model`.

    The rank, alpha and adapted layers come from the file, so no template is needed.

    **Arguments:**

    - `path`: a file written by `save_adapters`.
    - `base_model`: the base model the adapters were trained on (without adapters).

    **Returns:**

    A `LoraModel` of `base_model` and the stored adapters.

    **Raises:**

    - `ValueError`: naming the file when it is not an adapter file, or when `base_model`'s
        fingerprint differs from the stored one (giving both), or a stored layer is missing
        from `base_model` or has another shape; naming `base_model` when it holds adapters.
    """
    if has_adapters(base_model):
        raise ValueError("`base_model` holds adapters; pass `lora.base(model)`.")
    with open(path, "rb") as handle:
        try:
            header = json.loads(handle.readline())
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"{os.fspath(path)!r} is not a LoRA adapter file.") from error
        if not isinstance(header, dict) or header.get("format") != _FORMAT:
            raise ValueError(f"{os.fspath(path)!r} is not a LoRA adapter file ({_FORMAT}).")
        found = fingerprint(base_model)
        if header["fingerprint"] != found:
            raise ValueError(
                f"The adapters in {os.fspath(path)!r} belong to the base model with fingerprint "
                f"{header['fingerprint']}, but `base_model` has fingerprint {found}."
            )
        linears = _linears_by_path(base_model)
        rank = int(header["rank"])
        like: list[LoraAdapter] = []
        for layer in header["layers"]:
            linear = linears.get(layer["path"])
            a_shape, b_shape = tuple(layer["a_shape"]), tuple(layer["b_shape"])
            if linear is None or (b_shape[0], a_shape[1]) != linear.weight.shape:
                raise ValueError(
                    f"{os.fspath(path)!r} holds an adapter for {layer['path']}, which is not an "
                    "`eqx.nn.Linear` of that shape in `base_model`."
                )
            dtype = jnp.dtype(layer["dtype"])
            like.append(LoraAdapter(a=_zeros(a_shape, dtype), b=_zeros(b_shape, dtype)))
        loaded: tuple[LoraAdapter, ...] = eqx.tree_deserialise_leaves(handle, tuple(like))
    return LoraModel(
        base=base_model,
        adapters=loaded,
        layer_paths=tuple(layer["path"] for layer in header["layers"]),
        rank=rank,
        alpha=float(header["alpha"]),
    )
