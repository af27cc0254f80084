"""The scale-out tests of tests/test_distributed.py with FSDP (`--param-sharding fsdp`): the
parameters, the held slot and AdamW's moments split over the devices.

The same test bodies, in a file of their own so that `pytest -n 2 --dist loadfile` runs them on
the other worker than the replicated ones; the one-device baseline is run again here (in the
test process, on the session's tiny base model).
"""

import pytest

from tests import test_distributed as distributed


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, tiny_base):
    return distributed.run_baseline(tmp_path_factory, tiny_base)


def test_two_processes_match_one_process(baseline, tmp_path):
    distributed.test_two_processes_match_one_process(baseline, tmp_path, "fsdp")


def test_a_run_killed_on_four_devices_resumes_on_two_to_the_same_result(baseline, tmp_path):
    distributed.test_a_run_killed_on_four_devices_resumes_on_two_to_the_same_result(
        baseline, tmp_path, "fsdp"
    )
