"""Properties of AWM as released (docs/mathematics/awm.md §9): on-policy the ratio is exactly 1 and
the loss is `-mean(A')`; the loss's denominators are the counted rows, whatever the masked
rows hold, and a batch's `Mean` is the sum of its disjoint masks' `Mean`s."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, strategies as st

import flowgrpo_eqx as fg
import flowgrpo_eqx.testing as T
from tests import numpy_reference as ref
from tests.test_awm import N, make_objective, setup
from tests.test_objective import perturbed


WEIGHTINGS = st.sampled_from([fg.GHuberWeighting(), fg.HuberWeighting(), fg.TimeSquaredWeighting()])
RATIOS = st.sampled_from([fg.PerTimeRatio(), fg.PerRowRatio()])
MASKS = st.lists(st.booleans(), min_size=N, max_size=N)


@eqx.filter_jit
def _loss(objective: fg.AWMObjective, variables: fg.AWMVariables, batch, step: fg.Step):
    def total(policy):
        both = fg.AWMVariables(policy, variables.ema, variables.reference)
        mean, aux = objective.loss(both, batch, step)
        return mean.total, (mean, aux)

    return jax.value_and_grad(total, has_aux=True)(variables.policy)


def _batch(seed: int, mask: list[bool], spread: float) -> fg.FinalSamples:
    """`setup`'s batch (its grid) with finite latents and advantages drawn from `seed`."""
    _, _, batch = setup()
    rng = np.random.default_rng(seed)
    return eqx.tree_at(
        lambda b: (b.latents, b.advantages, b.mask),
        batch,
        (
            jnp.asarray(rng.normal(size=batch.latents.shape).astype(np.float32)),
            jnp.asarray((rng.normal(size=N) * spread).astype(np.float32)),
            jnp.asarray(np.array(mask, bool)),
        ),
    )


@T.property_settings(20)
@given(seed=st.integers(0, 2**16), weighting=WEIGHTINGS, ratio=RATIOS, mask=MASKS)
def test_on_policy_the_ratio_is_one_and_the_loss_minus_the_mean_advantage(
    seed, weighting, ratio, mask
):
    """Whatever the policy, the weighting and where the ratio is taken, the released
    on-policy ratio `exp(log p - stop_gradient(log p))` is exactly 1, nothing clips, and
    without KL terms the loss is `-mean(A')` over the counted rows; zero advantages give
    zero gradient."""
    objective = make_objective(weighting=weighting, ratio=ratio, kl_beta=0.0, ema_beta=0.0)
    variables = objective.init(jax.random.key(0))
    variables = eqx.tree_at(
        lambda v: v.policy, variables, perturbed(variables.policy, jax.random.key(seed), 0.2)
    )
    batch = _batch(seed, mask, 3.0)
    step = fg.Step(index=0, key=jax.random.key(seed))
    (_, (mean, aux)), _ = _loss(objective, variables, batch, step)
    kept = np.array(mask, bool)
    assert float(mean.count) == kept.sum()
    if kept.any():
        assert float(aux["ratio"].value) == 1.0 and float(aux["clipfrac"].value) == 0.0
        a = ref.awm_advantages(np.asarray(batch.advantages)[kept], 5.0, 1.0)
        np.testing.assert_allclose(float(mean.value), -a.mean(), rtol=1e-5, atol=1e-7)
    else:
        assert float(mean.value) == 0.0
    zero = eqx.tree_at(lambda b: b.advantages, batch, jnp.zeros(N))
    _, grads = _loss(objective, variables, zero, step)
    for leaf in jax.tree.leaves(grads):
        np.testing.assert_array_equal(np.asarray(leaf), 0.0)


@T.property_settings(20)
@given(seed=st.integers(0, 2**16), ratio=RATIOS, first=MASKS, second=MASKS)
def test_the_loss_sums_over_disjoint_masks_and_ignores_masked_rows(seed, ratio, first, second):
    """With the KL terms and an off-policy ratio that clips: the count is the counted rows,
    the `Mean` of a mask is the sum of the `Mean`s of two disjoint masks that make it up
    (the same draws: the step and the row count are the same), and the masked rows' latents
    and advantages do not move it."""
    objective, variables, _ = setup(off_policy=True, clip_range=0.05, ratio=ratio)
    one = np.array(first, bool)
    other = np.array(second, bool) & ~one
    step = fg.Step(index=1, key=jax.random.key(seed))
    batch = _batch(seed, list(one | other), 4.0)
    (_, (whole, _)), _ = _loss(objective, variables, batch, step)
    parts = [
        _loss(objective, variables, eqx.tree_at(lambda b: b.mask, batch, jnp.asarray(m)), step)
        for m in (one, other)
    ]
    summed = parts[0][0][1][0] + parts[1][0][1][0]
    assert float(whole.count) == float(summed.count) == (one | other).sum()
    np.testing.assert_allclose(float(whole.total), float(summed.total), rtol=1e-5, atol=1e-6)
    hidden = ~(one | other)
    noisy = eqx.tree_at(
        lambda b: (b.latents, b.advantages),
        batch,
        (
            jnp.where(hidden[:, None], jnp.nan, batch.latents),
            jnp.where(hidden, 1e9, batch.advantages),
        ),
    )
    (_, (again, _)), grads = _loss(objective, variables, noisy, step)
    assert float(again.total) == float(whole.total)
    assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(grads))
