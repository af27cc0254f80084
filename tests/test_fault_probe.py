"""The fault probe's judge (`tools/fault_probe`, docs/faults.md): each verdict follows from what
a user would see, so that a run's counts mean what they say; and one real fault, run as the
probe runs it."""

import collections
import pathlib

import pytest

from tools.fault_probe import _main, _settings
from tools.fault_probe._probe import (
    FINDINGS,
    Fault,
    Finding,
    Outcome,
    Ran,
    attempt,
    judge_refusal,
    snapshot,
)


LIMIT = 10.0


def verdict(ran, **options):
    return judge_refusal(ran, limit=LIMIT, **{"names": ("width",), **options}).verdict


def test_a_refusal_is_named_only_in_one_line_that_names_the_argument():
    assert verdict(Ran(2, "", "flowgrpo-eqx: `width` must be an int >= 1, got -1.\n", False)) == (
        "named"
    )
    usage = "usage: flowgrpo-eqx train [-h]\n   [--width WIDTH]\nflowgrpo-eqx train: error: "
    assert verdict(Ran(2, "", usage + "argument --width: invalid int value\n", False)) == "named"
    assert verdict(Ran(1, "", "`width` is wrong\nand so is this\n", False)) == "unnamed"
    assert verdict(Ran(1, "", "something went wrong\n", False)) == "unnamed"
    assert verdict(Ran(1, "", "", False)) == "unnamed"


@pytest.mark.parametrize(
    ("ran", "found"),
    [
        (
            Ran(1, "", "Traceback (most recent call last):\n  ...\nIndexError: x\n", False),
            "traceback",
        ),
        (Ran(-6, "", "terminate called after throwing std::bad_alloc\n", False), "traceback"),
        (Ran(-9, "", "", True), "hang"),
        (Ran(0, "done\n", "", False), "accepted"),
    ],
    ids=["traceback", "abort", "hang", "accepted"],
)
def test_what_is_not_a_named_refusal_is_a_finding(ran, found):
    assert verdict(ran) == found
    assert found in FINDINGS


def test_a_refusal_that_changes_a_kept_file_or_leaves_a_folder_is_a_finding(tmp_path):
    kept = tmp_path / "run"
    kept.mkdir()
    (kept / "metrics.jsonl").write_text("{}\n")
    before = snapshot(kept)
    refused = Ran(1, "", "flowgrpo-eqx: `width` is wrong\n", False)
    assert verdict(refused, kept=(before, snapshot(kept))) == "named"
    (kept / "metrics.jsonl").write_text("")
    assert verdict(refused, kept=(before, snapshot(kept))) == "lost"
    assert verdict(refused, litter=kept) == "litter"
    assert verdict(refused, litter=tmp_path / "never_made") == "named"


def test_a_probe_that_fails_is_unprobed_and_a_finding_keeps_its_verdict(tmp_path):
    def broken(workdir):
        raise KeyError("the probe's own bug")

    def finds(workdir):
        raise Finding("hang", "no reply")

    assert attempt(Fault("g", "broken", broken), tmp_path).verdict == "unprobed"
    assert attempt(Fault("g", "finds", finds), tmp_path).verdict == "hang"


def test_the_report_counts_each_verdict_and_lists_every_finding():
    outcomes = [
        Outcome("settings", "a", "named", "ok", 1.0),
        Outcome("settings", "b", "litter", "run/ left", 1.0),
        Outcome("server", "c", "held", "ok", 1.0),
    ]
    text = _main.report(outcomes)
    assert text.startswith("3 faults: 1 held, 1 named, 1 litter\n")
    assert "| settings | 2 | 0 | 1 | 0 | 0 | 0 | 1 |" in text
    assert "- settings / b: **litter**: run/ left" in text and "/ a:" not in text


def test_every_fault_has_its_own_name_and_there_are_as_many_as_the_docs_say():
    faults = _main.all_faults()
    names = collections.Counter((f.group, f.name) for f in faults)
    assert [name for name, count in names.items() if count > 1] == []
    docs = (pathlib.Path(__file__).parents[1] / "docs" / "faults.md").read_text()
    assert f"{len(faults)} faults" in docs


@pytest.mark.several_processes("runs the flowgrpo-eqx command as a process")
def test_a_real_fault_is_run_and_named(tmp_path):
    (fault,) = [f for f in _settings.faults() if f.name == "coordinator without a port"]
    outcome = attempt(fault, tmp_path)
    assert outcome.verdict == "named", outcome.detail
    assert "`coordinator` must be HOST:PORT" in outcome.detail


def test_the_tpu_scripts_faults_are_each_held_or_named(tmp_path):
    """`tools/tpu/run.sh` in a sandbox (a copy of the script, a `python3` without a network):
    an unreachable index, folders it did not make, variables that are not seconds."""
    from tools.fault_probe import _tpu_script

    outcomes = [attempt(fault, tmp_path) for fault in _tpu_script.faults()]
    assert len(outcomes) == 8
    for outcome in outcomes:
        assert outcome.verdict in ("held", "named"), (outcome.name, outcome.detail)
