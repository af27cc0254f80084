"""Flow-DPPO (docs/mathematics/dppo.md §12) against the float64 NumPy statement of its release
(`numpy_reference.dppo_kl`, `dppo_dropped`, `dppo_loss`): the loss and its gradient, the
asymmetric divergence mask, where the anchors come from, and the constructor's checks."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flowgrpo_eqx as fg
from flowgrpo_eqx.train import Trainer, rl_epoch
from tests import numpy_reference as ref
from tests.errors import exact_message, raises_named
from tests.test_objective import (
    DIM,
    NULL,
    STEP,
    LinearParams,
    LinearVelocity,
    make_batch,
    numpy_guided,
    numpy_transitions,
    perturbed,
    rollout_info,
)


SDES = {"flow": fg.FlowSDE(0.7), "cps": fg.CoefficientsPreservingSDE(0.7)}


def info_of(batch):
    return rollout_info(jnp.zeros((batch.num_rows, DIM), jnp.float32))


def make_dppo(sde=SDES["flow"], key=0, **settings):
    flow = fg.GuidedFlow(
        LinearVelocity(jax.random.key(key)),
        fg.RectifiedFlow(shift=3.0),
        fg.InputSpec(null=jnp.asarray(NULL), latent_shape=(DIM,)),
        fg.CFG(2.5),
    )
    return fg.FlowDPPOObjective(flow, sde=sde, **settings)


def numpy_terms(objective, params, batch):
    """Each transition's log-ratio and KL in float64, and the kept set."""
    kept, means, std, log_ratio = numpy_transitions(objective, params, batch)
    old_means = np.asarray(batch.old_means, np.float64)
    kl = np.zeros(kept.shape)
    for i, j in zip(*np.nonzero(kept), strict=True):
        kl[i, j] = ref.dppo_kl(means[i, j], old_means[i, j], std[i, j], objective.normalise_kl)
    return log_ratio, kl, kept


def numpy_loss(objective, params, batch):
    """`(total, count, dropped)` of the released loss, in float64."""
    log_ratio, kl, kept = numpy_terms(objective, params, batch)
    advantages = np.asarray(batch.advantages, np.float64)
    return ref.dppo_loss(log_ratio, kl, advantages, kept, objective.kl_threshold)


def old_means_of(objective, model, batch):
    """The old policy's transition means, in float64 NumPy (cast to float32)."""
    params, sde = LinearParams.of(model), objective.sde
    scale = objective.flow.guidance.scale
    latents, cond = np.asarray(batch.latents, np.float64), np.asarray(batch.cond, np.float64)
    t_all, t_next_all = np.asarray(batch.timesteps), np.asarray(batch.next_timesteps)
    means = np.zeros(latents.shape)
    for i in range(latents.shape[0]):
        for j in range(latents.shape[1]):
            t, t_next = float(t_all[i, j]), float(t_next_all[i, j])
            v = numpy_guided(params, latents[i, j], t, cond[i], scale)
            means[i, j], _ = ref.transition(latents[i, j], v, t, t_next, sde.noise_level)
    return jnp.asarray(means, jnp.float32)


def setup(seed, sde=SDES["flow"], size=0.05, **settings):
    """An objective, a policy moved off the old one, and a batch with the old policy's
    means and (noisy) log densities, its threshold set between two of its KLs."""
    objective = make_dppo(sde=sde, **settings)
    old_policy = objective.init(jax.random.key(1)).policy
    policy = perturbed(old_policy, jax.random.key(2), size)
    batch = make_batch(seed=seed, steps=8)
    rescored = np.asarray(objective.log_probs(fg.PolicyVariables(old_policy), batch))
    noise = np.random.default_rng(seed).normal(size=rescored.shape) * 0.05
    batch = eqx.tree_at(
        lambda b: (b.old_log_probs, b.old_means),
        batch,
        (
            jnp.asarray((rescored + noise).astype(np.float32)),
            old_means_of(objective, old_policy, batch),
        ),
        is_leaf=lambda x: x is None,
    )
    if "kl_threshold" not in settings:
        _, kl, kept = numpy_terms(objective, LinearParams.of(policy), batch)
        # Between the two KLs of the middle half that lie furthest apart (as a ratio), so
        # that no KL lies near it.
        ordered = np.sort(kl[kept])
        middle = range(max(1, len(ordered) // 4), max(2, 3 * len(ordered) // 4))
        gap = max(middle, key=lambda i: ordered[i] / ordered[i - 1])
        assert ordered[gap] > 1.01 * ordered[gap - 1] > 0
        threshold = float(np.sqrt(ordered[gap - 1] * ordered[gap]))
        objective = eqx.tree_at(lambda o: o.kl_threshold, objective, threshold)
    return objective, fg.PolicyVariables(policy), batch


def value_and_grad(objective, variables, batch):
    def value(policy):
        total, aux = objective.loss(fg.PolicyVariables(policy), batch, STEP)
        return total.total, (total.count, aux)

    (total, (count, aux)), grads = eqx.filter_value_and_grad(value, has_aux=True)(variables.policy)
    return float(total), float(count), aux, grads


@pytest.mark.parametrize(
    "kind, normalise_kl", [("flow", True), ("cps", True), ("flow", False)], ids=str
)
def test_loss_aux_and_gradient_match_numpy(kind, normalise_kl):
    objective, variables, batch = setup(3, SDES[kind], normalise_kl=normalise_kl)
    total, count, aux, grads = value_and_grad(objective, variables, batch)
    params = LinearParams.of(variables.policy)
    want, want_count, dropped = numpy_loss(objective, params, batch)
    assert count == want_count > 0
    # The threshold splits the KLs: some terms are dropped, others kept.
    assert 0 < dropped.sum() < want_count
    np.testing.assert_allclose(total, want, rtol=2e-4, atol=1e-5)

    log_ratio, kl, kept = numpy_terms(objective, params, batch)
    advantages = np.repeat(np.asarray(batch.advantages, np.float64)[:, None], kl.shape[1], 1)
    ratio = np.exp(log_ratio)
    expected = {
        "ratio": ratio[kept].mean(),
        "approx_kl": (0.5 * log_ratio[kept] ** 2).mean(),
        "kl": kl[kept].mean(),
        "high_kl_fraction": (kl[kept] >= objective.kl_threshold).mean(),
        "masked_fraction": dropped[kept].mean(),
        "masked_positive_fraction": (dropped & (advantages > 0))[kept].mean(),
        "masked_negative_fraction": (dropped & (advantages < 0))[kept].mean(),
        "policy_loss": want / want_count,
    }
    for name, value in expected.items():
        np.testing.assert_allclose(
            float(getattr(aux, name).value), value, rtol=2e-4, atol=1e-6, err_msg=name
        )
    assert float(aux.counted) == want_count
    assert aux.log_probs is None and isinstance(aux.means, fg.PerRow)

    # The gradient: central differences of the float64 statement in every parameter.
    numerics = ref.central_differences(
        lambda arrays: numpy_loss(objective, LinearParams(*arrays), batch)[0],
        [params.weight, params.time, params.cond_weight],
    )
    for got, numeric in zip((grads.weight, grads.time, grads.cond_weight), numerics, strict=True):
        scale = max(np.abs(numeric).max(), 1e-3)
        np.testing.assert_allclose(np.asarray(got, np.float64), numeric, atol=2e-3 * scale)


def test_the_mask_drops_high_kl_terms_that_push_further_and_keeps_corrective_ones():
    # verl-omni's example: ratios 1.2, 0.8, 1.2, 0.8 with advantages 10, -10, -8, 8.
    ratio = jnp.asarray([1.2, 0.8, 1.2, 0.8])
    advantage = jnp.asarray([10.0, -10.0, -8.0, 8.0])
    high = jnp.full(4, 0.02)
    assert fg.divergence_mask(high, ratio, advantage, 1e-5).tolist() == [True, True, False, False]
    assert not fg.divergence_mask(jnp.full(4, 1e-6), ratio, advantage, 1e-5).any()
    # The threshold itself is high (the release keeps `kl < threshold`); a ratio of exactly 1
    # and an advantage of exactly 0 are never dropped.
    assert fg.divergence_mask(jnp.full(4, 1e-5), ratio, advantage, 1e-5).tolist()[:2] == [
        True,
        True,
    ]
    assert not fg.divergence_mask(high, jnp.ones(4), advantage, 1e-5).any()
    assert not fg.divergence_mask(high, ratio, jnp.zeros(4), 1e-5).any()
    rng = np.random.default_rng(0)
    kl = rng.exponential(1e-5, size=200).astype(np.float32)
    ratio = np.exp(rng.normal(size=200) * 0.1).astype(np.float32)
    ratio[:20] = 1.0
    advantage = rng.normal(size=200).astype(np.float32)
    advantage[20:40] = 0.0
    got = np.asarray(fg.divergence_mask(kl, ratio, advantage, np.float32(1e-5)))
    np.testing.assert_array_equal(got, ref.dppo_dropped(kl, ratio, advantage, np.float32(1e-5)))


def _single_transition(advantage, log_ratio_shift):
    """One kept transition, far from the old policy (every KL high), whose old log density
    makes its log-ratio `log_ratio_shift`."""
    objective, variables, batch = setup(7, size=0.5, kl_threshold=1e-12)
    mask = np.zeros(batch.transition_mask.shape, bool)
    mask[0, 0] = True
    new = np.asarray(objective.log_probs(variables, batch))
    old = np.asarray(batch.old_log_probs).copy()
    old[0, 0] = new[0, 0] - log_ratio_shift
    advantages = np.zeros(batch.advantages.shape, np.float32)
    advantages[0] = advantage
    batch = eqx.tree_at(
        lambda b: (b.transition_mask, b.old_log_probs, b.advantages),
        batch,
        (jnp.asarray(mask), jnp.asarray(old), jnp.asarray(advantages)),
    )
    return objective, variables, batch


@pytest.mark.parametrize("shift", [0.1, 1000.0])
def test_a_dropped_term_has_no_value_or_gradient_even_when_its_ratio_overflows(shift):
    objective, variables, batch = _single_transition(2.0, shift)
    total, count, aux, grads = value_and_grad(objective, variables, batch)
    assert (total, count) == (0.0, 1.0)
    assert float(aux.masked_fraction.value) == float(aux.masked_positive_fraction.value) == 1.0
    assert float(aux.kl.value) > 1e-6
    for leaf in jax.tree.leaves(grads):
        np.testing.assert_array_equal(np.asarray(leaf), 0.0)


def test_a_corrective_term_counts_however_high_its_kl():
    objective, variables, batch = _single_transition(-2.0, 0.1)
    total, count, aux, grads = value_and_grad(objective, variables, batch)
    assert count == 1.0 and float(aux.masked_fraction.value) == 0.0
    assert float(aux.high_kl_fraction.value) == 1.0
    np.testing.assert_allclose(total, 2.0 * np.exp(0.1), rtol=1e-5)
    assert any(np.any(np.asarray(leaf) != 0.0) for leaf in jax.tree.leaves(grads))


def test_the_denominator_counts_the_dropped_terms_as_released():
    objective, variables, batch = setup(5)
    total, aux = objective.loss(variables, batch, STEP)
    _, want_count, dropped = numpy_loss(objective, LinearParams.of(variables.policy), batch)
    assert dropped.any()
    assert float(total.count) == want_count == int(np.asarray(objective.kept(batch)).sum())


def test_chunking_and_row_splits_do_not_change_the_loss():
    objective, variables, batch = setup(4, old_log_probs="update")
    whole, aux = objective.loss(variables, batch, STEP)
    for chunk in (1, 2, 4):
        chunked = eqx.tree_at(
            lambda o: o.transition_chunk, objective, chunk, is_leaf=lambda x: x is None
        )
        value, chunked_aux = chunked.loss(variables, batch, STEP)
        np.testing.assert_allclose(float(value.total), float(whole.total), rtol=1e-6)
        for got, want in zip(jax.tree.leaves(chunked_aux), jax.tree.leaves(aux), strict=True):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    assert objective.loss_sums_over_rows()
    halves = [
        jax.tree.map(lambda leaf, r=rows: leaf[r], batch) for rows in (slice(0, 2), slice(2, None))
    ]
    parts = [objective.loss(variables, half, STEP)[0] for half in halves]
    np.testing.assert_allclose(float((parts[0] + parts[1]).total), float(whole.total), rtol=1e-6)
    assert float((parts[0] + parts[1]).count) == float(whole.count)


def test_the_update_program_anchors_the_kl_and_the_ratio_exactly():
    objective, variables, batch = setup(6, old_log_probs="update")
    batch = eqx.tree_at(lambda b: b.old_means, batch, None)
    request = objective.training_batch(batch, info_of(batch))
    assert isinstance(request, fg.Rescore)
    assert request.batch.old_means is not None
    rows = jnp.arange(batch.num_rows)
    _, aux = objective.loss(variables, request.batch, STEP)
    rescored = request.fill(request.batch, rows, aux)
    kept = np.asarray(objective.kept(batch))
    new_means = np.asarray(rescored.old_means)
    np.testing.assert_array_equal(new_means[~kept], 0.0)
    old_log_probs = np.asarray(rescored.old_log_probs)
    np.testing.assert_array_equal(old_log_probs[~kept], np.asarray(batch.old_log_probs)[~kept])
    total, aux = objective.loss(variables, rescored, STEP)
    # The KL's mean and the reported one are the same number computed in two fusions: equal
    # up to round-off (1e-13 here), far below any threshold.
    assert float(aux.kl.value) < 1e-10 and float(aux.masked_fraction.total) == 0.0
    np.testing.assert_allclose(float(aux.ratio.value), 1.0, atol=1e-6)
    assert float(aux.approx_kl.value) < 1e-12
    advantages = np.repeat(np.asarray(batch.advantages)[:, None], kept.shape[1], 1)
    np.testing.assert_allclose(float(total.value), -advantages[kept].mean(), rtol=1e-6)


def test_an_epoch_of_the_default_objective_starts_inside_the_trust_region():
    # One update per epoch (all rows at once): the epoch's metrics are the first update's,
    # whose anchors (the means, by default) the update program recomputed.
    objective = make_dppo(old_log_probs="update")
    rollout = fg.FlowRollout(objective, lambda s, r: np.asarray(s).sum(axis=1), groups=4, steps=5)
    assert not objective.rollout_sampler(None).record_means
    trainer = Trainer(objective)
    state = trainer.init(jax.random.key(1))
    rows = np.random.default_rng(0).normal(size=(2, 3)).astype(np.float32)
    _, metrics, _ = rl_epoch(trainer, state, rollout, rows, jax.random.key(2))
    assert metrics["kl"] < 1e-10 and metrics["masked_fraction"] == 0.0
    assert abs(metrics["ratio"] - 1.0) < 1e-6 and np.isfinite(metrics["loss"])


def test_the_rollout_anchor_needs_recorded_means():
    objective = make_dppo(old_means="rollout")
    assert objective.rollout_sampler(None) == fg.SDESampler(objective.sde, record_means=True)
    message = (
        "`sampler` must record the rollout's means (`record_means=True`): with "
        f"`old_means='rollout'` they are the KL's anchor, got {fg.SDESampler(objective.sde)!r}."
    )
    with pytest.raises(ValueError, match=exact_message(message)):
        objective.rollout_sampler(fg.SDESampler(objective.sde))
    with pytest.raises(ValueError, match="own `sde`"):
        objective.rollout_sampler(fg.SDESampler(fg.FlowSDE(0.5), record_means=True))
    batch = make_batch(0)
    with pytest.raises(ValueError, match=r"^The rollout recorded no means"):
        objective.training_batch(batch, info_of(batch))
    recorded = eqx.tree_at(
        lambda b: b.old_means, batch, jnp.zeros_like(batch.latents), is_leaf=lambda x: x is None
    )
    assert objective.training_batch(recorded, info_of(recorded)) is recorded

    rollout = fg.FlowRollout(objective, lambda s, r: np.asarray(s).sum(axis=1), groups=2, steps=5)
    policy = objective.init(jax.random.key(0)).policy
    rows = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3)).astype(np.float32))
    collected, _ = rollout.collect(policy, rows, jax.random.key(1))
    total, aux = objective.loss(fg.PolicyVariables(policy), collected, STEP)
    assert float(aux.kl.value) < 1e-10 and float(aux.masked_fraction.total) == 0.0
    del total


def test_the_loss_without_old_means_is_refused_by_name():
    objective = make_dppo()
    batch = make_batch(0)
    variables = objective.init(jax.random.key(0))
    with pytest.raises(ValueError, match=r"^`batch.old_means` is None"):
        objective.loss(variables, batch, STEP)
    with pytest.raises(ValueError, match="recorded transitions"):
        final = fg.FinalSamples(batch.latents[:, 0], batch.advantages, batch.cond)
        objective.training_batch(final, info_of(batch))


def test_the_default_is_the_release():
    objective = make_dppo()
    assert objective.kl_threshold == 1e-5
    assert objective.normalise_kl is True
    assert (objective.old_log_probs, objective.old_means) == ("rollout", "update")
    assert make_dppo(sde=fg.FlowSDE()).sde == fg.FlowSDE(0.7)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"kl_threshold": 0.0}, "`kl_threshold` must be a finite number > 0, got 0.0."),
        ({"kl_threshold": -1e-5}, "`kl_threshold` must be a finite number > 0, got -1e-05."),
        ({"kl_threshold": float("nan")}, "`kl_threshold` must be a finite number > 0, got nan."),
        ({"normalise_kl": 1}, "`normalise_kl` must be a bool, got 1."),
        ({"old_means": "replay"}, "`old_means` must be 'rollout' or 'update', got 'replay'."),
        (
            {"old_log_probs": "replay"},
            "`old_log_probs` must be 'rollout' or 'update', got 'replay'.",
        ),
        ({"transition_chunk": 0}, "`transition_chunk` must be None or an int >= 1, got 0."),
        ({"remat": 1}, "`remat` must be a bool or None, got 1."),
        ({"sde": "flow"}, "`sde` must be an AbstractSDE, got 'flow'."),
    ],
)
def test_the_constructor_names_a_bad_argument(settings, message):
    with raises_named(message):
        make_dppo(**settings)


def test_the_demo_builds_the_released_objective_and_refuses_what_it_lacks():
    from flowgrpo_eqx.shapes_demo import make_config
    from flowgrpo_eqx.shapes_demo.algorithms import JobPieces

    config = make_config("tiny", algorithm="dppo")
    algorithm = config.chosen_algorithm
    assert algorithm.trains_on_ratios and algorithm.advantage_std == "global"
    job = JobPieces(
        config=config,
        model=LinearVelocity(jax.random.key(0)),
        inputs=fg.InputSpec(null=jnp.asarray(NULL), latent_shape=(DIM,)),
        guidance=fg.CFG(config.rollout.guidance_scale),
        reward=lambda samples, rows: np.zeros(len(samples)),
    )
    objective = algorithm.objective(job, None)
    assert isinstance(objective, fg.FlowDPPOObjective)
    assert objective.kl_threshold == config.objective.dppo_kl_threshold == 1e-5
    # float32: both anchors from the rollout, which records its means.
    assert (objective.old_log_probs, objective.old_means) == ("rollout", "rollout")
    assert algorithm.sampler(job).record_means
    named = make_config("tiny", algorithm="dppo", dppo_kl_threshold=1e-3, old_log_probs="update")
    job = JobPieces(named, job.model, job.inputs, job.guidance, job.reward)
    objective = named.chosen_algorithm.objective(job, None)
    assert objective.kl_threshold == 1e-3
    assert (objective.old_log_probs, objective.old_means) == ("update", "update")
    assert not named.chosen_algorithm.sampler(job).record_means
    with pytest.raises(ValueError, match="`beta` .* must be 0 with algorithm 'dppo'"):
        make_config("tiny", algorithm="dppo", beta=0.01)
    with pytest.raises(ValueError, match="`grpo_guard` must be false with algorithm 'dppo'"):
        make_config("tiny", algorithm="dppo", grpo_guard=True)
