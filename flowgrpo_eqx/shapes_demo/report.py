"""Pictures of a run: the reward and held-out accuracy curve (matplotlib, loaded when used)."""

import pathlib
from typing import Any


def plot_curve(records: list[dict[str, Any]], path: pathlib.Path, reward_name: str) -> None:
    """Plot the held-out strict accuracy and, on an axis of its own, the train reward per
    epoch as a PNG.

    **Arguments:**

    - `records`: the run's `metrics.jsonl` records.
    - `path`: where the PNG goes.
    - `reward_name`: what the train reward is, for its axis (e.g. `partial=1,strict=1`).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["epoch"], r["reward_mean"]) for r in records if "reward_mean" in r]
    held = [(r["epoch"], r["heldout_accuracy"]) for r in records if "heldout_accuracy" in r]
    figure, axis = plt.subplots(figsize=(6, 3.5), dpi=100)
    lines = []
    if held:
        lines += axis.plot(
            *zip(*held, strict=True), label="held-out strict accuracy", marker="o", color="C1"
        )
    axis.set_ylabel("held-out strict accuracy")
    if train:
        reward_axis = axis.twinx()
        lines += reward_axis.plot(
            *zip(*train, strict=True), label=f"train reward ({reward_name})", marker=".",
            color="C0", alpha=0.6,
        )  # fmt: skip
        reward_axis.set_ylabel("train reward (mean)")
        # The held-out curve is drawn over the noisier train reward.
        axis.set_zorder(reward_axis.get_zorder() + 1)
        axis.patch.set_visible(False)
    _finish(plt, figure, axis, "Flow-GRPO on the shapes task", path, lines)


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
    _finish(
        plt, figure, axis, "Flow-GRPO on the shapes task, one curve per training seed", path, None
    )


def _finish(
    plt: Any, figure: Any, axis: Any, title: str, path: pathlib.Path, lines: list[Any] | None
) -> None:
    """The axes every plot of a run shares (epochs against a score in [0, 1]), its title, one
    legend for `lines` (default: the axis's own), and the PNG written to `path`."""
    axis.set_xlabel("epoch")
    axis.set_ylim(0, 1.02)
    axis.grid(alpha=0.3)
    if lines is None:
        axis.legend(loc="lower right")
    else:
        axis.legend(lines, [line.get_label() for line in lines], loc="lower right")
    axis.set_title(title)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
