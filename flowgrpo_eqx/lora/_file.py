"""The adapter file format: `save_adapters`/`load_adapters`, and the base model's
`fingerprint` that ties adapters to their base."""

import hashlib
import json
import os
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._files import atomic_file, read_leaves_to_end
from ._model import LoraAdapter, LoraModel, ModelT, require_lora_model
from ._tree import has_adapters, linears_by_path, zeros


_FORMAT = "flowgrpo_eqx.lora/1"


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
    require_lora_model(model, "model")
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


_HEADER_KEYS: dict[str, type | tuple[type, ...]] = {
    "format": str,
    "fingerprint": str,
    "rank": int,
    "alpha": (int, float),
    "layers": list,
}
_LAYER_KEYS: dict[str, type] = {"path": str, "a_shape": list, "b_shape": list, "dtype": str}


def _header_problem(header: Any) -> str | None:
    """What is wrong with an adapter file's JSON header (its keys and their types), or
    `None` when it has every key `load_adapters` reads."""
    if not isinstance(header, dict):
        return "its first line is not a JSON object"
    if header.get("format") != _FORMAT:
        return f"its header's format is {header.get('format')!r}"
    for key, kind in _HEADER_KEYS.items():
        if key not in header:
            return f"its header lacks {key!r}"
        if not isinstance(header[key], kind) or isinstance(header[key], bool):
            return f"its header's {key!r} is {header[key]!r}"
    for index, layer in enumerate(header["layers"]):
        if not isinstance(layer, dict):
            return f"its header's layer {index} is {layer!r}"
        for key, kind in _LAYER_KEYS.items():
            if not isinstance(layer.get(key), kind):
                return f"its header's layer {index} lacks {key!r} or has another type"
        shapes = layer["a_shape"] + layer["b_shape"]
        sizes_ok = all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shapes)
        if not (sizes_ok and layer["a_shape"] and layer["b_shape"]):
            shown = f"{layer['a_shape']}, {layer['b_shape']}"
            return f"its header's layer {index} has the shapes {shown}"
        try:
            jnp.dtype(layer["dtype"])
        except TypeError:
            return f"its header's layer {index} has the unknown dtype {layer['dtype']!r}"
    return None


def load_adapters(path: str | os.PathLike[str], base_model: ModelT) -> LoraModel[ModelT]:
    """Put adapters written by `save_adapters` onto `base_model`.

    The rank, alpha and adapted layers come from the file, so no template is needed.

    **Arguments:**

    - `path`: a file written by `save_adapters`.
    - `base_model`: the base model the adapters were trained on (without adapters).

    **Returns:**

    A `LoraModel` of `base_model` and the stored adapters.

    **Raises:**

    - `ValueError`: naming the file when it is not an adapter file (its JSON header is not
        one, or lacks a key such as `"fingerprint"`), when its arrays do not load (truncated
        or damaged) or it holds bytes after them, or when `base_model`'s fingerprint differs
        from the stored one (giving both), or a stored layer is missing from `base_model` or
        has another shape; naming `base_model` when it holds adapters.
    """
    if has_adapters(base_model):
        raise ValueError("`base_model` holds adapters; pass `lora.base(model)`.")
    name = repr(os.fspath(path))
    with open(path, "rb") as handle:
        try:
            header = json.loads(handle.readline())
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"{name} is not a LoRA adapter file.") from error
        problem = _header_problem(header)
        if problem is not None:
            raise ValueError(f"{name} is not a LoRA adapter file ({_FORMAT}): {problem}.")
        found = fingerprint(base_model)
        if header["fingerprint"] != found:
            raise ValueError(
                f"The adapters in {name} belong to the base model with fingerprint "
                f"{header['fingerprint']}, but `base_model` has fingerprint {found}."
            )
        linears = linears_by_path(base_model)
        rank = int(header["rank"])
        like: list[LoraAdapter] = []
        for layer in header["layers"]:
            linear = linears.get(layer["path"])
            a_shape, b_shape = tuple(layer["a_shape"]), tuple(layer["b_shape"])
            if linear is None or (*b_shape[:-1], a_shape[-1]) != linear.weight.shape:
                raise ValueError(
                    f"{name} holds an adapter for {layer['path']}, which is not an "
                    "`eqx.nn.Linear` of that shape in `base_model`."
                )
            dtype = jnp.dtype(layer["dtype"])
            like.append(LoraAdapter(a=zeros(a_shape, dtype), b=zeros(b_shape, dtype)))
        try:
            loaded = read_leaves_to_end(handle, tuple(like), "the adapters its header describes")
        except ValueError as error:
            raise ValueError(f"{name} {error}.") from error
    return LoraModel(
        base=base_model,
        adapters=loaded,
        layer_paths=tuple(layer["path"] for layer in header["layers"]),
        rank=rank,
        alpha=float(header["alpha"]),
    )
