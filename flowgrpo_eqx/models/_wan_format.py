"""`Wan` in diffusers' format: `WanTransformer3DModel` (Wan 2.1), every key of its state
dict by the leaf it fills, and its config."""

from collections.abc import Callable
from typing import Any, final

from ._format import (
    AbstractFormat,
    Entry,
    Fields,
    ModuleEntries,
    NpArray,
    in_block,
    latent_channels,
    linear_pairs,
)
from ._wan import Wan


@final
class WanFormat(AbstractFormat):
    """`Wan` as diffusers' `WanTransformer3DModel` (Wan 2.1 text-to-video: no image
    conditioning)."""

    class_name = "WanTransformer3DModel"
    model_type = Wan
    default_context_length = 512

    def model_kwargs(self, config: Fields, image_size: Any, context_length: int) -> Fields:
        # `qk_norm` and `rope_max_seq_len` are taken whatever their values: diffusers' Wan
        # attention RMS-normalises queries and keys whatever `qk_norm` says, and the rotary
        # table's length bounds the grid without changing a feature.
        for name in ("image_dim", "added_kv_proj_dim", "pos_embed_seq_len"):
            if config.get(name) is not None:
                raise ValueError(
                    f"config `{name}` must be None: image conditioning (Wan's image-to-video "
                    f"models) is not built, got {config[name]!r}."
                )
        channels = latent_channels(config)
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

    def config(self, model: Wan) -> Fields:
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

    def modules(self, model: Wan) -> list[ModuleEntries]:
        conv = (model.width, model.channels, *model.patch)
        modules = [
            ModuleEntries("patch_embedding", lambda m: m.patch_embed, conv=conv),
            ModuleEntries("condition_embedder.time_embedder.linear_1", lambda m: m.time_mlp[0]),
            ModuleEntries("condition_embedder.time_embedder.linear_2", lambda m: m.time_mlp[1]),
            ModuleEntries("condition_embedder.time_proj", lambda m: m.time_proj),
            ModuleEntries("condition_embedder.text_embedder.linear_1", lambda m: m.text_mlp[0]),
            ModuleEntries("condition_embedder.text_embedder.linear_2", lambda m: m.text_mlp[1]),
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
            modules += linear_pairs(f"blocks.{i}", i, pairs)
        return modules + [ModuleEntries("proj_out", lambda m: m.final_proj)]

    def other_entries(self, model: Wan) -> list[Entry]:
        width = model.width

        def table(a: NpArray) -> NpArray:
            return a.reshape(a.shape[1:])

        def batched(a: NpArray) -> NpArray:
            return a.reshape(1, *a.shape)

        entries = [
            Entry("scale_shift_table", lambda m: m.final_table, (1, 2, width), table, batched)
        ]
        for i in range(model.depth):
            prefix = f"blocks.{i}"
            entries.append(
                Entry(
                    f"{prefix}.scale_shift_table",
                    in_block(i, lambda b: b.table),
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
                Entry(f"{prefix}.{name}", in_block(i, get), (width,)) for name, get in names
            ]
        return entries

    def computed(self, model: Wan) -> list[tuple[Callable[[Any], Any], NpArray]]:
        return []

    def check_exportable(self, model: Wan) -> None:
        return None
