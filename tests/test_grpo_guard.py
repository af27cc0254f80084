"""GRPO-Guard (docs/mathematics/flow_grpo.md §5a) against the float64 NumPy statement in
numpy_reference."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flowgrpo_eqx as fg
import flowgrpo_eqx.testing as fgt
from flowgrpo_eqx.train import Trainer
from tests import numpy_reference as ref
from tests.errors import exact_message
from tests.test_objective import (
    STEP,
    make_batch,
    make_objective,
    numpy_transitions,
    perturbed,
)
from tests.tolerances import loss_rtol


def guarded(objective, guard):
    return eqx.tree_at(lambda o: o.guard, objective, guard, is_leaf=lambda x: x is None)


def numpy_parts(objective, policy, batch):
    """Per transition, in float64: the raw log-ratio, the transition std and the kept set."""
    kept, _, std, log_ratio = numpy_transitions(objective, policy, batch)
    return log_ratio, std, kept


def column_statistics(values, kept):
    means, stds = [], []
    for j in range(values.shape[1]):
        column = values[kept[:, j], j]
        means.append(column.mean() if column.size else 0.0)
        stds.append(column.std() if column.size else 0.0)
    return np.asarray(means), np.asarray(stds)


def setup(seed, per_transition=False, steps=8):
    objective = make_objective(chunk=4)
    variables = objective.init(jax.random.key(1))
    policy = perturbed(variables.policy, jax.random.key(2))
    variables = fg.FlowGRPOVariables(policy=policy, reference=variables.reference)
    batch = make_batch(seed=seed, advantages_per_transition=per_transition, steps=steps)
    rescored = np.asarray(objective.log_probs(variables, batch))
    noise = np.random.default_rng(seed).normal(size=rescored.shape) * 0.3
    batch = eqx.tree_at(
        lambda b: b.old_log_probs, batch, jnp.asarray((rescored + noise).astype(np.float32))
    )
    return objective, variables, batch


@pytest.mark.parametrize(
    "ratio_norm, reweight, per_transition",
    [(True, True, False), (True, False, True), (False, True, False)],
)
def test_guarded_loss_and_statistics_match_numpy(ratio_norm, reweight, per_transition):
    objective, variables, batch = setup(7, per_transition)
    objective = guarded(objective, fg.EmpiricalGuard(ratio_norm=ratio_norm, reweight=reweight))
    total, aux = objective.loss(variables, batch, STEP)

    log_ratio, std, kept = numpy_parts(objective, variables.policy, batch)
    normalised = ref.ratio_norm(log_ratio, std, kept) if ratio_norm else log_ratio
    weights = (
        ref.step_weights(np.asarray(batch.timesteps), np.asarray(batch.next_timesteps), kept)
        if reweight
        else kept.astype(float)
    )
    advantages = np.asarray(batch.advantages, np.float64)
    if advantages.ndim == 1:
        advantages = np.broadcast_to(advantages[:, None], kept.shape)
    sums = dict.fromkeys(("policy", "clipped", "ratio", "approx_kl"), 0.0)
    for i, j in zip(*np.nonzero(kept), strict=True):
        ratio = math.exp(normalised[i, j])
        surrogate = ref.surrogate(
            advantages[i, j], ratio, objective.clip_range, objective.adv_clip_max
        )
        sums["policy"] += weights[i, j] * surrogate
        sums["clipped"] += abs(ratio - 1) > objective.clip_range
        sums["ratio"] += ratio
        sums["approx_kl"] += 0.5 * log_ratio[i, j] ** 2

    assert float(total.count) == kept.sum() > 0
    rtol = loss_rtol()
    np.testing.assert_allclose(float(total.total), sums["policy"], rtol=rtol, atol=1e-5)
    np.testing.assert_allclose(float(aux.policy_loss.total), sums["policy"], rtol=rtol, atol=1e-5)
    np.testing.assert_allclose(float(aux.clipfrac.total), sums["clipped"])
    np.testing.assert_allclose(float(aux.ratio.total), sums["ratio"], rtol=rtol)
    np.testing.assert_allclose(float(aux.approx_kl.total), sums["approx_kl"], rtol=rtol, atol=1e-6)

    raw_mean, raw_std = column_statistics(np.exp(log_ratio), kept)
    normalised_mean, normalised_std = column_statistics(np.exp(normalised), kept)
    steps = aux.step_ratios
    np.testing.assert_allclose(np.asarray(steps.raw_mean), raw_mean, rtol=rtol, atol=1e-6)
    np.testing.assert_allclose(np.asarray(steps.raw_std), raw_std, rtol=1e-3, atol=1e-5)
    np.testing.assert_allclose(
        np.asarray(steps.normalised_mean), normalised_mean, rtol=rtol, atol=1e-6
    )
    np.testing.assert_allclose(
        np.asarray(steps.normalised_std), normalised_std, rtol=1e-3, atol=1e-5
    )


def test_ratio_norm_centres_a_drifted_ratio_on_one():
    # An old log-prob uniformly above the policy's (the paper's left shift) leaves every raw
    # ratio below 1; after RatioNorm every ratio of a step is 1 (rows share each step's time).
    objective, variables, batch = setup(11, steps=7)
    rescored = objective.log_probs(variables, batch)
    batch = eqx.tree_at(lambda b: b.old_log_probs, batch, rescored + 0.5)
    objective = guarded(objective, fg.EmpiricalGuard(reweight=False))
    _, aux = objective.loss(variables, batch, STEP)
    counted = np.asarray(aux.step_ratios.raw_mean) > 0
    np.testing.assert_allclose(np.asarray(aux.step_ratios.raw_mean)[counted], math.exp(-0.5), 1e-4)
    np.testing.assert_allclose(np.asarray(aux.step_ratios.normalised_mean)[counted], 1.0, 1e-5)
    np.testing.assert_allclose(np.asarray(aux.step_ratios.normalised_std)[counted], 0.0, 0, 1e-5)


def test_guarded_gradient_is_finite_with_poisoned_masked_entries():
    objective, variables, _ = setup(3)
    objective = guarded(objective, fg.EmpiricalGuard())
    batch = make_batch(seed=3, poison=True)
    value, _, _, grads = fgt.loss_value_and_grad(objective, variables, batch)
    assert np.isfinite(float(value)) and fgt.all_finite(grads)


def test_unguarded_loss_reports_no_step_ratios_and_bad_guards_are_named():
    objective, variables, batch = setup(5)
    _, aux = objective.loss(variables, batch, STEP)
    assert aux.step_ratios is None
    with pytest.raises(ValueError, match="`ratio_norm` and `reweight`"):
        fg.EmpiricalGuard(ratio_norm=False, reweight=False)


def test_trainer_logs_the_ratio_per_step():
    objective, variables, batch = setup(9)
    trainer = Trainer(guarded(objective, fg.EmpiricalGuard()))
    state = trainer.init(jax.random.key(0), variables)
    _, metrics = trainer.update(state, batch)
    k = batch.timesteps.shape[1]
    for name in ("raw_mean", "raw_std", "normalised_mean", "normalised_std"):
        assert {f"step_ratios/{name}/{j}" for j in range(k)} <= set(metrics)
    assert all(jnp.ndim(value) == 0 for value in metrics.values())


# --------------------------------------------------------------------------------------
# The guard's settings.


def test_a_guard_that_does_nothing_is_refused_by_name():
    message = "`ratio_norm` and `reweight` are both False: the guard does nothing."
    with pytest.raises(ValueError, match=exact_message(message)):
        fg.EmpiricalGuard(ratio_norm=False, reweight=False)
    assert (
        fg.EmpiricalGuard(ratio_norm=False).reweight
        and fg.EmpiricalGuard(reweight=False).ratio_norm
    )
