"""A published pipeline folder (or random weights of a published size) as the parts the
trainer uses: the transformer, the VAE, the prompt encoders with their tokenizers, the time
grid and the guidance (`Pipeline`, `load_pipeline`, `check_pipeline`). How each model kind's
folder is read is in `_pipeline_kinds.py` (`PIPELINE_KINDS`), the text side in
`_text_side.py`."""

import dataclasses
import pathlib
from typing import Any

from .. import AbstractAutoEncoder, AbstractGuidance, RectifiedFlow
from ..models import PromptTokenizer, attention_from_name, remat_from_name
from ..models._mirror import conversion_command
from ._config import FinetuneConfig
from ._kinds import ModelKind, PipelineError, pipeline_kind
from ._pipeline_kinds import (
    PIPELINE_KINDS as PIPELINE_KINDS,
    AbstractPipelineKind as AbstractPipelineKind,
    FluxKind as FluxKind,
    SD3Kind as SD3Kind,
    WanKind as WanKind,
    random_model as random_model,
    wan_prompt_clean as wan_prompt_clean,
)
from ._text_side import ENCODE_BATCH as ENCODE_BATCH, Rows as Rows, TextSide as TextSide


@dataclasses.dataclass
class Pipeline:
    """What the trainer takes from a pipeline: the model, its autoencoder, the process and
    guidance, the latent shape, which fields of the rows condition the model, and the text
    side (closed once the prompts are embedded)."""

    kind: ModelKind
    transformer: Any
    vae: AbstractAutoEncoder
    process: RectifiedFlow
    guidance: AbstractGuidance | None
    latent_shape: tuple[int, ...]
    select: tuple[str, ...] | str
    text: TextSide
    needs_null: bool


def check_pipeline(config: FinetuneConfig) -> None:
    """Refuse, before anything is loaded or written, a pipeline folder that lacks a subfolder
    its kind reads, and a size its VAE or its transformer's patches cannot take.

    **Arguments:**

    - `config`: a resolved configuration.

    **Raises:**

    - `PipelineError`: naming the folder, the subfolder (a tokenizer folder whose files are
        missing or damaged) or the setting.
    """
    reader = PIPELINE_KINDS[config.kind]
    if config.pipeline.path is not None:
        folder = pathlib.Path(config.pipeline.path)
        reader.check_folder(folder)
        for name in reader.subfolders:
            weights = folder / name
            if not name.startswith("tokenizer") and not any(weights.glob("*.safetensors*")):
                converted = conversion_command(weights) if any(weights.glob("*.bin")) else None
                raise PipelineError(
                    f"{weights} holds no safetensors weights"
                    + (
                        f": it holds a PyTorch .bin checkpoint, which this library does not read "
                        f"(it reads safetensors, without torch). Convert it once, in an "
                        f"environment with torch: {converted}"
                        if converted
                        else "."
                    )
                )
            if name.startswith("tokenizer"):
                try:
                    PromptTokenizer(folder / name, 77)
                except ValueError as error:
                    raise PipelineError(f"{folder / name} cannot be read: {error}") from None
    folder_or_none = None if config.pipeline.path is None else pathlib.Path(config.pipeline.path)
    reader.latent_shape(config, folder_or_none)


def load_pipeline(config: FinetuneConfig, *, text: bool = True) -> Pipeline:
    """Read the configured pipeline folder (or make random weights of its published size),
    with the transformer at the configured settings (remat, attention).

    **Arguments:**

    - `config`: a resolved configuration.
    - `text`: whether to load the text encoders and tokenizers (`False`: a closed text side,
        for a run whose prompts are embedded already).

    **Returns:**

    The `Pipeline`.

    **Raises:**

    - `PipelineError`: naming the folder and what is missing or not supported (a folder that
        is not a pipeline, a missing subfolder, another pipeline class, a size the model
        cannot take); `ValueError` from the loaders, naming the file.
    """
    folder = None if config.pipeline.path is None else pathlib.Path(config.pipeline.path)
    kind = config.kind if folder is None else pipeline_kind(folder)
    reader = PIPELINE_KINDS[kind]
    if folder is not None:
        reader.check_folder(folder)
    latent_shape = reader.latent_shape(config, folder)
    transformer = reader.transformer(folder, config)
    transformer = transformer.with_settings(
        remat=remat_from_name(config.precision.remat),
        attention=attention_from_name(config.precision.attention),
    )
    shift = config.sampling.time_shift
    return Pipeline(
        kind=kind,
        transformer=transformer,
        vae=reader.vae(folder, config),
        process=reader.process(folder, config) if shift is None else RectifiedFlow(shift=shift),
        guidance=reader.guidance(config),
        latent_shape=latent_shape,
        select=reader.select,
        text=reader.text(folder, config, transformer) if text else TextSide(None),
        needs_null=reader.needs_null and reader.guidance(config) is not None,
    )
