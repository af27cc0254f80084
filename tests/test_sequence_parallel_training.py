"""Sequence parallelism in training, on 4 simulated devices: a Flow-GRPO epoch of a
LoRA-adapted MMDiT split over devices (with FSDP) equals the one-device epoch, and a
checkpoint written on one mesh shape resumes on another (`tests/sequence_worker.py`)."""

import numpy as np
import pytest

from tests.test_sequence_parallel import run_worker


# Every test here reads the worker's report.
pytestmark = pytest.mark.several_processes("runs a worker process on simulated devices")


@pytest.fixture(scope="module")
def epoch_report(tmp_path_factory):
    return run_worker("training", str(tmp_path_factory.mktemp("sequence")))["epoch"]


def test_a_flow_grpo_epoch_split_over_devices_is_the_one_device_epoch(epoch_report):
    report = epoch_report
    assert report["moved"] > 1e-3  # the adapters trained, so equality says something
    assert report["ulysses_fsdp_2x2"] <= 1e-5 and report["ring_1x4"] <= 1e-5, report
    assert report["base_split_over_4"]  # FSDP over data and sequence together
    np.testing.assert_allclose(report["losses"][1:], report["losses"][0], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(report["rewards"][1:], report["rewards"][0], rtol=1e-5)


def test_a_checkpoint_written_on_one_mesh_shape_resumes_on_another(epoch_report):
    report = epoch_report
    assert report["restored_meshes"] == [{"data": 1, "sequence": 4}]
    assert report["restored_equal"] == 0.0
    assert report["resumed_second_epoch"] <= 1e-5, report
    np.testing.assert_allclose(*report["second_losses"], rtol=1e-5, atol=1e-7)
