"""Pictures of a run: the reward and held-out accuracy curve (matplotlib, loaded when used)."""

import pathlib
from typing import Any


def plot_curve(records: list[dict[str, Any]], path: pathlib.Path) -> None:
    """Plot the train reward and the held-out strict accuracy per epoch as a PNG.

    **Arguments:**

    - `records`: the run's `metrics.jsonl` records.
    - `path`: where the PNG goes.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["epoch"], r["reward_mean"]) for r in records if "reward_mean" in r]
    held = [(r["epoch"], r["heldout_accuracy"]) for r in records if "heldout_accuracy" in r]
    figure, axis = plt.subplots(figsize=(6, 3.5), dpi=100)
    if train:
        axis.plot(*zip(*train, strict=True), label="train reward (partial score)", marker=".")
    if held:
        axis.plot(*zip(*held, strict=True), label="held-out strict accuracy", marker="o")
    _finish(plt, figure, axis, "Flow-GRPO on the shapes task", path)


def plot_seed_curves(curves: dict[int, list[tuple[int, float]]], path: pathlib.Path) -> None:
    """Plot every training seed's held-out strict accuracy per epoch as a PNG.

    **Arguments:**

    - `curves`: `{seed: [(epoch, accuracy), ...]}`.
    - `path`: where the PNG goes.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 3.5), dpi=100)
    for seed, points in sorted(curves.items()):
        if points:
            axis.plot(*zip(*points, strict=True), marker="o", label=f"seed {seed}")
    axis.set_ylabel("held-out strict accuracy")
    _finish(plt, figure, axis, "Flow-GRPO on the shapes task, one curve per training seed", path)


def _finish(plt: Any, figure: Any, axis: Any, title: str, path: pathlib.Path) -> None:
    """The axes every plot of a run shares (epochs against a score in [0, 1]), its title, and
    the PNG written to `path`."""
    axis.set_xlabel("epoch")
    axis.set_ylim(0, 1.02)
    axis.grid(alpha=0.3)
    axis.legend(loc="lower right")
    axis.set_title(title)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
