"""The transformers in diffusers' format: weights, config and LoRA adapters.

`MMDiT` is diffusers' `SD3Transformer2DModel` (SD3 and SD3.5), `Flux` its
`FluxTransformer2DModel` (FLUX.1-dev and -schnell); a format class per model says which key
fills which leaf. Every parameter maps to one leaf (`_layout`), with a reshape only for SD3's
patch embedding (diffusers' strided convolution, `[width, channels, patch, patch]`, is our
linear map of `patch x patch x channels` patches) and a crop for its position buffer. The
files are read and written with `safetensors` into NumPy arrays; torch is never imported.
"""

import abc
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
import numpy.typing as npt
from safetensors.numpy import save_file

from ..lora import LoraModel
from ._flux import Flux
from ._mirror import (
    config_error,
    fill_from_state_dict,
    read_config_json,
    read_safetensors_folder,
    state_dict_leaves,
)
from ._mmdit import MMDiT, pos_crop
from ._vae import AutoencoderKL, vae_config, vae_kwargs
from ._wan import Wan
from ._wan_vae import AutoencoderKLWan, wan_vae_config, wan_vae_kwargs


DiffusersTransformer: TypeAlias = MMDiT | Flux | Wan
DiffusersModel: TypeAlias = MMDiT | Flux | Wan | AutoencoderKL | AutoencoderKLWan
"""What `load_diffusers` reads: a transformer or an autoencoder."""
"""A model that diffusers' format holds: `MMDiT` (SD3, SD3.5), `Flux` (FLUX.1) or `Wan`
(Wan 2.1)."""

_WEIGHTS = "diffusion_pytorch_model.safetensors"
_LORA_WEIGHTS = "pytorch_lora_weights.safetensors"
_NpArray = npt.NDArray[Any]
_Fields: TypeAlias = dict[str, Any]
"""A diffusers config, or a model's keyword arguments: values by name."""


def _identity(array: _NpArray) -> _NpArray:
    return array


def _weight(get: Callable[[Any], eqx.nn.Linear]) -> Callable[[Any], Any]:
    return lambda m: get(m).weight


def _bias(get: Callable[[Any], eqx.nn.Linear]) -> Callable[[Any], Any]:
    return lambda m: get(m).bias


def _in_block(i: int, get: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda m: get(m.blocks[i])


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One diffusers key: the leaf it fills, its diffusers shape and the conversions."""

    key: str
    where: Callable[[Any], Any]
    shape: tuple[int, ...]
    to_ours: Callable[[_NpArray], _NpArray] = _identity
    to_theirs: Callable[[_NpArray], _NpArray] = _identity


@dataclasses.dataclass(frozen=True)
class _Module:
    """One diffusers `nn.Linear` (or a patch convolution, `conv` its diffusers shape
    `[out, channels, *kernel]`: SD3's 2D, Wan's 3D) and the `eqx.nn.Linear` it is."""

    name: str
    where: Callable[[Any], eqx.nn.Linear]
    conv: tuple[int, ...] | None = None

    def to_ours(self, array: _NpArray) -> _NpArray:
        """A convolution weight (or its LoRA `A`) as our linear map of flattened channels-last
        patches."""
        return np.moveaxis(array, 1, -1).reshape(array.shape[0], -1)

    def to_theirs(self, array: _NpArray) -> _NpArray:
        """Our linear map of flattened patches as the convolution's weight layout."""
        assert self.conv is not None
        channels, kernel = self.conv[1], self.conv[2:]
        return np.moveaxis(array.reshape(array.shape[0], *kernel, channels), -1, 1)

    def lora_b(self, b: _NpArray) -> _NpArray:
        """A LoRA `B` (`[out, rank]`) as diffusers holds it: a 1 x ... x 1 convolution's
        weight for a patch convolution."""
        if self.conv is None:
            return b
        return b.reshape(*b.shape, *(1,) * (len(self.conv) - 2))


def _linear_pairs(prefix: str, i: int, pairs: list[tuple[str, Any]]) -> list[_Module]:
    return [_Module(f"{prefix}.{name}", _in_block(i, get)) for name, get in pairs]


def _norm_entries(prefix: str, i: int, head_dim: int, pairs: list[tuple[str, Any]]) -> list[_Entry]:
    return [
        _Entry(f"{prefix}.{name}.weight", _in_block(i, get), (head_dim,)) for name, get in pairs
    ]


# A double-stream block's two streams, as SD3's and FLUX's blocks name them.
_JOINT_ATTENTION: list[tuple[str, Callable[[Any], Any]]] = [
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
_CONTEXT_OUT: list[tuple[str, Callable[[Any], Any]]] = [
    ("attn.to_add_out", lambda b: b.context.attn.out)
]
_IMAGE_FF: list[tuple[str, Callable[[Any], Any]]] = [
    ("ff.net.0.proj", lambda b: b.image.fc1),
    ("ff.net.2", lambda b: b.image.fc2),
]
_CONTEXT_FF: list[tuple[str, Callable[[Any], Any]]] = [
    ("ff_context.net.0.proj", lambda b: b.context.fc1),
    ("ff_context.net.2", lambda b: b.context.fc2),
]
_JOINT_NORMS: list[tuple[str, Callable[[Any], Any]]] = [
    ("attn.norm_q", lambda b: b.image.attn.norm_q),
    ("attn.norm_k", lambda b: b.image.attn.norm_k),
    ("attn.norm_added_q", lambda b: b.context.attn.norm_q),
    ("attn.norm_added_k", lambda b: b.context.attn.norm_k),
]
_TIME_AND_TEXT: list[_Module] = [
    _Module("time_text_embed.timestep_embedder.linear_1", lambda m: m.time_mlp[0]),
    _Module("time_text_embed.timestep_embedder.linear_2", lambda m: m.time_mlp[1]),
    _Module("time_text_embed.text_embedder.linear_1", lambda m: m.pooled_mlp[0]),
    _Module("time_text_embed.text_embedder.linear_2", lambda m: m.pooled_mlp[1]),
    _Module("context_embedder", lambda m: m.context_embed),
]
_FINAL: list[_Module] = [
    _Module("norm_out.linear", lambda m: m.final_modulation),
    _Module("proj_out", lambda m: m.final_proj),
]


def _latent_channels(config: _Fields) -> int:
    """The latent channels of an SD3 or Wan config (`in_channels`; `ValueError` unless
    `out_channels` is the same)."""
    channels: int = config.get("in_channels", 16)
    out_channels = config.get("out_channels") or channels
    if out_channels != channels:
        raise ValueError(
            f"config `out_channels` ({out_channels}) must equal `in_channels` ({channels}): "
            "the velocity has the latent's shape."
        )
    return channels


class _AbstractFormat(eqx.Module):
    """How one model class is held in diffusers' format: its class name there, its config,
    and the key of every leaf."""

    class_name: eqx.AbstractClassVar[str]
    model_type: eqx.AbstractClassVar[type[DiffusersTransformer]]
    default_context_length: eqx.AbstractClassVar[int]

    @abc.abstractmethod
    def model_kwargs(self, config: _Fields, image_size: Any, context_length: int) -> _Fields:
        """The model's arguments for a diffusers config (`ValueError` if it cannot hold it);
        a key an older config lacks takes diffusers' default."""

    @abc.abstractmethod
    def config(self, model: Any) -> _Fields:
        """The diffusers config of `model`."""

    @abc.abstractmethod
    def modules(self, model: Any) -> list[_Module]:
        """Every linear module of the diffusers model, by its name there, in its order."""

    @abc.abstractmethod
    def other_entries(self, model: Any) -> list[_Entry]:
        """The keys that are not linear modules' (norm weights, buffers)."""

    @abc.abstractmethod
    def computed(self, model: Any) -> list[tuple[Callable[[Any], Any], _NpArray]]:
        """The leaves no checkpoint holds, with their values (fixed buffers)."""

    @abc.abstractmethod
    def check_exportable(self, model: Any) -> None:
        """Raise a `ValueError` naming `model` if diffusers' model cannot hold it."""


@final
class _SD3Format(_AbstractFormat):
    """`MMDiT` as diffusers' `SD3Transformer2DModel`."""

    class_name = "SD3Transformer2DModel"
    model_type = MMDiT
    default_context_length = 333

    def model_kwargs(self, config: _Fields, image_size: Any, context_length: int) -> _Fields:
        heads = config.get("num_attention_heads", 18)
        width = heads * config.get("attention_head_dim", 64)
        caption = config.get("caption_projection_dim", 1152)
        if caption != width:
            raise ValueError(
                f"config `caption_projection_dim` ({caption}) must equal the attention width "
                f"`num_attention_heads * attention_head_dim` ({width}): diffusers builds such a "
                "model, but its blocks cannot take the text tokens it embeds."
            )
        qk_norm = config.get("qk_norm")
        if qk_norm not in (None, "rms_norm"):
            raise ValueError(
                f"config `qk_norm` must be None or 'rms_norm' (the per-head RMS norm `MMDiT` "
                f"computes), got {qk_norm!r}."
            )
        channels = _latent_channels(config)
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
            qk_norm=qk_norm,
            dual_attention_layers=tuple(config.get("dual_attention_layers", ())),
            pos_embed_max_size=config.get("pos_embed_max_size", 96),
            sample_size=sample_size,
        )

    def config(self, model: MMDiT) -> _Fields:
        return {
            "_class_name": self.class_name,
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

    def modules(self, model: MMDiT) -> list[_Module]:
        conv = (model.width, model.channels, model.patch, model.patch)
        modules = [_Module("pos_embed.proj", lambda m: m.patch_embed, conv=conv), *_TIME_AND_TEXT]
        for i, block in enumerate(model.blocks):
            pairs = list(_JOINT_ATTENTION)
            if not block.context.pre_only:
                pairs += _CONTEXT_OUT
            if block.attn2 is not None:
                pairs += [
                    ("attn2.to_q", lambda b: b.attn2.q),
                    ("attn2.to_k", lambda b: b.attn2.k),
                    ("attn2.to_v", lambda b: b.attn2.v),
                    ("attn2.to_out.0", lambda b: b.attn2.out),
                ]
            pairs += _IMAGE_FF
            if not block.context.pre_only:
                pairs += _CONTEXT_FF
            modules += _linear_pairs(f"transformer_blocks.{i}", i, pairs)
        return modules + _FINAL

    def other_entries(self, model: MMDiT) -> list[_Entry]:
        entries = [] if model.pos_embed_max_size is None else [_pos_entry(model)]
        if model.qk_norm is not None:
            head_dim = model.width // model.heads
            for i, block in enumerate(model.blocks):
                names = list(_JOINT_NORMS)
                if block.attn2 is not None:
                    names += [
                        ("attn2.norm_q", lambda b: b.attn2.norm_q),
                        ("attn2.norm_k", lambda b: b.attn2.norm_k),
                    ]
                entries += _norm_entries(f"transformer_blocks.{i}", i, head_dim, names)
        return entries

    def computed(self, model: MMDiT) -> list[tuple[Callable[[Any], Any], _NpArray]]:
        if model.pos_embed_max_size is not None:
            return []
        # No buffer in the checkpoint (diffusers keeps it out): computed as diffusers does.
        return [(lambda m: m.pos_embed.value, model.position_table())]

    def check_exportable(self, model: MMDiT) -> None:
        if model.vocab_size is not None:
            raise ValueError(
                "`model` has token-id conditioning (`vocab_size` set), which diffusers' SD3 "
                "transformer does not have."
            )
        if model.mlp_ratio != 4:
            raise ValueError(
                f"diffusers' SD3 transformer has `mlp_ratio` 4, got {model.mlp_ratio}."
            )


@final
class _FluxFormat(_AbstractFormat):
    """`Flux` as diffusers' `FluxTransformer2DModel` (the pipelines pack the latents 2 x 2, so
    diffusers' `in_channels` is 4 times the latent's channels and `patch_size` is 1)."""

    class_name = "FluxTransformer2DModel"
    model_type = Flux
    default_context_length = 512

    def model_kwargs(self, config: _Fields, image_size: Any, context_length: int) -> _Fields:
        # diffusers' FLUX embeds each packed token whole whatever `patch_size` says; the
        # output projection gives `patch_size**2 * out_channels` values per token, which must be
        # the token's `in_channels` for the result to be a velocity of the packed latent.
        patch = config.get("patch_size", 1)
        in_channels = config.get("in_channels", 64)
        out_channels = config.get("out_channels") or in_channels
        if patch * patch * out_channels != in_channels:
            raise ValueError(
                f"config `out_channels` ({out_channels}) times `patch_size` squared ({patch}**2) "
                f"must equal `in_channels` ({in_channels}): the output projection must give "
                "each packed token's values (the velocity has the latent's shape)."
            )
        if in_channels % 4:
            raise ValueError(
                f"config `in_channels` ({in_channels}) must be 4 latent channels per token "
                "times the latent's channels (2 x 2 packing)."
            )
        heads = config.get("num_attention_heads", 24)
        return dict(
            image_size=128 if image_size is None else image_size,
            channels=in_channels // 4,
            double_depth=config.get("num_layers", 19),
            single_depth=config.get("num_single_layers", 38),
            width=heads * config.get("attention_head_dim", 128),
            heads=heads,
            mlp_ratio=4,
            context_length=context_length,
            context_dim=config.get("joint_attention_dim", 4096),
            pooled_dim=config.get("pooled_projection_dim", 768),
            guidance_embeds=bool(config.get("guidance_embeds", False)),
            axes_dims=tuple(config.get("axes_dims_rope", (16, 56, 56))),
        )

    def config(self, model: Flux) -> _Fields:
        return {
            "_class_name": self.class_name,
            "_diffusers_version": "0.35.0",
            "patch_size": 1,
            "in_channels": 4 * model.channels,
            "out_channels": None,
            "num_layers": model.double_depth,
            "num_single_layers": model.single_depth,
            "attention_head_dim": model.width // model.heads,
            "num_attention_heads": model.heads,
            "joint_attention_dim": model.context_dim,
            "pooled_projection_dim": model.pooled_dim,
            "guidance_embeds": model.guidance_embeds,
            "axes_dims_rope": list(model.axes_dims),
        }

    def modules(self, model: Flux) -> list[_Module]:
        modules = [_Module("x_embedder", lambda m: m.x_embed), *_TIME_AND_TEXT]
        if model.guidance_embeds:
            modules += [
                _Module("time_text_embed.guidance_embedder.linear_1", lambda m: m.guidance_mlp[0]),
                _Module("time_text_embed.guidance_embedder.linear_2", lambda m: m.guidance_mlp[1]),
            ]
        double = _JOINT_ATTENTION + _CONTEXT_OUT + _IMAGE_FF + _CONTEXT_FF
        single: list[tuple[str, Callable[[Any], Any]]] = [
            ("norm.linear", lambda b: b.modulation),
            ("attn.to_q", lambda b: b.attn.q),
            ("attn.to_k", lambda b: b.attn.k),
            ("attn.to_v", lambda b: b.attn.v),
            ("proj_mlp", lambda b: b.proj_mlp),
            ("proj_out", lambda b: b.proj_out),
        ]
        for i in range(model.double_depth + model.single_depth):
            modules += _linear_pairs(
                *self._prefix(model, i), double if i < model.double_depth else single
            )
        return modules + _FINAL

    def _prefix(self, model: Flux, i: int) -> tuple[str, int]:
        if i < model.double_depth:
            return f"transformer_blocks.{i}", i
        return f"single_transformer_blocks.{i - model.double_depth}", i

    def other_entries(self, model: Flux) -> list[_Entry]:
        head_dim = model.width // model.heads
        single: list[tuple[str, Callable[[Any], Any]]] = [
            ("attn.norm_q", lambda b: b.attn.norm_q),
            ("attn.norm_k", lambda b: b.attn.norm_k),
        ]
        entries: list[_Entry] = []
        for i in range(model.double_depth + model.single_depth):
            names = _JOINT_NORMS if i < model.double_depth else single
            entries += _norm_entries(*self._prefix(model, i), head_dim, names)
        return entries

    def computed(self, model: Flux) -> list[tuple[Callable[[Any], Any], _NpArray]]:
        return []

    def check_exportable(self, model: Flux) -> None:
        if model.mlp_ratio != 4:
            raise ValueError(
                f"diffusers' FLUX transformer has `mlp_ratio` 4, got {model.mlp_ratio}."
            )


@final
class _WanFormat(_AbstractFormat):
    """`Wan` as diffusers' `WanTransformer3DModel` (Wan 2.1 text-to-video: no image
    conditioning)."""

    class_name = "WanTransformer3DModel"
    model_type = Wan
    default_context_length = 512

    def model_kwargs(self, config: _Fields, image_size: Any, context_length: int) -> _Fields:
        # `qk_norm` and `rope_max_seq_len` are taken whatever their values: diffusers' Wan
        # attention RMS-normalises queries and keys whatever `qk_norm` says, and the rotary
        # table's length bounds the grid without changing a feature.
        for name in ("image_dim", "added_kv_proj_dim", "pos_embed_seq_len"):
            if config.get(name) is not None:
                raise ValueError(
                    f"config `{name}` must be None: image conditioning (Wan's image-to-video "
                    f"models) is not built, got {config[name]!r}."
                )
        channels = _latent_channels(config)
        heads = config.get("num_attention_heads", 40)
        grid = (21, 60, 104) if image_size is None else tuple(image_size)
        patch = tuple(config.get("patch_size", (1, 2, 2)))
        longest = max(size // p for size, p in zip(grid, patch, strict=False))
        rope_length = config.get("rope_max_seq_len", 1024)
        if longest > rope_length:
            raise ValueError(
                f"config `rope_max_seq_len` ({rope_length}) is shorter than the patch grid's "
                f"longest axis ({longest}): diffusers' rotary table has no row for it."
            )
        return dict(
            latent_size=grid,
            channels=channels,
            patch=patch,
            depth=config.get("num_layers", 40),
            width=heads * config.get("attention_head_dim", 128),
            heads=heads,
            ffn_dim=config.get("ffn_dim", 13824),
            context_length=context_length,
            text_dim=config.get("text_dim", 4096),
            freq_dim=config.get("freq_dim", 256),
            eps=config.get("eps", 1e-6),
            cross_attn_norm=bool(config.get("cross_attn_norm", True)),
        )

    def config(self, model: Wan) -> _Fields:
        return {
            "_class_name": self.class_name,
            "_diffusers_version": "0.35.0",
            "patch_size": list(model.patch),
            "num_attention_heads": model.heads,
            "attention_head_dim": model.width // model.heads,
            "in_channels": model.channels,
            "out_channels": model.channels,
            "text_dim": model.text_dim,
            "freq_dim": model.freq_dim,
            "ffn_dim": model.ffn_dim,
            "num_layers": model.depth,
            "cross_attn_norm": model.cross_attn_norm,
            "qk_norm": "rms_norm_across_heads",
            "eps": model.eps,
            "image_dim": None,
            "added_kv_proj_dim": None,
            "rope_max_seq_len": 1024,
            "pos_embed_seq_len": None,
        }

    def modules(self, model: Wan) -> list[_Module]:
        conv = (model.width, model.channels, *model.patch)
        modules = [
            _Module("patch_embedding", lambda m: m.patch_embed, conv=conv),
            _Module("condition_embedder.time_embedder.linear_1", lambda m: m.time_mlp[0]),
            _Module("condition_embedder.time_embedder.linear_2", lambda m: m.time_mlp[1]),
            _Module("condition_embedder.time_proj", lambda m: m.time_proj),
            _Module("condition_embedder.text_embedder.linear_1", lambda m: m.text_mlp[0]),
            _Module("condition_embedder.text_embedder.linear_2", lambda m: m.text_mlp[1]),
        ]
        pairs: list[tuple[str, Callable[[Any], Any]]] = [
            ("attn1.to_q", lambda b: b.self_attn.q),
            ("attn1.to_k", lambda b: b.self_attn.k),
            ("attn1.to_v", lambda b: b.self_attn.v),
            ("attn1.to_out.0", lambda b: b.self_attn.out),
            ("attn2.to_q", lambda b: b.cross_attn.q),
            ("attn2.to_k", lambda b: b.cross_attn.k),
            ("attn2.to_v", lambda b: b.cross_attn.v),
            ("attn2.to_out.0", lambda b: b.cross_attn.out),
        ]
        pairs += [("ffn.net.0.proj", lambda b: b.fc1), ("ffn.net.2", lambda b: b.fc2)]
        for i in range(model.depth):
            modules += _linear_pairs(f"blocks.{i}", i, pairs)
        return modules + [_Module("proj_out", lambda m: m.final_proj)]

    def other_entries(self, model: Wan) -> list[_Entry]:
        width = model.width

        def table(a: _NpArray) -> _NpArray:
            return a.reshape(a.shape[1:])

        def batched(a: _NpArray) -> _NpArray:
            return a.reshape(1, *a.shape)

        entries = [
            _Entry("scale_shift_table", lambda m: m.final_table, (1, 2, width), table, batched)
        ]
        for i in range(model.depth):
            prefix = f"blocks.{i}"
            entries.append(
                _Entry(
                    f"{prefix}.scale_shift_table",
                    _in_block(i, lambda b: b.table),
                    (1, 6, width),
                    table,
                    batched,
                )
            )
            names: list[tuple[str, Callable[[Any], Any]]] = [
                ("attn1.norm_q.weight", lambda b: b.self_attn.norm_q),
                ("attn1.norm_k.weight", lambda b: b.self_attn.norm_k),
                ("attn2.norm_q.weight", lambda b: b.cross_attn.norm_q),
                ("attn2.norm_k.weight", lambda b: b.cross_attn.norm_k),
            ]
            if model.cross_attn_norm:
                names += [
                    ("norm2.weight", lambda b: b.cross_norm_weight),
                    ("norm2.bias", lambda b: b.cross_norm_bias),
                ]
            entries += [
                _Entry(f"{prefix}.{name}", _in_block(i, get), (width,)) for name, get in names
            ]
        return entries

    def computed(self, model: Wan) -> list[tuple[Callable[[Any], Any], _NpArray]]:
        return []

    def check_exportable(self, model: Wan) -> None:
        return None


_FORMATS: tuple[_AbstractFormat, ...] = (_SD3Format(), _FluxFormat(), _WanFormat())


@final
@dataclasses.dataclass(frozen=True)
class _AutoencoderFormat:
    """An autoencoder in diffusers' format: its class (named as diffusers names it), the
    constructor arguments of a config and the config of a model. Its keys are its leaves'
    state-dict names (`state_dict_leaves`)."""

    model_type: type[AutoencoderKL] | type[AutoencoderKLWan]
    kwargs: Callable[[_Fields], _Fields]
    config: Callable[[Any], _Fields]

    def abstract(self, config: _Fields) -> Any:
        """The model of a diffusers config, shape-evaluated."""
        return eqx.filter_eval_shape(
            lambda key: self.model_type(**self.kwargs(config), key=key), jax.random.key(0)
        )


_AUTOENCODERS = (
    _AutoencoderFormat(AutoencoderKL, vae_kwargs, vae_config),
    _AutoencoderFormat(AutoencoderKLWan, wan_vae_kwargs, wan_vae_config),
)


def _format_of(model: Any) -> _AbstractFormat:
    """The format of `model`'s class (`ValueError` naming `model` if none)."""
    for fmt in _FORMATS:
        if type(model) is fmt.model_type:
            return fmt
    names = ", ".join(fmt.model_type.__name__ for fmt in _FORMATS)
    raise ValueError(f"`model` must be one of {names}, got {type(model).__name__}.")


def _format_named(name: str) -> _AbstractFormat:
    for fmt in _FORMATS:
        if fmt.class_name == name:
            return fmt
    names = ", ".join(fmt.class_name for fmt in _FORMATS)
    raise ValueError(f"`path` holds a {name}, not one of {names}.")


def _layout(model: Any) -> list[_Entry]:
    """Every key of the diffusers model's state dict for `model`'s configuration."""
    fmt = _format_of(model)
    entries: list[_Entry] = []
    for module in fmt.modules(model):
        get = module.where
        out_features, in_features = get(model).weight.shape
        if module.conv is not None:
            entries.append(
                _Entry(
                    f"{module.name}.weight",
                    _weight(get),
                    module.conv,
                    module.to_ours,
                    module.to_theirs,
                )
            )
        else:
            entries.append(
                _Entry(f"{module.name}.weight", _weight(get), (out_features, in_features))
            )
        entries.append(_Entry(f"{module.name}.bias", _bias(get), (out_features,)))
    return entries + fmt.other_entries(model)


def _pos_entry(model: MMDiT) -> _Entry:
    """The position buffer, `[1, side**2, width]`, of which `model.pos_embed` is the centre."""
    side = model.pos_embed_max_size
    assert side is not None
    grid, width = model.image_size // model.patch, model.width
    top, size = pos_crop(side, grid)

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


def _abstract(fmt: _AbstractFormat, kwargs: _Fields) -> Any:
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
            try:
                abstract = vae.abstract(config)
            except (TypeError, ValueError) as error:
                raise config_error(folder / "config.json", ValueError(error)) from None
            tensors = read_safetensors_folder(folder, _WEIGHTS)
            autoencoder: AutoencoderKL | AutoencoderKLWan = fill_from_state_dict(
                abstract, tensors, dtype, vae.model_type.__name__
            )
            return autoencoder
    fmt = _format_named(config.get("_class_name", _SD3Format.class_name))
    length = fmt.default_context_length if context_length is None else context_length
    model = _abstract(fmt, fmt.model_kwargs(config, image_size, length))
    kind = type(model).__name__
    tensors = read_safetensors_folder(folder, _WEIGHTS)
    entries = _layout(model)
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

    if dtype is None:
        dtype = tensors["proj_out.weight"].dtype
    wheres = []
    values = []
    for entry in entries:
        array = tensors[entry.key]
        if tuple(array.shape) != entry.shape:
            raise ValueError(
                f"`path` ({folder}): key {entry.key} has shape {tuple(array.shape)}, "
                f"the config gives {entry.shape}."
            )
        # On the host until the blocks are stacked: the device sees each array once.
        wheres.append(entry.where)
        values.append(np.asarray(entry.to_ours(array)).astype(np.dtype(dtype)))
    for where, value in fmt.computed(model):
        wheres.append(where)
        values.append(value.astype(np.dtype(dtype)))
    filled = eqx.tree_at(lambda m: [where(m) for where in wheres], model, values)
    unfilled = [
        jax.tree_util.keystr(p)
        for p, leaf in jax.tree_util.tree_flatten_with_path(filled)[0]
        if isinstance(leaf, jax.ShapeDtypeStruct)
    ]
    if unfilled:
        raise ValueError(f"`path` ({folder}) left these {kind} leaves unfilled: {unfilled}.")
    if stacked:
        filled = filled.with_settings(stacked=True)
    placed: DiffusersTransformer = jax.tree.map(
        lambda leaf: jax.device_put(leaf) if isinstance(leaf, np.ndarray) else leaf, filled
    )
    return placed


def _leaf_paths(model: Any) -> dict[int, str]:
    """`keystr` of every array leaf of `model`, by the leaf's `id`."""
    leaves = jax.tree_util.tree_flatten_with_path(model)[0]
    return {id(leaf): jax.tree_util.keystr(path) for path, leaf in leaves}


def _exportable_format(model: Any) -> _AbstractFormat:
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
    path: str | os.PathLike[str], tensors: dict[str, _NpArray], config: _Fields, dtype: Any
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
    tensors: dict[str, _NpArray] = {}
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
) -> tuple[Any, list[tuple[str, _NpArray, _NpArray]]]:
    """The base with one module per block (on the host) and each block's `(path, a, b)`.

    An adapter of a stacked run's layer (`.blocks[g]...`, `a` `[n, rank, in]`) becomes
    one per block of the run (`.blocks[start + j]...`, `a[j]`).
    """
    base = model.base
    layers: list[tuple[str, _NpArray, _NpArray]] = []
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
