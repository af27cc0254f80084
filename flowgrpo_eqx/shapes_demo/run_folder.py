"""A run folder holds one run: its identity, and the rules for starting, resuming or replacing.

A run's identity is the settings that determine its result: every setting but those in
`FREE_ON_RESUME` (logging, evaluation cadence, checkpoint cadence, the epoch count and
where things live or run). Every checkpoint records them, so that `--resume` can compare.

One process writes a run folder at a time: `lock_run_folder` holds an advisory lock on
`LOCK_FILE` for the whole run, and a second writer is refused naming the first's pid and host.
"""

import json
import pathlib
import shlex
from typing import Any

from ..train import (
    LOCK_FILE as LOCK_FILE,
    Checkpointer,
    CheckpointError,
    RunFolderError as RunFolderError,
    check_out_folder as check_out_folder,
    lock_run_folder as lock_run_folder,
    move_run_aside,
    replaced_name as replaced_name,
)
from .algorithms import ALGORITHM_SETTINGS
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

FINISHED_FILES: tuple[str, ...] = ("summary.json", "policy.eqx", "policy.lora")
"""What marks a run as finished: the files its last step writes."""


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
        differs from the newest checkpoint's (both values; but those the algorithm does not
        read), or an `epochs` below the epochs that checkpoint has done, or when no
        checkpoint is left of a run that finished
        (`FINISHED_FILES`) or began checkpointing (its `checkpoints` folder exists: the
        message says whether a first checkpoint's write was cut short, or the folder is
        empty, and gives the command that starts the run afresh in the same folder,
        `restart_command`): starting over would overwrite what it wrote.
    - `CheckpointError`: naming the checkpoint, if its `meta.json` does not record what a
        run resumes from (`check_resumable`).
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
    checkpoints = Checkpointer(out / "checkpoints")
    found = checkpoints.latest_metadata()
    if found is None:
        _check_nothing_lost(out, checkpoints)
        return
    metadata, path = found
    check_resumable(metadata, path)
    recorded = metadata["settings"]
    now = identity(config)
    # A setting the algorithm does not read cannot change what the run computes (a run
    # checkpointed with one at another value resumes at its default).
    unread = ALGORITHM_SETTINGS - config.chosen_algorithm.reads
    changed = [
        f"{name}: {recorded.get(name)!r} in the checkpoint, {now.get(name)!r} now"
        for name in sorted(set(recorded) | set(now))
        if recorded.get(name) != now.get(name) and name not in unread
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
    done = int(metadata["epoch"])
    if config.training.epochs < done:
        raise RunFolderError(
            f"Setting `epochs`={config.training.epochs} is below the {done} epochs the run in "
            f"{out} has done: resume with at least as many."
        )


def _check_nothing_lost(out: pathlib.Path, checkpoints: Checkpointer) -> None:
    """With no readable checkpoint, `--resume` starts over: refuse it where that would
    overwrite a run that checkpointed or finished."""
    if checkpoints.paths():
        return  # every one unreadable: restoring names each problem
    finished = [name for name in FINISHED_FILES if (out / name).exists()]
    if finished:
        raise RunFolderError(
            f"{out} holds a finished run ({', '.join(finished)}) and no checkpoint to resume "
            "from: --resume would start over and overwrite its outputs. Train into another "
            "folder, or pass --replace to move it aside."
        )
    if checkpoints.directory.exists():
        unfinished = checkpoints.unfinished_writes()
        if unfinished:
            happened = (
                "it was stopped while writing its first checkpoint, which never completed "
                f"(the unfinished write {unfinished[-1]} is all its checkpoints folder holds)"
            )
        else:
            happened = (
                f"its checkpoints folder {checkpoints.directory} is empty: the run stopped, "
                "or its first checkpoint's write failed, before any checkpoint was complete "
                "(or its checkpoints were removed)"
            )
        raise RunFolderError(
            f"{out} holds a run with no checkpoint to resume from: {happened}. Nothing of it "
            "can be resumed, and --resume would start over and overwrite its metrics. Start "
            f"it afresh in the same folder with: {restart_command(out)} (the old run's files "
            f"move to {replaced_name(out)}), or train into another folder."
        )


def restart_command(out: pathlib.Path) -> str:
    """The command that starts the run in `out` afresh in the same folder: its own settings
    (its `config.toml`, read before the old run is moved aside) with `--replace`.

    **Arguments:**

    - `out`: the run folder.

    **Returns:**

    The shell command; without a `config.toml` in `out`, the command with the settings left
    for the user to give again.
    """
    config = out / "config.toml"
    settings = ["--config", str(config)] if config.is_file() else []
    command = shlex.join(["flowgrpo-eqx", "train", *settings, "--out", str(out), "--replace"])
    return command if settings else f"{command} with the run's settings as flags"


def check_resumable(metadata: dict[str, Any], path: pathlib.Path) -> None:
    """Check that a checkpoint's metadata records what the main job resumes from.

    **Arguments:**

    - `metadata`: the checkpoint's `meta.json`, as read.
    - `path`: the checkpoint's folder, for the message.

    **Raises:**

    - `CheckpointError`: naming the checkpoint and the entry, for an `epoch` that is not an
        int >= 1 equal to its `step`, `settings` that are not a table, or a `base` measure
        that is not a table of numbers `accuracy`, `reward` and `diversity`.
    """
    epoch, step = metadata.get("epoch"), metadata.get("step")
    if type(epoch) is not int or epoch < 1 or epoch != step:
        raise CheckpointError(
            path,
            f"meta.json records epoch {epoch!r} at step {step!r}; a checkpoint of the main "
            "job records the same int >= 1 for both. Restore the file, or remove this "
            "checkpoint to resume from an older one.",
        )
    if not isinstance(metadata.get("settings"), dict):
        raise CheckpointError(path, "meta.json records no `settings` to resume with.")
    base = metadata.get("base")
    if not isinstance(base, dict) or not all(
        isinstance(base.get(name), int | float) for name in ("accuracy", "reward", "diversity")
    ):
        raise CheckpointError(
            path,
            f"meta.json records no `base` measure (accuracy, reward, diversity), got {base!r}. "
            "Restore the file, or remove this checkpoint to resume from an older one.",
        )


def replace_run(out: pathlib.Path) -> pathlib.Path | None:
    """Move the run in `out` aside (`move_run_aside`), keeping the folder's cached base models
    and its lock file (`LOCK_FILE`, which the caller may hold) in place.

    **Arguments:**

    - `out`: the run folder.

    **Returns:**

    Where the old run went, or `None` when `out` held no run.
    """
    if not holds_a_run(out):
        return None
    return move_run_aside(out, keep=("base_*.eqx",))
