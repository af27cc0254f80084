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


def kl_sigma(objective, t, t_next, std):
    """The KL's std in float64: the release's `_compute_sigma_t` (`ReleasedKLStd`), the
    transition's own (`TransitionKLStd`, its open fix), or 1 (`UnitKLStd`)."""
    kind = type(objective.kl_std)
    if kind is fg.ReleasedKLStd:
        grid = np.asarray([t, t_next], np.float64)
        sigma_max = objective.kl_std.sigma_max
        return float(ref.unirl_kl_sigma(grid, [0], objective.sde.noise_level, sigma_max)[0])
    return float(std) if kind is fg.TransitionKLStd else 1.0


def numpy_terms(objective, params, batch):
    """Each transition's log-ratio and KL in float64, and the kept set."""
    kept, means, std, log_ratio = numpy_transitions(objective, params, batch)
    old_means = np.asarray(batch.old_means, np.float64)
    t_all = np.asarray(batch.timesteps, np.float64)
    t_next_all = np.asarray(batch.next_timesteps, np.float64)
    kl = np.zeros(kept.shape)
    for i, j in zip(*np.nonzero(kept), strict=True):
        sigma = kl_sigma(objective, t_all[i, j], t_next_all[i, j], std[i, j])
        kl[i, j] = ref.dppo_kl(means[i, j], old_means[i, j], sigma)
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


def setup(seed, sde=SDES["flow"], size=0.05, steps=8, n=5, **settings):
    """An objective, a policy moved off the old one, and a batch with the old policy's
    means and (noisy) log densities, its threshold set between two of its KLs."""
    objective = make_dppo(sde=sde, **settings)
    old_policy = objective.init(jax.random.key(1)).policy
    policy = perturbed(old_policy, jax.random.key(2), size)
    batch = make_batch(seed=seed, steps=steps, n=n)
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


KL_STDS = {
    "released": fg.ReleasedKLStd(),
    "transition": fg.TransitionKLStd(),
    "unit": fg.UnitKLStd(),
}


@pytest.mark.parametrize(
    "kind, kl_std",
    [("flow", "released"), ("flow", "transition"), ("cps", "released"), ("flow", "unit")],
    ids=str,
)
def test_loss_aux_and_gradient_match_numpy(kind, kl_std):
    objective, variables, batch = setup(3, SDES[kind], kl_std=KL_STDS[kl_std])
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
    # whose anchors (the means, by default) the update program recomputed. The release's
    # grid of 10 steps, 3 of the first 5 stochastic.
    objective = make_dppo(old_log_probs="update")
    rollout = fg.FlowRollout(
        objective,
        lambda s, r: np.asarray(s).sum(axis=1),
        groups=4,
        steps=11,
        advantage_std="global_unbiased",
    )
    assert not objective.rollout_sampler(None).record_means
    trainer = Trainer(objective)
    state = trainer.init(jax.random.key(1))
    rows = np.random.default_rng(0).normal(size=(2, 3)).astype(np.float32)
    _, metrics, _ = rl_epoch(trainer, state, rollout, rows, jax.random.key(2))
    assert metrics["kl"] < 1e-10 and metrics["masked_fraction"] == 0.0
    assert abs(metrics["ratio"] - 1.0) < 1e-6 and np.isfinite(metrics["loss"])


def test_the_rollout_anchor_needs_recorded_means():
    objective = make_dppo(old_means="rollout", sde_steps=None)
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
    assert objective.kl_std == fg.ReleasedKLStd(0.99)
    assert (objective.old_log_probs, objective.old_means) == ("rollout", "update")
    assert make_dppo(sde=fg.FlowSDE()).sde == fg.FlowSDE(0.7)
    # The release's rollout: 3 SDE steps drawn per rollout among the first 5 of 10.
    sampler = objective.rollout_sampler(None)
    assert sampler.window_schedule == fg.RandomSteps(3, fraction=(0.0, 0.5))
    for epoch in range(1, 21):
        steps = sampler.window_schedule.steps(epoch, 10)
        assert list(steps) == ref.unirl_sde_indices(10, (0.0, 0.5), 3, epoch - 1)


# The KL's std on SD3's grid of 10 steps (shift 3), as `_compute_sigma_t` computes it with
# the release's eta 0.7, and as the release's open fix computes it (the transition's std).
SD3_GRID = ref.grid(11, 3.0)


def test_the_released_kl_std_is_the_releases_and_differs_at_the_first_step_only():
    t, t_next = jnp.asarray(SD3_GRID[:-1], jnp.float32), jnp.asarray(SD3_GRID[1:], jnp.float32)
    sde = fg.FlowSDE(0.7)
    _, transition_std = jax.vmap(lambda a, b: sde.transition(jnp.zeros(2), jnp.zeros(2), a, b))(
        t, t_next
    )
    released = jax.vmap(lambda a, b, s: fg.ReleasedKLStd()(sde, a, b, s))(t, t_next, transition_std)
    want = ref.unirl_kl_sigma(np.float32(SD3_GRID).astype(np.float64), range(10), 0.7)
    np.testing.assert_allclose(np.asarray(released), want, rtol=2e-6)
    fixed = jax.vmap(lambda a, b, s: fg.TransitionKLStd()(sde, a, b, s))(t, t_next, transition_std)
    np.testing.assert_array_equal(np.asarray(fixed), np.asarray(transition_std))
    # After the first step the two agree; at t = 1 the clamp makes the KL 100 (1 - t_next)
    # times smaller: 1/3.57 on this grid.
    np.testing.assert_allclose(np.asarray(released)[1:], np.asarray(transition_std)[1:], rtol=2e-6)
    kl_ratio = float((released[0] / transition_std[0]) ** 2)
    np.testing.assert_allclose(kl_ratio, 100 * (1 - SD3_GRID[1]), rtol=1e-5)
    assert 3.56 < kl_ratio < 3.58
    unit = fg.UnitKLStd()(sde, t[0], t_next[0], transition_std[0])
    assert float(unit) == 1.0
    assert float(fg.ReleasedKLStd()(sde, t[0], t_next[0], jnp.float32(0.0))) == 0.0


def test_the_first_steps_kl_decides_the_mask_differently():
    # A batch of first-step transitions only, its threshold their median KL under the
    # transition's std: the released KL std (100 (1 - t_next) times smaller there) lets
    # through terms that the transition's std drops.
    objective, variables, batch = setup(
        3, size=0.2, steps=7, n=12, kl_std=fg.TransitionKLStd(), kl_threshold=1.0
    )
    first = np.asarray(batch.timesteps) == 1.0
    batch = eqx.tree_at(
        lambda b: b.transition_mask, batch, jnp.asarray(np.asarray(batch.transition_mask) & first)
    )
    params = LinearParams.of(variables.policy)
    log_ratio, fixed_kl, kept = numpy_terms(objective, params, batch)
    assert kept.sum() >= 6
    objective = eqx.tree_at(lambda o: o.kl_threshold, objective, float(np.median(fixed_kl[kept])))
    released = eqx.tree_at(lambda o: o.kl_std, objective, fg.ReleasedKLStd())
    _, released_kl, _ = numpy_terms(released, params, batch)
    t_next = np.asarray(batch.next_timesteps, np.float64)[kept]
    np.testing.assert_allclose(released_kl[kept], fixed_kl[kept] / (100 * (1 - t_next)), rtol=1e-6)
    advantages = np.repeat(np.asarray(batch.advantages)[:, None], kept.shape[1], 1)
    drops = {}
    for candidate, kl in ((objective, fixed_kl), (released, released_kl)):
        total, count, dropped = ref.dppo_loss(
            log_ratio, kl, advantages, kept, candidate.kl_threshold
        )
        value, aux = candidate.loss(variables, batch, STEP)
        np.testing.assert_allclose(float(aux.kl.value), kl[kept].mean(), rtol=2e-4)
        np.testing.assert_allclose(float(value.total), total, rtol=2e-4, atol=1e-6)
        drops[candidate.kl_std] = dropped
    fixed_dropped, released_dropped = drops[fg.TransitionKLStd()], drops[fg.ReleasedKLStd()]
    assert (released_dropped <= fixed_dropped).all()
    assert fixed_dropped.sum() > released_dropped.sum()


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"kl_threshold": 0.0}, "`kl_threshold` must be a finite number > 0, got 0.0."),
        ({"kl_threshold": -1e-5}, "`kl_threshold` must be a finite number > 0, got -1e-05."),
        ({"kl_threshold": float("nan")}, "`kl_threshold` must be a finite number > 0, got nan."),
        (
            {"kl_std": "released"},
            "`kl_std` must be an AbstractKLStd (ReleasedKLStd, TransitionKLStd, UnitKLStd), got "
            "'released'.",
        ),
        (
            {"sde": fg.FlowSDE(0.7, window=(1.0, 0.5))},
            "`sde_steps` must be None with an `sde` that has a `window` (the window places the "
            "noise), got RandomSteps(count=3, fraction=(0.0, 0.5)) beside window=(1.0, 0.5).",
        ),
        (
            {"sde_steps": 3},
            "`sde_steps` must be None or an AbstractWindowSchedule (RandomSteps, "
            "FixedWindow, ...), got 3.",
        ),
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
    assert algorithm.trains_on_ratios and algorithm.advantage_std == "global_unbiased"
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
    assert objective.kl_std == fg.ReleasedKLStd()
    # float32: both anchors from the rollout, which records its means.
    assert (objective.old_log_probs, objective.old_means) == ("rollout", "rollout")
    sampler = algorithm.sampler(job)
    assert sampler.record_means and sampler.sde == objective.sde == fg.FlowSDE(0.7)
    # The tiny grid's 3 transitions: the first half widened to the job's 2 SDE steps.
    assert sampler.window_schedule == objective.sde_steps
    assert sampler.window_schedule.steps(1, 3) == (0, 1)
    named = make_config(
        "tiny",
        algorithm="dppo",
        dppo_kl_threshold=1e-3,
        dppo_kl_std="transition",
        old_log_probs="update",
    )
    job = JobPieces(named, job.model, job.inputs, job.guidance, job.reward)
    objective = named.chosen_algorithm.objective(job, None)
    assert objective.kl_threshold == 1e-3 and objective.kl_std == fg.TransitionKLStd()
    assert (objective.old_log_probs, objective.old_means) == ("update", "update")
    assert not named.chosen_algorithm.sampler(job).record_means
    # The release's grid and steps: 3 drawn among the first 5 of 10 transitions.
    released = make_config("tiny", algorithm="dppo", rollout_steps=11, sde_steps=3, train_steps=3)
    job = JobPieces(released, job.model, job.inputs, job.guidance, job.reward)
    assert released.chosen_algorithm.sampler(job).window_schedule == fg.RandomSteps(
        3, fraction=(0.0, 0.5)
    )
    with pytest.raises(ValueError, match="`train_steps`=2 must equal `sde_steps`=3"):
        make_config("tiny", algorithm="dppo", rollout_steps=11, sde_steps=3)
    with pytest.raises(ValueError, match="`beta` .* must be 0 with algorithm 'dppo'"):
        make_config("tiny", algorithm="dppo", beta=0.01)
    with pytest.raises(ValueError, match="`grpo_guard` must be false with algorithm 'dppo'"):
        make_config("tiny", algorithm="dppo", grpo_guard=True)
