"""Properties of Flow-DPPO (docs/mathematics/dppo.md §12): on-policy it is Flow-GRPO's unclipped
surrogate, its mask only grows with the KL, and its loss is a mean over every trained
transition, dropped ones included, as released.

Batches are rollout-like (`_strategies.make_rollout`); the old policy's means are rescored by
the objective's own loss, as the trainer's `Rescore` does (`old_means="update"`).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, strategies as st
from hypothesis.extra import numpy as hnp

import flowgrpo_eqx as fg
import flowgrpo_eqx.testing as T
from property_tests import _strategies as S
from tests import numpy_reference as ref, tolerances


STEP = fg.Step(index=0, key=jax.random.key(0))
THRESHOLDS = (1e-9, 1e-5, 1e-2)
OFF_POLICY_THRESHOLDS = (1e-4, 1e-3, 1e-2, 1e-1)
SHAPES = ((2, 2), (4, 3))


@eqx.filter_jit
def _dppo(objective: fg.FlowDPPOObjective, policy, batch: fg.Transitions):
    """`((total, (count, aux)), d mean / d policy)`: the loss as the trainer differentiates it."""

    def mean(p):
        value, aux = objective.loss(fg.PolicyVariables(p), batch, STEP)
        return value.value, (value, aux)

    (_, (value, aux)), grads = eqx.filter_value_and_grad(mean, has_aux=True)(policy)
    return (value.total, (value.count, aux)), grads


def _dppo_of(config: S.Config, threshold: float) -> fg.FlowDPPOObjective:
    grpo = config.objective()
    return fg.FlowDPPOObjective(grpo.flow, sde=config.sde, kl_threshold=threshold)


def _anchored(objective: fg.FlowDPPOObjective, old_policy, batch: fg.Transitions):
    """`batch` with the old policy's means, as the trainer's `Rescore` writes them."""
    placeholder = eqx.tree_at(
        lambda b: b.old_means, batch, jnp.zeros_like(batch.latents), is_leaf=lambda x: x is None
    )
    _, (_, aux) = _dppo(objective, old_policy, placeholder)[0]
    return objective.with_rescored_rows(placeholder, jnp.arange(batch.num_rows), aux)


@T.property_settings(20)
@given(
    config=S.beta_free_configs,
    seed=T.seeds(),
    shape=st.sampled_from(SHAPES),
    per_transition=st.booleans(),
    threshold=st.sampled_from(THRESHOLDS),
)
def test_on_policy_nothing_is_masked_and_the_loss_is_the_unclipped_surrogate(
    config, seed, shape, per_transition, threshold
):
    """With the policy equal to the old policy every KL is 0 (up to round-off, far below any
    threshold): the mask keeps every step, whatever the ratios (the rollout's old log
    densities are noisy here), and the loss and its gradient are Flow-GRPO's with a clip
    that never binds: `mean_kept(-A r)`."""
    rows, transitions = shape
    rollout = S.make_rollout(
        config, seed, rows, transitions, per_transition_advantages=per_transition
    )
    objective = _dppo_of(config, threshold)
    policy = objective.init(jax.random.key(0)).policy
    batch = _anchored(objective, policy, rollout.batch)
    (total, (count, aux)), grads = _dppo(objective, policy, batch)
    assert float(aux.masked_fraction.total) == 0.0
    assert float(aux.high_kl_fraction.total) == 0.0
    assert float(aux.kl.total) <= 1e-10 * max(float(count), 1.0)
    assert float(count) == rollout.kept.sum()

    unclipped = config.objective(clip_range=1e30, adv_clip_max=1e30)
    value, mean, _, grpo_grads = T.loss_value_and_grad(
        unclipped, fg.FlowGRPOVariables(policy, None), batch
    )
    assert float(mean.count) == float(count)
    np.testing.assert_allclose(float(total), float(mean.total), rtol=1e-5, atol=1e-6)
    # Two float32 programs' round-off in a gradient entry is of the size of the terms summed
    # into it, which is the gradient's, not that entry's: a scalar leaf of 0.016 beside
    # entries of 0.54 was 3.7e-7 off, as they were.
    T.assert_trees_close(
        grads, grpo_grads, rtol=1e-7, atol=tolerances.gradient_agreement(), scale_floor=1e-3
    )
    del value


_N = 64


@T.property_settings(50)
@given(
    kl=hnp.arrays(np.float32, _N, elements=st.floats(0.0, 2.0**-10, width=32)),
    extra=hnp.arrays(np.float32, _N, elements=st.floats(0.0, 2.0**-10, width=32)),
    log_ratio=hnp.arrays(np.float32, _N, elements=st.sampled_from([-0.5, -1e-3, 0.0, 1e-3, 0.5])),
    advantage=hnp.arrays(np.float32, _N, elements=st.sampled_from([-2.0, -0.1, 0.0, 0.1, 2.0])),
    thresholds=st.lists(st.floats(2.0**-23, 2.0**-10, width=32), min_size=2, max_size=2),
)
def test_a_larger_kl_never_unmasks_a_step(kl, extra, log_ratio, advantage, thresholds):
    """`divergence_mask` is the release's mask (`dppo_dropped`), and monotone: raising a
    step's KL, or lowering the threshold, never un-drops it."""
    ratio = np.exp(log_ratio)
    low, high = sorted(np.float32(t) for t in thresholds)
    dropped = np.asarray(fg.divergence_mask(kl, ratio, advantage, high))
    np.testing.assert_array_equal(dropped, ref.dppo_dropped(kl, ratio, advantage, high))
    further = np.asarray(fg.divergence_mask(kl + extra, ratio, advantage, high))
    assert np.all(further[dropped])
    tighter = np.asarray(fg.divergence_mask(kl, ratio, advantage, low))
    assert np.all(tighter[dropped])
    # Only the high-KL terms that push further are dropped.
    assert not np.any(dropped & (kl < high))
    assert not np.any(dropped & (advantage * log_ratio <= 0))


@T.property_settings(20)
@given(
    config=S.beta_free_configs,
    seed=T.seeds(),
    shape=st.sampled_from(SHAPES),
    thresholds=st.lists(
        st.sampled_from(OFF_POLICY_THRESHOLDS), min_size=2, max_size=2, unique=True
    ),
)
def test_the_loss_is_a_mean_over_every_trained_step_dropped_ones_included(
    config, seed, shape, thresholds
):
    """Off the old policy: the count is the kept (trained) set whatever the mask drops, the
    total is the release's (`dppo_loss` on the loss's own log-ratios and KLs), and a lower
    threshold drops at least what a higher one does."""
    rows, transitions = shape
    rollout = S.make_rollout(config, seed, rows, transitions)
    low, high = sorted(thresholds)
    objective = _dppo_of(config, high)
    old_policy = objective.init(jax.random.key(0)).policy
    policy = S.perturbed(old_policy, scale=0.05, seed=seed % 1000)
    batch = _anchored(objective, old_policy, rollout.batch)
    (total, (count, aux)), _ = _dppo(objective, policy, batch)
    assert float(count) == rollout.kept.sum()

    # The release's statement on this evaluation's own log-ratios and KLs.
    log_ratio = np.asarray(objective.log_probs(fg.PolicyVariables(policy), batch), np.float64)
    log_ratio -= np.asarray(batch.old_log_probs, np.float64)
    current = _anchored(objective, policy, rollout.batch)
    kl = np.zeros(rollout.kept.shape)
    t_all = np.asarray(batch.timesteps, np.float64)
    t_next_all = np.asarray(batch.next_timesteps, np.float64)
    assert objective.kl_std == fg.ReleasedKLStd()
    for i, j in zip(*np.nonzero(rollout.kept), strict=True):
        # The default KL std is the release's recomputed Flow-SDE std, whatever the sampler.
        grid = np.asarray([t_all[i, j], t_next_all[i, j]], np.float64)
        sigma = ref.unirl_kl_sigma(grid, [0], objective.sde.noise_level, 0.99)[0]
        kl[i, j] = ref.dppo_kl(current.old_means[i, j], batch.old_means[i, j], sigma)
    want, want_count, dropped = ref.dppo_loss(
        log_ratio, kl, np.asarray(batch.advantages), rollout.kept, high
    )
    assert want_count == float(count)
    np.testing.assert_allclose(float(total), want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(
        float(aux.masked_fraction.value), dropped.sum() / max(want_count, 1), atol=1e-6
    )

    (_, (low_count, low_aux)), _ = _dppo(_dppo_of(config, low), policy, batch)
    assert float(low_count) == float(count)
    assert float(low_aux.masked_fraction.total) >= float(aux.masked_fraction.total)
    assert float(low_aux.high_kl_fraction.total) >= float(aux.high_kl_fraction.total)
