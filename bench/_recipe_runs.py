"""What the recipe benches share: the command line of rows and seeds, and training one row's
run of the shapes demo in a fresh process (so that runs do not share compiled programs or
memory, as separate jobs would not)."""

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
from collections.abc import Callable, Mapping
from typing import Any


def cli(*arguments: str) -> subprocess.CompletedProcess[str]:
    """`flowgrpo-eqx ARGUMENTS` in a fresh interpreter, its output captured."""
    command = [sys.executable, "-m", "flowgrpo_eqx.shapes_demo.cli", *arguments]
    return subprocess.run(command, capture_output=True, text=True, check=False)


def train(folder: pathlib.Path, flags: list[str], seed: int) -> None:
    """`flowgrpo-eqx train FLAGS --seed SEED --out FOLDER --quiet --replace`, unless `FOLDER`
    already holds its `summary.json` (a run stopped part-way is moved aside and run again).

    **Raises:**

    - `RuntimeError`: with the end of its standard error, if the run fails.
    """
    if (folder / "summary.json").exists():
        return
    result = cli("train", *flags, "--seed", str(seed), "--out", str(folder), "--quiet", "--replace")
    if result.returncode != 0:
        raise RuntimeError(f"training in {folder} failed:\n{result.stderr[-3000:]}")


def parse_rows(
    parser: argparse.ArgumentParser,
    rows: Mapping[str, Any],
    default_seeds: str,
    argv: list[str] | None,
) -> tuple[argparse.Namespace, list[str], list[int]]:
    """Add `--out`, `--rows` and `--seeds` to `parser` and parse `argv`.

    **Returns:**

    The parsed arguments, the row names chosen (checked against `rows`) and the seeds.
    """
    parser.add_argument("--out", required=True, help="one folder per row and seed goes here")
    parser.add_argument("--rows", default=",".join(rows), help=f"any of {', '.join(rows)}")
    parser.add_argument(
        "--seeds", default=default_seeds, help=f"training seeds (default {default_seeds})"
    )
    arguments = parser.parse_args(argv)
    chosen = arguments.rows.split(",")
    unknown = [row for row in chosen if row not in rows]
    if unknown:
        parser.error(f"--rows names unknown rows {unknown}; known: {list(rows)}")
    return arguments, chosen, [int(seed) for seed in arguments.seeds.split(",")]


def run_rows(
    bench: str,
    rows: list[str],
    seeds: list[int],
    out: pathlib.Path,
    run: Callable[[str, pathlib.Path, int], dict[str, Any]],
) -> dict[str, list[dict[str, Any]]]:
    """`run(row, OUT/ROW/seed_S, S)` for every row and seed, in order, saying which on
    standard error; the results by row."""
    results: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        results[row] = []
        for seed in seeds:
            print(f"[{bench}] {row}, seed {seed}", file=sys.stderr, flush=True)
            results[row].append(run(row, out / row / f"seed_{seed}", seed))
    return results


def over_seeds(values: list[float], seeds: int, digits: int) -> str:
    """`values` (one per seed that has one) as `mean ± std`, and `(k of n)` when only `k` of
    the `n` seeds have one; `not reached (0 of n)` when none has."""
    if not values:
        return f"not reached (0 of {seeds})"
    figure = f"{statistics.fmean(values):.{digits}f}"
    if len(values) > 1:
        figure += f" ± {statistics.pstdev(values):.{digits}f}"
    return figure if len(values) == seeds else f"{figure} ({len(values)} of {seeds})"


Results = dict[str, list[dict[str, Any]]]
"""Per row, one result per seed."""


def plotted_bench(
    bench: str,
    description: str | None,
    rows: Mapping[str, Any],
    run: Callable[[str, pathlib.Path, int], dict[str, Any]],
    report: Callable[[Results], str],
    plot: Callable[[Results, pathlib.Path], None],
    argv: list[str] | None,
) -> int:
    """The command line of a bench over rows and seeds 0, 1, 2 that draws one figure: parse
    `--out`, `--rows`, `--seeds` and `--plot` (default `OUT/BENCH.png`), `run` every row and
    seed, print `report` of the results, draw `plot`, then print every result as one JSON
    object.

    **Returns:**

    The exit status, 0.
    """
    parser = argparse.ArgumentParser(prog=f"python -m bench.{bench}", description=description)
    parser.add_argument("--plot", default=None, help=f"the figure (default OUT/{bench}.png)")
    arguments, chosen, seeds = parse_rows(parser, rows, "0,1,2", argv)
    out = pathlib.Path(arguments.out)
    results = run_rows(bench, chosen, seeds, out, run)
    print(report(results))
    plot(results, pathlib.Path(arguments.plot or out / f"{bench}.png"))
    print(json.dumps({"seeds": seeds, "runs": results}))
    return 0


def save_figure(figure: Any, axes: Any, path: pathlib.Path) -> None:
    """Grid `axes`, lay `figure` out tightly and write it to `path` (its folder made), then
    close it."""
    import matplotlib.pyplot as plt

    axes.grid(alpha=0.3)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
