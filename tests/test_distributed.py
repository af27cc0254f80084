"""Scale out: 4 simulated devices in one process, 2 processes on jax.distributed, failures.

Every run is `flowgrpo-eqx` on the tiny preset with the same seed and global batch; they
share the session's tiny base model (copied into each run folder) so that only the Flow-GRPO
part differs. The one-device baseline runs in the test process (`cli.main`); the others are
processes, since they need another XLA device count (fixed when JAX starts), several
processes, or a kill. The two-process run takes its reward from a real `flowgrpo-eqx
serve-reward` process on 127.0.0.1, as data-parallel jobs with a reward model on its own
machine do.
"""

import json
import os
import pathlib
import signal
import subprocess
import time

import equinox as eqx
import jax
import numpy as np
import pytest

from flowgrpo_eqx.shapes_demo import ShapesJob, make_config
from flowgrpo_eqx.shapes_demo.task import ShapesTask
from flowgrpo_eqx.train import load_model
from tests.cli_helpers import (
    RESULT_FIELDS,
    TIMEOUT,
    RewardServer,
    assert_close_metrics,
    command,
    environment,
    made_once,
    run_cli,
    run_process,
    simulated_devices,
    with_base,
)


# At the main job's learning rate: the tiny preset's, a hundred times larger, makes updates
# that carry float32 round-off differences of the processes' summation order past 1e-5.
COMMON = ["--preset", "tiny", "--quiet", "--seed", "5", "--learning-rate", "1e-4"]


def process_with_arguments(*needles):
    """The pid of the one running process whose command line holds every needle."""
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            arguments = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        text = " ".join(a.decode(errors="replace") for a in arguments).strip()
        if all(needle in text for needle in needles):
            found.append(int(entry.name))
    assert len(found) == 1, found
    return found[0]


def run_baseline(tmp_path_factory, tiny_base):
    """The one-process, one-device run every other run must reproduce (in the test process,
    once per session: tests/test_distributed_fsdp.py compares with it too)."""

    def train(folder):
        with_base(tiny_base, folder)
        result = run_cli("train", *COMMON, "--out", str(folder), "--devices", "1")
        assert result.returncode == 0, result.stderr[-3000:]

    return made_once(tmp_path_factory, "distributed_baseline", train)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, tiny_base):
    return run_baseline(tmp_path_factory, tiny_base)


def placements(folder):
    with open(folder / "distributed.jsonl") as handle:
        return [json.loads(line) for line in handle]


def assert_same_run(folder, baseline, *, unmeasured=()):
    assert_close_metrics(folder, baseline, unmeasured=unmeasured)
    job = ShapesJob(make_config("tiny", seed=5), baseline, quiet=True)
    policy_want = load_model(baseline / "policy.eqx", job.model)
    policy_got = load_model(folder / "policy.eqx", job.model)
    leaves_want = jax.tree.leaves(eqx.filter(policy_want, eqx.is_array))
    leaves_got = jax.tree.leaves(eqx.filter(policy_got, eqx.is_array))
    base = load_model(next(baseline.glob("base_*.eqx")), job.model)
    moved = [
        not np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(eqx.filter(base, eqx.is_array)), leaves_want, strict=True)
    ]
    assert any(moved), "Flow-GRPO changed nothing; the comparison would be vacuous"
    for a, b in zip(leaves_want, leaves_got, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


# Parameters, the held slot and AdamW's moments replicated here; split over the devices with
# FSDP (`--param-sharding fsdp`) in tests/test_distributed_fsdp.py, a file of its own so that
# `pytest -n 2 --dist loadfile` runs it beside these (its processes compile programs no other
# test does).


@pytest.mark.several_processes("runs flowgrpo-eqx processes on simulated devices")
def test_two_processes_match_one_process(baseline, tmp_path):
    # The reward comes from a `serve-reward` process scoring what the baseline scores in
    # process, counting the requests it gets.
    calls = tmp_path / "calls.txt"
    server = RewardServer(
        "tests.cli_rewards:CountedJpegIncompressibility", REWARD_CALLS_FILE=str(calls)
    )
    try:
        out = with_base(baseline, tmp_path / "two")
        result = run_process(
            "launch", "--local", "2", "--", "train", *COMMON, "--out", str(out),
            "--reward-url", server.url,
        )  # fmt: skip
    finally:
        server.stop()
    assert result.returncode == 0, result.stdout[-3000:]
    config = make_config("tiny")
    # One request per collect (epoch), each scoring every row of the global batch, and one
    # per held-out measure (the base's, each due epoch's and the final one), as in process.
    heldout = (
        len(ShapesTask().rows("heldout")["tokens"]) * config.evaluation.eval_samples_per_prompt
    )
    expected = [heldout]
    for epoch in range(1, config.training.epochs + 1):
        expected.append(config.rollout.rollout_rows)
        if epoch % config.evaluation.eval_every == 0 or epoch == config.training.epochs:
            expected.append(heldout)
    expected.append(heldout)
    assert calls.read_text().split() == [str(count) for count in expected]
    for placement in placements(out):
        assert placement["processes"] == 2 and placement["devices"] == 2
        # The reward ran once per collect in total, on process 0.
        assert placement["reward_calls_per_process"] == [1, 0]
        # Each process held half of the rows of each batch.
        assert placement["rows_per_process"] == [placement["rows_total"] // 2] * 2
    # The held-out measure scores its samples through the reward server too (on process 0),
    # to what the baseline measures in process.
    assert_same_run(out, baseline)


@pytest.mark.several_processes("runs flowgrpo-eqx processes on simulated devices")
def test_a_run_killed_on_four_devices_resumes_on_two_to_the_same_result(baseline, tmp_path):
    # A SIGKILL (no handler runs) after epoch 2's checkpoint; the resumed run writes every
    # output an uninterrupted one does. The checkpoint written on four devices is read onto a
    # mesh of two.
    out = with_base(baseline, tmp_path / "killed")
    flags = ["train", *COMMON, "--out", str(out)]
    crashing = subprocess.Popen(
        command(*flags),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=environment(**simulated_devices(4)),
    )
    checkpoint = out / "checkpoints" / "ckpt_00000002"
    while not checkpoint.exists() and crashing.poll() is None:
        time.sleep(0.02)
    crashing.send_signal(signal.SIGKILL)
    _, crash_err = crashing.communicate(timeout=TIMEOUT)
    assert crashing.returncode == -signal.SIGKILL, crash_err[-3000:]
    assert not (out / "summary.json").exists()
    resumed = run_process(*flags, "--resume", **simulated_devices(2))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Continuing from checkpoint" in resumed.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["devices"] == 2 and summary["resumed"]
    for name in (*RESULT_FIELDS, "epochs", "wall_seconds"):
        assert name in summary, name
    for picture in ("reward_curve.png", "samples_before.png", "samples_after.png"):
        assert (out / picture).stat().st_size > 0
    assert {p["devices"] for p in placements(out)} == {4, 2}
    for placement in placements(out):
        assert placement["processes"] == 1 and placement["reward_calls_per_process"] == [1]
        assert placement["param_sharding"] == "replicated"
        assert placement["state_fraction_per_device"] == 1.0
    # Every epoch's metrics and the final policy: the epochs on four devices and those on two
    # computed what one device did.
    assert_same_run(out, baseline)


@pytest.mark.several_processes("runs flowgrpo-eqx processes on simulated devices")
def test_reward_failure_on_process_zero_stops_every_process(baseline, tmp_path):
    out = with_base(baseline, tmp_path / "reward_fault")
    result = run_process(
        "launch",
        "--local",
        "2",
        "--grace-seconds",
        "60",
        "--",
        "train",
        *COMMON,
        "--out",
        str(out),
        "--custom-reward",
        "tests.cli_rewards:FailingReward",
    )
    assert result.returncode == 1
    for rank in (0, 1):
        assert (
            f"[rank {rank}] flowgrpo-eqx: error on process {rank}: (from process 0, reward "
            "'injected_failure')"
        ) in result.stdout
    assert "[launch] stopping rank" not in result.stdout  # both stopped on their own


@pytest.mark.several_processes("runs flowgrpo-eqx processes on simulated devices")
def test_dead_process_stops_the_others_with_a_clear_error(baseline, tmp_path):
    out = with_base(baseline, tmp_path / "death")
    launcher = subprocess.Popen(
        command(
            "launch",
            "--local",
            "2",
            "--grace-seconds",
            "120",
            "--",
            "train",
            *COMMON,
            "--out",
            str(out),
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=environment(),
    )
    # Kill process 1 once training is under way (epoch 1's checkpoint is written).
    while not (out / "checkpoints" / "ckpt_00000001").exists() and launcher.poll() is None:
        time.sleep(0.05)
    if launcher.poll() is not None:
        stdout, _ = launcher.communicate()
        pytest.fail(f"the launch ended before training got under way:\n{stdout[-3000:]}")
    victim = process_with_arguments("--process-id 1", str(out))
    os.kill(victim, signal.SIGKILL)
    stdout, _ = launcher.communicate(timeout=TIMEOUT)
    result = subprocess.CompletedProcess(launcher.args, launcher.returncode, stdout, "")
    assert result.returncode != 0
    # Process 0 stops on its own with a clear error: ours when the failure surfaces as a Python
    # exception, or the runtime's own when its heartbeat check ends the process first.
    ours = "[rank 0] flowgrpo-eqx: error on process 0: another process failed"
    runtime = (
        "Terminating process because the JAX distributed service detected fatal errors. "
        "This most likely indicates that another task died"
    )
    assert ours in result.stdout or runtime in result.stdout, result.stdout[-3000:]
    assert "[launch] stopping rank" not in result.stdout
    assert "[launch] rank 1 failed (exit status -9)" in result.stdout


def test_runtime_statuses_are_told_apart_from_named_errors():
    from flowgrpo_eqx.shapes_demo.cli import _is_runtime_status

    # How JAX raised a peer's death in CI: the failed all-reduce reached a later gather.
    gloo = "UNKNOWN: Gloo all-reduce failed: [pair.cc:538] Read error: Connection reset by peer"
    assert _is_runtime_status(ValueError(gloo))
    assert _is_runtime_status(RuntimeError("UNAVAILABLE: failed to connect to all addresses"))
    assert not _is_runtime_status(ValueError("`epochs` must be >= 1, got 0."))
    assert not _is_runtime_status(ValueError("UNKNOWN reward 'x'"))
