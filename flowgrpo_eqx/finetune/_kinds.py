"""The model kinds `flowgrpo-eqx finetune` trains, how a pipeline folder names its kind, and
each kind's defaults (the pipeline's own, or flow_grpo's where it fine-tunes the kind)."""

import dataclasses
import json
import pathlib
from typing import Any, Literal, TypeAlias


ModelKind: TypeAlias = Literal["sd3", "flux-dev", "flux-schnell", "wan"]
"""SD3 and SD3.5 (`StableDiffusion3Pipeline`), FLUX.1-dev and FLUX.1-schnell (`FluxPipeline`,
with and without the guidance embedding), Wan 2.1 text-to-video (`WanPipeline`)."""


class PipelineError(ValueError):
    """A pipeline folder that cannot be fine-tuned: the message names the folder, the file
    and what was expected."""


@dataclasses.dataclass(frozen=True)
class KindDefaults:
    """A model kind's defaults for the settings that depend on it."""

    pipeline_class: str
    resolution: int | None
    height: int | None
    width: int | None
    frames: int
    train_steps: int
    eval_steps: int
    guidance_scale: float
    text_length: int
    lora_targets: tuple[str, ...]


_MMDIT_TARGETS = (
    "attn.add_k_proj",
    "attn.add_q_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "attn.to_k",
    "attn.to_out.0",
    "attn.to_q",
    "attn.to_v",
)
"""flow_grpo's `target_modules` (`scripts/train_sd3.py`): every attention projection of the
joint blocks (PEFT's rule: a module whose name ends with one of them)."""

_WAN_TARGETS = tuple(
    f"{attention}.{projection}"
    for attention in ("attn1", "attn2")
    for projection in ("to_q", "to_k", "to_v", "to_out.0")
)
"""Wan's self- and cross-attention projections."""

MODEL_KINDS: dict[ModelKind, KindDefaults] = {
    # flow_grpo's `config/grpo.py` (pickscore_sd3): 10 training steps, 40 evaluation steps,
    # guidance 4.5, 512 x 512; the pipeline's T5 length, 256 (flow_grpo passes 128).
    "sd3": KindDefaults(
        "StableDiffusion3Pipeline", 512, None, None, 1, 10, 40, 4.5, 256, _MMDIT_TARGETS
    ),
    # FluxPipeline's defaults (guidance 3.5, 28 steps, 512 T5 tokens); 16 training steps.
    "flux-dev": KindDefaults("FluxPipeline", 512, None, None, 1, 16, 28, 3.5, 512, _MMDIT_TARGETS),
    # FLUX.1-schnell: 4 steps, no guidance, 256 T5 tokens (the model card's call).
    "flux-schnell": KindDefaults(
        "FluxPipeline", 512, None, None, 1, 4, 4, 0.0, 256, _MMDIT_TARGETS
    ),
    # WanPipeline's defaults for the 1.3B model: 480 x 832, guidance 5.0, 512 tokens; 33
    # frames and 20 training steps.
    "wan": KindDefaults("WanPipeline", None, 480, 832, 33, 20, 50, 5.0, 512, _WAN_TARGETS),
}

PUBLISHED_SIZES: dict[str, ModelKind] = {
    "sd3.5-medium": "sd3",
    "flux.1-dev": "flux-dev",
    "flux.1-schnell": "flux-schnell",
    "wan2.1-t2v-1.3b": "wan",
}
"""The published models `pipeline.random_weights` builds at their sizes (random weights)."""

_SUPPORTED = (
    "SD3/SD3.5 (StableDiffusion3Pipeline), FLUX.1-dev and -schnell (FluxPipeline) and Wan 2.1 "
    "text-to-video (WanPipeline)"
)


def kind_of_published_size(name: str) -> ModelKind:
    """The kind of a `PUBLISHED_SIZES` name.

    **Raises:**

    - `PipelineError`: naming `name` when it is not one.
    """
    if name not in PUBLISHED_SIZES:
        raise PipelineError(
            f"`pipeline.random_weights` must be one of {', '.join(PUBLISHED_SIZES)}, got {name!r}."
        )
    return PUBLISHED_SIZES[name]


def read_json(path: pathlib.Path, what: str) -> dict[str, Any]:
    """A JSON object file, or a `PipelineError` naming it and what is wrong.

    **Arguments:**

    - `path`: the file.
    - `what`: what the file is, for the message.

    **Raises:**

    - `PipelineError`: naming `path` when it is missing, unreadable, not UTF-8, not JSON or
        not an object.
    """
    if not path.is_file():
        raise PipelineError(f"{path} is missing: {what} has no {path.name}.")
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise PipelineError(f"{path} ({what}) is not a readable JSON file: {error}") from None
    if not isinstance(loaded, dict):
        raise PipelineError(
            f"{path} ({what}) must hold a JSON object, got {type(loaded).__name__}."
        )
    return loaded


def pipeline_kind(folder: pathlib.Path) -> ModelKind:
    """The model kind of a diffusers pipeline folder, from its `model_index.json` (and, for
    FLUX.1, whether its transformer embeds the guidance).

    **Arguments:**

    - `folder`: the pipeline folder.

    **Returns:**

    The kind.

    **Raises:**

    - `PipelineError`: naming the folder when it is not a folder or has no `model_index.json`
        (not a pipeline), naming the class for a pipeline of another kind (with those
        supported), naming the file for one that cannot be read.
    """
    if not folder.is_dir():
        raise PipelineError(
            f"`pipeline.path` {folder} is not a folder: give a diffusers pipeline folder "
            "(model_index.json, transformer/, vae/, text_encoder*/, tokenizer*/)."
        )
    if not (folder / "model_index.json").is_file():
        raise PipelineError(
            f"`pipeline.path` {folder} is not a diffusers pipeline folder: it has no "
            "model_index.json (a pipeline's `save_pretrained` writes one beside transformer/, "
            "vae/, text_encoder*/ and tokenizer*/)."
        )
    index = read_json(folder / "model_index.json", "the pipeline")
    name = index.get("_class_name")
    if name == "StableDiffusion3Pipeline":
        return "sd3"
    if name == "WanPipeline":
        return "wan"
    if name == "FluxPipeline":
        config = read_json(folder / "transformer" / "config.json", "the pipeline's transformer")
        return "flux-dev" if config.get("guidance_embeds") else "flux-schnell"
    raise PipelineError(
        f"{folder / 'model_index.json'} names the pipeline {name!r}, which finetune does not "
        f"train: it takes {_SUPPORTED}."
    )
