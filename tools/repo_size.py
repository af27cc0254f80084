"""`python -m tools.repo_size`: the size of the repository's tracked files, against a budget.

The repository is the product: run records and logs live outside it, and a test that reads a
result reads a small fixture beside it. This sums the bytes of every file `git ls-files`
lists, but the test fixtures under `tests/data/` (model weights and reference outputs the
tests compare with), prints one line, and exits 1 when the sum is over the budget (6 MB,
10^6 bytes each). `.ci/run` runs it.
"""

import argparse
import pathlib
import subprocess
import sys


BUDGET_MB = 6.0
"""The most the tracked files outside the test fixtures may hold, in MB (10^6 bytes)."""

FIXTURES = "tests/data/"
"""The test fixtures, left out of the sum."""


def tracked_files(root: pathlib.Path) -> list[str]:
    """The paths `git ls-files` lists under `root`, relative to it; raises
    `subprocess.CalledProcessError` outside a git checkout."""
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True
    ).stdout
    return [path for path in listed.decode().split("\0") if path]


def tracked_bytes(root: pathlib.Path, paths: list[str]) -> int:
    """The bytes of `paths` under `root` but the fixtures' (a listed file missing from the
    working tree, as one deleted and not yet committed, counts 0)."""
    total = 0
    for path in paths:
        if path.startswith(FIXTURES):
            continue
        file = root / path
        if file.is_file() and not file.is_symlink():
            total += file.stat().st_size
    return total


def report(total: int, budget_mb: float = BUDGET_MB) -> tuple[str, bool]:
    """The line to print and whether `total` bytes fit the budget."""
    megabytes = total / 1e6
    where = FIXTURES.rstrip("/")
    line = f"== tracked files outside {where}: {megabytes:.1f} MB of a {budget_mb:g} MB budget"
    fits = megabytes <= budget_mb
    return (line if fits else f"{line}: OVER BUDGET"), fits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.repo_size", description=__doc__)
    parser.add_argument("--budget", type=float, default=BUDGET_MB, help="MB (6)")
    args = parser.parse_args(argv)
    root = pathlib.Path(__file__).resolve().parent.parent
    line, fits = report(tracked_bytes(root, tracked_files(root)), args.budget)
    print(line)
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
