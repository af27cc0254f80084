"""Test configuration shared by `tests/` and `property_tests/`.

Rank promotion raises and dtype promotion is strict, so a test fails on any implicit
broadcast of mismatched ranks or mixing of dtypes in the library's arithmetic.
"""

import jax
import pytest


jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")


@pytest.fixture
def key() -> jax.Array:
    """A fresh PRNG key for a test."""
    return jax.random.key(0)
