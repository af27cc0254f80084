"""The released GRPO-Guard forms (docs/mathematics/flow_grpo.md §5a) against the float64 NumPy
statement `numpy_reference.guard_released`: the loss and its gradient for each variant."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flowgrpo_eqx as fg
from tests import numpy_reference as ref
from tests.errors import exact_message
from tests.test_objective import (
    STEP,
    LinearParams,
    make_batch,
    make_objective,
    numpy_guided,
    numpy_transitions,
    perturbed,
)
from tests.tolerances import loss_rtol


VARIANTS = {
    "fixed": fg.GRPOGuard(),
    "released": fg.GRPOGuard(drift="batch"),
    "per_sample": fg.GRPOGuard(scale="sample", reweight=False),
}


def numpy_loss(objective, guard, params, batch):
    """The guarded Flow-GRPO loss total in float64, from the released formulas."""
    kept, means, std, log_ratio = numpy_transitions(objective, params, batch)
    old_means = np.asarray(batch.old_means, np.float64)
    drift = np.zeros(kept.shape)
    drift[kept] = np.mean((means[kept] - old_means[kept]) ** 2, axis=-1)
    t_all = np.asarray(batch.timesteps, np.float64)
    t_next_all = np.asarray(batch.next_timesteps, np.float64)
    guarded, weights = ref.guard_released(
        log_ratio, drift, std, t_all, t_next_all, kept, guard.drift, guard.scale, guard.reweight
    )
    advantages = np.asarray(batch.advantages, np.float64)
    total = 0.0
    for i, j in zip(*np.nonzero(kept), strict=True):
        total += weights[i, j] * ref.surrogate(
            advantages[i], np.exp(guarded[i, j]), objective.clip_range, objective.adv_clip_max
        )
    return total, int(kept.sum())


def setup(seed):
    objective = make_objective(chunk=4)
    variables = objective.init(jax.random.key(1))
    old_policy = variables.policy
    policy = perturbed(old_policy, jax.random.key(2))
    variables = fg.FlowGRPOVariables(policy=policy, reference=variables.reference)
    batch = make_batch(seed=seed, steps=8)
    old = LinearParams.of(old_policy)
    scale = objective.flow.guidance.scale
    sde = objective.sde
    t_all, t_next_all = np.asarray(batch.timesteps), np.asarray(batch.next_timesteps)
    latents, cond = np.asarray(batch.latents, np.float64), np.asarray(batch.cond, np.float64)
    old_means = np.zeros(latents.shape)
    for i in range(latents.shape[0]):
        for j in range(latents.shape[1]):
            v = numpy_guided(old, latents[i, j], float(t_all[i, j]), cond[i], scale)
            old_means[i, j], _ = ref.transition(
                latents[i, j], v, float(t_all[i, j]), float(t_next_all[i, j]), sde.noise_level
            )
    rescored = np.asarray(objective.log_probs(variables, batch))
    noise = np.random.default_rng(seed).normal(size=rescored.shape) * 0.05
    batch = eqx.tree_at(
        lambda b: (b.old_log_probs, b.old_means),
        batch,
        (jnp.asarray((rescored + noise).astype(np.float32)), jnp.asarray(old_means, jnp.float32)),
        is_leaf=lambda x: x is None,
    )
    return objective, variables, batch


@pytest.mark.parametrize("name", list(VARIANTS))
def test_released_guard_loss_and_gradient_match_numpy(name):
    guard = VARIANTS[name]
    objective, variables, batch = setup(3)
    objective = eqx.tree_at(lambda o: o.guard, objective, guard, is_leaf=lambda x: x is None)

    def value(policy):
        total, _ = objective.loss(fg.FlowGRPOVariables(policy, variables.reference), batch, STEP)
        return total.total, total.count

    (total, count), grads = eqx.filter_value_and_grad(value, has_aux=True)(variables.policy)
    params = LinearParams.of(variables.policy)
    want, want_count = numpy_loss(objective, guard, params, batch)
    assert float(count) == want_count > 0
    np.testing.assert_allclose(float(total), want, rtol=max(2e-4, loss_rtol()), atol=1e-5)

    # The gradient: central differences of the float64 statement in every parameter.
    numerics = ref.central_differences(
        lambda arrays: numpy_loss(objective, guard, LinearParams(*arrays), batch)[0],
        [params.weight, params.time, params.cond_weight],
    )
    for got, numeric in zip((grads.weight, grads.time, grads.cond_weight), numerics, strict=True):
        scale = max(np.abs(numeric).max(), 1e-3)
        np.testing.assert_allclose(np.asarray(got, np.float64), numeric, atol=2e-3 * scale)


def test_the_batch_and_sample_drift_differ_and_the_default_is_the_authors_fix():
    assert fg.GRPOGuard() == fg.GRPOGuard(drift="sample", scale="batch", reweight=True)
    objective, variables, batch = setup(5)
    totals = {}
    for name, guard in VARIANTS.items():
        guarded = eqx.tree_at(lambda o: o.guard, objective, guard, is_leaf=lambda x: x is None)
        totals[name] = float(guarded.loss(variables, batch, STEP)[0].total)
    assert len({round(v, 6) for v in totals.values()}) == 3


def test_a_released_guard_without_old_means_is_refused_by_name():
    objective, variables, batch = setup(3)
    batch = eqx.tree_at(lambda b: b.old_means, batch, None)
    objective = eqx.tree_at(
        lambda o: o.guard, objective, fg.GRPOGuard(), is_leaf=lambda x: x is None
    )
    message = (
        "`guard`=GRPOGuard() adds back the drift from the rollout's means, but "
        "`batch.old_means` is None: sample with `SDESampler(record_means=True)`."
    )
    with pytest.raises(ValueError, match=exact_message(message)):
        objective.loss(variables, batch, STEP)


def test_the_rollout_records_the_means_that_score_its_log_probs():
    objective = make_objective(guidance=True)
    flow = objective.flow

    def reward(samples, rows):
        return np.asarray(samples, np.float64).sum(axis=1)

    sampler = fg.SDESampler(objective.sde, record_means=True)
    rollout = fg.FlowRollout(objective, reward, groups=2, steps=5, sampler=sampler)
    rows = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3)).astype(np.float32))
    batch, _ = rollout.collect(objective.init(jax.random.key(0)).policy, rows, jax.random.key(1))
    assert batch.old_means is not None and batch.old_means.shape == batch.latents.shape
    mean, std = flow.transition(
        objective.sde,
        objective.init(jax.random.key(0)).policy,
        batch.latents[:, 0],
        batch.timesteps[:, 0],
        batch.next_timesteps[:, 0],
        batch.cond,
    )
    np.testing.assert_allclose(np.asarray(batch.old_means[:, 0]), np.asarray(mean), atol=1e-5)
    del std
