"""`python -m bench.recipes --out DIR [--rows a,b] [--seeds 0,1,2]`: the recipe comparison.

Trains the shapes demo once per row and seed (`flowgrpo-eqx train` with the row's flags on top
of `FORMER_DEFAULT`, the main job's default when the options were compared), measures each
policy again on other noise (`flowgrpo-eqx eval --eval-samples-per-prompt 16 --eval-seed 1`),
and prints the table of `docs/recipes.md` as Markdown, followed by one JSON object with every
run's figures. A run whose `summary.json` (and other-noise `eval.json`) is already in DIR is
not run again, so an interrupted comparison continues where it stopped. Each row takes about
7.5 minutes per seed on a 2-core CPU.
"""

import argparse
import json
import pathlib
from typing import Any

from ._recipe_runs import cli, over_seeds, parse_rows, run_rows, train


# E17 of docs/tuning.md: independent initial noise, the partial reward alone, 200 epochs. Two of
# the options compared on it (shared noise, each reward normalised) are in today's default, so
# the rows name the base they were measured on rather than inherit today's.
FORMER_DEFAULT = ["--shared-noise", "false", "--reward", "partial", "--epochs", "200"]

ROWS: dict[str, tuple[str, list[str]]] = {
    "default": ("Flow-GRPO, the former default (E17)", []),
    "shared_noise": ("shared initial noise per group", ["--shared-noise", "true"]),
    "random_window": ("window at a random position per rollout", ["--window-schedule", "random"]),
    "sliding_window": (
        "MixGRPO's sliding window (one transition later every 20 epochs)",
        ["--window-schedule", "sliding", "--window-shift-every", "20"],
    ),
    "grpo_guard": ("GRPO-Guard as released (`GRPOGuard`)", ["--grpo-guard", "true"]),
    "normalize_each": (
        "partial + strict rewards, each normalised in its group",
        ["--reward-weights", "partial=1,strict=1", "--reward-combination", "normalize_each"],
    ),
    "nft": ("DiffusionNFT as released", ["--algorithm", "nft"]),
    "weighted_sum": (
        "partial + strict rewards, their sum normalised (the control for the row above)",
        ["--reward-weights", "partial=1,strict=1", "--reward-combination", "sum"],
    ),
}


def row_flags(row: str) -> list[str]:
    """The `flowgrpo-eqx train` flags of `row`: `FORMER_DEFAULT`, then the row's own (a flag
    named twice takes its last value)."""
    return [*FORMER_DEFAULT, *ROWS[row][1]]


def _run(folder: pathlib.Path, flags: list[str], seed: int) -> dict[str, Any]:
    """Train (unless done) and evaluate on other noise (unless done); the run's figures."""
    train(folder, flags, seed)
    summary: dict[str, Any] = json.loads((folder / "summary.json").read_text())
    other = folder / "eval.json"
    if not other.exists():
        result = cli(
            "eval", *flags, "--checkpoint", str(folder / "policy.eqx"),
            "--eval-samples-per-prompt", "16", "--eval-seed", "1",
            "--out", str(folder / "eval"),
        )  # fmt: skip
        if result.returncode != 0:
            raise RuntimeError(f"evaluating {folder} failed:\n{result.stderr[-3000:]}")
        other.write_text(result.stdout.strip().splitlines()[-1])
    summary["other_noise_accuracy"] = json.loads(other.read_text())["accuracy"]
    return summary


def _figure(values: list[float], digits: int = 3, worst: bool = False) -> str:
    """One value as it is; several as mean ± (population) std, with the lowest if `worst`."""
    figure = over_seeds(values, len(values), digits)
    return f"{figure} (worst {min(values):.{digits}f})" if worst and len(values) > 1 else figure


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.recipes", description=__doc__)
    arguments, rows, seeds = parse_rows(parser, ROWS, "0", argv)
    results = run_rows(
        "recipes",
        rows,
        seeds,
        pathlib.Path(arguments.out),
        lambda row, folder, seed: _run(folder, row_flags(row), seed),
    )
    print(
        "| recipe | flags | held-out accuracy | other noise | train reward (last epoch) "
        "| diversity | wall time |"
    )
    print("|---|---|---|---|---|---|---|")
    for row, runs in results.items():
        name, flags = ROWS[row]

        def column(key: str, runs: list[dict[str, Any]] = runs) -> list[float]:
            return [float(run[key]) for run in runs]

        print(
            f"| {name} | `{' '.join(flags) or '(none)'}` "
            f"| {_figure(column('final_accuracy'), worst=True)} "
            f"| {_figure(column('other_noise_accuracy'), worst=True)} "
            f"| {_figure(column('train_reward_last_epoch'))} "
            f"| {_figure(column('final_diversity'))} | {_figure(column('wall_seconds'), 0)} s |"
        )
    print(json.dumps({"seeds": seeds, "runs": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
