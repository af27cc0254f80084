"""Fixtures the example tests share (the root `conftest.py` sets up JAX for every test)."""

import pathlib

import pytest

from tests.cli_helpers import tiny_base_folder


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A folder holding the tiny preset's base model `base_<fingerprint>.eqx`, pretrained once
    per session and shared by both xdist workers; copy it into a run folder with
    `tests.cli_helpers.with_base` and the run loads it instead of pretraining."""
    return tiny_base_folder(tmp_path_factory)
