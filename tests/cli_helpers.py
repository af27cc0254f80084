"""What the command-line tests share: how to start `flowgrpo-eqx`, and how to compare runs."""

import json
import os
import pathlib
import shutil
import subprocess
import sys


REPO = pathlib.Path(__file__).resolve().parent.parent
TIMEOUT = 600
RESULT_FIELDS = (
    "base_accuracy",
    "final_accuracy",
    "base_reward",
    "final_reward",
    "base_diversity",
    "final_diversity",
    "train_reward_first_epoch",
    "train_reward_last_epoch",
    "epochs",
)
"""The figures of `summary.json` that depend on the run's arithmetic alone (not on where the
base model came from, how long it took, or whether it was resumed)."""


def command(*args):
    """The `flowgrpo-eqx` command line, as this interpreter runs it."""
    return [sys.executable, "-m", "flowgrpo_eqx.shapes_demo.cli", *args]


def environment(**extra):
    """The environment of a CLI subprocess: unbuffered, and able to import `tests`."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO), **extra}


def run_cli(*args, **extra_env):
    """Run `flowgrpo-eqx ARGS` to the end, capturing its output."""
    return subprocess.run(
        command(*args), capture_output=True, text=True, env=environment(**extra_env),
        timeout=TIMEOUT,
    )  # fmt: skip


def with_base(reference, folder):
    """`folder`, created, holding copies of `reference`'s base model files (no pretraining)."""
    folder.mkdir(parents=True, exist_ok=True)
    for base in reference.glob("base_*.eqx"):
        shutil.copy(base, folder / base.name)
    return folder


def result_of(folder):
    """The `RESULT_FIELDS` of a run folder's `summary.json`."""
    summary = json.loads((folder / "summary.json").read_text())
    return {name: summary[name] for name in RESULT_FIELDS}
