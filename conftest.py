"""Test configuration shared by `tests/` and `property_tests/`.

Rank promotion raises and dtype promotion is strict, so a test fails on any implicit
broadcast of mismatched ranks or mixing of dtypes in the library's arithmetic.

The `flowgrpo-eqx` processes that tests start compile the same programs run after run; they
share a persistent compilation cache (JAX's own, keyed by the program, the JAX version and
the devices), which leaves their results unchanged and saves most of each run's start. The
test processes themselves do not use it: tests that count compilations must see real ones.
"""

import os
import tempfile

import jax
import pytest


jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_enable_compilation_cache", False)

os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(tempfile.gettempdir(), f"flowgrpo-eqx-test-compilation-cache-{os.getuid()}"),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


@pytest.fixture
def key() -> jax.Array:
    """A fresh PRNG key for a test."""
    return jax.random.key(0)
