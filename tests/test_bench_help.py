"""Every bench answers `--help` with its usage and description, and measures nothing: a user
reads what a bench does before spending its minutes."""

import importlib
import pathlib

import pytest


BENCH = pathlib.Path(__file__).parent.parent / "bench"
RUNNABLE = sorted(
    path.stem
    for path in BENCH.glob("*.py")
    if 'if __name__ == "__main__":' in path.read_text() and not path.stem.startswith("_")
)


def test_the_runnable_benches_are_found():
    assert {"checkpoints", "mutation_score", "precision", "recipes"} <= set(RUNNABLE)


@pytest.mark.parametrize("name", ["_main", *RUNNABLE])
def test_help_prints_the_usage_and_runs_nothing(name, capsys):
    module = importlib.import_module(f"bench.{name}")
    # A bench that ignored `--help` would measure and return rather than exit.
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python")
    assert len(out.splitlines()) > 3, out
