"""`python -m bench.time_to_accuracy --out DIR [--rows a,b] [--seeds 0,1,2]`: time to accuracy.

Trains the shapes demo once per row and seed (`flowgrpo-eqx train --eval-every 10 --seed S
--out DIR/ROW/seed_S --quiet` with the row's flags, everything else the main job's defaults),
then reads each run's `metrics.jsonl` and reports, per row, the epochs and the training
seconds until held-out strict accuracy first reaches 0.85 and 0.90 (mean ± std over the seeds
that reach it, and how many do), the final accuracy and the wall time. Training seconds are
the epochs' own phases summed (`seconds_sampling + seconds_reward + seconds_update`, the first
epoch's compilation included): the held-out evaluations, checkpoints and start-up are left
out, so that evaluating every 10 epochs does not count against a row.

Prints the Markdown table of `docs/recipes.md`, the table of where an epoch's time goes
(`docs/performance.md`), and then one JSON object with every curve, and
draws `--plot` (default `DIR/time_to_accuracy.png`): accuracy against training seconds per row,
the mean over seeds as a line and the lowest to highest seed as a band. A run whose
`summary.json` is in DIR is not run again, so an interrupted comparison continues where it
stopped. Run it with nothing else on the machine: the seconds are the comparison.
"""

import json
import pathlib
import statistics
from typing import Any

import numpy as np

from ._recipe_runs import over_seeds, plotted_bench, save_figure, train


THRESHOLDS = (0.85, 0.90)
EVAL_EVERY = 10

ROWS: dict[str, tuple[str, list[str]]] = {
    "flow_grpo": ("Flow-GRPO, the main job's defaults", []),
    "flow_grpo_former": (
        "Flow-GRPO, the former defaults (independent noise, partial reward, 200 epochs)",
        ["--shared-noise", "false", "--reward", "partial", "--epochs", "200"],
    ),
    "nft": ("DiffusionNFT as released", ["--algorithm", "nft"]),
    "awm": ("AWM as released, adapted", ["--algorithm", "awm"]),
    "dgpo": ("DGPO as released, adapted", ["--algorithm", "dgpo"]),
    "mixgrpo": ("MixGRPO as released, adapted", ["--algorithm", "mixgrpo"]),
    "mixgrpo_flash": ("MixGRPO-Flash as released, adapted", ["--algorithm", "mixgrpo-flash"]),
    "mixgrpo_flash_star": (
        "MixGRPO-Flash* as released, adapted",
        ["--algorithm", "mixgrpo-flash-star"],
    ),
    "dppo": ("Flow-DPPO as released, adapted", ["--algorithm", "dppo"]),
    "dancegrpo": ("DanceGRPO as released, adapted", ["--algorithm", "dancegrpo"]),
}


TRAINING_PHASES = ("seconds_sampling", "seconds_reward", "seconds_update")
"""The phases of an epoch that train; their sum is the epoch's training seconds."""


def curve(folder: pathlib.Path) -> dict[str, Any]:
    """One run's held-out accuracy against epochs and training seconds, and its summary.

    **Arguments:**

    - `folder`: a finished run folder (`metrics.jsonl` and `summary.json`).

    **Returns:**

    `{"epochs": [...], "seconds": [...], "accuracy": [...], "summary": {...}, "phases":
    {...}}`, starting with the base model's measure at epoch 0 and 0 seconds; `phases` is
    `phase_seconds`.
    """
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    epochs, seconds, accuracy = [], [], []
    spent = 0.0
    for record in records:
        spent += sum(record.get(phase, 0.0) for phase in TRAINING_PHASES)
        if "heldout_accuracy" in record:
            epochs.append(int(record["epoch"]))
            seconds.append(spent)
            accuracy.append(float(record["heldout_accuracy"]))
    summary = json.loads((folder / "summary.json").read_text())
    return {
        "epochs": epochs,
        "seconds": seconds,
        "accuracy": accuracy,
        "summary": summary,
        "phases": phase_seconds(records),
    }


def phase_seconds(records: list[dict[str, Any]]) -> dict[str, float]:
    """A run's mean seconds per epoch in each phase.

    **Arguments:**

    - `records`: the records of a finished run's `metrics.jsonl`.

    **Returns:**

    Per phase, the mean over epochs 2 onwards (the first compiles its programs), with
    `seconds_evaluation` the mean over the epochs that measured; `first_epoch`, the first
    epoch's three training phases together; `evaluations`, how many epochs measured.
    """
    epochs = [r for r in records if r.get("epoch", 0) >= 1]
    later = [r for r in epochs if r["epoch"] >= 2]
    measured = [r for r in epochs if "seconds_evaluation" in r]
    result = {phase: statistics.fmean(r[phase] for r in later) for phase in TRAINING_PHASES}
    result["seconds_evaluation"] = statistics.fmean(r["seconds_evaluation"] for r in measured)
    result["first_epoch"] = sum(epochs[0][phase] for phase in TRAINING_PHASES)
    result["evaluations"] = float(len(measured))
    return result


def phase_table(results: dict[str, list[dict[str, Any]]]) -> str:
    """The Markdown table of where an epoch's time goes, per row (mean ± std over seeds)."""
    lines = [
        "| recipe | sampling | reward | update | epoch (the three) | evaluation (each) "
        "| first epoch (compiling) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row, runs in results.items():
        phases = [run["phases"] for run in runs]

        def figure(values: list[float]) -> str:
            return over_seeds(values, len(values), 3) + " s"

        epoch = [sum(p[phase] for phase in TRAINING_PHASES) for p in phases]
        line = f"| {ROWS[row][0]} |"
        for phase in TRAINING_PHASES:
            line += f" {figure([p[phase] for p in phases])} |"
        line += f" {figure(epoch)} | {figure([p['seconds_evaluation'] for p in phases])} |"
        line += f" {figure([p['first_epoch'] for p in phases])} |"
        lines.append(line)
    return "\n".join(lines)


def first_reaching(run: dict[str, Any], threshold: float) -> tuple[int, float] | None:
    """The first evaluation at or above `threshold`: `(epoch, training seconds)`, or `None`."""
    for epoch, seconds, accuracy in zip(
        run["epochs"], run["seconds"], run["accuracy"], strict=True
    ):
        if accuracy >= threshold:
            return epoch, seconds
    return None


def table(results: dict[str, list[dict[str, Any]]]) -> str:
    """The Markdown table: per row, epochs and seconds to each threshold, and the end."""
    head = "| recipe | flags |"
    rule = "|---|---|"
    for threshold in THRESHOLDS:
        head += f" epochs to {threshold:.2f} | seconds to {threshold:.2f} |"
        rule += "---|---|"
    head += " final accuracy | final diversity (x base) | training seconds (all epochs) |"
    head += " wall time |"
    rule += "---|---|---|---|"
    lines = [head, rule]
    for row, runs in results.items():
        name, flags = ROWS[row]
        line = f"| {name} | `{' '.join(flags) or '(none)'}` |"
        for threshold in THRESHOLDS:
            hits = [hit for hit in (first_reaching(run, threshold) for run in runs) if hit]
            line += f" {over_seeds([float(e) for e, _ in hits], len(runs), 0)} |"
            line += f" {over_seeds([s for _, s in hits], len(runs), 0)} s |"
        finals = [run["summary"]["final_accuracy"] for run in runs]
        line += f" {over_seeds(finals, len(runs), 3)} (worst {min(finals):.3f}) |"
        kept = [r["summary"]["final_diversity"] / r["summary"]["base_diversity"] for r in runs]
        line += f" {over_seeds(kept, len(runs), 3)} (lowest {min(kept):.3f}) |"
        line += f" {over_seeds([run['seconds'][-1] for run in runs], len(runs), 0)} s |"
        line += f" {over_seeds([run['summary']['wall_seconds'] for run in runs], len(runs), 0)} s |"
        lines.append(line)
    return "\n".join(lines)


def plot(results: dict[str, list[dict[str, Any]]], path: pathlib.Path) -> None:
    """Accuracy against training seconds per row: the seeds' mean, and a band from the lowest
    to the highest seed, on a common grid of seconds (each seed's curve interpolated)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7.5, 4.5))
    for row, runs in results.items():
        end = min(run["seconds"][-1] for run in runs)
        grid = np.linspace(0.0, end, 200)
        curves = np.stack([np.interp(grid, run["seconds"], run["accuracy"]) for run in runs])
        (line,) = axes.plot(grid, curves.mean(axis=0), label=f"{ROWS[row][0]} ({len(runs)} seeds)")
        axes.fill_between(
            grid, curves.min(axis=0), curves.max(axis=0), alpha=0.2, color=line.get_color()
        )
    for threshold in THRESHOLDS:
        axes.axhline(threshold, color="grey", linewidth=0.8, linestyle=":")
    axes.set_xlabel("training seconds (2-core CPU; evaluation excluded)")
    axes.set_ylabel("held-out strict accuracy")
    axes.set_title("Time to accuracy on the shapes demo")
    axes.legend(loc="lower right", fontsize=8)
    save_figure(figure, axes, path)


def main(argv: list[str] | None = None) -> int:
    def run(row: str, folder: pathlib.Path, seed: int) -> dict[str, Any]:
        train(folder, [*ROWS[row][1], "--eval-every", str(EVAL_EVERY)], seed)
        return curve(folder)

    def report(results: dict[str, list[dict[str, Any]]]) -> str:
        return table(results) + "\n\n" + phase_table(results)

    return plotted_bench("time_to_accuracy", __doc__, ROWS, run, report, plot, argv)


if __name__ == "__main__":
    raise SystemExit(main())
