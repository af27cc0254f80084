"""Modules whose tree mirrors a PyTorch state dict, and loading one by its keys alone.

A model built of these and of `eqx.nn.Linear` (whose weight is torch's `[out, in]`) keeps
torch's names and layouts (an embedding's `[vocab, width]` table), so the leaf at
`encoder.layers[3].mlp.fc1.weight` is the tensor `encoder.layers.3.mlp.fc1.weight`:
`state_dict_leaves` names every leaf that way and `fill_from_state_dict` loads a checkpoint
with nothing to map by hand. The autoencoder and the text and image towers (CLIP, T5) are
built this way; the transformers keep their own layouts.
"""

import json
import math
import pathlib
from collections.abc import Iterable, Mapping
from typing import Any, final

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray
from safetensors import safe_open

from ._init import ones, zeros
from ._layers import layer_norm


def uniform_init(key: PRNGKeyArray, shape: tuple[int, ...], fan_in: int) -> Float[Array, "..."]:
    """`U[-1/sqrt(fan_in), 1/sqrt(fan_in))` float32, torch's default for weights and biases."""
    limit = 1.0 / math.sqrt(fan_in)
    return jax.random.uniform(key, shape, jnp.float32, -limit, limit)


@final
class LayerNorm(eqx.Module):
    """LayerNorm over the last axis with an affine part, statistics in float32.

    **Arguments:**

    - `width`: the width.
    - `eps`: added to the variance.
    """

    weight: Float[Array, " D"]
    bias: Float[Array, " D"]
    eps: float = eqx.field(static=True)

    def __init__(self, width: int, eps: float) -> None:
        self.weight = ones((width,))
        self.bias = zeros((width,))
        self.eps = eps

    def __call__(self, x: Float[Array, "*S D"]) -> Float[Array, "*S D"]:
        normed = layer_norm(x.astype(jnp.float32), self.eps)
        shape = (1,) * (x.ndim - 1) + (-1,)
        out = normed * self.weight.astype(jnp.float32).reshape(shape)
        return (out + self.bias.astype(jnp.float32).reshape(shape)).astype(x.dtype)


@final
class Embedding(eqx.Module):
    """A lookup table `[count, width]` (torch's `nn.Embedding`).

    **Arguments:**

    - `count`: the number of entries.
    - `width`: each entry's width.
    - `key`: a JAX PRNG key for the initialisation.
    """

    weight: Float[Array, "count width"]

    def __init__(self, count: int, width: int, *, key: PRNGKeyArray) -> None:
        self.weight = 0.02 * jax.random.normal(key, (count, width), jnp.float32)

    def __call__(self, ids: Int[Array, " S"]) -> Float[Array, "S width"]:
        out: Float[Array, "S width"] = jnp.take(self.weight, ids, axis=0)
        return out


def _is_array_leaf(x: Any) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def state_dict_leaves(model: Any) -> dict[str, Any]:
    """Every array leaf of `model` by its key in the state dict it mirrors: attribute names
    and sequence indices joined by dots.

    **Arguments:**

    - `model`: the model (or its shape, `eqx.filter_eval_shape`).

    **Returns:**

    `{key: leaf}` for every array leaf, in the tree's order.
    """
    leaves: dict[str, Any] = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(model, is_leaf=_is_array_leaf):
        if not _is_array_leaf(leaf):
            continue
        parts = []
        for entry in path:
            if isinstance(entry, jax.tree_util.GetAttrKey):
                parts.append(entry.name)
            elif isinstance(entry, jax.tree_util.SequenceKey):
                parts.append(str(entry.idx))
        leaves[".".join(parts)] = leaf
    return leaves


def fill_from_state_dict(
    model: Any,
    tensors: dict[str, np.ndarray],
    dtype: Any,
    kind: str,
    ignored: Iterable[str] = (),
) -> Any:
    """`model` (or its shape) with every array leaf replaced by the tensor of its key.

    **Arguments:**

    - `model`: the model or its shape.
    - `tensors`: the state dict.
    - `dtype`: the parameters' dtype; `None` keeps the tensors'.
    - `kind`: the model's name, for the error.
    - `ignored`: suffixes of keys that hold no parameter (buffers such as `position_ids`).

    **Returns:**

    The model, its arrays on the default device.

    **Raises:**

    - `ValueError`: listing the keys that map to no leaf, the leaves without a key and the
        tensors of another shape.
    """
    suffixes = tuple(ignored)
    leaves = state_dict_leaves(model)
    keys = {key for key in tensors if not (suffixes and key.endswith(suffixes))}
    unused = sorted(keys - set(leaves))
    missing = sorted(set(leaves) - keys)
    wrong = sorted(
        f"{key}: {tuple(tensors[key].shape)} for {tuple(leaf.shape)}"
        for key, leaf in leaves.items()
        if key in tensors and tuple(tensors[key].shape) != tuple(leaf.shape)
    )
    if unused or missing or wrong:
        raise ValueError(
            f"the checkpoint does not fit the {kind}: {len(unused)} keys map to no leaf "
            f"{unused[:20]}, {len(missing)} leaves have no key {missing[:20]}, {len(wrong)} "
            f"tensors have another shape {wrong[:20]}."
        )

    def cast(array: np.ndarray) -> Any:
        return jnp.asarray(array if dtype is None else array.astype(np.dtype(dtype)))

    arrays, treedef = jax.tree_util.tree_flatten(model, is_leaf=_is_array_leaf)
    values = iter(cast(tensors[key]) for key in leaves)
    filled = [next(values) if _is_array_leaf(a) else a for a in arrays]
    return jax.tree_util.tree_unflatten(treedef, filled)


def _read_file(file: pathlib.Path) -> dict[str, np.ndarray]:
    """Every tensor of one safetensors file as a NumPy array (bfloat16 via `ml_dtypes`).

    **Raises:**

    - `ValueError`: naming `file` when it is missing, empty, truncated or not a safetensors
        file.
    """
    if not file.is_file():
        raise ValueError(f"{file} is missing: the folder's weights name it.")
    try:
        return _read_tensors(file)
    except Exception as error:  # noqa: BLE001 - safetensors' errors are of its own types
        size = file.stat().st_size
        raise ValueError(
            f"{file} is not a readable safetensors file ({size} bytes; "
            f"{type(error).__name__}: {error}): it is empty, truncated or damaged. Download or "
            "write it again."
        ) from None


def _read_tensors(file: pathlib.Path) -> dict[str, np.ndarray]:
    tensors: dict[str, np.ndarray] = {}
    raw: list[str] = []
    with safe_open(str(file), framework="numpy") as f:
        for name in f.keys():
            if f.get_slice(name).get_dtype() == "BF16":
                raw.append(name)
            else:
                tensors[name] = f.get_tensor(name)
    if raw:
        # safetensors' NumPy reader has no bfloat16: read those tensors from the documented
        # layout, a little-endian u64 header size, the JSON header, then the data.
        data = np.memmap(file, dtype=np.uint8, mode="r")
        header_size = int(data[:8].view("<u8")[0])
        header = json.loads(bytes(data[8 : 8 + header_size]))
        start = 8 + header_size
        for name in raw:
            begin, end = header[name]["data_offsets"]
            chunk = np.asarray(data[start + begin : start + end]).view(np.dtype(jnp.bfloat16))
            tensors[name] = chunk.reshape(header[name]["shape"])
    return tensors


def read_config_json(folder: pathlib.Path, what: str) -> dict[str, Any]:
    """A model folder's `config.json`, as a dict.

    **Arguments:**

    - `folder`: the model folder.
    - `what`: what the folder should hold, for the messages (`"a transformers CLIP
        folder"`).

    **Returns:**

    The parsed JSON object.

    **Raises:**

    - `ValueError`: naming `path` when the folder has no `config.json`; naming the file when
        it cannot be read, is not UTF-8 text (a binary file), is not JSON, or holds something
        other than a JSON object.
    """
    file = folder / "config.json"
    if not file.is_file():
        raise ValueError(f"`path` ({folder}) has no config.json: it must be {what}.")
    try:
        data = file.read_bytes()
    except OSError as error:
        raise ValueError(f"{file} cannot be read: {error.strerror or error}.") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"{file} is not UTF-8 text (byte 0x{data[error.start]:02x} at offset "
            f"{error.start}): a model's config.json is JSON text, as {what} holds it."
        ) from None
    try:
        loaded = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{file} is not JSON ({error}): {what} holds its config there.") from None
    if not isinstance(loaded, dict):
        raise ValueError(
            f"{file} must hold a JSON object of the model's settings, got {type(loaded).__name__}."
        )
    return loaded


def config_object(config: Mapping[str, Any], name: str, file: pathlib.Path) -> dict[str, Any]:
    """The JSON object a config holds under `name` (CLIP's `text_config`).

    **Arguments:**

    - `config`: the parsed config (or the part of it holding `name`).
    - `name`: the field, as the message names it (`"text_config"`).
    - `file`: the config file, for the message.

    **Returns:**

    The object.

    **Raises:**

    - `ValueError`: naming the file and the field when it is missing or not an object.
    """
    value = config.get(name.rsplit(".", 1)[-1])
    if not isinstance(value, dict):
        got = "nothing" if value is None else type(value).__name__
        raise ValueError(f"{file}: `{name}` must be a JSON object of settings, got {got}.")
    return value


_REQUIRED = object()


def config_int(
    config: Mapping[str, Any],
    name: str,
    file: pathlib.Path,
    default: Any = _REQUIRED,
    minimum: int = 1,
) -> int:
    """An int setting of a config: present (or `default`) and `>= minimum`.

    **Arguments:**

    - `config`: the parsed config (or the part of it holding the field).
    - `name`: the field, as the message names it (`"text_config.hidden_size"`: the part
        after the last dot is looked up).
    - `file`: the config file, for the message.
    - `default`: the value when the field is absent; by default the field is required.
    - `minimum`: the smallest value allowed.

    **Returns:**

    The int.

    **Raises:**

    - `ValueError`: naming the file and the field when it is missing (and required), not an
        int, or below `minimum`.
    """
    key = name.rsplit(".", 1)[-1]
    if key not in config:
        if default is _REQUIRED:
            raise ValueError(f"{file} has no `{name}` (an int >= {minimum}), which it needs.")
        return int(default)
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{file}: `{name}` must be an int >= {minimum}, got {value!r}.")
    return value


def config_error(file: pathlib.Path, error: ValueError) -> ValueError:
    """`error` (a model constructor's refusal of a value a config gave) with the config file
    named first.

    **Arguments:**

    - `file`: the config file.
    - `error`: the refusal.

    **Returns:**

    A `ValueError` to raise.
    """
    return ValueError(f"{file} gives a model this library cannot build: {error}")


def check_token_ids(
    name: str, ids: Any, vocab_size: int, mask: Any = None, max_length: int | None = None
) -> Any:
    """Check one prompt's token ids for an embedding table of `vocab_size` entries.

    The dtype and shape are checked at once (they are known while tracing). The values are
    checked at once when `ids` is a concrete array; inside a traced function (`jit`, `vmap`)
    an id outside `[0, vocab_size)` raises from the compiled program (`eqx.error_if`), where
    `jnp.take` would otherwise read NaN past the table or wrap a negative id round to its
    last entries.

    **Arguments:**

    - `name`: the argument's name, for the messages.
    - `ids`: the token ids, `[L]`.
    - `vocab_size`: the table's entries.
    - `mask`: the attention mask given with them, or `None`; checked to be `[L]` of ints.
    - `max_length`: the most ids allowed, or `None`.

    **Returns:**

    `ids` (under tracing, with the range check attached).

    **Raises:**

    - `ValueError`: naming `name` when `ids` is not `[L]` of integers with `1 <= L` (`<=
        max_length`), or a concrete id is outside `[0, vocab_size)`; naming `attention_mask`
        when `mask` is not `[L]` of integers or bools.
    - `EquinoxRuntimeError`: from the compiled program, for a traced id out of range.
    """
    dtype = getattr(ids, "dtype", None)
    shape = tuple(getattr(ids, "shape", ()))
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(
            f"`{name}` must be integer token ids (a tokenizer's int32 ids), got "
            f"{dtype if dtype is not None else type(ids).__name__}."
        )
    longest = "" if max_length is None else f" <= {max_length}"
    if len(shape) != 1 or shape[0] < 1 or (max_length is not None and shape[0] > max_length):
        raise ValueError(f"`{name}` must be [L] with 1 <= L{longest}, got shape {shape}.")
    if mask is not None:
        mask_dtype = getattr(mask, "dtype", None)
        if (
            mask_dtype is None
            or not (jnp.issubdtype(mask_dtype, jnp.integer) or mask_dtype == jnp.bool_)
            or tuple(mask.shape) != shape
        ):
            raise ValueError(
                f"`attention_mask` must be [L] = {shape} of ints (1 for a prompt's tokens, 0 for "
                f"padding), as `{name}` is, got {getattr(mask, 'shape', None)} of {mask_dtype}."
            )
    table = f"[0, {vocab_size}) (the embedding table's {vocab_size} entries)"
    if isinstance(ids, jax.core.Tracer):
        bad = (ids < 0) | (ids >= vocab_size)
        return eqx.error_if(ids, bad, f"`{name}` holds a token id outside {table}.")
    values = np.asarray(ids)
    outside = np.flatnonzero((values < 0) | (values >= vocab_size))
    if outside.size:
        where = int(outside[0])
        raise ValueError(
            f"`{name}` holds token id {int(values[where])} at position {where}; ids must be "
            f"in {table}."
        )
    return ids


def conversion_command(folder: pathlib.Path) -> str:
    """The one command that rewrites a PyTorch `.bin` checkpoint folder as safetensors, in
    place, with the library that wrote it (diffusers for a `_class_name` config, transformers
    for an `architectures` one).

    **Arguments:**

    - `folder`: the model folder.

    **Returns:**

    A shell command.
    """
    config: dict[str, Any] = {}
    try:
        loaded = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        config = loaded if isinstance(loaded, dict) else {}
    except (OSError, ValueError):
        pass
    if "_class_name" in config:
        library, name = "diffusers", str(config["_class_name"])
    else:
        library, name = "transformers", str((config.get("architectures") or ["AutoModel"])[0])
    path = str(folder).replace("'", "\\'")
    return (
        f"python -c \"import {library}; {library}.{name}.from_pretrained('{path}')"
        f".save_pretrained('{path}', safe_serialization=True)\""
    )


def read_safetensors_folder(folder: pathlib.Path, name: str) -> dict[str, np.ndarray]:
    """The state dict of a model folder: the file `name` (`model.safetensors`,
    `diffusion_pytorch_model.safetensors`), or the shards its `name.index.json` lists.

    **Arguments:**

    - `folder`: the folder.
    - `name`: the weights' file name.

    **Returns:**

    `{key: array}`, bfloat16 tensors as `ml_dtypes` bfloat16 arrays.

    **Raises:**

    - `ValueError`: naming `path` when the folder holds neither (and, when it holds a PyTorch
        `.bin` checkpoint instead, the one command that converts it); naming the index when
        it is not JSON or has no `weight_map` of file names; naming a shard or the file
        when it is missing, empty, truncated or damaged.
    """
    if (folder / name).exists():
        return _read_file(folder / name)
    index = folder / f"{name}.index.json"
    if index.exists():
        tensors: dict[str, np.ndarray] = {}
        for shard in _shards(index):
            tensors.update(_read_file(folder / shard))
        return tensors
    if any(folder.glob("*.bin")):
        raise ValueError(
            f"`path` ({folder}) holds a PyTorch .bin checkpoint, which this library does not "
            "read (it reads safetensors, without torch). Convert it once, in an environment "
            f"with torch: {conversion_command(folder)}"
        )
    raise ValueError(f"`path` ({folder}) holds neither {name} nor {index.name}.")


def _shards(index: pathlib.Path) -> list[str]:
    """The shard files a safetensors index lists (its `weight_map`'s values)."""
    try:
        loaded = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ValueError(f"{index} is not a readable JSON file: {error}") from None
    weight_map = loaded.get("weight_map") if isinstance(loaded, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(shard, str) and "/" not in shard for shard in weight_map.values()
    ):
        raise ValueError(
            f"{index} has no `weight_map` of tensor names to shard files in this folder, as "
            "a sharded safetensors checkpoint's index has."
        )
    return sorted(set(weight_map.values()))
