"""A run folder holds one run: its identity, and the rules for starting, resuming or replacing.

A run's identity is the settings that determine its result: every setting but those in
`FREE_ON_RESUME` (logging, evaluation cadence, checkpoint cadence, the epoch count and
where things live or run). Every checkpoint records them, so that `--resume` can compare.
"""

import json
import pathlib
import shutil
from typing import Any

from ..train import Checkpointer
from .config import JobConfig


FREE_ON_RESUME: frozenset[str] = frozenset(
    {
        "epochs",
        "eval_every",
        "preview_prompts",
        "log",
        "checkpoint_every",
        "keep_checkpoints",
        "reward_url",
        "reward_timeout",
        "reward_retries",
        "param_sharding",
        "fsdp_min_elements",
    }
)
"""The settings a resumed run may change: more epochs (a cosine schedule then stretches to
the new count), logging, evaluation and checkpoint cadence, where the reward server is and
how patiently it is called, and how parameters lie on the devices."""

RUN_FILES: tuple[str, ...] = (
    "checkpoints",
    "metrics.jsonl",
    "distributed.jsonl",
    "summary.json",
    "config.toml",
)
"""What marks a folder as holding a run (the base model cache `base_*.eqx` does not)."""


class RunFolderError(ValueError):
    """The run folder holds another run, or `--resume` would change what the run computes.

    A `ValueError` whose message says what differs and how to go on.
    """


def identity(config: JobConfig) -> dict[str, Any]:
    """The settings that determine a run's result, as JSON values.

    **Arguments:**

    - `config`: the run's settings.

    **Returns:**

    `{setting: value}` for every setting not in `FREE_ON_RESUME` (tuples become lists).
    """
    values = {
        name: value for name, value in config.settings().items() if name not in FREE_ON_RESUME
    }
    loaded: dict[str, Any] = json.loads(json.dumps(values))
    return loaded


def holds_a_run(out: pathlib.Path) -> bool:
    """Whether `out` holds any file of a run (`RUN_FILES`)."""
    return any((out / name).exists() for name in RUN_FILES)


def check_run_folder(out: pathlib.Path, config: JobConfig, *, resume: bool) -> None:
    """Refuse to start over another run, or to resume with settings that differ.

    Reads only files (no arrays, no model): it runs before any work.

    **Arguments:**

    - `out`: the run folder.
    - `config`: the settings of the run about to start or resume.
    - `resume`: whether the run continues the folder's run.

    **Raises:**

    - `RunFolderError`: without `resume`, if `out` holds a run (the message says how to
        continue it or start fresh); with `resume`, naming every identity setting whose value
        differs from the newest checkpoint's (both values), or an `epochs` below the epochs
        that checkpoint has done.
    - `CheckpointVersionError`: if the newest checkpoint was written by another version.
    """
    if not resume:
        if holds_a_run(out):
            raise RunFolderError(
                f"{out} holds another run. Continue it with --resume, or start this one in "
                "another folder, or pass --replace to move the old run aside "
                f"(to {replaced_name(out)})."
            )
        return
    found = Checkpointer(out / "checkpoints").latest_metadata()
    if found is None:
        return
    metadata, path = found
    recorded = metadata.get("settings")
    if not isinstance(recorded, dict):
        raise RunFolderError(f"Checkpoint {path} records no settings to resume with.")
    now = identity(config)
    changed = [
        f"{name}: {recorded.get(name)!r} in the checkpoint, {now.get(name)!r} now"
        for name in sorted(set(recorded) | set(now))
        if recorded.get(name) != now.get(name)
    ]
    if changed:
        raise RunFolderError(
            f"--resume would change what the run in {out} computes ({len(changed)} "
            "setting(s) differ from its checkpoint "
            + f"{path.name}): "
            + "; ".join(changed)
            + ". Resume with the run's own settings (its config.toml), or train into another "
            "folder."
        )
    done = int(metadata.get("epoch", 0))
    if config.training.epochs < done:
        raise RunFolderError(
            f"Setting `epochs`={config.training.epochs} is below the {done} epochs the run in "
            f"{out} has done: resume with at least as many."
        )


def replaced_name(out: pathlib.Path) -> pathlib.Path:
    """Where `replace_run` moves the run in `out`: `<out>.replaced-<k>`, the first free k."""
    index = 1
    while (candidate := out.with_name(f"{out.name}.replaced-{index}")).exists():
        index += 1
    return candidate


def replace_run(out: pathlib.Path) -> pathlib.Path | None:
    """Move the run in `out` aside, keeping the folder's cached base models in place.

    **Arguments:**

    - `out`: the run folder.

    **Returns:**

    Where the old run went, or `None` when `out` held no run.
    """
    if not holds_a_run(out):
        return None
    target = replaced_name(out)
    shutil.move(str(out), str(target))
    out.mkdir(parents=True)
    for base in target.glob("base_*.eqx"):
        shutil.copy2(base, out / base.name)
    return target
