"""The main job's entry points: pretrain (or load) a base model on the shapes task, measure
it, fine-tune it with an RL objective, and measure again; once or once per seed; or measure a
saved policy.

The base model derives from the `pretrain_seed` setting, the RL run from `seed` (with the step
counters and the epoch index), and the held-out evaluation's noise from `eval_seed`; a run
resumed from its latest checkpoint ends exactly as an uninterrupted one. The pieces live in
`parts` (`ShapesJob`), the run in `training` (`run_train`), the seeds in `seeds`
(`run_seeds`).
"""

import json
import pathlib
from collections.abc import Callable
from typing import Any

import jax

from .. import lora
from ..train import Checkpointer, CheckpointError, TrainState, load_model, save_model
from .config import JobConfig
from .parts import BUILTIN_REWARDS, SHIPPED_DIR, ShapesJob
from .seeds import run_seeds
from .training import run_train


__all__ = [
    "BUILTIN_REWARDS",
    "SHIPPED_DIR",
    "ShapesJob",
    "run_eval",
    "run_pretrain",
    "run_seeds",
    "run_train",
]


def run_pretrain(
    config: JobConfig,
    out: str | pathlib.Path,
    *,
    quiet: bool = False,
    log: Callable[[str], None] = print,
) -> pathlib.Path:
    """Pretrain the base model and write it as `out/base_<fingerprint>.eqx`."""
    job = ShapesJob(config, out, quiet)
    pathlib.Path(out).mkdir(parents=True, exist_ok=True)
    model = job.pretrain(log)
    path = job.base_paths()[0]
    save_model(path, model)
    measured = job.measure(model)
    log(
        f"Wrote {path}: held-out accuracy {measured['accuracy']:.3f}, "
        f"reward {measured['reward']:.3f}, diversity {measured['diversity']:.3f}"
    )
    return path


def run_eval(
    config: JobConfig,
    checkpoint: str | pathlib.Path,
    out: str | pathlib.Path,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Measure a saved policy on the held-out prompts and write `out/samples_eval.png`.

    **Arguments:**

    - `config`: the settings the policy was trained with (its run's `config.toml`).
    - `checkpoint`: `policy.eqx`, `policy.lora` with its run's base model beside it, a base
        `.eqx`, or a `ckpt_<n>` checkpoint folder.
    - `out`: where the picture goes.
    - `log`: where the measurement goes, as one JSON line.

    **Returns:**

    `{"accuracy", "reward", "diversity"}`, as `summary.json` reports them, and
    `"train_reward"` (the run's own reward on the same samples) where `ShapesJob.measure`
    reports it.

    **Raises:**

    - `ValueError`: naming the policy, the model settings it was read with and how to pass
        the right ones, if it does not hold a model of `config`'s shape (or is damaged); or
        naming both fingerprints, if LoRA adapters belong to another base model.
    """
    job = ShapesJob(config, out, True)
    path = pathlib.Path(checkpoint)
    try:
        policy = _load_policy(job, path)
    except CheckpointError as error:
        model = config.model
        shape = (
            f"width={model.width}, depth={model.depth}, heads={model.heads}, patch={model.patch}"
        )
        if model.lora_rank:
            shape += f", lora_rank={model.lora_rank}, lora_alpha={model.lora_alpha}"
        # The problem's first clause: what follows is equinox's leaf path and the read error.
        problem = error.problem.split(": ")[0]
        raise ValueError(
            f"{path} does not fit the model settings {shape}: {problem}. Pass the settings "
            "it was trained with: `--run RUN_FOLDER` (reads its config.toml), or flags such as "
            "`--preset tiny` or `--width W --depth D --heads H --patch P`."
        ) from error
    measured = job.measure(policy)
    pathlib.Path(out).mkdir(parents=True, exist_ok=True)
    job.preview(
        policy,
        pathlib.Path(out) / "samples_eval.png",
        f"{path.name}: held-out accuracy {measured['accuracy']:.2f}",
    )
    log(json.dumps(measured))
    return measured


def _load_policy(job: ShapesJob, path: pathlib.Path) -> Any:
    """The policy a `policy.eqx`, `policy.lora`, base `.eqx` or checkpoint folder holds."""
    if path.is_dir():
        lora_rank = job.config.model.lora_rank
        start = job.policy(job.saved_base(path.parent.parent)) if lora_rank else job.model
        trainer = job.trainer(job.train_objective(start))
        like: TrainState = trainer.init(jax.random.key(0))
        stored, meta = Checkpointer(path.parent).restore(lora.without_bases(like), path)
        return job.from_checkpoint(stored, like, meta, path).variables.policy
    if path.suffix == ".lora":
        return lora.load_adapters(path, job.saved_base(path.parent))
    return load_model(path, job.model)
