"""Preemption and damaged checkpoints, through the command line as a user meets them.

A scheduler's SIGTERM stops a run after the epoch in progress with a checkpoint, and
`--resume` ends exactly where an uninterrupted run ends; damaged checkpoints are reported by
path and skipped, and a folder with none intact is a named error, never a raw traceback.

Runs that are signalled are `flowgrpo-eqx` processes; the others run in the test process
(`cli.main`). Every run starts from the session's tiny base model. Two processes stopped by
one SIGTERM, after the same epoch, are in tests/test_distributed_fsdp.py.
"""

import shutil
import signal
import subprocess
import time

import pytest

from flowgrpo_eqx.shapes_demo import ShapesJob, make_config
from flowgrpo_eqx.train import MetricsLog, save_model
from flowgrpo_eqx.train._preemption import PREEMPTED_EXIT_STATUS
from tests.cli_helpers import (
    TIMEOUT,
    command,
    environment,
    epochs_done,
    metrics_of,
    result_of,
    run_cli,
    started_past_first_epoch,
    with_base,
)


# Checkpoints every 3 epochs, so a stop at another epoch must write its own.
COMMON = ["--preset", "tiny", "--quiet", "--seed", "4", "--epochs", "7", "--checkpoint-every", "3"]


def run(*args):
    """`flowgrpo-eqx ARGS` in this process."""
    return run_cli(*args)


def assert_same_result(folder, reference):
    assert result_of(folder) == result_of(reference)
    assert (folder / "policy.eqx").read_bytes() == (reference / "policy.eqx").read_bytes()
    assert metrics_of(folder) == metrics_of(reference)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_base):
    out = with_base(tiny_base, tmp_path_factory.mktemp("uninterrupted"))
    # Every epoch's checkpoint kept, for the damaged-checkpoint tests' copies.
    result = run(
        "train", *COMMON, "--out", str(out), "--checkpoint-every", "1", "--keep-checkpoints", "7"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.mark.several_processes("signals a flowgrpo-eqx process of its own")
def test_sigterm_checkpoints_the_epoch_and_resume_matches(uninterrupted, tmp_path):
    out = with_base(uninterrupted, tmp_path / "preempted")
    process = started_past_first_epoch(out, "train", *COMMON, "--out", str(out))
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=TIMEOUT)
    assert process.returncode == PREEMPTED_EXIT_STATUS, output[-3000:]
    assert "received SIGTERM" in output
    stopped = epochs_done(out)
    assert 1 <= stopped < 7
    assert f"Stopped after epoch {stopped} (SIGTERM)" in output
    # The stop wrote its own checkpoint (epoch 1 or 2 is not a multiple of 3, say).
    assert (out / "checkpoints" / f"ckpt_{stopped:08d}").exists()
    assert not (out / "summary.json").exists()
    resumed = run("train", *COMMON, "--out", str(out), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Continuing from checkpoint {out / 'checkpoints' / f'ckpt_{stopped:08d}'}" in (
        resumed.stdout
    )
    assert_same_result(out, uninterrupted)


def _damage(checkpoint, how):
    state = max(
        (p for p in (checkpoint / "state").rglob("*") if p.is_file()),
        key=lambda p: p.stat().st_size,
    )
    meta = checkpoint / "meta.json"
    if how == "truncated":
        state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    elif how == "garbled":
        meta.write_text("{not json")
    elif how == "missing":
        state.unlink()
    else:
        raise AssertionError(how)


def _resumable_copy(reference, folder, newest):
    """A copy of the uninterrupted run as it stood after epoch `newest`'s checkpoint."""
    with_base(reference, folder)
    (folder / "checkpoints").mkdir()
    for checkpoint in sorted((reference / "checkpoints").glob("ckpt_*")):
        if int(checkpoint.name[len("ckpt_") :]) <= newest:
            shutil.copytree(checkpoint, folder / "checkpoints" / checkpoint.name)
    records = [r for r in MetricsLog(reference / "metrics.jsonl").read() if r["epoch"] <= newest]
    log = MetricsLog(folder / "metrics.jsonl")
    for record in records:
        log.write(record)
    return folder


@pytest.fixture(scope="module")
def other_width_checkpoint(tmp_path_factory):
    """A checkpoint of a model of another width: intact, but not this run's structure. Its
    base model is the untrained width-8 model (a structure is all the test needs; no
    pretraining)."""
    out = tmp_path_factory.mktemp("other_width")
    job = ShapesJob(make_config("tiny", width=8), out, quiet=True)
    save_model(job.base_paths()[0], job.model)
    result = run("train", *COMMON, "--width", "8", "--epochs", "1", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    return out / "checkpoints" / "ckpt_00000001"


@pytest.mark.several_processes("signals a flowgrpo-eqx process of its own")
@pytest.mark.parametrize(
    "damages",
    [("truncated", "garbled"), ("missing", "other_width")],
    ids=["truncated-then-garbled", "missing-then-other-width"],
)
def test_damaged_checkpoints_are_named_and_skipped(
    uninterrupted, other_width_checkpoint, tmp_path, damages
):
    out = _resumable_copy(uninterrupted, tmp_path / "damaged", newest=6)
    newest, second = out / "checkpoints" / "ckpt_00000006", out / "checkpoints" / "ckpt_00000005"
    for checkpoint, how in zip((newest, second), damages, strict=True):
        if how == "other_width":
            shutil.rmtree(checkpoint)
            shutil.copytree(other_width_checkpoint, checkpoint)
        else:
            _damage(checkpoint, how)
    result = run("train", *COMMON, "--out", str(out), "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stdout + result.stderr
    assert f"Skipping unusable checkpoint {newest}" in result.stdout
    assert f"Skipping unusable checkpoint {second}" in result.stdout
    continued = out / "checkpoints" / "ckpt_00000004"
    assert f"Continuing from checkpoint {continued} (step 4, epoch 4)" in result.stdout
    assert_same_result(out, uninterrupted)


@pytest.mark.several_processes("signals a flowgrpo-eqx process of its own")
def test_no_intact_checkpoint_is_a_named_error(uninterrupted, tmp_path):
    out = _resumable_copy(uninterrupted, tmp_path / "ruined", newest=2)
    for checkpoint in (out / "checkpoints").glob("ckpt_*"):
        _damage(checkpoint, "truncated")
    result = run("train", *COMMON, "--out", str(out), "--resume")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert f"{out / 'checkpoints'}: none of its 2 checkpoints is usable" in result.stderr
    assert not (out / "summary.json").exists()


def started_and_locked(out, *args):
    """`flowgrpo-eqx ARGS` started, returned once it holds the run folder `out` (its pid is
    in the lock file): past its imports, before its first epoch."""
    from flowgrpo_eqx.shapes_demo.run_folder import LOCK_FILE

    process = subprocess.Popen(
        command(*args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=environment(),
    )  # fmt: skip
    lock = out / LOCK_FILE
    while process.poll() is None:
        if lock.exists() and f"pid {process.pid} " in lock.read_text():
            break
        time.sleep(0.01)
    return process


@pytest.mark.several_processes("signals a flowgrpo-eqx process of its own")
@pytest.mark.parametrize("signals", [1, 2], ids=["once", "twice"])
def test_a_signal_before_the_first_epoch_exits_75_with_a_checkpoint_kept(
    uninterrupted, tmp_path, signals
):
    """SIGTERM before the first epoch, or twice, exited 143 though a checkpoint
    was kept."""
    out = _resumable_copy(uninterrupted, tmp_path / "stopped", newest=2)
    metrics = (out / "metrics.jsonl").read_bytes()
    process = started_and_locked(out, "train", *COMMON, "--out", str(out), "--resume")
    for _ in range(signals):
        process.send_signal(signal.SIGTERM)
        time.sleep(0.05)
    output, _ = process.communicate(timeout=TIMEOUT)
    assert process.returncode == PREEMPTED_EXIT_STATUS, output[-3000:]
    assert "Traceback" not in output
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "ckpt_00000001",
        "ckpt_00000002",
    ]
    assert (out / "metrics.jsonl").read_bytes() == metrics
    if signals == 1:  # two leave what one leaves, checked above; the resume once suffices
        resumed = run("train", *COMMON, "--out", str(out), "--resume")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert_same_result(out, uninterrupted)


@pytest.mark.several_processes("signals a flowgrpo-eqx process of its own")
def test_a_second_signal_of_either_kind_stops_at_once_and_exits_75_once_a_checkpoint_is_kept(
    uninterrupted, tmp_path
):
    out = with_base(uninterrupted, tmp_path / "twice")
    process = started_past_first_epoch(
        out, "train", *COMMON, "--checkpoint-every", "1", "--out", str(out)
    )
    while not (out / "checkpoints" / "ckpt_00000001").exists() and process.poll() is None:
        time.sleep(0.02)
    # Ctrl-C asks for a stop after the epoch; the scheduler's SIGTERM then ends it at once.
    process.send_signal(signal.SIGINT)
    time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=TIMEOUT)
    assert process.returncode == PREEMPTED_EXIT_STATUS, output[-3000:]
    assert "received SIGINT" in output
    assert "Traceback" not in output
    assert not (out / "summary.json").exists()


# `flowgrpo-eqx` as its script runs it, with a SIGTERM sent while the interpreter shuts down
# (an exit handler), as a scheduler's signal lands after a stopped run's last checkpoint.
_SIGNALLED_AT_SHUTDOWN = """
import atexit, os, signal, sys, time
from flowgrpo_eqx.shapes_demo import cli
atexit.register(lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(1)))
sys.argv[0] = "flowgrpo-eqx"
status = cli.run_command() if sys.argv.pop(1) == "script" else cli.main()
raise SystemExit(status)
"""


@pytest.mark.several_processes("signals a flowgrpo-eqx process of its own")
@pytest.mark.parametrize("entry", ["script", "main"])
def test_a_signal_while_the_process_shuts_down_exits_75_once_a_checkpoint_is_kept(
    uninterrupted, tmp_path, entry
):
    """A SIGINT then a SIGTERM 0.1 s later ended a run by the signal (exit -15): the stopped
    run had returned, and its handlers were gone while the interpreter shut down."""
    out = tmp_path / "finished"
    shutil.copytree(uninterrupted, out)
    arguments = ["train", *COMMON, "--out", str(out), "--resume"]
    script = [command()[0], "-c", _SIGNALLED_AT_SHUTDOWN, entry, *arguments]
    ran = subprocess.run(
        script, capture_output=True, text=True, env=environment(), timeout=TIMEOUT, check=False
    )
    assert "nothing to resume, nothing written" in ran.stdout, ran.stderr[-3000:]
    # The script keeps its handlers to the end; `main`, for callers in a process that goes
    # on, gives theirs back (here the default action).
    expected = PREEMPTED_EXIT_STATUS if entry == "script" else -signal.SIGTERM
    assert ran.returncode == expected, ran.stderr[-3000:]


@pytest.mark.several_processes("signals a flowgrpo-eqx process of its own")
@pytest.mark.parametrize("entry", ["script", "main"])
def test_a_signal_while_the_launcher_shuts_down_leaves_its_processes_status(tmp_path, entry):
    """The launcher exits with its processes' status (here 2, a refused setting), whatever
    signal reaches it once they are gone."""
    arguments = ["launch", "--local", "1", "--", "train", "--width", "wide", "--out", tmp_path]
    script = [command()[0], "-c", _SIGNALLED_AT_SHUTDOWN, entry, *map(str, arguments)]
    ran = subprocess.run(
        script, capture_output=True, text=True, env=environment(), timeout=TIMEOUT, check=False
    )
    assert "[launch] rank 0 failed (exit status 2)" in ran.stdout, ran.stdout + ran.stderr
    assert ran.returncode == (2 if entry == "script" else -signal.SIGTERM), ran.stderr[-3000:]
