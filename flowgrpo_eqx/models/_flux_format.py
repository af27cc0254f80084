"""`Flux` in diffusers' format: `FluxTransformer2DModel` (FLUX.1-dev and -schnell), every key
of its state dict by the leaf it fills, and its config."""

from collections.abc import Callable
from typing import Any, final

from ._flux import Flux
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
    linear_pairs,
    norm_entries,
)


@final
class FluxFormat(AbstractFormat):
    """`Flux` as diffusers' `FluxTransformer2DModel` (the pipelines pack the latents 2 x 2, so
    diffusers' `in_channels` is 4 times the latent's channels and `patch_size` is 1)."""

    class_name = "FluxTransformer2DModel"
    model_type = Flux
    default_context_length = 512

    def model_kwargs(self, config: Fields, image_size: Any, context_length: int) -> Fields:
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

    def config(self, model: Flux) -> Fields:
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

    def modules(self, model: Flux) -> list[ModuleEntries]:
        modules = [ModuleEntries("x_embedder", lambda m: m.x_embed), *TIME_AND_TEXT]
        if model.guidance_embeds:
            modules += [
                ModuleEntries(
                    "time_text_embed.guidance_embedder.linear_1", lambda m: m.guidance_mlp[0]
                ),
                ModuleEntries(
                    "time_text_embed.guidance_embedder.linear_2", lambda m: m.guidance_mlp[1]
                ),
            ]
        double = JOINT_ATTENTION + CONTEXT_OUT + IMAGE_FF + CONTEXT_FF
        single: list[tuple[str, Callable[[Any], Any]]] = [
            ("norm.linear", lambda b: b.modulation),
            ("attn.to_q", lambda b: b.attn.q),
            ("attn.to_k", lambda b: b.attn.k),
            ("attn.to_v", lambda b: b.attn.v),
            ("proj_mlp", lambda b: b.proj_mlp),
            ("proj_out", lambda b: b.proj_out),
        ]
        for i in range(model.double_depth + model.single_depth):
            modules += linear_pairs(
                *self._prefix(model, i), double if i < model.double_depth else single
            )
        return modules + FINAL

    def _prefix(self, model: Flux, i: int) -> tuple[str, int]:
        if i < model.double_depth:
            return f"transformer_blocks.{i}", i
        return f"single_transformer_blocks.{i - model.double_depth}", i

    def other_entries(self, model: Flux) -> list[Entry]:
        head_dim = model.width // model.heads
        single: list[tuple[str, Callable[[Any], Any]]] = [
            ("attn.norm_q", lambda b: b.attn.norm_q),
            ("attn.norm_k", lambda b: b.attn.norm_k),
        ]
        entries: list[Entry] = []
        for i in range(model.double_depth + model.single_depth):
            names = JOINT_NORMS if i < model.double_depth else single
            entries += norm_entries(*self._prefix(model, i), head_dim, names)
        return entries

    def computed(self, model: Flux) -> list[tuple[Callable[[Any], Any], NpArray]]:
        return []

    def check_exportable(self, model: Flux) -> None:
        if model.mlp_ratio != 4:
            raise ValueError(
                f"diffusers' FLUX transformer has `mlp_ratio` 4, got {model.mlp_ratio}."
            )
