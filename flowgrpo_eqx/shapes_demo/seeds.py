"""One configuration trained once per seed, and the statistics over the seeds."""

import json
import pathlib
import shutil
from collections.abc import Callable
from typing import Any

import numpy as np

from ..train import MetricsLog
from .config import JobConfig
from .report import plot_seed_curves
from .run_folder import check_out_folder
from .training import run_train


def run_seeds(
    config: JobConfig,
    out: str | pathlib.Path,
    seeds: list[int],
    *,
    quiet: bool = False,
    resume: bool = False,
    replace: bool = False,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run one configuration once per training seed and summarise the runs.

    Each run goes to `out/seed_<s>` with `seed = s` (the base model and the evaluation noise
    are shared). `out/seeds_summary.json` holds, for every numeric summary figure, the mean,
    the standard deviation (population, over the seeds), the worst (lowest) and the best
    (highest) value, and every seed's value; `out/seeds_accuracy.png` plots every seed's
    held-out accuracy curve.

    With `resume`, each seed's run continues (`run_train(resume=True)`): finished ones are
    left as they are, stopped ones go on from their checkpoints, and those not begun start.
    A signal stops the sweep after the seed run in progress has checkpointed.

    **Arguments:**

    - `config`: the settings shared by every run (its `seed` is replaced).
    - `out`: the parent folder.
    - `seeds`: the training seeds, at least one, no repeats.
    - `quiet`: no progress bars.
    - `resume`: continue each seed's run (`run_train(resume=True)`).
    - `replace`: move runs already in the seed folders aside (`run_train(replace=True)`).
    - `log`: where messages go.

    **Returns:**

    The summary (also written to `seeds_summary.json`), or the stop record of the seed run
    a signal stopped (`{"stopped_at_epoch": E, "preempted": True, "seed": s}`).

    **Raises:**

    - `ValueError`: naming `seeds` if it is empty or repeats a seed; a `RunFolderError`
        naming `out`, before any work, if it is a file or lies under one.
    """
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"`seeds` must be distinct training seeds, at least one, got {seeds}.")
    out = pathlib.Path(out)
    check_out_folder(out)
    runs: dict[int, dict[str, Any]] = {}
    curves: dict[int, list[tuple[int, float]]] = {}
    for index, seed in enumerate(seeds):
        folder = out / f"seed_{seed}"
        if index > 0:
            # Every seed fine-tunes the same base model: share the one the first run found or
            # pretrained instead of pretraining it again.
            folder.mkdir(parents=True, exist_ok=True)
            for base_file in (out / f"seed_{seeds[0]}").glob("base_*.eqx"):
                shutil.copy(base_file, folder / base_file.name)
        log(f"Training seed {seed} into {folder}.")
        runs[seed] = run_train(
            config.replace(seed=seed), folder, quiet=quiet, resume=resume, replace=replace, log=log
        )
        if runs[seed].get("preempted"):
            log(f"Stopped the sweep in seed {seed}; continue it with --seeds ... --resume.")
            return {**runs[seed], "seed": seed}
        records = MetricsLog(folder / "metrics.jsonl").read()
        curves[seed] = [
            (r["epoch"], r["heldout_accuracy"]) for r in records if "heldout_accuracy" in r
        ]
    figures = sorted(
        name
        for name, value in runs[seeds[0]].items()
        if isinstance(value, (int, float)) and not isinstance(value, bool)
    )
    summary: dict[str, Any] = {"seeds": seeds, "folders": [f"seed_{seed}" for seed in seeds]}
    for name in figures:
        values = np.asarray([float(runs[seed][name]) for seed in seeds], np.float64)
        summary[name] = {
            "mean": float(values.mean()),
            "std": float(values.std()),
            "worst": float(values.min()),
            "best": float(values.max()),
            "per_seed": {str(seed): float(v) for seed, v in zip(seeds, values, strict=True)},
        }
    (out / "seeds_summary.json").write_text(json.dumps(summary, indent=2))
    plot_seed_curves(curves, out / "seeds_accuracy.png")
    accuracy = summary.get("final_accuracy")
    if accuracy is not None:
        log(
            f"Held-out accuracy over seeds {seeds}: {accuracy['mean']:.3f} ± {accuracy['std']:.3f} "
            f"(worst {accuracy['worst']:.3f}, best {accuracy['best']:.3f})."
        )
    return summary
