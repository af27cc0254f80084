"""A fine-tuning run's folder: what marks it as holding a run (`RUN_FILES`), and the check of
a new, resumed or replaced run against it (`claim_folder`)."""

import json
import pathlib
from collections.abc import Callable
from typing import Any

import jax

from .. import (
    sync_processes,
)
from ..train import (
    Checkpointer,
    RunFolderError,
    move_run_aside,
)
from ._config import FinetuneConfig


RUN_FILES: tuple[str, ...] = ("checkpoints", "metrics.jsonl", "summary.json", "config.toml")
"""What marks a folder as holding a run."""


def holds_a_run(out: pathlib.Path) -> bool:
    """Whether `out` holds a run (one of `RUN_FILES`).

    **Arguments:**

    - `out`: the run folder.

    **Returns:**

    `True` when one of `RUN_FILES` is there.
    """
    return any((out / name).exists() for name in RUN_FILES)


def claim_folder(
    out: pathlib.Path,
    config: FinetuneConfig,
    resume: bool,
    replace: bool,
    config_text: str | None,
    log: Callable[[str], None],
) -> dict[str, Any] | None:
    """Check the run folder against the request; returns a finished run's summary when a
    resume has nothing to do."""
    again = config_text or "flowgrpo-eqx finetune CONFIG"
    if replace:
        if jax.process_index() == 0 and holds_a_run(out):
            log(f"Moved the run that was in {out} to {move_run_aside(out, keep=('embeddings',))}.")
    elif not resume:
        if holds_a_run(out):
            raise RunFolderError(
                f"{out} holds another run. Continue it with `{again} --out {out} --resume`, or "
                f"start afresh with `{again} --out {out} --replace` (the old run is moved aside), "
                "or train into another folder."
            )
    else:
        found = Checkpointer(out / "checkpoints").latest_metadata()
        if found is None:
            if holds_a_run(out):
                raise RunFolderError(
                    f"{out} holds a run with no checkpoint to resume from (it stopped, or its "
                    "first checkpoint could not be written, before any checkpoint was "
                    f"complete): nothing was saved to continue. Start it over in the same folder "
                    f"with `{again} --out {out} --replace`."
                )
        else:
            metadata, path = found
            recorded = metadata.get("settings", {})
            now = config.identity()
            changed = differences(recorded, now)
            if changed:
                raise RunFolderError(
                    f"--resume would change what the run in {out} computes ({len(changed)} "
                    f"setting(s) differ from its checkpoint {path.name}): {'; '.join(changed)}. "
                    "Resume with the run's own settings (its config.toml), or train into another "
                    "folder."
                )
            done = int(metadata.get("epoch", 0))
            if config.training.epochs < done:
                raise RunFolderError(
                    f"Setting `training.epochs`={config.training.epochs} is below the {done} "
                    f"epochs the run in {out} has done: resume with at least as many."
                )
            summary = out / "summary.json"
            if done == config.training.epochs and summary.exists():
                loaded: dict[str, Any] = json.loads(summary.read_text())
                return loaded
    sync_processes("run folder checked")
    out.mkdir(parents=True, exist_ok=True)
    return None


def differences(recorded: Any, now: Any, prefix: str = "") -> list[str]:
    """Every dotted key whose value differs between two identity tables."""
    if isinstance(recorded, dict) and isinstance(now, dict):
        found = []
        for key in sorted(set(recorded) | set(now)):
            found += differences(recorded.get(key), now.get(key), f"{prefix}{key}.")
        return found
    if recorded != now:
        return [f"`{prefix[:-1]}`: {recorded!r} in the checkpoint, {now!r} now"]
    return []
