"""What every model's diffusers format is built from: one key of a state dict (`Entry`), one
linear module of diffusers' model (`Module`), the blocks' names that SD3 and FLUX share, and
the abstract format a model class's format fills in (`AbstractFormat`). Each model's format
sits beside the model (`_mmdit_format.py`, `_flux_format.py`, `_wan_format.py`);
`_diffusers.py` reads and writes them."""

import abc
import dataclasses
from collections.abc import Callable
from typing import Any, TypeAlias

import equinox as eqx
import numpy as np
import numpy.typing as npt


NpArray = npt.NDArray[Any]
Fields: TypeAlias = dict[str, Any]
"""A diffusers config, or a model's keyword arguments: values by name."""


def _identity(array: NpArray) -> NpArray:
    return array


def weight_of(get: Callable[[Any], eqx.nn.Linear]) -> Callable[[Any], Any]:
    return lambda m: get(m).weight


def bias_of(get: Callable[[Any], eqx.nn.Linear]) -> Callable[[Any], Any]:
    return lambda m: get(m).bias


def in_block(i: int, get: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda m: get(m.blocks[i])


@dataclasses.dataclass(frozen=True)
class Entry:
    """One diffusers key: the leaf it fills, its diffusers shape and the conversions."""

    key: str
    where: Callable[[Any], Any]
    shape: tuple[int, ...]
    to_ours: Callable[[NpArray], NpArray] = _identity
    to_theirs: Callable[[NpArray], NpArray] = _identity


@dataclasses.dataclass(frozen=True)
class ModuleEntries:
    """One diffusers `nn.Linear` (or a patch convolution, `conv` its diffusers shape
    `[out, channels, *kernel]`: SD3's 2D, Wan's 3D) and the `eqx.nn.Linear` it is."""

    name: str
    where: Callable[[Any], eqx.nn.Linear]
    conv: tuple[int, ...] | None = None

    def to_ours(self, array: NpArray) -> NpArray:
        """A convolution weight (or its LoRA `A`) as our linear map of flattened channels-last
        patches."""
        return np.moveaxis(array, 1, -1).reshape(array.shape[0], -1)

    def to_theirs(self, array: NpArray) -> NpArray:
        """Our linear map of flattened patches as the convolution's weight layout."""
        assert self.conv is not None
        channels, kernel = self.conv[1], self.conv[2:]
        return np.moveaxis(array.reshape(array.shape[0], *kernel, channels), -1, 1)

    def lora_b(self, b: NpArray) -> NpArray:
        """A LoRA `B` (`[out, rank]`) as diffusers holds it: a 1 x ... x 1 convolution's
        weight for a patch convolution."""
        if self.conv is None:
            return b
        return b.reshape(*b.shape, *(1,) * (len(self.conv) - 2))


def linear_pairs(prefix: str, i: int, pairs: list[tuple[str, Any]]) -> list[ModuleEntries]:
    return [ModuleEntries(f"{prefix}.{name}", in_block(i, get)) for name, get in pairs]


def norm_entries(prefix: str, i: int, head_dim: int, pairs: list[tuple[str, Any]]) -> list[Entry]:
    return [Entry(f"{prefix}.{name}.weight", in_block(i, get), (head_dim,)) for name, get in pairs]


# A double-stream block's two streams, as SD3's and FLUX's blocks name them.
JOINT_ATTENTION: list[tuple[str, Callable[[Any], Any]]] = [
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
CONTEXT_OUT: list[tuple[str, Callable[[Any], Any]]] = [
    ("attn.to_add_out", lambda b: b.context.attn.out)
]
IMAGE_FF: list[tuple[str, Callable[[Any], Any]]] = [
    ("ff.net.0.proj", lambda b: b.image.fc1),
    ("ff.net.2", lambda b: b.image.fc2),
]
CONTEXT_FF: list[tuple[str, Callable[[Any], Any]]] = [
    ("ff_context.net.0.proj", lambda b: b.context.fc1),
    ("ff_context.net.2", lambda b: b.context.fc2),
]
JOINT_NORMS: list[tuple[str, Callable[[Any], Any]]] = [
    ("attn.norm_q", lambda b: b.image.attn.norm_q),
    ("attn.norm_k", lambda b: b.image.attn.norm_k),
    ("attn.norm_added_q", lambda b: b.context.attn.norm_q),
    ("attn.norm_added_k", lambda b: b.context.attn.norm_k),
]
TIME_AND_TEXT: list[ModuleEntries] = [
    ModuleEntries("time_text_embed.timestep_embedder.linear_1", lambda m: m.time_mlp[0]),
    ModuleEntries("time_text_embed.timestep_embedder.linear_2", lambda m: m.time_mlp[1]),
    ModuleEntries("time_text_embed.text_embedder.linear_1", lambda m: m.pooled_mlp[0]),
    ModuleEntries("time_text_embed.text_embedder.linear_2", lambda m: m.pooled_mlp[1]),
    ModuleEntries("context_embedder", lambda m: m.context_embed),
]
FINAL: list[ModuleEntries] = [
    ModuleEntries("norm_out.linear", lambda m: m.final_modulation),
    ModuleEntries("proj_out", lambda m: m.final_proj),
]


def latent_channels(config: Fields) -> int:
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


class AbstractFormat(eqx.Module):
    """How one model class is held in diffusers' format: its class name there, its config,
    and the key of every leaf."""

    class_name: eqx.AbstractClassVar[str]
    model_type: eqx.AbstractClassVar[type[Any]]
    default_context_length: eqx.AbstractClassVar[int]

    @abc.abstractmethod
    def model_kwargs(self, config: Fields, image_size: Any, context_length: int) -> Fields:
        """The model's arguments for a diffusers config (`ValueError` if it cannot hold it);
        a key an older config lacks takes diffusers' default."""

    @abc.abstractmethod
    def config(self, model: Any) -> Fields:
        """The diffusers config of `model`."""

    @abc.abstractmethod
    def modules(self, model: Any) -> list[ModuleEntries]:
        """Every linear module of the diffusers model, by its name there, in its order."""

    @abc.abstractmethod
    def other_entries(self, model: Any) -> list[Entry]:
        """The keys that are not linear modules' (norm weights, buffers)."""

    @abc.abstractmethod
    def computed(self, model: Any) -> list[tuple[Callable[[Any], Any], NpArray]]:
        """The leaves no checkpoint holds, with their values (fixed buffers)."""

    @abc.abstractmethod
    def check_exportable(self, model: Any) -> None:
        """Raise a `ValueError` naming `model` if diffusers' model cannot hold it."""
