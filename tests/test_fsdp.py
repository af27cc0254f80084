"""Fully sharded data parallel: `shard_parameters` and the trainer on 4 simulated devices."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import flowgrpo_eqx as fg
from flowgrpo_eqx._distributed import fsdp_spec
from tests.cli_helpers import REPO, simulated_devices
from tests.errors import NAMED_ARGUMENT_ERRORS


# A fresh interpreter: the device count is fixed when JAX starts. One for both models, which
# share its start.
@pytest.fixture(scope="module")
def four_device_reports():
    """`tests.fsdp_worker`'s reports, run on 4 simulated devices."""
    environment = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        **simulated_devices(4),
    }
    result = subprocess.run(
        [sys.executable, "-m", "tests.fsdp_worker"],
        capture_output=True, text=True, env=environment, timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def checked(report):
    """`report`, after checking that its updates moved the policy and that FSDP on four
    devices computed what one device did (every metric of every update, and the state after
    them)."""
    assert report["moved"] > 1e-5, "the updates changed nothing; the comparison is vacuous"
    for one, four in zip(report["replicated"], report["fsdp"], strict=True):
        assert one.keys() == four.keys()
        for name in one:
            np.testing.assert_allclose(four[name], one[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert report["largest_difference"] <= 1e-5
    return report


@pytest.mark.several_processes("runs a worker process on simulated devices")
def test_four_devices_fsdp_match_one_device_and_stay_sharded(four_device_reports):
    report = checked(four_device_reports["mlp"])
    # Every large array of the policy, the held reference and AdamW's moments is still split in
    # four after the updates, and one device holds about a quarter of the state.
    assert report["large_arrays"] >= 9 and report["large_sharded"] == report["large_arrays"]
    assert 0.25 <= report["device_fraction"] <= 0.3
    first = report["bfloat16_first_update"]
    assert first["approx_kl"] == 0.0 and first["ratio"] == 1.0


@pytest.mark.several_processes("runs a worker process on simulated devices")
def test_four_devices_fsdp_mmdit_gathers_weights_not_activations(four_device_reports):
    report = checked(four_device_reports["mmdit"])
    # The step gathers weights (each block's as the scan reaches it), never activations.
    assert report["weight_gathers"] > 0
    assert report["activation_gathers"] == []
    assert report["device_fraction"] < 0.4


@pytest.mark.parametrize(
    "shape, devices, minimum, want",
    [
        ((64, 16), 4, 256, ("data", None)),
        ((16, 64), 4, 256, (None, "data")),
        ((6, 64), 4, 256, (None, "data")),
        ((6, 10), 4, 1, ()),
        ((64,), 4, 256, ()),
        ((64, 64), 1, 1, ()),
        ((8, 8), 4, 64, ("data", None)),
    ],
)
def test_fsdp_splits_the_largest_divisible_axis_of_large_arrays(shape, devices, minimum, want):
    assert tuple(fsdp_spec(shape, devices, minimum)) == want


def test_fsdp_on_a_mesh_with_a_sequence_axis_splits_over_both_axes():
    both = ("data", "sequence")
    assert tuple(fsdp_spec((6, 64), 8, 256, both)) == (None, both)
    assert tuple(fsdp_spec((6, 12), 8, 1, both)) == ()


def test_shard_parameters_names_bad_settings():
    mesh = fg.data_mesh(1)
    tree = {"w": np.ones((4, 4), np.float32), "key": jax.random.key(0), "static": "text"}
    placed = fg.shard_parameters(tree, mesh)
    assert placed["static"] == "text" and placed["w"].shape == (4, 4)
    assert jax.dtypes.issubdtype(placed["key"].dtype, jax.dtypes.prng_key)
    with pytest.raises(NAMED_ARGUMENT_ERRORS, match="param_sharding"):
        fg.shard_parameters(tree, mesh, "zero3")
    with pytest.raises(ValueError, match="`min_elements`"):
        fg.shard_parameters(tree, mesh, min_elements=0)
