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
import sys
from collections.abc import Callable
from typing import Any

import jax

from .. import lora
from ..train import Checkpointer, CheckpointError, TrainState, load_model, save_model
from .config import JobConfig
from .eval_target import checkpoint_folders
from .parts import BUILTIN_REWARDS, SHIPPED_DIR, ShapesJob
from .run_folder import check_out_folder
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
    """Pretrain the base model and write it as `out/base_<fingerprint>.eqx`.

    **Raises:**

    - `RunFolderError`: naming `out`, before any work, if it is a file or lies under one.
    """
    check_out_folder(pathlib.Path(out))
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
    *,
    newest_of: pathlib.Path | None = None,
) -> dict[str, Any]:
    """Measure a saved policy on the held-out prompts and write `out/samples_eval.png`.

    **Arguments:**

    - `config`: the settings the policy was trained with (its run's `config.toml`).
    - `checkpoint`: `policy.eqx`, `policy.lora` with its run's base model beside it, a base
        `.eqx`, or a `ckpt_<n>` checkpoint folder.
    - `out`: where the picture goes.
    - `log`: where the measurement goes, as one JSON line.
    - `newest_of`: the `checkpoints` folder `checkpoint` was chosen from as its newest
        (`EvalTarget.newest_of`): when a run still training prunes it while it is read,
        the newest checkpoint then is measured instead (and said so).

    **Returns:**

    `{"accuracy", "reward", "diversity"}`, as `summary.json` reports them, and
    `"train_reward"` (the run's own reward on the same samples) where `ShapesJob.measure`
    reports it (a run's reward server that does not answer is said on stderr, and the
    measure goes on without it).

    **Raises:**

    - `ValueError`: naming the policy, the model settings it was read with and how to pass
        the right ones, if it does not hold a model of `config`'s shape (or is damaged); or
        naming both fingerprints, if LoRA adapters belong to another base model; or naming
        the checkpoint(s) removed while they were read (by the run that wrote them, still
        training), and what to do; a `RunFolderError` naming `out`, before any work, if it
        is a file or lies under one.
    """
    check_out_folder(pathlib.Path(out))
    job = ShapesJob(config, out, True)
    path = pathlib.Path(checkpoint)
    try:
        policy, path = _load_kept_policy(job, path, newest_of)
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
    measured = job.measure(policy, server_down=_warn)
    pathlib.Path(out).mkdir(parents=True, exist_ok=True)
    job.preview(
        policy,
        pathlib.Path(out) / "samples_eval.png",
        f"{path.name}: held-out accuracy {measured['accuracy']:.2f}",
    )
    log(json.dumps(measured))
    return measured


def _warn(message: str) -> None:
    print(f"flowgrpo-eqx: {message}", file=sys.stderr, flush=True)


PRUNED_RETRIES = 5
"""How many newer checkpoints `run_eval` tries when a run still training prunes each one it
was reading."""


def _load_kept_policy(
    job: ShapesJob, path: pathlib.Path, newest_of: pathlib.Path | None
) -> tuple[Any, pathlib.Path]:
    """`(policy, path)`: the policy `path` holds (`_load_policy`); when a run still training
    removed that checkpoint while it was read and `newest_of` is its `checkpoints` folder,
    the policy of the newest checkpoint there, and its path.

    A failed read is put down to pruning only where it is certain: the checkpoint is gone,
    or (a removal under way) a newer one has been written since; a run never prunes its
    newest checkpoint, so damage to that one is reported as damage.
    """
    tried: list[str] = []
    while True:
        try:
            return _load_policy(job, path), path
        except (CheckpointError, OSError) as error:
            kept = checkpoint_folders(newest_of) if newest_of is not None else []
            pruned = not path.exists() or (bool(kept) and kept[-1] != path)
            if not pruned:
                raise
            tried.append(path.name)
            if newest_of is None:
                raise ValueError(
                    f"{path} was removed while it was read: the run that wrote it is still "
                    "training and prunes its older checkpoints (it keeps --keep-checkpoints "
                    "of them). Name a newer one, or pass `--run RUN_FOLDER` to measure its "
                    "newest."
                ) from error
            if not kept or len(tried) > PRUNED_RETRIES:
                raise ValueError(
                    f"The run in {newest_of.parent} pruned each checkpoint eval read "
                    f"({', '.join(tried)}) before the read was done: it is still training. "
                    "Try again, or wait for it to finish (eval then reads its policy), or "
                    "train with a larger --keep-checkpoints."
                ) from error
            print(
                f"{path.name} was pruned by the run (still training) while it was read; "
                f"measuring its newest checkpoint, {kept[-1].name}.",
                flush=True,
            )
            path = kept[-1]


def _load_policy(job: ShapesJob, path: pathlib.Path) -> Any:
    """The policy a `policy.eqx`, `policy.lora`, base `.eqx` or checkpoint folder holds."""
    if path.is_dir():
        lora_rank = job.config.model.lora_rank
        start = job.policy(job.saved_base(path.parent.parent)) if lora_rank else job.model
        trainer = job.trainer(job.objective(start))
        like: TrainState = trainer.init(jax.random.key(0))
        stored, meta = Checkpointer(path.parent).restore(lora.without_bases(like), path)
        return job.from_checkpoint(stored, like, meta, path).variables.policy
    if path.suffix == ".lora":
        return lora.load_adapters(path, job.saved_base(path.parent))
    return load_model(path, job.model)
