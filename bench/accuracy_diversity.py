"""`python -m bench.accuracy_diversity --out DIR [--rows a,b] [--seeds 0,1,2]`: what each recipe
of the main job ends at, held-out accuracy against the diversity it keeps.

Trains the shapes demo once per row and seed (`flowgrpo-eqx train --seed S --out
DIR/ROW/seed_S --quiet` with the row's flags, everything else the main job's defaults), then
reads each run's `summary.json` and prints a Markdown table: per row, the final held-out strict
accuracy and the diversity kept (the final held-out diversity over the base model's) per seed
and as mean ± std, and how many seeds end inside the goal (accuracy >= 0.95 and diversity >=
0.9 x the base's). Draws `--plot` (default `DIR/accuracy_diversity.png`): one point per run and
a larger one per row's mean, with the goal's corner shaded. A run whose `summary.json` is in
DIR is not run again, so an interrupted comparison continues where it stopped, and runs made
by hand with the same flags and seed can be put in place. Wall times are not compared here
(runs may share the machine); `bench.time_to_accuracy` compares them.
"""

import json
import pathlib
from typing import Any

from ._recipe_runs import over_seeds, plotted_bench, save_figure, train


GOAL_ACCURACY = 0.95
"""The held-out strict accuracy the main job aims at."""

GOAL_DIVERSITY = 0.9
"""The fraction of the base model's diversity the main job aims to keep."""

ROWS: dict[str, tuple[str, list[str]]] = {
    "flow_grpo": ("Flow-GRPO, the main job's defaults", []),
    "half_strict": (
        "the strict reward at half weight",
        ["--reward-weights", "partial=1,strict=0.5"],
    ),
    "small_kl": ("a small KL to the base", ["--beta", "0.005"]),
    "half_strict_small_kl": (
        "the strict reward at half weight and a small KL",
        ["--reward-weights", "partial=1,strict=0.5", "--beta", "0.005"],
    ),
    "kl": ("a KL to the base", ["--beta", "0.02"]),
}


def final(folder: pathlib.Path) -> dict[str, float]:
    """One finished run's end: `accuracy` (held-out strict) and `kept` (final diversity over
    the base model's), read from its `summary.json`."""
    summary = json.loads((folder / "summary.json").read_text())
    return {
        "accuracy": float(summary["final_accuracy"]),
        "kept": float(summary["final_diversity"]) / float(summary["base_diversity"]),
    }


def in_goal(run: dict[str, float]) -> bool:
    """Whether a run ends at `GOAL_ACCURACY` or more with `GOAL_DIVERSITY` or more kept."""
    return run["accuracy"] >= GOAL_ACCURACY and run["kept"] >= GOAL_DIVERSITY


def table(results: dict[str, list[dict[str, float]]]) -> str:
    """The Markdown table: per row, accuracy and diversity kept per seed and over seeds, and
    the seeds that end inside the goal."""
    lines = [
        "| recipe | flags | held-out accuracy, per seed | over seeds | diversity kept (x base), "
        "per seed | over seeds | seeds in the goal |",
        "|---|---|---|---|---|---|---|",
    ]
    for row, runs in results.items():
        name, flags = ROWS[row]
        accuracy = [run["accuracy"] for run in runs]
        kept = [run["kept"] for run in runs]
        lines.append(
            f"| {name} | `{' '.join(flags) or '(none)'}` "
            f"| {', '.join(f'{a:.3f}' for a in accuracy)} "
            f"| {over_seeds(accuracy, len(runs), 3)} (worst {min(accuracy):.3f}) "
            f"| {', '.join(f'{k:.2f}' for k in kept)} "
            f"| {over_seeds(kept, len(runs), 2)} (lowest {min(kept):.2f}) "
            f"| {sum(in_goal(run) for run in runs)} of {len(runs)} |"
        )
    return "\n".join(lines)


def plot(results: dict[str, list[dict[str, float]]], path: pathlib.Path) -> None:
    """Each run's final accuracy against the diversity it keeps, a larger marker per row's
    mean, and the goal's corner shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7.5, 6.0))
    for row, runs in results.items():
        kept = [run["kept"] for run in runs]
        accuracy = [run["accuracy"] for run in runs]
        points = axes.scatter(kept, accuracy, s=22, alpha=0.6)
        colour = points.get_facecolor()[0]
        axes.scatter(
            [sum(kept) / len(kept)],
            [sum(accuracy) / len(accuracy)],
            s=120,
            marker="D",
            color=colour,
            edgecolor="black",
            label=f"{ROWS[row][0]} ({len(runs)} seeds; ◆ the mean)",
        )
    left, right = axes.get_xlim()
    bottom, top = axes.get_ylim()
    right, top = max(right, GOAL_DIVERSITY + 0.02), max(top, GOAL_ACCURACY + 0.01)
    axes.fill_between(
        [GOAL_DIVERSITY, right],
        GOAL_ACCURACY,
        top,
        color="green",
        alpha=0.12,
        label=f"the goal: accuracy >= {GOAL_ACCURACY}, diversity >= {GOAL_DIVERSITY} x",
    )
    axes.set_xlim(left, right)
    axes.set_ylim(bottom, top)
    axes.set_xlabel("diversity kept (final held-out diversity / the base model's)")
    axes.set_ylabel("final held-out strict accuracy")
    axes.set_title("Where the main job's recipes end, per training seed")
    axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, fontsize=7)
    save_figure(figure, axes, path)


def main(argv: list[str] | None = None) -> int:
    def run(row: str, folder: pathlib.Path, seed: int) -> dict[str, Any]:
        train(folder, ROWS[row][1], seed)
        return final(folder)

    return plotted_bench("accuracy_diversity", __doc__, ROWS, run, table, plot, argv)


if __name__ == "__main__":
    raise SystemExit(main())
