"""The tolerances `docs/accelerators.md` promises against the float64 statements, by backend:
one table, so that the documentation's table and the tests cannot drift apart.

On a TPU the suite runs with JAX's matmul precision at `"highest"` (conftest.py), the
library's own policy for every call of a model (`GuidedFlow.matmul_precision`), so that the
tests' direct calls of a model compute as the library's do. What remains on a TPU is its
float32 arithmetic: its `exp`, `log`, `sin`, `cos` and division are not correctly rounded,
and a log density of thousands (a small std) carries that error into the ratio.
"""

import jax


def backend() -> str:
    """`"tpu"` on a TPU; `"cpu"` elsewhere (a GPU has not been measured: the CPU's row)."""
    return "tpu" if jax.default_backend() == "tpu" else "cpu"


ATTENTION_TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}
"""Attention (every implementation) against `numpy_reference.attention`: the largest absolute
error over the largest magnitude, of values and of gradients, by the inputs' dtype (the same
on every backend)."""

_LOSS_RTOL = {"cpu": 1e-4, "tpu": 1e-3}
_LOG_PROB_RTOL = {"cpu": 1e-6, "tpu": 2e-5}


def loss_rtol() -> float:
    """Flow-GRPO's loss and its statistics against `numpy_loss` (relative). Measured on the
    v5e: at most 4.9e-4, in the coefficients-preserving SDE's cases."""
    return _LOSS_RTOL[backend()]


def log_prob_rtol() -> float:
    """One Gaussian log density of float32 inputs against `numpy_reference.log_prob`
    (relative). Measured on the v5e: 6.4e-6."""
    return _LOG_PROB_RTOL[backend()]
