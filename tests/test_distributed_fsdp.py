"""Scale out with FSDP (`--param-sharding fsdp`): the parameters, the held slot and AdamW's
moments split over the devices.

One run covers what tests/test_distributed.py checks for the replicated layout: two processes
on jax.distributed train while each writes its own shards of the checkpoints, a SIGTERM stops
both after the same epoch, and one process on four devices reads those shards onto its own mesh
and finishes the run, with the one-device baseline's metrics and policy. In a file of its own
so that `pytest -n 2 --dist loadfile` runs it beside the replicated tests; the one-device
baseline is run again here (in the test process, on the session's tiny base model).
"""

import json
import signal

import pytest

from flowgrpo_eqx.train._preemption import PREEMPTED_EXIT_STATUS
from tests import test_distributed as distributed
from tests.cli_helpers import (
    TIMEOUT,
    epochs_done,
    run_process,
    simulated_devices,
    started_past_first_epoch,
    with_base,
)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, tiny_base):
    return distributed.run_baseline(tmp_path_factory, tiny_base)


@pytest.mark.several_processes("runs flowgrpo-eqx processes on simulated devices")
def test_two_processes_stop_together_and_four_devices_resume_to_the_same_result(baseline, tmp_path):
    out = with_base(baseline, tmp_path / "fsdp")
    flags = ["train", *distributed.COMMON, "--param-sharding", "fsdp", "--out", str(out)]
    launcher = started_past_first_epoch(out, "launch", "--local", "2", "--", *flags)
    launcher.send_signal(signal.SIGTERM)
    output, _ = launcher.communicate(timeout=TIMEOUT)
    assert launcher.returncode == PREEMPTED_EXIT_STATUS, output[-3000:]
    stopped = epochs_done(out)
    assert 1 <= stopped < 4
    # Process 0 reports the stop; both processes stopped after the same epoch.
    assert f"[rank 0] Stopped after epoch {stopped}" in output
    assert "every rank stopped after a signal and checkpointed" in output
    # Each process wrote its own shards of the checkpoint; nothing was gathered to save it.
    meta = json.loads((out / "checkpoints" / f"ckpt_{stopped:08d}" / "meta.json").read_text())
    for process in (0, 1):
        assert any(name.startswith(f"ocdbt.process_{process}/d/") for name in meta["state_files"])

    resumed = run_process(*flags, "--resume", **simulated_devices(4))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Continuing from checkpoint" in resumed.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["devices"] == 4 and summary["resumed"]
    placements = distributed.placements(out)
    assert [p["processes"] for p in placements] == [2] * stopped + [1] * (4 - stopped)
    for placement in placements:
        assert placement["param_sharding"] == "fsdp"
        if placement["processes"] == 2:
            assert placement["devices"] == 2
            # The reward ran once per collect in total, on process 0, and each process held
            # half of the rows of each batch.
            assert placement["reward_calls_per_process"] == [1, 0]
            assert placement["rows_per_process"] == [placement["rows_total"] // 2] * 2
            assert placement["state_fraction_per_device"] < 0.9
        else:
            assert placement["devices"] == 4
            # The tiny DiT's large matrices are split in four; its small arrays stay whole.
            assert 0.25 < placement["state_fraction_per_device"] < 0.75
    # Every epoch's metrics and the final policy: the epochs on two processes and those on
    # four devices computed what one device did.
    distributed.assert_same_run(out, baseline)
