"""DanceGRPO (docs/mathematics/dancegrpo.md §13) against its released code run on the CPU
(`tests/data/released/dancegrpo.npz`, made by `tools/make_released_fixtures.py`) and against
the float64 statements of that code (`numpy_reference.dance_step`, `dance_log_prob`,
`dancegrpo_advantages`, `dancegrpo_loss`): the SDE step and its log density, the rollout's
trained steps, the group advantages, and the loss with one or several rewards."""

import math
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flowgrpo_eqx as fg
from flowgrpo_eqx.train import Trainer, rl_epoch
from tests import numpy_reference as ref
from tests.errors import raises_named
from tests.test_objective import (
    DIM,
    NULL,
    STEP,
    LinearParams,
    LinearVelocity,
    make_batch,
    numpy_guided,
    perturbed,
    rollout_info,
)


FIXTURE = np.load(pathlib.Path(__file__).parent / "data" / "released" / "dancegrpo.npz")
SDE = fg.DanceSDE(0.3)


def make_dance(key=0, **settings):
    flow = fg.GuidedFlow(
        LinearVelocity(jax.random.key(key)),
        fg.RectifiedFlow(shift=3.0),
        fg.InputSpec(null=jnp.asarray(NULL), latent_shape=(DIM,)),
        fg.CFG(2.5),
        model_time="thousandths",
    )
    return fg.DanceGRPOObjective(flow, **settings)


# --------------------------------------------------------------------------------------
# The step, its log density, and what the rollout decodes.


def library_step(x, v, t, t_next):
    """The library's `(mean, std)` of rows `x`, `v` (float32) at `t -> t_next`."""
    return jax.vmap(lambda a, b: SDE.transition(a, b, t, t_next))(jnp.asarray(x), jnp.asarray(v))


def test_the_step_and_its_log_density_are_the_releases():
    sigmas = FIXTURE["sigmas"]
    for i in range(15):
        x, v, prev = FIXTURE["x"][i], FIXTURE["v"][i], FIXTURE["prev_sample"][i]
        mean, std = library_step(x, v, sigmas[i], sigmas[i + 1])
        released = FIXTURE["prev_sample_mean"][i]
        scale = np.abs(released).max()
        np.testing.assert_allclose(np.asarray(mean), released, rtol=1e-5, atol=1e-6 * scale)
        log_prob = jax.vmap(SDE.log_prob)(jnp.asarray(prev), mean, std)
        np.testing.assert_allclose(np.asarray(log_prob), FIXTURE["log_prob"][i], rtol=2e-6)
        for row in range(x.shape[0]):
            want_mean, want_std, _ = ref.dance_step(x[row], v[row], sigmas, i, 0.3)
            np.testing.assert_allclose(released[row], want_mean, rtol=1e-5, atol=1e-6 * scale)
            np.testing.assert_allclose(float(std[row]), want_std, rtol=1e-6)
            want = ref.dance_log_prob(prev[row], want_mean, want_std)
            np.testing.assert_allclose(FIXTURE["log_prob"][i, row], want, rtol=2e-6)


def test_the_last_step_is_the_data_prediction_the_release_decodes():
    # The release samples the last step with noise, then decodes `pred_original`, `x - t v`:
    # the Euler step to t = 0, which is what the library's deterministic last step gives.
    sigmas = FIXTURE["sigmas"]
    x, v = FIXTURE["x"][15], FIXTURE["v"][15]
    mean, std = library_step(x, v, sigmas[15], sigmas[16])
    assert float(sigmas[16]) == 0.0 and np.all(np.asarray(std) == 0.0)
    np.testing.assert_allclose(np.asarray(mean), FIXTURE["pred_original"][15], rtol=1e-6, atol=1e-7)
    assert not bool(SDE.is_stochastic(sigmas[15], 0.0))
    assert bool(SDE.is_stochastic(1.0, sigmas[1]))


def test_the_step_is_flow_grpos_with_a_constant_noise_level():
    # mean = x (1 + eta^2 dt / (2 t)) + v (1 + eta^2 (1 - t) / (2 t)) dt: FlowSDE's with
    # sigma = eta at every step.
    rng = np.random.default_rng(0)
    x, v = rng.normal(size=(2, 3, 5))
    for t, t_next in ((1.0, 0.9), (0.7, 0.5), (0.2, 0.05)):
        s2, dt = 0.09, t_next - t
        want = x * (1 + s2 * dt / (2 * t)) + v * (1 + s2 * (1 - t) / (2 * t)) * dt
        mean, std = library_step(x.astype(np.float32), v.astype(np.float32), t, t_next)
        np.testing.assert_allclose(np.asarray(mean), want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(std), 0.3 * math.sqrt(-dt), rtol=1e-6)


# --------------------------------------------------------------------------------------
# Advantages and the loss, as the release computes them.


def test_the_group_advantages_are_the_releases():
    got = fg.group_advantages(FIXTURE["rewards"], 4, std="group_unbiased")
    np.testing.assert_allclose(got, FIXTURE["advantages"], rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(
        FIXTURE["advantages"], ref.dancegrpo_advantages(FIXTURE["rewards"], 4), rtol=2e-6, atol=1e-7
    )


@pytest.mark.parametrize("rewards", ["one", "two"])
def test_the_clipped_surrogates_are_the_releases(rewards):
    objective = make_dance()
    log_ratio = jnp.asarray(FIXTURE["new_log_probs"] - FIXTURE["old_log_probs"])[:, None]
    if rewards == "one":
        advantages, weights, want = FIXTURE["vq_advantages"][:, None], (1.0,), FIXTURE["loss"]
    else:
        advantages = np.stack([FIXTURE["vq_advantages"], FIXTURE["mq_advantages"]], axis=1)
        weights, want = (1.0, 0.5), FIXTURE["multi_reward_loss"]
    got = np.asarray(objective.surrogate(log_ratio, jnp.asarray(advantages), weights))[:, 0]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    kept = np.ones((len(want), 1), bool)
    for row in range(len(want)):
        total, _ = ref.dancegrpo_loss(
            np.asarray(log_ratio, np.float64)[row : row + 1],
            advantages[row : row + 1],
            weights,
            kept[:1],
            1e-4,
            5.0,
        )
        np.testing.assert_allclose(want[row], total, rtol=1e-5)
    # The clip binds on rows whose ratio left [1 - 1e-4, 1 + 1e-4], and row 0's advantage 7
    # is clipped to 5.
    assert np.any(np.abs(np.exp(np.asarray(log_ratio)) - 1) > 1e-4)
    assert FIXTURE["vq_advantages"][0] > 5.0


def test_several_rewards_are_not_one_reward_of_their_weighted_sum():
    # Where the rewards' advantages differ in sign and the ratio is past the clip, the sum
    # of each reward's clipped surrogate keeps a gradient that one clipped surrogate of the
    # summed advantage would not.
    objective = make_dance()
    log_ratio = jnp.asarray([[3e-4]])
    separate = jax.grad(
        lambda lr: objective.surrogate(lr, jnp.asarray([[2.0, -1.0]]), (1.0, 1.0)).sum()
    )(log_ratio)
    summed = jax.grad(lambda lr: objective.surrogate(lr, jnp.asarray([[1.0]]), (1.0,)).sum())(
        log_ratio
    )
    assert float(summed[0, 0]) == 0.0 and float(separate[0, 0]) != 0.0


# --------------------------------------------------------------------------------------
# The loss and its gradient on recorded transitions.


def numpy_loss(objective, params, batch):
    """The release's loss in float64: `(total, count)`."""
    transitions = batch.transitions
    t_all = np.asarray(transitions.timesteps)
    t_next_all = np.asarray(transitions.next_timesteps)
    latents = np.asarray(transitions.latents, np.float64)
    next_latents = np.asarray(transitions.next_latents, np.float64)
    old = np.asarray(transitions.old_log_probs, np.float64)
    cond = np.asarray(transitions.cond, np.float64)
    mask = np.asarray(transitions.transition_mask)
    kept = mask & (t_next_all > 0)
    log_ratio = np.zeros(kept.shape)
    scale = objective.flow.guidance.scale
    for i, j in zip(*np.nonzero(kept), strict=True):
        t = np.float32(t_all[i, j])
        model_t = float(np.floor(t * np.float32(1000)) / 1000)  # int(sigma * 1000) / 1000
        v = numpy_guided(params, latents[i, j], model_t, cond[i], scale)
        mean, std, _ = ref.dance_step(
            latents[i, j], v, [float(t), float(t_next_all[i, j])], 0, objective.sde.noise_level
        )
        log_ratio[i, j] = ref.dance_log_prob(next_latents[i, j], mean, std) - old[i, j]
    advantages = np.asarray(batch.advantages, np.float64)
    return ref.dancegrpo_loss(
        log_ratio, advantages, batch.weights, kept, objective.clip_range, objective.adv_clip_max
    )


def setup(seed, weights=(1.0, 0.5), size=0.05, **settings):
    """An objective, a policy moved off the old one, and a batch with the old policy's
    (noisy) log densities and one advantage per reward."""
    objective = make_dance(**settings)
    old_policy = objective.init(jax.random.key(1)).policy
    policy = perturbed(old_policy, jax.random.key(2), size)
    transitions = make_batch(seed=seed, steps=8)
    rescored = np.asarray(objective.log_probs(fg.PolicyVariables(old_policy), transitions))
    noise = np.random.default_rng(seed).normal(size=rescored.shape) * 1e-3
    transitions = eqx.tree_at(
        lambda b: b.old_log_probs, transitions, jnp.asarray((rescored + noise).astype(np.float32))
    )
    rng = np.random.default_rng(seed + 1)
    advantages = rng.normal(size=(transitions.num_rows, len(weights))) * 2.0
    advantages[0, 0] = 6.0  # beyond the advantage clip
    batch = fg.RewardTransitions(transitions, jnp.asarray(advantages, jnp.float32), weights)
    return objective, fg.PolicyVariables(policy), batch


@pytest.mark.parametrize("weights", [(1.0,), (1.0, 0.5)], ids=["one reward", "two rewards"])
def test_loss_and_gradient_match_numpy(weights):
    # A clip wide enough that some ratios pass it and others do not.
    objective, variables, batch = setup(3, weights, size=0.005, clip_range=0.02)

    def value(policy):
        total, aux = objective.loss(fg.PolicyVariables(policy), batch, STEP)
        return total.total, (total.count, aux)

    (total, (count, aux)), grads = eqx.filter_value_and_grad(value, has_aux=True)(variables.policy)
    params = LinearParams.of(variables.policy)
    want, want_count = numpy_loss(objective, params, batch)
    assert float(count) == want_count > 0
    np.testing.assert_allclose(float(total), want, rtol=2e-4, atol=1e-6)
    assert 0 < float(aux.clipfrac.value) < 1
    numerics = ref.central_differences(
        lambda arrays: numpy_loss(objective, LinearParams(*arrays), batch)[0],
        [params.weight, params.time, params.cond_weight],
    )
    for got, numeric in zip((grads.weight, grads.time, grads.cond_weight), numerics, strict=True):
        scale = max(np.abs(numeric).max(), 1e-3)
        np.testing.assert_allclose(np.asarray(got, np.float64), numeric, atol=2e-3 * scale)


def test_chunking_and_row_splits_do_not_change_the_loss():
    objective, variables, batch = setup(4)
    whole, _ = objective.loss(variables, batch, STEP)
    chunked = eqx.tree_at(lambda o: o.transition_chunk, objective, 2, is_leaf=lambda x: x is None)
    np.testing.assert_allclose(
        float(chunked.loss(variables, batch, STEP)[0].total), float(whole.total), rtol=1e-6
    )
    halves = [
        jax.tree.map(lambda leaf, r=rows: leaf[r], batch) for rows in (slice(0, 2), slice(2, None))
    ]
    parts = [objective.loss(variables, half, STEP)[0] for half in halves]
    np.testing.assert_allclose(float((parts[0] + parts[1]).total), float(whole.total), rtol=1e-6)
    assert objective.loss_sums_over_rows()


# --------------------------------------------------------------------------------------
# The rollout: every step noisy but the last, each row's own trained steps.


def two_rewards():
    return fg.WeightedReward(
        [
            (lambda s, r: np.asarray(s).sum(axis=1), 1.0),
            (lambda s, r: np.asarray(s)[:, 0] ** 2, 0.5),
        ]
    )


def test_each_row_trains_its_own_random_steps_and_the_ratio_starts_at_one():
    objective = make_dance()
    rollout = fg.FlowRollout(
        objective,
        two_rewards(),
        groups=4,
        steps=7,
        advantage_std="group_unbiased",
        reward_combination="normalize_each",
        shared_noise=True,
    )
    sampler = rollout.active_sampler
    assert sampler == fg.DanceSampler(objective.sde, 0.6)
    assert rollout.recorded_transitions == int(5 * 0.6) == 3
    policy = objective.init(jax.random.key(0)).policy
    rows = jnp.asarray(np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32))
    batch, info = rollout.collect(policy, rows, jax.random.key(1))
    grid = ref.grid(7, 3.0)
    t = np.asarray(batch.timesteps, np.float64)
    chosen = np.rint(np.interp(-t, -grid, np.arange(7))).astype(int)
    np.testing.assert_allclose(t, grid[chosen], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(batch.next_timesteps), grid[chosen + 1], rtol=1e-6)
    assert np.all(np.diff(chosen, axis=1) > 0) and chosen.max() <= 4
    assert len({tuple(row) for row in chosen}) > 1
    rescored = objective.log_probs(fg.PolicyVariables(policy), batch)
    np.testing.assert_allclose(np.asarray(rescored), np.asarray(batch.old_log_probs), atol=1e-5)
    # Each reward normalised in its group by torch's unbiased std plus 1e-8, apart.
    components = [term(np.asarray(info.samples), None) for term, _ in two_rewards().terms]
    for term, scores in zip(info.reward_advantages, components, strict=True):
        np.testing.assert_allclose(term, ref.dancegrpo_advantages(scores, 4), rtol=2e-6, atol=1e-6)
    assert info.reward_weights == (1.0, 0.5)
    training = objective.training_batch(batch, info)
    np.testing.assert_array_equal(np.asarray(training.advantages), info.reward_advantages.T)


def test_the_trained_steps_are_uniform_over_the_steps_before_the_last():
    sampler = fg.DanceSampler(SDE, 0.6)
    chosen = np.asarray(sampler.trained_steps(jax.random.key(3), 2000, 17))
    assert chosen.shape == (2000, 9)  # int(15 x 0.6) of the 15 steps before the last
    assert np.all(np.diff(chosen, axis=1) > 0) and chosen.min() == 0 and chosen.max() == 14
    counts = np.bincount(chosen.reshape(-1), minlength=15)
    np.testing.assert_allclose(counts / 2000, 0.6, atol=0.04)


def test_an_epoch_trains_with_one_reward_or_two():
    for reward, combination in ((lambda s, r: np.asarray(s).sum(axis=1), "sum"),
                                (two_rewards(), "normalize_each")):  # fmt: skip
        objective = make_dance(old_log_probs="update")
        rollout = fg.FlowRollout(
            objective,
            reward,
            groups=4,
            steps=7,
            advantage_std="group_unbiased",
            reward_combination=combination,
        )
        trainer = Trainer(objective)
        state = trainer.init(jax.random.key(1))
        rows = np.random.default_rng(0).normal(size=(2, 3)).astype(np.float32)
        _, metrics, _ = rl_epoch(trainer, state, rollout, rows, jax.random.key(2))
        assert abs(metrics["ratio"] - 1.0) < 1e-6 and np.isfinite(metrics["loss"])


def test_the_default_is_the_release():
    objective = make_dance()
    assert objective.sde == fg.DanceSDE(0.3)
    assert (objective.clip_range, objective.adv_clip_max) == (1e-4, 5.0)
    assert objective.timestep_fraction == 0.6 and objective.old_log_probs == "rollout"


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: make_dance(clip_range=0.0), "`clip_range` must be a finite number > 0, got 0.0."),
        (
            lambda: make_dance(timestep_fraction=1.5),
            "`timestep_fraction` must be a finite number in (0, 1], got 1.5.",
        ),
        (
            lambda: make_dance(old_log_probs="replay"),
            "`old_log_probs` must be 'rollout' or 'update', got 'replay'.",
        ),
        (lambda: make_dance(sde="dance"), "`sde` must be an AbstractSDE, got 'dance'."),
        (
            lambda: make_dance().rollout_sampler(fg.SDESampler(fg.FlowSDE())),
            "`sampler` must record transitions of the DanceGRPO objective's own `sde` "
            "(DanceSDE()): a DanceSampler or an SDESampler of it, got "
            "SDESampler(sde=FlowSDE()).",
        ),
        (
            lambda: fg.FlowRollout(make_dance(), lambda s, r: np.zeros(len(s)), steps=3),
            "`timestep_fraction`=0.6 trains int(1 x 0.6) = 0 of the 1 steps before the last "
            "(steps=3): use more steps or a larger fraction.",
        ),
    ],
)
def test_refusals_name_the_argument(make, message):
    with raises_named(message):
        make()


def test_a_batch_of_one_advantage_per_row_trains_as_one_reward():
    objective, _, batch = setup(5)
    info = rollout_info(jnp.zeros((batch.num_rows, DIM), jnp.float32))
    made = objective.training_batch(batch.transitions, info)
    assert made.weights == (1.0,)
    np.testing.assert_array_equal(
        np.asarray(made.advantages)[:, 0], np.asarray(batch.transitions.advantages)
    )


def test_the_demo_builds_the_released_objective():
    from flowgrpo_eqx.shapes_demo import make_config
    from flowgrpo_eqx.shapes_demo.algorithms import JobPieces

    config = make_config("tiny", algorithm="dancegrpo")
    algorithm = config.chosen_algorithm
    assert algorithm.trains_on_ratios and algorithm.advantage_std == "group_unbiased"
    assert config.rollout.noise_level == 0.3
    job = JobPieces(
        config=config,
        model=LinearVelocity(jax.random.key(0)),
        inputs=fg.InputSpec(null=jnp.asarray(NULL), latent_shape=(DIM,)),
        guidance=fg.CFG(config.rollout.guidance_scale),
        reward=lambda samples, rows: np.zeros(len(samples)),
    )
    objective = algorithm.objective(job, None)
    assert isinstance(objective, fg.DanceGRPOObjective)
    assert objective.flow.model_time == "thousandths" and objective.sde == fg.DanceSDE(0.3)
    assert objective.clip_range == config.objective.clip_range
    assert algorithm.sampler(job) == fg.DanceSampler(fg.DanceSDE(0.3), 0.6)
    # The ratios the histograms show are DanceGRPO's own.
    assert algorithm.flow_grpo_objective(job, None).sde == objective.sde
    with pytest.raises(ValueError, match="`beta`=0.01 .* is not read by algorithm 'dancegrpo'"):
        make_config("tiny", algorithm="dancegrpo", beta=0.01)
    with pytest.raises(ValueError, match="`rollout_steps` must be at least 4"):
        make_config("tiny", algorithm="dancegrpo", rollout_steps=3)
