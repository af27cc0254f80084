"""The precision policy (docs/accelerators.md): every call of the model the library makes is
traced at `GuidedFlow.matmul_precision` ("highest" by default), whatever JAX's own setting
around it; and the fused attention kernel keeps half-precision products at the precision
Mosaic accepts, whatever is set around its forward or its gradient.

The policy is checked on the traced programs (each matmul's precision), so that it is tested
on any backend: on a CPU the precisions compute the same numbers.
"""

import inspect
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flowgrpo_eqx as fg
from flowgrpo_eqx.models import SplashAttention
from flowgrpo_eqx.models._layers import local_attention
from tests.errors import NAMED_ARGUMENT_ERRORS
from tests.test_objective import STEP, LinearVelocity, make_batch, make_objective


def _equations(jaxpr: Any) -> Iterator[Any]:
    """Every equation of a jaxpr and of the jaxprs inside it (scans, kernels, custom rules)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for item in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(item, jax.extend.core.ClosedJaxpr):
                    yield from _equations(item.jaxpr)
                elif isinstance(item, jax.extend.core.Jaxpr):
                    yield from _equations(item)


def _dot_precisions(function: Any, *args: Any) -> set[Any]:
    """The precision of every `dot_general` `function` traces (None: JAX's default)."""
    jaxpr = jax.make_jaxpr(function)(*args).jaxpr
    found = set()
    for eqn in _equations(jaxpr):
        if eqn.primitive.name == "dot_general":
            precision = eqn.params["precision"]
            found.add(None if precision is None else tuple(precision)[0])
    return found


def _loss_precisions(**settings: Any) -> set[Any]:
    objective = make_objective(beta=0.3)
    if settings:
        objective = fg.FlowGRPOObjective(
            LinearVelocity(jax.random.key(0)),
            objective.flow.process,
            objective.flow.inputs,
            sde=objective.sde,
            beta=0.3,
            clip_range=0.2,
            **settings,
        )
    variables = objective.init(jax.random.key(1))
    batch = make_batch(seed=0)
    return _dot_precisions(lambda v, b: objective.loss(v, b, STEP)[0].value, variables, batch)


def test_the_loss_calls_the_policy_and_the_reference_at_the_highest_precision_by_default():
    parameters = inspect.signature(fg.FlowGRPOObjective).parameters
    assert parameters["matmul_precision"].default == "highest"
    assert inspect.signature(fg.GuidedFlow).parameters["matmul_precision"].default == "highest"
    assert _loss_precisions() == {jax.lax.Precision.HIGHEST}
    # The caller's own setting does not lower it.
    with jax.default_matmul_precision("default"):
        assert _loss_precisions() == {jax.lax.Precision.HIGHEST}


def test_matmul_precision_default_and_none_leave_the_backends_choice():
    assert _loss_precisions(matmul_precision="default") == {jax.lax.Precision.DEFAULT}
    assert _loss_precisions(matmul_precision="high") == {jax.lax.Precision.HIGH}
    # None: JAX's own setting around the call decides, as for any product traced here (on a
    # TPU the suite sets "highest" for the whole process: conftest.py).
    jax_setting = _dot_precisions(lambda a: a @ a, jnp.ones((2, 2), jnp.float32))
    assert _loss_precisions(matmul_precision=None) == jax_setting
    with jax.default_matmul_precision("high"):
        assert _loss_precisions(matmul_precision=None) == {jax.lax.Precision.HIGH}


def test_the_rollout_samples_at_the_objectives_precision():
    objective = make_objective(guidance=False)
    rollout = fg.FlowRollout(objective, reward=_zeros, groups=2, steps=4)
    rows = np.random.default_rng(0).normal(size=(2, 3)).astype(np.float32)
    policy = objective.init(jax.random.key(0)).policy
    found = _dot_precisions(
        lambda p, key: rollout.generate(p, jnp.asarray(rows), key).final,
        policy,
        jax.random.key(1),
    )
    assert found == {jax.lax.Precision.HIGHEST}


def _zeros(samples: Any, rows: Any) -> Any:
    return np.zeros(len(samples))


def test_an_unknown_matmul_precision_is_named():
    with pytest.raises(NAMED_ARGUMENT_ERRORS, match="matmul_precision"):
        make_objective().flow.__class__(
            LinearVelocity(jax.random.key(0)),
            fg.RectifiedFlow(),
            fg.InputSpec(latent_shape=(4,)),
            guidance=None,
            matmul_precision="float64",
        )


@pytest.mark.parametrize("scope", ["forward", "gradient"])
def test_half_precision_splash_keeps_its_products_at_the_default_precision(scope: str):
    """Mosaic refuses a multi-pass precision for bfloat16 operands: the kernel's products stay
    at the default however "highest" is set around the forward or around the gradient."""
    q = jnp.ones((1, 200, 2, 64), jnp.bfloat16)
    attention = SplashAttention(128)

    def value(q: Any) -> Any:
        out = jax.vmap(lambda q: local_attention(q, q, q, attention))(q)
        return jnp.sum(out.astype(jnp.float32))

    def forward_scoped(q: Any) -> Any:
        with jax.default_matmul_precision("highest"):
            return value(q)

    if scope == "forward":
        found = _dot_precisions(jax.grad(forward_scoped), q)
    else:
        with jax.default_matmul_precision("highest"):
            found = _dot_precisions(jax.grad(value), q)
    assert found and jax.lax.Precision.HIGHEST not in found, found
