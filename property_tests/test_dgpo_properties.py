"""Properties of DGPO as released (docs/mathematics/dgpo.md §10): the released surrogate and the
group DPO loss have one gradient; the loss reads rewards only through their group
advantages, so the shifts those ignore leave it unchanged; with shared noise it does not
depend on the order of the rows; and without advantages nothing but the KL trains."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, strategies as st

import flowgrpo_eqx as fg
import flowgrpo_eqx.testing as T
from tests import tolerances
from tests.test_dgpo import G, N, _value_and_grad, setup
from tests.test_objective import perturbed


MASKS = st.lists(st.booleans(), min_size=N, max_size=N)
CLIPS = st.sampled_from([None, 0.01])
REFERENCES = st.sampled_from(["base", "ema"])


def _batch(batch: fg.GroupedSamples, seed: int, mask, advantages=None) -> fg.GroupedSamples:
    """`batch` with finite latents drawn from `seed`, the given mask and advantages."""
    rng = np.random.default_rng(seed)
    if advantages is None:
        advantages = rng.normal(size=N) * 2
    return eqx.tree_at(
        lambda b: (b.samples.latents, b.samples.advantages, b.samples.mask),
        batch,
        (
            jnp.asarray(rng.normal(size=(N, batch.samples.latents.shape[1])), jnp.float32),
            jnp.asarray(np.asarray(advantages, np.float32)),
            jnp.asarray(np.array(mask, bool)),
        ),
    )


def _perturbed(variables: fg.DGPOVariables, seed: int) -> fg.DGPOVariables:
    return eqx.tree_at(
        lambda v: v.policy, variables, perturbed(variables.policy, jax.random.key(seed), 0.1)
    )


@T.property_settings(15)
@given(seed=st.integers(0, 2**16), mask=MASKS, clip_range=CLIPS, reference=REFERENCES)
def test_the_group_dpo_loss_has_the_surrogates_gradient(seed, mask, clip_range, reference):
    """Whatever the rows, the clip and the reference: `softplus(x_g) / beta` (its group's
    counted rows sharing it) and `sg(sigmoid(x_g)) A e` differ in value, not in gradient;
    the release's surrogate (line 166) is the group DPO loss's gradient."""
    settings = {"clip_range": clip_range, "dpo_reference": reference}
    surrogate, variables, batch = setup(**settings)
    group_dpo, _, _ = setup(loss_form=fg.GroupDPOLoss(), **settings)
    variables = _perturbed(variables, seed)
    batch = _batch(batch, seed, mask)
    step = fg.Step(index=0, key=jax.random.key(seed))
    (_, (one, _)), grads = _value_and_grad(surrogate, variables, batch, step)
    (_, (other, _)), others = _value_and_grad(group_dpo, variables, batch, step)
    assert float(one.count) == float(other.count) == sum(mask)
    T.assert_trees_close(
        grads, others, rtol=1e-4, atol=tolerances.gradient_agreement(), scale_floor=0.0
    )


@T.property_settings(15)
@given(
    seed=st.integers(0, 2**16),
    rewards=st.lists(st.floats(-3, 3), min_size=N, max_size=N),
    shifts=st.lists(st.floats(-50, 50), min_size=N // G, max_size=N // G),
)
def test_the_loss_reads_rewards_through_their_group_advantages(seed, rewards, shifts):
    """The released advantages are `(r - mean_group) / std` (`PerPromptStatTracker`): a
    shift of each group's rewards leaves the group-std advantages and so the loss
    unchanged; with the global std (the released recipe's `global_std`) a shift of all
    rewards does."""
    objective, variables, batch = setup()
    variables = _perturbed(variables, seed)
    step = fg.Step(index=0, key=jax.random.key(seed))
    r = np.asarray(rewards, np.float64)
    per_group = r + np.repeat(np.asarray(shifts), G)
    common = r + shifts[0]
    for std, shifted in (("group", per_group), ("global", common)):
        values = []
        for scores in (r, shifted):
            advantages = fg.group_advantages(scores, G, std=std)
            candidate = _batch(batch, seed, [True] * N, advantages)
            (_, (mean, _)), _ = _value_and_grad(objective, variables, candidate, step)
            values.append(float(mean.value))
        np.testing.assert_allclose(values[0], values[1], rtol=1e-4, atol=1e-6)


@T.property_settings(15)
@given(seed=st.integers(0, 2**16), mask=MASKS, order=st.permutations(range(N)))
def test_with_shared_noise_the_order_of_the_rows_does_not_matter(seed, mask, order):
    """Each group draws its noise by its id and sums over its rows wherever they are: an
    epoch's shuffle of the rows (with their groups) changes neither the loss nor its
    gradient."""
    objective, variables, batch = setup()
    variables = _perturbed(variables, seed)
    batch = _batch(batch, seed, mask)
    shuffled = jax.tree.map(lambda leaf: leaf[np.asarray(order)], batch)
    step = fg.Step(index=2, key=jax.random.key(seed))
    (_, (one, _)), grads = _value_and_grad(objective, variables, batch, step)
    (_, (other, _)), others = _value_and_grad(objective, variables, shuffled, step)
    np.testing.assert_allclose(float(one.total), float(other.total), rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(others), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@T.property_settings(10)
@given(seed=st.integers(0, 2**16), mask=MASKS)
def test_without_advantages_only_the_kl_trains(seed, mask):
    """`A = 0` makes every margin 0 (weight 1/2) and the policy loss 0: the gradient is the
    KL's, and without a KL it is zero."""
    objective, variables, batch = setup()
    bare, _, _ = setup(kl_beta=0.0)
    variables = _perturbed(variables, seed)
    batch = _batch(batch, seed, mask, np.zeros(N))
    step = fg.Step(index=0, key=jax.random.key(seed))
    (_, (mean, aux)), _ = _value_and_grad(objective, variables, batch, step)
    if any(mask):
        assert float(aux["weight"].value) == 0.5 and float(aux["policy_loss"].value) == 0.0
        np.testing.assert_allclose(
            float(mean.value), 0.02 * float(aux["kl"].value), rtol=1e-6, atol=1e-9
        )
    (_, (zero, _)), grads = _value_and_grad(bare, variables, batch, step)
    assert float(zero.value) == 0.0
    for leaf in jax.tree.leaves(grads):
        np.testing.assert_array_equal(np.asarray(leaf), 0.0)
