"""`MMDiT` in diffusers' format: `SD3Transformer2DModel` (SD3 and SD3.5), every key of its
state dict by the leaf it fills, its config, and the crop of its position buffer."""

from collections.abc import Callable
from typing import Any, final

import numpy as np

from ._format import (
    CONTEXT_FF,
    CONTEXT_OUT,
    FINAL,
    IMAGE_FF,
    JOINT_ATTENTION,
    JOINT_NORMS,
    TIME_AND_TEXT,
    AbstractFormat,
    Entry,
    Fields,
    ModuleEntries,
    NpArray,
    latent_channels,
    linear_pairs,
    norm_entries,
)
from ._mmdit import MMDiT, pos_crop


@final
class SD3Format(AbstractFormat):
    """`MMDiT` as diffusers' `SD3Transformer2DModel`."""

    class_name = "SD3Transformer2DModel"
    model_type = MMDiT
    default_context_length = 333

    def model_kwargs(self, config: Fields, image_size: Any, context_length: int) -> Fields:
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
        channels = latent_channels(config)
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

    def config(self, model: MMDiT) -> Fields:
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

    def modules(self, model: MMDiT) -> list[ModuleEntries]:
        conv = (model.width, model.channels, model.patch, model.patch)
        modules = [
            ModuleEntries("pos_embed.proj", lambda m: m.patch_embed, conv=conv),
            *TIME_AND_TEXT,
        ]
        for i, block in enumerate(model.blocks):
            pairs = list(JOINT_ATTENTION)
            if not block.context.pre_only:
                pairs += CONTEXT_OUT
            if block.attn2 is not None:
                pairs += [
                    ("attn2.to_q", lambda b: b.attn2.q),
                    ("attn2.to_k", lambda b: b.attn2.k),
                    ("attn2.to_v", lambda b: b.attn2.v),
                    ("attn2.to_out.0", lambda b: b.attn2.out),
                ]
            pairs += IMAGE_FF
            if not block.context.pre_only:
                pairs += CONTEXT_FF
            modules += linear_pairs(f"transformer_blocks.{i}", i, pairs)
        return modules + FINAL

    def other_entries(self, model: MMDiT) -> list[Entry]:
        entries = [] if model.pos_embed_max_size is None else [_pos_entry(model)]
        if model.qk_norm is not None:
            head_dim = model.width // model.heads
            for i, block in enumerate(model.blocks):
                names = list(JOINT_NORMS)
                if block.attn2 is not None:
                    names += [
                        ("attn2.norm_q", lambda b: b.attn2.norm_q),
                        ("attn2.norm_k", lambda b: b.attn2.norm_k),
                    ]
                entries += norm_entries(f"transformer_blocks.{i}", i, head_dim, names)
        return entries

    def computed(self, model: MMDiT) -> list[tuple[Callable[[Any], Any], NpArray]]:
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


def _pos_entry(model: MMDiT) -> Entry:
    """The position buffer, `[1, side**2, width]`, of which `model.pos_embed` is the centre."""
    side = model.pos_embed_max_size
    assert side is not None
    grid, width = model.image_size // model.patch, model.width
    top, size = pos_crop(side, grid)

    def to_ours(table: NpArray) -> NpArray:
        square = table.reshape(side, side, width)[top : top + size, top : top + size]
        return np.ascontiguousarray(square.reshape(size * size, width))

    def to_theirs(ours: NpArray) -> NpArray:
        full = model.position_table(full=True).reshape(side, side, width).astype(ours.dtype)
        full[top : top + size, top : top + size] = ours.reshape(size, size, width)
        return full.reshape(1, side * side, width)

    return Entry(
        "pos_embed.pos_embed",
        lambda m: m.pos_embed.value,
        (1, side * side, width),
        to_ours,
        to_theirs,
    )
