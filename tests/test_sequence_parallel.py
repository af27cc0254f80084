"""Sequence parallelism on 4 simulated devices against one device: the attention itself and
the velocity and gradients of each model with each strategy (a Flow-GRPO epoch and
checkpoints are in `tests/test_sequence_parallel_training.py`)."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import flowgrpo_eqx as fg
from flowgrpo_eqx.models import MMDiT, RingSequence, UlyssesSequence, sequence_strategy_from_name
from flowgrpo_eqx.models._sequence import sequence_parallel_attention
from tests.cli_helpers import REPO, simulated_devices
from tests.errors import NAMED_ARGUMENT_ERRORS, raises_named


def run_worker(*arguments: str) -> dict:
    """`tests.sequence_worker`'s report (a fresh interpreter: the device count is fixed when
    JAX starts)."""
    environment = {**os.environ, "PYTHONPATH": str(REPO), **simulated_devices(4)}
    result = subprocess.run(
        [sys.executable, "-m", "tests.sequence_worker", *arguments],
        capture_output=True, text=True, env=environment, timeout=900, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def four_device_report():
    return run_worker("models")


@pytest.mark.several_processes("runs a worker process on simulated devices")
@pytest.mark.parametrize("strategy", ["ulysses", "ring", "ring_chunked"])
def test_split_attention_is_one_device_attention(four_device_report, strategy):
    report = four_device_report["attention"][strategy]
    assert report["values"] <= 1e-5
    assert max(report["gradients"]) <= 1e-5


@pytest.mark.several_processes("runs a worker process on simulated devices")
def test_a_sequence_the_axis_does_not_divide_is_named(four_device_report):
    message = four_device_report["attention"]["indivisible"]
    assert message.startswith("`q`: the sequence length (6)") and "'sequence' (4)" in message


@pytest.mark.several_processes("runs a worker process on simulated devices")
def test_text_and_image_tokens_join_in_one_split_sequence(four_device_report):
    report = four_device_report["streams"]
    assert report["order"]
    assert report["split"] == [6, 6, 6, 6]
    assert report["parted"] == [True, True]


@pytest.mark.several_processes("runs a worker process on simulated devices")
@pytest.mark.parametrize("strategy", ["ulysses", "ring"])
@pytest.mark.parametrize("model", ["mmdit", "flux", "flux_uneven_text", "wan"])
def test_each_model_split_over_four_devices_is_the_one_device_model(
    four_device_report, model, strategy
):
    report = four_device_report["models"][model][strategy]
    assert report["values"] <= 1e-5, report
    assert report["gradients"] <= 1e-5, report


def test_an_axis_the_mesh_lacks_is_named():
    mesh = Mesh(np.array(jax.devices()[:1]), ("sequence",))
    q = jax.numpy.zeros((4, 2, 8), jax.numpy.float32)
    with pytest.raises(ValueError, match="`axis` must name an axis of the mesh"):
        sequence_parallel_attention(q, q, q, mesh, "tokens", RingSequence())


def test_settings_and_meshes_are_checked_by_name():
    with pytest.raises(NAMED_ARGUMENT_ERRORS, match="sequence_strategy"):
        MMDiT(sequence_strategy="tree", key=jax.random.key(0))  # type: ignore[arg-type]
    # A name is refused: the boundary that reads one calls `sequence_strategy_from_name`.
    with raises_named(
        "`sequence_strategy` must be an AbstractSequenceStrategy (UlyssesSequence() or "
        "RingSequence()), got 'ring'; `sequence_strategy_from_name` reads a setting's name."
    ):
        MMDiT(sequence_strategy="ring", key=jax.random.key(0))  # type: ignore[arg-type]
    model = MMDiT(key=jax.random.key(0))
    assert model.sequence_strategy == UlyssesSequence()
    assert model.with_settings(sequence_strategy=RingSequence()).sequence_strategy == RingSequence()
    with pytest.raises(NAMED_ARGUMENT_ERRORS, match="sequence_strategy"):
        model.with_settings(sequence_strategy="ring")  # type: ignore[arg-type]
    assert sequence_strategy_from_name("ring") == RingSequence()
    assert sequence_strategy_from_name("ulysses") == UlyssesSequence()
    with pytest.raises(ValueError, match="`sequence_strategy` must be one of"):
        sequence_strategy_from_name("tree")
    q = jax.numpy.zeros((4, 2, 8), jax.numpy.float32)
    mesh = Mesh(np.array(jax.devices()[:1]), ("sequence",))
    with pytest.raises(NAMED_ARGUMENT_ERRORS, match="strategy"):
        sequence_parallel_attention(q, q, q, mesh, "sequence", "ring")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`sequence` \\(2\\) must divide the device count"):
        fg.data_mesh(1, sequence=2)
    with pytest.raises(ValueError, match="`sequence`"):
        fg.data_mesh(1, sequence=0)
    assert fg.data_mesh(1).axis_names == ("data",)


@pytest.mark.several_processes("runs a worker process on simulated devices")
def test_ulysses_over_more_devices_than_heads_divide_is_named(four_device_report):
    message = four_device_report["models"]["heads_not_divisible"]
    assert message.startswith("`sequence_strategy`: Ulysses needs the number of heads (2)")
    assert "mesh axis 'sequence' (4); RingSequence() splits tokens only" in message


@pytest.mark.several_processes("runs a worker process on simulated devices")
def test_a_bfloat16_model_trains_split_over_the_axis(four_device_report):
    assert four_device_report["models"]["bfloat16_gradient_finite"]
