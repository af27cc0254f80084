"""Orbax checkpoints across meshes and under SIGKILL, in fresh interpreters.

A checkpoint saved from an FSDP state on 4 simulated devices restores onto 2 devices and onto 1
with identical values, each array taking the sharding of the state it is restored into; a
process killed with SIGKILL while saving leaves the previous checkpoints loadable. (The demo's
killed FSDP run resumed on another device count is in `tests/test_distributed.py`.)
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest

from flowgrpo_eqx.train import Checkpointer
from tests.cli_helpers import simulated_devices


REPO = pathlib.Path(__file__).resolve().parent.parent
TIMEOUT = 300


def worker(*arguments, devices=1):
    return subprocess.Popen(
        [sys.executable, "-m", "tests.checkpoint_worker", *arguments],
        cwd=REPO,
        env={
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            **simulated_devices(devices),
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finished(process):
    out, err = process.communicate(timeout=TIMEOUT)
    assert process.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.several_processes("saves and restores in worker processes on simulated devices")
def test_a_checkpoint_saved_on_four_devices_restores_on_two_and_on_one(tmp_path):
    saved = finished(worker("save", str(tmp_path), devices=4))
    assert saved["devices"] == 4 and saved["sharded_arrays"] >= 6
    # Split arrays are stored shard by shard, whole ones packed into one buffer per dtype.
    assert saved["own_arrays"] == saved["sharded_arrays"]
    assert saved["packed_arrays"] == saved["arrays"] - saved["sharded_arrays"] > 0
    on_two = finished(worker("restore", str(tmp_path), devices=2))
    assert on_two["devices"] == 2 and on_two["sharded_arrays"] == saved["sharded_arrays"]
    assert on_two["same_sharding"] and on_two["meta"]["devices"] == 4
    on_one = finished(worker("restore", str(tmp_path), devices=1))
    assert on_one["same_sharding"] and on_one["sharded_arrays"] == 0
    want = np.load(tmp_path / "saved.npz")
    for count in (2, 1):
        got = np.load(tmp_path / f"restored_{count}.npz")
        assert sorted(got.files) == sorted(want.files) and len(want.files) >= 10
        for name in want.files:
            assert got[name].dtype == want[name].dtype, name
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def like_loop_state():
    return {"weights": jnp.zeros(16 * 2**20, jnp.float32), "step": jnp.asarray(0)}


def assert_loadable(checkpoints, newest_allowed):
    """No checkpoint is damaged, and the newest holds the state of its step."""
    lines = []
    tree, meta, path = checkpoints.restore_latest(like_loop_state(), report=lines.append)
    assert lines == [
        f"Continuing from checkpoint {path} ({'step'} {meta['step']}, epoch {meta['epoch']})."
    ]
    assert meta["step"] in newest_allowed
    assert int(tree["step"]) == meta["step"]
    np.testing.assert_array_equal(
        np.asarray(tree["weights"][:4]), np.arange(4, dtype=np.float32) + meta["step"]
    )
    for folder in checkpoints.paths():
        checkpoints.verify(folder, like_loop_state())
    return meta["step"]


@pytest.mark.several_processes("saves and restores in worker processes on simulated devices")
@pytest.mark.parametrize("delay", [0.0, 0.05, 0.2])
def test_sigkill_while_saving_leaves_the_previous_checkpoint_loadable(tmp_path, delay):
    process = worker("save-loop", str(tmp_path))
    for line in process.stdout:
        if line.strip() == "saving 3":
            break
    else:
        pytest.fail(f"the worker ended before saving 3: {process.stderr.read()[-3000:]}")
    time.sleep(delay)
    process.send_signal(signal.SIGKILL)
    rest, _ = process.communicate(timeout=TIMEOUT)
    assert process.returncode == -signal.SIGKILL
    printed = ["saving 3", *rest.strip().splitlines()]
    assert printed[-1].startswith("saving "), f"the kill landed between saves: {printed}"
    step = int(printed[-1].split()[1])
    checkpoints = Checkpointer(tmp_path / "checkpoints", keep=2)
    # The kill came before the rename (the previous checkpoint is the newest) or after it.
    assert assert_loadable(checkpoints, newest_allowed={step - 1, step}) in (step - 1, step)
    # Saving the interrupted step again replaces what the killed save left.
    state = {
        "weights": jnp.arange(16 * 2**20, dtype=jnp.float32) + step,
        "step": jnp.asarray(step),
    }
    checkpoints.save(step, state, {"epoch": step})
    assert assert_loadable(checkpoints, newest_allowed={step}) == step
    assert not any(p.name.startswith(".tmp-") for p in checkpoints.directory.iterdir())


@pytest.mark.several_processes("saves and restores in worker processes on simulated devices")
def test_sigkill_after_the_shards_before_the_rename_leaves_the_previous_checkpoint(tmp_path):
    process = worker("save-loop", str(tmp_path), "pause")
    for line in process.stdout:
        if line.strip() == "paused":
            break
    else:
        pytest.fail(f"the worker never paused: {process.stderr.read()[-3000:]}")
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=TIMEOUT)
    directory = tmp_path / "checkpoints"
    assert sorted(p.name for p in directory.iterdir()) == [".tmp-00000002", "ckpt_00000001"]
    assert (directory / ".tmp-00000002" / "state" / "commit_success.txt").exists()
    checkpoints = Checkpointer(directory, keep=2)
    assert checkpoints.paths() == [directory / "ckpt_00000001"]
    assert assert_loadable(checkpoints, newest_allowed={1}) == 1
