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


_ATTENTION_TOLERANCE = {
    "cpu": {"float32": 1e-5, "bfloat16": 2e-2},
    "tpu": {"float32": 2e-4, "bfloat16": 2e-2},
}
_REFERENCE_MODEL_RTOL = {"cpu": 1e-4, "tpu": 3e-3}
_LOSS_RTOL = {"cpu": 1e-4, "tpu": 1e-3}
_GRADIENT_AGREEMENT = {"cpu": 1e-5, "tpu": 1e-3}
_LOG_PROB_RTOL = {"cpu": 1e-6, "tpu": 2e-5}
_OPTIMIZER_RTOL = {"cpu": 1e-4, "tpu": 1e-3}
_ON_POLICY_RATIO_ATOL = {"cpu": 1e-6, "tpu": 1e-5}
_ACTIVATION_TOLERANCE = {"cpu": 3e-7, "tpu": 2e-6}
_ROLLOUT_LOG_PROB_TOLERANCE = {"cpu": (1e-5, 2e-5), "tpu": (1e-4, 2e-4)}


def attention_tolerance(dtype: str) -> float:
    """Attention (every implementation) against `numpy_reference.attention`, or fused against
    plain attention: the largest absolute error over the largest magnitude, of values and of
    gradients, by the inputs' dtype (`"float32"` or `"bfloat16"`). Measured on the v5e for
    float32 with the splash kernel: at most 6.2e-5 (a query gradient), and 1.1e-5 for the
    DiT's velocity; bfloat16 within 2e-2."""
    return _ATTENTION_TOLERANCE[backend()][dtype]


def reference_model_rtol() -> float:
    """A whole float32 model (a transformer, an autoencoder, a prompt encoder, a reward model)
    against the float32 output of the implementation it ports (diffusers, transformers),
    with any attention: the largest absolute error over the largest magnitude. Measured on
    the v5e: 1.1e-4 (SD3.5), 1.5e-4 (Wan) and 3.2e-4 (FLUX) with splash attention; 1.1e-4
    (SD3.5) and 1.35e-3 (SD3) with plain attention. The SD3 fixture has no q/k norm and
    attention scores up to 169, so a score's last-bit error moves its softmax weight by about
    1e-4 of itself (its CPU error, 8.7e-6, is five times SD3.5's too)."""
    return _REFERENCE_MODEL_RTOL[backend()]


def loss_rtol() -> float:
    """An objective's loss built on log densities (Flow-GRPO's, GRPO-Guard's) and its
    statistics against their float64 statement (relative). Measured on the v5e for
    Flow-GRPO: at most 4.9e-4, in the coefficients-preserving SDE's cases; GRPO-Guard's
    tests, whose ratios come from the same log densities, read the same row."""
    return _LOSS_RTOL[backend()]


def gradient_agreement() -> float:
    """Two float32 programs of one objective's gradient against each other (two statements of
    a loss, or one loss in two configurations that must agree): the largest absolute
    difference over the gradient's largest entry, since each entry's round-off is of the size
    of the terms summed into it. Measured on the v5e: 4.6e-5, DGPO's group DPO loss against
    its release's surrogate (`sigmoid` of a group's log-density difference scales every entry,
    so that difference's error reaches them all); the TPU's row is the loss's (`loss_rtol`):
    the same log densities' error, carried by the same factor."""
    return _GRADIENT_AGREEMENT[backend()]


def log_prob_rtol() -> float:
    """One Gaussian log density of float32 inputs against `numpy_reference.log_prob`
    (relative). Measured on the v5e: 6.4e-6."""
    return _LOG_PROB_RTOL[backend()]


def optimizer_rtol() -> float:
    """Optax's step sizes (Adam's bias corrections, a cosine schedule) against their NumPy
    statement (relative). Measured on the v5e: 2.8e-4."""
    return _OPTIMIZER_RTOL[backend()]


def on_policy_ratio_atol() -> float:
    """The mean ratio of a policy rescoring its own rollout against 1 (absolute): the log
    densities of the rollout and of the loss are computed by two programs, whose float32
    transcendental functions differ in the last bits on a TPU. Measured on the v5e: 2.0e-6."""
    return _ON_POLICY_RATIO_ATOL[backend()]


def activation_tolerance() -> float:
    """`silu`'s float32 value and slope against the float64 statement, over `max(1, |x|)`.
    The CPU's is float32 resolution. Measured on the v5e (`jax.nn.silu`, which `silu` is
    there): 6.1e-7 for the value, 8.5e-7 for the slope."""
    return _ACTIVATION_TOLERANCE[backend()]


def rollout_log_prob_tolerance() -> tuple[float, float]:
    """`(rtol, atol)` of the log densities an objective gives a rollout (the model's velocity,
    then the SDE's Gaussian density) against the sample's own float64 density. Measured on
    the v5e in the property tests' first failing examples at the CPU's row: 4.9e-5 absolute
    (7.6e-5 relative); the largest over all their examples is not yet measured."""
    return _ROLLOUT_LOG_PROB_TOLERANCE[backend()]


def _at_least_off_the_cpu(
    cpu_atol: float, floors: dict[str, float], magnitude: float = 1.0
) -> float:
    """`cpu_atol`, a test's own tolerance, raised to `floors[backend()]` times `magnitude`
    where there is one."""
    return max(cpu_atol, floors.get(backend(), 0.0) * magnitude)


_TANH_MODEL_ATOL = {"tpu": 2e-4}


def tanh_model_atol(cpu_atol: float, magnitude: float = 1.0) -> float:
    """The absolute tolerance of the tests' small `tanh` MLP (the user model) against its
    float64 statement: `cpu_atol`, the test's own, on the CPU; on a TPU, whose float32 `tanh`
    is coarse, at least 2e-4 times `magnitude` (the largest output's size, at least 1, where
    a test's outputs grow with its draws): a layer's round-off is relative to the largest
    terms it sums, so an output that cancels down from large terms keeps their error.
    Measured on the v5e: 2.2e-5 for one call of a LoRA-adapted model (8.3e-6 for one with
    random adapters, against a CPU atol of 4e-6), 2.8e-5 for an Euler ODE sample after six
    steps, 5.2e-5 for DPM-Solver++(2M) on MixGRPO-Flash's compressed grid; 7.5e-4 for random
    adapters whose outputs reach 13.5 (5.6e-5 of it, on an output of 1.005)."""
    return _at_least_off_the_cpu(cpu_atol, _TANH_MODEL_ATOL, magnitude)


_LOG_DENSITY_ATOL = {"tpu": 2e-4}


def log_density_atol(cpu_atol: float) -> float:
    """The absolute tolerance of a Gaussian log density's `log std` term against its float64
    statement: `cpu_atol`, the test's own, on the CPU; on a TPU, whose float32 `log` is off by
    tens of its last bits, at least 2e-4. Measured on the v5e: `-log(6.017) - log(2 pi) / 2`
    off by 4.9e-5, the same absolute error as `rollout_log_prob_tolerance`'s."""
    return _at_least_off_the_cpu(cpu_atol, _LOG_DENSITY_ATOL)
