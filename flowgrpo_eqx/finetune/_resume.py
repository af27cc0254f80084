"""A run's checkpoint read back: its trained policy, to export on demand."""

import pathlib

import jax

from .. import lora
from ..train import Checkpointer
from ._config import read_config
from ._export import export_policy
from ._job import Job
from ._pipeline import load_pipeline
from ._plan import MeshPlan
from ._prompts import EmbeddingStore


def export_checkpoint(
    run: pathlib.Path, checkpoint: str | None, to: pathlib.Path | None
) -> list[pathlib.Path]:
    """Export the policy of one of a run's checkpoints (the EMA's weights when the run keeps
    an EMA) as `lora/` and `transformer/` diffusers folders.

    **Arguments:**

    - `run`: the run folder (its `config.toml` and `checkpoints/`).
    - `checkpoint`: `ckpt_<n>` (or a path to one); `None` for the newest.
    - `to`: where the folders go; `None` for `run/export/<checkpoint>`.

    **Returns:**

    The folders written.

    **Raises:**

    - `ValueError`: naming the run folder when it has no `config.toml` or no checkpoint, or
        the checkpoint when it is not one of the run's; `ConfigError`, `PipelineError`,
        `CheckpointError` as reading the configuration, the pipeline and the checkpoint
        raise them.
    """
    if not (run / "config.toml").is_file():
        raise ValueError(f"{run} is not a finetune run folder: it has no config.toml.")
    config = read_config(run / "config.toml").resolved()
    checkpoints = Checkpointer(run / "checkpoints")
    if checkpoint is None:
        path = checkpoints.latest()
        if path is None:
            raise ValueError(f"{run} has no checkpoint to export.")
    else:
        path = pathlib.Path(checkpoint)
        if not path.is_absolute() and not path.exists():
            path = checkpoints.directory / checkpoint
        if path not in checkpoints.paths():
            names = ", ".join(p.name for p in checkpoints.paths()) or "none"
            raise ValueError(f"{checkpoint} is not a checkpoint of {run} (it has: {names}).")
    pipeline = load_pipeline(config, text=False)
    null = EmbeddingStore(run / "embeddings").stored("null")
    plan = MeshPlan.of(config)
    job = Job.build(config, plan, pipeline, null, [], [], None)
    like = job.trainer.init(jax.random.key(config.seed + 2))
    stored, _ = checkpoints.restore(lora.without_bases(like), path)
    state = lora.with_bases(stored, like)
    target = to if to is not None else run / "export" / path.name
    return export_policy(job.evaluation_policy(state), target, dtype=config.pipeline.dtype)
