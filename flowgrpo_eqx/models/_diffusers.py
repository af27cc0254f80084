"""`MMDiT` in diffusers' `SD3Transformer2DModel` format: weights, config and LoRA adapters.

Every parameter of diffusers' SD3 (and SD3.5) transformer maps to one leaf of an `MMDiT`
(`_layout`), with a reshape only for the patch embedding (diffusers' strided convolution,
`[width, channels, patch, patch]`, is our linear map of `patch x patch x channels` patches)
and a crop for the position buffer. The files are read and written with `safetensors` into
NumPy arrays; torch is never imported.
"""

import dataclasses
import json
import os
import pathlib
import re
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from safetensors import safe_open
from safetensors.numpy import save_file

from ..lora import LoraModel
from ._mmdit import MMDiT, _pos_crop


_WEIGHTS = "diffusion_pytorch_model.safetensors"
_INDEX = "diffusion_pytorch_model.safetensors.index.json"
_LORA_WEIGHTS = "pytorch_lora_weights.safetensors"
_CLASS = "SD3Transformer2DModel"
_NpArray = npt.NDArray[Any]


def _identity(array: _NpArray) -> _NpArray:
    return array


def _weight(get: Callable[[MMDiT], eqx.nn.Linear]) -> Callable[[MMDiT], Any]:
    return lambda m: get(m).weight


def _bias(get: Callable[[MMDiT], eqx.nn.Linear]) -> Callable[[MMDiT], Any]:
    return lambda m: get(m).bias


def _in_block(i: int, get: Callable[[Any], Any]) -> Callable[[MMDiT], Any]:
    return lambda m: get(m.blocks[i])


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One diffusers key: the `MMDiT` leaf it fills, its diffusers shape and the conversions."""

    key: str
    where: Callable[[MMDiT], Any]
    shape: tuple[int, ...]
    to_ours: Callable[[_NpArray], _NpArray] = _identity
    to_theirs: Callable[[_NpArray], _NpArray] = _identity


@dataclasses.dataclass(frozen=True)
class _Module:
    """One diffusers `nn.Linear` (or the patch convolution) and the `eqx.nn.Linear` it is."""

    name: str
    where: Callable[[MMDiT], eqx.nn.Linear]
    conv: bool = False


def _modules(model: MMDiT) -> list[_Module]:
    """Every linear module of diffusers' SD3 transformer, by its name there, in its order."""
    modules = [
        _Module("pos_embed.proj", lambda m: m.patch_embed, conv=True),
        _Module("time_text_embed.timestep_embedder.linear_1", lambda m: m.time_mlp[0]),
        _Module("time_text_embed.timestep_embedder.linear_2", lambda m: m.time_mlp[1]),
        _Module("time_text_embed.text_embedder.linear_1", lambda m: m.pooled_mlp[0]),
        _Module("time_text_embed.text_embedder.linear_2", lambda m: m.pooled_mlp[1]),
        _Module("context_embedder", lambda m: m.context_embed),
    ]
    for i, block in enumerate(model.blocks):
        prefix = f"transformer_blocks.{i}"

        pairs: list[tuple[str, Callable[[Any], Any]]] = [
            ("norm1.linear", lambda b: b.image.modulation),
            ("norm1_context.linear", lambda b: b.context.modulation),
            ("attn.to_q", lambda b: b.image.attn.q),
            ("attn.to_k", lambda b: b.image.attn.k),
            ("attn.to_v", lambda b: b.image.attn.v),
            ("attn.to_out.0", lambda b: b.image.attn.out),
            ("attn.add_q_proj", lambda b: b.context.attn.q),
            ("attn.add_k_proj", lambda b: b.context.attn.k),
            ("attn.add_v_proj", lambda b: b.context.attn.v),
        ]
        if not block.context.pre_only:
            pairs.append(("attn.to_add_out", lambda b: b.context.attn.out))
        if block.attn2 is not None:
            pairs += [
                ("attn2.to_q", lambda b: b.attn2.q),
                ("attn2.to_k", lambda b: b.attn2.k),
                ("attn2.to_v", lambda b: b.attn2.v),
                ("attn2.to_out.0", lambda b: b.attn2.out),
            ]
        pairs += [
            ("ff.net.0.proj", lambda b: b.image.fc1),
            ("ff.net.2", lambda b: b.image.fc2),
        ]
        if not block.context.pre_only:
            pairs += [
                ("ff_context.net.0.proj", lambda b: b.context.fc1),
                ("ff_context.net.2", lambda b: b.context.fc2),
            ]
        modules += [_Module(f"{prefix}.{name}", _in_block(i, get)) for name, get in pairs]
    modules += [
        _Module("norm_out.linear", lambda m: m.final_modulation),
        _Module("proj_out", lambda m: m.final_proj),
    ]
    return modules


def _layout(model: MMDiT) -> list[_Entry]:
    """Every key of diffusers' SD3 transformer state dict for `model`'s configuration."""
    width, patch, channels = model.width, model.patch, model.channels
    entries: list[_Entry] = []
    for module in _modules(model):
        get = module.where
        out_features, in_features = get(model).weight.shape
        if module.conv:
            conv_shape = (width, channels, patch, patch)
            entries.append(
                _Entry(
                    f"{module.name}.weight",
                    _weight(get),
                    conv_shape,
                    to_ours=lambda a: a.transpose(0, 2, 3, 1).reshape(a.shape[0], -1),
                    to_theirs=lambda a: a.reshape(width, patch, patch, channels).transpose(
                        0, 3, 1, 2
                    ),
                )
            )
        else:
            entries.append(
                _Entry(
                    f"{module.name}.weight",
                    _weight(get),
                    (out_features, in_features),
                )
            )
        entries.append(_Entry(f"{module.name}.bias", _bias(get), (out_features,)))
        if module.name == "pos_embed.proj" and model.pos_embed_max_size is not None:
            entries.append(_pos_entry(model))
    if model.qk_norm is not None:
        head_dim = width // model.heads
        for i, block in enumerate(model.blocks):
            names: list[tuple[str, Callable[[Any], Any]]] = [
                ("attn.norm_q", lambda b: b.image.attn.norm_q),
                ("attn.norm_k", lambda b: b.image.attn.norm_k),
                ("attn.norm_added_q", lambda b: b.context.attn.norm_q),
                ("attn.norm_added_k", lambda b: b.context.attn.norm_k),
            ]
            if block.attn2 is not None:
                names += [
                    ("attn2.norm_q", lambda b: b.attn2.norm_q),
                    ("attn2.norm_k", lambda b: b.attn2.norm_k),
                ]
            entries += [
                _Entry(
                    f"transformer_blocks.{i}.{name}.weight",
                    _in_block(i, get),
                    (head_dim,),
                )
                for name, get in names
            ]
    return entries


def _pos_entry(model: MMDiT) -> _Entry:
    """The position buffer, `[1, side**2, width]`, of which `model.pos_embed` is the centre."""
    side = model.pos_embed_max_size
    assert side is not None
    grid, width = model.image_size // model.patch, model.width
    top, size = _pos_crop(side, grid)

    def to_ours(table: _NpArray) -> _NpArray:
        square = table.reshape(side, side, width)[top : top + size, top : top + size]
        return np.ascontiguousarray(square.reshape(size * size, width))

    def to_theirs(ours: _NpArray) -> _NpArray:
        full = model.position_table(full=True).reshape(side, side, width).astype(ours.dtype)
        full[top : top + size, top : top + size] = ours.reshape(size, size, width)
        return full.reshape(1, side * side, width)

    return _Entry(
        "pos_embed.pos_embed",
        lambda m: m.pos_embed.value,
        (1, side * side, width),
        to_ours,
        to_theirs,
    )


def _read_file(file: pathlib.Path) -> dict[str, _NpArray]:
    """Every tensor of one safetensors file as a NumPy array (bfloat16 via `ml_dtypes`)."""
    tensors: dict[str, _NpArray] = {}
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


def _read_folder(folder: pathlib.Path) -> dict[str, _NpArray]:
    """The state dict of a diffusers model folder, single-file or sharded."""
    if (folder / _WEIGHTS).exists():
        return _read_file(folder / _WEIGHTS)
    if (folder / _INDEX).exists():
        weight_map: dict[str, str] = json.loads((folder / _INDEX).read_text())["weight_map"]
        tensors: dict[str, _NpArray] = {}
        for shard in sorted(set(weight_map.values())):
            tensors.update(_read_file(folder / shard))
        return tensors
    raise ValueError(f"`path` ({folder}) holds neither {_WEIGHTS} nor {_INDEX}.")


def _config_kwargs(
    config: dict[str, Any], image_size: int | None, context_length: int
) -> dict[str, Any]:
    """`MMDiT`'s arguments for a diffusers `SD3Transformer2DModel` config."""
    name = config.get("_class_name", _CLASS)
    if name != _CLASS:
        raise ValueError(f"`path` holds a {name}, not an {_CLASS}.")
    # diffusers' defaults, for keys an older config may lack.
    heads = config.get("num_attention_heads", 18)
    width = heads * config.get("attention_head_dim", 64)
    caption = config.get("caption_projection_dim", 1152)
    if caption != width:
        raise ValueError(
            f"config `caption_projection_dim` ({caption}) must equal the attention width "
            f"`num_attention_heads * attention_head_dim` ({width})."
        )
    channels = config.get("in_channels", 16)
    out_channels = config.get("out_channels") or channels
    if out_channels != channels:
        raise ValueError(
            f"config `out_channels` ({out_channels}) must equal `in_channels` ({channels}): "
            "the velocity has the latent's shape."
        )
    sample_size = config.get("sample_size", 128)
    return dict(
        image_size=sample_size if image_size is None else image_size,
        channels=channels,
        patch=config.get("patch_size", 2),
        depth=config.get("num_layers", 18),
        width=width,
        heads=heads,
        mlp_ratio=4,
        context_length=context_length,
        context_dim=config.get("joint_attention_dim", 4096),
        pooled_dim=config.get("pooled_projection_dim", 2048),
        vocab_size=None,
        qk_norm=config.get("qk_norm"),
        dual_attention_layers=tuple(config.get("dual_attention_layers", ())),
        pos_embed_max_size=config.get("pos_embed_max_size", 96),
        sample_size=sample_size,
    )


def _config(model: MMDiT) -> dict[str, Any]:
    """The diffusers `SD3Transformer2DModel` config of `model`."""
    return {
        "_class_name": _CLASS,
        "_diffusers_version": "0.31.0",
        "sample_size": model.sample_size,
        "patch_size": model.patch,
        "in_channels": model.channels,
        "num_layers": model.depth,
        "attention_head_dim": model.width // model.heads,
        "num_attention_heads": model.heads,
        "joint_attention_dim": model.context_dim,
        "caption_projection_dim": model.width,
        "pooled_projection_dim": model.pooled_dim,
        "out_channels": model.channels,
        "pos_embed_max_size": model.pos_embed_max_size,
        "dual_attention_layers": list(model.dual_attention_layers),
        "qk_norm": model.qk_norm,
    }


def _abstract(kwargs: dict[str, Any]) -> MMDiT:
    """The model of `kwargs`, shape-evaluated, with one module per block (as diffusers)."""
    model: MMDiT = eqx.filter_eval_shape(
        lambda key: MMDiT(**kwargs, stacked=False, key=key), jax.random.key(0)
    )
    return model


def _on_host(model: MMDiT) -> MMDiT:
    """`model` with its arrays as NumPy arrays, one module per block (views of the stacks)."""
    host: MMDiT = jax.tree.map(lambda leaf: np.asarray(leaf) if eqx.is_array(leaf) else leaf, model)
    return host.with_settings(stacked=False)


def load_diffusers(
    path: str | os.PathLike[str],
    *,
    image_size: int | None = None,
    context_length: int = 333,
    dtype: Any = None,
    stacked: bool = True,
) -> MMDiT:
    """Read a diffusers `SD3Transformer2DModel` folder (SD3 or SD3.5) into an `MMDiT`.

    The folder holds `config.json` and `diffusion_pytorch_model.safetensors` (or the
    shards a `diffusion_pytorch_model.safetensors.index.json` lists), as
    `SD3Transformer2DModel.save_pretrained` writes them: a pipeline's `transformer/`
    subfolder. Read with `safetensors` into NumPy; torch is not needed. The model computes
    what diffusers' does, on our conventions: one unbatched channels-last latent, `t` in
    [0, 1] (diffusers' timestep is `1000 t`), an `MMDiTCondition`, the velocity out.

    **Arguments:**

    - `path`: the folder.
    - `image_size`: the latent size to run at (the position features are cropped for
        it); `None` means the config's `sample_size`.
    - `context_length`: the number of text tokens of `cond["context"]`; diffusers'
        SD3 pipelines give 77 CLIP + 256 T5 = 333.
    - `dtype`: the parameters' dtype, e.g. `jnp.bfloat16`; `None` keeps the
        checkpoint's (float32 for a float32 checkpoint).
    - `stacked`: the block layout (see `MMDiT`): stacked per group of one structure
        (the default) or one module per block. The arrays are stacked on the host, so
        the device holds each once. Other settings: `MMDiT.with_settings`.

    **Returns:**

    The `MMDiT`.

    **Raises:**

    - `ValueError`: when the config is not an SD3 transformer's that `MMDiT` can hold, or
        a key of the checkpoint maps to no leaf (all such keys listed), or a leaf has no
        key (all listed), or a tensor's shape is wrong.
    """
    folder = pathlib.Path(path)
    if not (folder / "config.json").exists():
        raise ValueError(f"`path` ({folder}) has no config.json.")
    config = json.loads((folder / "config.json").read_text())
    model = _abstract(_config_kwargs(config, image_size, context_length))
    tensors = _read_folder(folder)
    entries = _layout(model)
    paths = _leaf_paths(model)

    unused = sorted(set(tensors) - {e.key for e in entries})
    missing = [e for e in entries if e.key not in tensors]
    problems = []
    if unused:
        problems.append(f"{len(unused)} keys map to no leaf of the MMDiT: {', '.join(unused)}")
    if missing:
        left = ", ".join(f"{paths[id(e.where(model))]} (key {e.key})" for e in missing)
        problems.append(f"{len(missing)} leaves have no key in the checkpoint: {left}")
    if problems:
        raise ValueError(
            f"`path` ({folder}) does not fit the MMDiT of its config: " + "; ".join(problems) + "."
        )

    if dtype is None:
        dtype = tensors["proj_out.weight"].dtype
    values = []
    for entry in entries:
        array = tensors[entry.key]
        if tuple(array.shape) != entry.shape:
            raise ValueError(
                f"`path` ({folder}): key {entry.key} has shape {tuple(array.shape)}, "
                f"the config gives {entry.shape}."
            )
        # On the host until the blocks are stacked: the device sees each array once.
        values.append(np.asarray(entry.to_ours(array)).astype(np.dtype(dtype)))
    if model.pos_embed_max_size is None:
        # No buffer in the checkpoint (diffusers keeps it out): computed as diffusers does.
        entries = entries + [_Entry("", lambda m: m.pos_embed.value, ())]
        values.append(model.position_table().astype(np.dtype(dtype)))
    filled: MMDiT = eqx.tree_at(lambda m: [entry.where(m) for entry in entries], model, values)
    unfilled = [
        jax.tree_util.keystr(p)
        for p, leaf in jax.tree_util.tree_flatten_with_path(filled)[0]
        if isinstance(leaf, jax.ShapeDtypeStruct)
    ]
    if unfilled:
        raise ValueError(f"`path` ({folder}) left these MMDiT leaves unfilled: {unfilled}.")
    if stacked:
        filled = filled.with_settings(stacked=True)
    placed: MMDiT = jax.tree.map(
        lambda leaf: jax.device_put(leaf) if isinstance(leaf, np.ndarray) else leaf, filled
    )
    return placed


def _leaf_paths(model: MMDiT) -> dict[int, str]:
    """`keystr` of every array leaf of `model`, by the leaf's `id`."""
    leaves = jax.tree_util.tree_flatten_with_path(model)[0]
    return {id(leaf): jax.tree_util.keystr(path) for path, leaf in leaves}


def _check_exportable(model: MMDiT) -> None:
    if not isinstance(model, MMDiT):
        raise ValueError(f"`model` must be an MMDiT, got {type(model).__name__}.")
    if model.vocab_size is not None:
        raise ValueError(
            "`model` has token-id conditioning (`vocab_size` set), which diffusers' SD3 "
            "transformer does not have."
        )
    if model.mlp_ratio != 4:
        raise ValueError(f"diffusers' SD3 transformer has `mlp_ratio` 4, got {model.mlp_ratio}.")


def save_diffusers(path: str | os.PathLike[str], model: MMDiT, *, dtype: Any = None) -> None:
    """Write an `MMDiT` as a diffusers `SD3Transformer2DModel` folder.

    `config.json` and `diffusion_pytorch_model.safetensors`, which
    `SD3Transformer2DModel.from_pretrained(path)` reads (the position buffer written in
    full, with this model's features at its centre); stacked blocks are written one per
    block, as diffusers holds them. For a LoRA policy, save `lora.merge(policy)`;
    `save_diffusers_lora` writes the adapters alone.

    **Arguments:**

    - `path`: the folder, created if missing; existing files of those names are replaced.
    - `model`: the `MMDiT`.
    - `dtype`: the dtype to write, e.g. `jnp.bfloat16`; `None` keeps the parameters'.

    **Raises:**

    - `ValueError`: when `model` is not an `MMDiT` or has no diffusers counterpart
        (token-id conditioning, an MLP ratio other than 4).
    """
    _check_exportable(model)
    model = _on_host(model)
    folder = pathlib.Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for entry in _layout(model):
        leaf = np.asarray(entry.where(model))
        if dtype is not None:
            leaf = leaf.astype(np.dtype(dtype))
        tensors[entry.key] = np.ascontiguousarray(entry.to_theirs(leaf))
    save_file(tensors, str(folder / _WEIGHTS), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(_config(model), indent=2) + "\n")


def save_diffusers_lora(path: str | os.PathLike[str], model: object) -> None:
    """Write the LoRA adapters of an `MMDiT` policy alone, as diffusers' SD3 LoRA loaders read them.

    Writes `path/pytorch_lora_weights.safetensors` with, for each adapted layer, the keys
    `transformer.<module>.lora_A.weight` (our `a`, `[rank, in]`) and `...lora_B.weight`
    (our `b` times `alpha / rank`, `[out, rank]`: diffusers' loaders read a PEFT state dict
    without alphas at scale 1), `<module>` the layer's name in diffusers'
    `SD3Transformer2DModel` (e.g. `transformer_blocks.0.attn.to_q`; an adapted patch
    embedding becomes the convolution LoRA of `pos_embed.proj`). diffusers loads them onto
    the pipeline's transformer with

    ```text
    pipe.load_lora_weights("PATH")  # pipe: a StableDiffusion3Pipeline of the same base model
    ```

    and the pipeline then computes what `lora.merge(model)` computes.

    **Arguments:**

    - `path`: the folder, created if missing.
    - `model`: a `LoraModel` (from `lora.add` or `lora.load_adapters`) whose base is an
        `MMDiT`.

    **Raises:**

    - `ValueError`: when `model` is not a `LoraModel` of an `MMDiT` that diffusers can hold,
        or one of its adapted layers has no diffusers counterpart.
    """
    if not isinstance(model, LoraModel):
        raise ValueError(f"`model` must be a LoraModel, got {type(model).__name__}.")
    _check_exportable(model.base)
    base, layers = _unstacked_adapters(model)
    names = {}
    linears = _linear_paths(base)
    for module in _modules(base):
        names[linears[id(module.where(base))]] = module
    scale = model.alpha / model.rank
    tensors: dict[str, _NpArray] = {}
    for layer_path, a, b in layers:
        if layer_path not in names:
            raise ValueError(f"`model` adapts {layer_path}, which has no diffusers counterpart.")
        module = names[layer_path]
        b = (b.astype(np.float32) * scale).astype(b.dtype)
        if module.conv:
            patch, channels = base.patch, base.channels
            a = a.reshape(a.shape[0], patch, patch, channels).transpose(0, 3, 1, 2)
            b = b[:, :, None, None]
        tensors[f"transformer.{module.name}.lora_A.weight"] = np.ascontiguousarray(a)
        tensors[f"transformer.{module.name}.lora_B.weight"] = np.ascontiguousarray(b)
    folder = pathlib.Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / _LORA_WEIGHTS), metadata={"format": "pt"})


def _linear_paths(model: MMDiT) -> dict[int, str]:
    """`keystr` of every `eqx.nn.Linear` of `model` (as `LoraModel.layer_paths`), by `id`."""

    def is_linear(node: Any) -> bool:
        return isinstance(node, eqx.nn.Linear)

    nodes = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_linear)[0]
    return {id(node): jax.tree_util.keystr(path) for path, node in nodes if is_linear(node)}


def _unstacked_adapters(
    model: LoraModel[MMDiT],
) -> tuple[MMDiT, list[tuple[str, _NpArray, _NpArray]]]:
    """The base with one module per block (on the host) and each block's `(path, a, b)`.

    An adapter of a stacked group's layer (`.blocks[g]...`, `a` `[n, rank, in]`) becomes
    one per block of the group (`.blocks[start + j]...`, `a[j]`).
    """
    base = model.base
    layers: list[tuple[str, _NpArray, _NpArray]] = []
    for layer_path, adapter in zip(model.layer_paths, model.adapters, strict=True):
        a, b = np.asarray(adapter.a), np.asarray(adapter.b)
        found = re.fullmatch(r"\.blocks\[(\d+)\](.*)", layer_path)
        if not base.stacked or found is None:
            layers.append((layer_path, a, b))
            continue
        start, stop = base.block_groups[int(found.group(1))]
        layers += [
            (f".blocks[{start + j}]{found.group(2)}", a[j], b[j]) for j in range(stop - start)
        ]
    return _on_host(base), layers
