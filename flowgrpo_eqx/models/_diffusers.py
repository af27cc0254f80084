"""The transformers in diffusers' format: weights, config and LoRA adapters.

`MMDiT` is diffusers' `SD3Transformer2DModel` (SD3 and SD3.5), `Flux` its
`FluxTransformer2DModel` (FLUX.1-dev and -schnell); a format class per model says which key
fills which leaf. Every parameter maps to one leaf (`_layout`), with a reshape only for SD3's
patch embedding (diffusers' strided convolution, `[width, channels, patch, patch]`, is our
linear map of `patch x patch x channels` patches) and a crop for its position buffer. The
files are read and written with `safetensors` into NumPy arrays; torch is never imported.
"""

import dataclasses
import json
import os
import pathlib
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias, final

import equinox as eqx
import jax
import numpy as np
from safetensors.numpy import save_file

from ..lora import LoraModel
from ._flux import Flux
from ._flux_format import FluxFormat
from ._format import AbstractFormat, Entry, Fields, NpArray, bias_of, weight_of
from ._mirror import (
    config_error,
    fill_from_state_dict,
    read_config_json,
    read_safetensors_folder,
    state_dict_leaves,
)
from ._mmdit import MMDiT
from ._mmdit_format import SD3Format
from ._vae import AutoencoderKL, vae_config, vae_kwargs
from ._wan import Wan
from ._wan_format import WanFormat
from ._wan_vae import AutoencoderKLWan, wan_vae_config, wan_vae_kwargs


DiffusersTransformer: TypeAlias = MMDiT | Flux | Wan
DiffusersModel: TypeAlias = MMDiT | Flux | Wan | AutoencoderKL | AutoencoderKLWan
"""What `load_diffusers` reads: a transformer or an autoencoder."""
"""A model that diffusers' format holds: `MMDiT` (SD3, SD3.5), `Flux` (FLUX.1) or `Wan`
(Wan 2.1)."""

_WEIGHTS = "diffusion_pytorch_model.safetensors"
_LORA_WEIGHTS = "pytorch_lora_weights.safetensors"


_FORMATS: tuple[AbstractFormat, ...] = (SD3Format(), FluxFormat(), WanFormat())


@final
@dataclasses.dataclass(frozen=True)
class _AutoencoderFormat:
    """An autoencoder in diffusers' format: its class (named as diffusers names it), the
    constructor arguments of a config and the config of a model. Its keys are its leaves'
    state-dict names (`state_dict_leaves`)."""

    model_type: type[AutoencoderKL] | type[AutoencoderKLWan]
    kwargs: Callable[[Fields], Fields]
    config: Callable[[Any], Fields]

    def abstract(self, config: Fields) -> Any:
        """The model of a diffusers config, shape-evaluated."""
        return eqx.filter_eval_shape(
            lambda key: self.model_type(**self.kwargs(config), key=key), jax.random.key(0)
        )


_AUTOENCODERS = (
    _AutoencoderFormat(AutoencoderKL, vae_kwargs, vae_config),
    _AutoencoderFormat(AutoencoderKLWan, wan_vae_kwargs, wan_vae_config),
)


def _format_of(model: Any) -> AbstractFormat:
    """The format of `model`'s class (`ValueError` naming `model` if none)."""
    for fmt in _FORMATS:
        if type(model) is fmt.model_type:
            return fmt
    names = ", ".join(fmt.model_type.__name__ for fmt in _FORMATS)
    raise ValueError(f"`model` must be one of {names}, got {type(model).__name__}.")


def _format_named(name: str) -> AbstractFormat:
    for fmt in _FORMATS:
        if fmt.class_name == name:
            return fmt
    names = ", ".join(fmt.class_name for fmt in _FORMATS)
    raise ValueError(f"`path` holds a {name}, not one of {names}.")


def _layout(model: Any) -> list[Entry]:
    """Every key of the diffusers model's state dict for `model`'s configuration."""
    fmt = _format_of(model)
    entries: list[Entry] = []
    for module in fmt.modules(model):
        get = module.where
        out_features, in_features = get(model).weight.shape
        if module.conv is not None:
            entries.append(
                Entry(
                    f"{module.name}.weight",
                    weight_of(get),
                    module.conv,
                    module.to_ours,
                    module.to_theirs,
                )
            )
        else:
            entries.append(
                Entry(f"{module.name}.weight", weight_of(get), (out_features, in_features))
            )
        entries.append(Entry(f"{module.name}.bias", bias_of(get), (out_features,)))
    return entries + fmt.other_entries(model)


def _abstract(fmt: AbstractFormat, kwargs: Fields) -> Any:
    """The model of `kwargs`, shape-evaluated, with one module per block (as diffusers)."""
    return eqx.filter_eval_shape(
        lambda key: fmt.model_type(**kwargs, stacked=False, key=key), jax.random.key(0)
    )


def _on_host(model: Any) -> Any:
    """`model` with its arrays as NumPy arrays, one module per block (views of the stacks)."""
    host = jax.tree.map(lambda leaf: np.asarray(leaf) if eqx.is_array(leaf) else leaf, model)
    return host.with_settings(stacked=False)


def load_diffusers(
    path: str | os.PathLike[str],
    *,
    image_size: int | tuple[int, ...] | None = None,
    context_length: int | None = None,
    dtype: Any = None,
    stacked: bool = True,
) -> DiffusersModel:
    """Read a diffusers transformer folder into an `MMDiT` (SD3, SD3.5), a `Flux` (FLUX.1) or a
    `Wan` (Wan 2.1), or a pipeline's `vae/` folder into an `AutoencoderKL` or an
    `AutoencoderKLWan` (Wan 2.1's video autoencoder).

    The folder holds `config.json` and `diffusion_pytorch_model.safetensors` (or the
    shards a `diffusion_pytorch_model.safetensors.index.json` lists), as diffusers'
    `save_pretrained` writes them: a pipeline's `transformer/` subfolder. Its config's
    `_class_name` chooses the model: `SD3Transformer2DModel` gives an `MMDiT`,
    `FluxTransformer2DModel` a `Flux`, `WanTransformer3DModel` a `Wan`, `AutoencoderKL` an
    `AutoencoderKL` and `AutoencoderKLWan` an `AutoencoderKLWan` (every key by its name:
    `image_size`, `context_length` and `stacked` do not apply to them). Read with
    `safetensors` into NumPy; torch is not needed. The model computes what diffusers' does,
    on our conventions: one unbatched channels-last latent (a video's `[F, H, W, C]` for
    Wan), `t` in [0, 1] (diffusers' timestep is `1000 t`), the condition (`MMDiTCondition`,
    `FluxCondition`, Wan's text states), the velocity out.

    Every field of the class's config is read, not only the published values (a fine-tuned or
    distilled variant's `freq_dim`, `eps`, `cross_attn_norm`, `patch_size`, rotary widths,
    heads, ...). Refused, with the field named, is only what the model cannot compute: an
    `out_channels` that makes the output other than a velocity of the latent, image
    conditioning (Wan's `image_dim`, `added_kv_proj_dim`, `pos_embed_seq_len`), SD3's
    `qk_norm` other than `"rms_norm"`, and what diffusers' own model cannot run either (an SD3
    `caption_projection_dim` other than the attention width, a Wan `rope_max_seq_len` shorter
    than the patch grid). Wan's `qk_norm` is taken whatever it says: diffusers' Wan attention
    does not read it.

    **Arguments:**

    - `path`: the folder.
    - `image_size`: the latent size to run at. SD3: an int (the position features are
        cropped for it), `None` for the config's `sample_size`. FLUX: an int or `(height,
        width)`, both even, `None` for 128 (a 1024 x 1024 image). Wan: `(frames, height,
        width)`, `None` for `(21, 60, 104)` (81 frames at 480 x 832).
    - `context_length`: the number of text tokens of the condition; `None` for the
        pipelines' default: 77 CLIP + 256 T5 = 333 for SD3, 512 T5 tokens for FLUX and Wan.
    - `dtype`: the parameters' dtype, e.g. `jnp.bfloat16`; `None` keeps the
        checkpoint's (float32 for a float32 checkpoint).
    - `stacked`: the block layout (see `MMDiT`): stacked per group of one structure
        (the default) or one module per block. The arrays are stacked on the host, so
        the device holds each once. Other settings: `with_settings`.

    **Returns:**

    The `MMDiT`, `Flux`, `Wan`, `AutoencoderKL` or `AutoencoderKLWan`.

    **Raises:**

    - `ValueError`: naming `path` when the folder has no `config.json`; naming the config
        file when it is not a JSON object (binary, not JSON), or an autoencoder's config
        gives values the module cannot be built with; naming the weights file when it is
        missing, empty, truncated or damaged (or the one command that converts a `.bin`
        checkpoint); when the config is not one of those classes' or not one the model can
        hold, or a key of the checkpoint maps to no leaf (all such keys listed), or a leaf
        has no key (all listed), or a tensor's shape is wrong.
    """
    folder = pathlib.Path(path)
    config = read_config_json(folder, "a diffusers transformer or vae folder")
    for vae in _AUTOENCODERS:
        if config.get("_class_name") == vae.model_type.__name__:
            return _load_autoencoder(vae, folder, config, dtype)
    fmt = _format_named(config.get("_class_name", SD3Format.class_name))
    length = fmt.default_context_length if context_length is None else context_length
    model = _abstract(fmt, fmt.model_kwargs(config, image_size, length))
    tensors = read_safetensors_folder(folder, _WEIGHTS)
    entries = _layout(model)
    _check_keys(folder, model, tensors, entries)
    if dtype is None:
        dtype = tensors["proj_out.weight"].dtype
    filled = _filled(folder, fmt, model, tensors, entries, np.dtype(dtype))
    if stacked:
        filled = filled.with_settings(stacked=True)
    placed: DiffusersTransformer = jax.tree.map(
        lambda leaf: jax.device_put(leaf) if isinstance(leaf, np.ndarray) else leaf, filled
    )
    return placed


def _load_autoencoder(
    vae: "_AutoencoderFormat", folder: pathlib.Path, config: Fields, dtype: Any
) -> AutoencoderKL | AutoencoderKLWan:
    """An autoencoder folder's model, every leaf filled by its state-dict name."""
    try:
        abstract = vae.abstract(config)
    except (TypeError, ValueError) as error:
        raise config_error(folder / "config.json", ValueError(error)) from None
    tensors = read_safetensors_folder(folder, _WEIGHTS)
    autoencoder: AutoencoderKL | AutoencoderKLWan = fill_from_state_dict(
        abstract, tensors, dtype, vae.model_type.__name__
    )
    return autoencoder


def _check_keys(
    folder: pathlib.Path, model: Any, tensors: dict[str, NpArray], entries: list[Entry]
) -> None:
    """Refuse a checkpoint with a key that maps to no leaf or a leaf without its key (every
    one listed)."""
    kind = type(model).__name__
    paths = _leaf_paths(model)
    unused = sorted(set(tensors) - {e.key for e in entries})
    missing = [e for e in entries if e.key not in tensors]
    problems = []
    if unused:
        problems.append(f"{len(unused)} keys map to no leaf of the {kind}: {', '.join(unused)}")
    if missing:
        left = ", ".join(f"{paths[id(e.where(model))]} (key {e.key})" for e in missing)
        problems.append(f"{len(missing)} leaves have no key in the checkpoint: {left}")
    if problems:
        raise ValueError(
            f"`path` ({folder}) does not fit the {kind} of its config: " + "; ".join(problems) + "."
        )


def _filled(
    folder: pathlib.Path,
    fmt: AbstractFormat,
    model: Any,
    tensors: dict[str, NpArray],
    entries: list[Entry],
    dtype: np.dtype[Any],
) -> Any:
    """`model` (shape-evaluated) with every leaf the checkpoint's array in our layout, on the
    host until the blocks are stacked (the device sees each array once)."""
    kind = type(model).__name__
    wheres = []
    values = []
    for entry in entries:
        array = tensors[entry.key]
        if tuple(array.shape) != entry.shape:
            raise ValueError(
                f"`path` ({folder}): key {entry.key} has shape {tuple(array.shape)}, "
                f"the config gives {entry.shape}."
            )
        wheres.append(entry.where)
        values.append(np.asarray(entry.to_ours(array)).astype(dtype))
    for where, value in fmt.computed(model):
        wheres.append(where)
        values.append(value.astype(dtype))
    filled = eqx.tree_at(lambda m: [where(m) for where in wheres], model, values)
    unfilled = [
        jax.tree_util.keystr(p)
        for p, leaf in jax.tree_util.tree_flatten_with_path(filled)[0]
        if isinstance(leaf, jax.ShapeDtypeStruct)
    ]
    if unfilled:
        raise ValueError(f"`path` ({folder}) left these {kind} leaves unfilled: {unfilled}.")
    return filled


def _leaf_paths(model: Any) -> dict[int, str]:
    """`keystr` of every array leaf of `model`, by the leaf's `id`."""
    leaves = jax.tree_util.tree_flatten_with_path(model)[0]
    return {id(leaf): jax.tree_util.keystr(path) for path, leaf in leaves}


def _exportable_format(model: Any) -> AbstractFormat:
    fmt = _format_of(model)
    fmt.check_exportable(model)
    return fmt


def save_diffusers(
    path: str | os.PathLike[str], model: DiffusersModel, *, dtype: Any = None
) -> None:
    """Write an `MMDiT`, a `Flux` or a `Wan` as a diffusers transformer folder, or an
    `AutoencoderKL` or an `AutoencoderKLWan` as a diffusers `vae/` folder.

    `config.json` and `diffusion_pytorch_model.safetensors`, which
    `SD3Transformer2DModel.from_pretrained(path)` (for an `MMDiT`; the position buffer written
    in full, with this model's features at its centre) or
    `FluxTransformer2DModel.from_pretrained(path)` (for a `Flux`) or
    `WanTransformer3DModel.from_pretrained(path)` (for a `Wan`) reads; stacked blocks are
    written one per block, as diffusers holds them. For a LoRA policy, save
    `lora.merge(policy)`; `save_diffusers_lora` writes the adapters alone.

    **Arguments:**

    - `path`: the folder, created if missing; existing files of those names are replaced.
    - `model`: the `MMDiT`, `Flux`, `Wan`, `AutoencoderKL` or `AutoencoderKLWan`.
    - `dtype`: the dtype to write, e.g. `jnp.bfloat16`; `None` keeps the parameters'.

    **Raises:**

    - `ValueError`: when `model` is none of them or has no diffusers counterpart (token-id
        conditioning, an MLP ratio other than 4).
    """
    for vae in _AUTOENCODERS:
        if isinstance(model, vae.model_type):
            leaves = state_dict_leaves(model)
            _save_tensors(
                path, {k: np.asarray(v) for k, v in leaves.items()}, vae.config(model), dtype
            )
            return
    fmt = _exportable_format(model)
    model = _on_host(model)
    tensors = {
        entry.key: entry.to_theirs(np.asarray(entry.where(model))) for entry in _layout(model)
    }
    _save_tensors(path, tensors, fmt.config(model), dtype)


def _save_tensors(
    path: str | os.PathLike[str], tensors: dict[str, NpArray], config: Fields, dtype: Any
) -> None:
    """Write `tensors` (in `dtype`, or their own) and `config` as a diffusers model folder."""
    folder = pathlib.Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    cast = {
        key: np.ascontiguousarray(value if dtype is None else value.astype(np.dtype(dtype)))
        for key, value in tensors.items()
    }
    save_file(cast, str(folder / _WEIGHTS), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def save_diffusers_lora(path: str | os.PathLike[str], model: object) -> None:
    """Write the LoRA adapters of an `MMDiT`, `Flux` or `Wan` policy alone, as diffusers' LoRA
    loaders read them.

    Writes `path/pytorch_lora_weights.safetensors` with, for each adapted layer, the keys
    `transformer.<module>.lora_A.weight` (our `a`, `[rank, in]`) and `...lora_B.weight`
    (our `b` times `alpha / rank`, `[out, rank]`: diffusers' loaders read a PEFT state dict
    without alphas at scale 1), `<module>` the layer's name in diffusers' transformer (e.g.
    `transformer_blocks.0.attn.to_q`; an adapted SD3 patch embedding becomes the convolution
    LoRA of `pos_embed.proj`). diffusers loads them onto the pipeline's transformer with

    ```text
    pipe.load_lora_weights("PATH")  # the StableDiffusion3, Flux or Wan pipeline of the base
    ```

    and the pipeline then computes what `lora.merge(model)` computes.

    **Arguments:**

    - `path`: the folder, created if missing.
    - `model`: a `LoraModel` (from `lora.add` or `lora.load_adapters`) whose base is an
        `MMDiT`, a `Flux` or a `Wan`.

    **Raises:**

    - `ValueError`: when `model` is not a `LoraModel` of a model that diffusers can hold,
        or one of its adapted layers has no diffusers counterpart.
    """
    if not isinstance(model, LoraModel):
        raise ValueError(f"`model` must be a LoraModel, got {type(model).__name__}.")
    fmt = _exportable_format(model.base)
    base, layers = _unstacked_adapters(model)
    names = {}
    linears = _linear_paths(base)
    for module in fmt.modules(base):
        names[linears[id(module.where(base))]] = module
    scale = model.alpha / model.rank
    tensors: dict[str, NpArray] = {}
    for layer_path, a, b in layers:
        if layer_path not in names:
            raise ValueError(f"`model` adapts {layer_path}, which has no diffusers counterpart.")
        module = names[layer_path]
        b = (b.astype(np.float32) * scale).astype(b.dtype)
        if module.conv is not None:
            a = module.to_theirs(a)
            b = module.lora_b(b)
        tensors[f"transformer.{module.name}.lora_A.weight"] = np.ascontiguousarray(a)
        tensors[f"transformer.{module.name}.lora_B.weight"] = np.ascontiguousarray(b)
    folder = pathlib.Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / _LORA_WEIGHTS), metadata={"format": "pt"})


def _linear_paths(model: Any) -> dict[int, str]:
    """`keystr` of every `eqx.nn.Linear` of `model` (as `LoraModel.layer_paths`), by `id`."""

    def is_linear(node: Any) -> bool:
        return isinstance(node, eqx.nn.Linear)

    nodes = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_linear)[0]
    return {id(node): jax.tree_util.keystr(path) for path, node in nodes if is_linear(node)}


def _linears(model: Any) -> dict[str, eqx.nn.Linear]:
    """Every `eqx.nn.Linear` of `model` by the `keystr` of its path."""

    def is_linear(node: Any) -> bool:
        return isinstance(node, eqx.nn.Linear)

    nodes = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_linear)[0]
    return {jax.tree_util.keystr(path): node for path, node in nodes if is_linear(node)}


def _unstacked_adapters(
    model: LoraModel[Any],
) -> tuple[Any, list[tuple[str, NpArray, NpArray]]]:
    """The base with one module per block (on the host) and each block's `(path, a, b)`.

    An adapter of a stacked run's layer (`.blocks[g]...`, `a` `[n, rank, in]`) becomes
    one per block of the run (`.blocks[start + j]...`, `a[j]`).
    """
    base = model.base
    layers: list[tuple[str, NpArray, NpArray]] = []
    for layer_path, adapter in zip(model.layer_paths, model.adapters, strict=True):
        a, b = np.asarray(adapter.a), np.asarray(adapter.b)
        found = re.fullmatch(r"\.blocks\[(\d+)\](.*)", layer_path)
        if not base.stacked or found is None:
            layers.append((layer_path, a, b))
            continue
        start, stop = base.block_layout.runs[int(found.group(1))]
        layers += [
            (f".blocks[{start + j}]{found.group(2)}", a[j], b[j]) for j in range(stop - start)
        ]
    return _on_host(base), layers


def diffusers_layers(
    model: DiffusersTransformer, targets: Sequence[str]
) -> Callable[[Any], list[eqx.nn.Linear]]:
    """Which linear layers of an `MMDiT`, `Flux` or `Wan` diffusers' module names pick, under
    PEFT's `target_modules` rule: a module is adapted when its name equals a target or ends
    with `"." + target` (`"attn.to_q"` picks every block's `attn.to_q`). The result is a
    `where` for `lora.add`, so adapters go where a PEFT config of the same targets puts them
    and `save_diffusers_lora` writes them under the same names.

    **Arguments:**

    - `model`: the transformer (stacked or not; a stacked run's layer is picked when its
        blocks' layers are).
    - `targets`: diffusers module names or suffixes, e.g. flow_grpo's `("attn.to_q",
        "attn.to_k", ...)`.

    **Returns:**

    `where(model) -> [eqx.nn.Linear, ...]`.

    **Raises:**

    - `ValueError`: naming `model` when it is not one of those, or `targets` when it is empty
        or a target picks no layer (the message lists some of the model's module names).
    """
    fmt = _format_of(model)
    if isinstance(targets, str) or not targets:
        raise ValueError(f"`targets` must be a non-empty list of module names, got {targets!r}.")
    unstacked = (
        eqx.filter_eval_shape(lambda m: m.with_settings(stacked=False), model)
        if model.stacked
        else model
    )
    paths = _linear_paths(unstacked)
    by_name = {module.name: paths[id(module.where(unstacked))] for module in fmt.modules(unstacked)}
    chosen: set[str] = set()
    for target in targets:
        picked = [
            path for name, path in by_name.items() if name == target or name.endswith("." + target)
        ]
        if not picked:
            examples = ", ".join(sorted(by_name)[:6])
            raise ValueError(
                f"`targets` names {target!r}, which picks no layer of this "
                f"{type(model).__name__} (module names such as {examples})."
            )
        chosen.update(picked)
    held = sorted({_held_path(model, path) for path in chosen})

    def where(current: Any) -> list[eqx.nn.Linear]:
        layers = _linears(current)
        return [layers[path] for path in held]

    return where


def _held_path(model: DiffusersTransformer, path: str) -> str:
    """The path of the layer that holds an unstacked layer `.blocks[i]...` in `model`'s
    layout (`.blocks[g]...` of the run that holds block `i`)."""
    found = re.fullmatch(r"\.blocks\[(\d+)\](.*)", path)
    if not model.stacked or found is None:
        return path
    block = int(found.group(1))
    layout: Any = model.block_layout  # a stacked model's StackedLayout
    for held, (start, stop) in enumerate(layout.runs):
        if start <= block < stop:
            return f".blocks[{held}]{found.group(2)}"
    raise AssertionError(f"block {block} is in no run")
