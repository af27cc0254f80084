"""Sequence-parallel attention (`flowgrpo_eqx.models._sequence`) on 4 simulated devices."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from flowgrpo_eqx.models._sequence import sequence_parallel_attention
from tests.cli_helpers import REPO, simulated_devices


@pytest.fixture(scope="module")
def four_device_report():
    """`tests.sequence_worker`'s report (a fresh interpreter: the device count is fixed when
    JAX starts)."""
    environment = {**os.environ, "PYTHONPATH": str(REPO), **simulated_devices(4)}
    result = subprocess.run(
        [sys.executable, "-m", "tests.sequence_worker"],
        capture_output=True, text=True, env=environment, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("strategy", ["ulysses", "ring"])
def test_split_attention_is_one_device_attention(four_device_report, strategy):
    report = four_device_report[strategy]
    assert report["values"] <= 1e-5
    assert max(report["gradients"]) <= 1e-5


def test_a_sequence_the_axis_does_not_divide_is_named(four_device_report):
    message = four_device_report["indivisible"]
    assert message.startswith("`q`: the sequence length (6)") and "'sequence' (4)" in message


def test_an_axis_the_mesh_lacks_is_named():
    mesh = Mesh(np.array(jax.devices()[:1]), ("sequence",))
    q = jax.numpy.zeros((4, 2, 8), jax.numpy.float32)
    with pytest.raises(ValueError, match="`axis` must name an axis of the mesh"):
        sequence_parallel_attention(q, q, q, mesh, "tokens", "ring")
