"""FlowRollout: shapes, groups, the float64 reward path, masking, rescoring, compilation."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

import flowgrpo_eqx as fg
from tests import numpy_reference as ref
from tests.cli_rewards import brightness
from tests.errors import NAMED_ARGUMENT_ERRORS


LATENT = (3, 3, 3)
COND = 2


class SmallNet(eqx.Module):
    linear: eqx.nn.Linear

    def __init__(self, key):
        size = int(np.prod(LATENT))
        self.linear = eqx.nn.Linear(size + COND + 1, size, key=key)

    def __call__(self, x, t, cond):
        h = jnp.concatenate([x.reshape(-1), cond, t[None]])
        return jnp.tanh(self.linear(h)).reshape(x.shape)


class CountingReward:
    """Mean brightness plus whatever `offsets` says per row; counts its calls."""

    name = "counting"

    def __init__(self, values=None):
        self.calls = []
        self.values = values

    def __call__(self, samples, rows):
        self.calls.append((np.array(samples), {k: np.array(v) for k, v in rows.items()}))
        if self.values is not None:
            return self.values(samples, rows)
        return samples.reshape(samples.shape[0], -1).mean(axis=1).astype(np.float64)


def make_rollout(
    reward, *, groups=3, steps=6, train_steps=None, window=None, guidance=True, shared_noise=False
):
    objective = fg.FlowGRPOObjective(
        SmallNet(jax.random.key(0)),
        fg.RectifiedFlow(shift=2.0),
        fg.InputSpec(select="cond", null=jnp.zeros(COND), latent_shape=LATENT),
        sde=fg.FlowSDE(0.7, window=window),
        guidance=fg.CFG(2.0) if guidance else None,
        steps=4,
    )
    return fg.FlowRollout(
        objective,
        reward,
        groups=groups,
        steps=steps,
        sampler=fg.SDESampler(objective.sde, train_steps=train_steps),
        shared_noise=shared_noise,
    )


ROWS = {
    "cond": np.array([[0.5, -0.5], [0.5, -0.5], [1.0, 2.0]], np.float32),
    "prompt_id": np.array([7, 7, 9]),
}


@pytest.mark.parametrize("train_steps", [None, 1, 3])
def test_batch_shapes_grid_and_chaining(train_steps):
    reward = CountingReward()
    rollout = make_rollout(reward, train_steps=train_steps)
    variables = objective_of(rollout).init(jax.random.key(0))
    batch, info = rollout.collect(variables.policy, ROWS, jax.random.key(1))
    n, k = 9, 5 if train_steps is None else train_steps
    assert batch.latents.shape == batch.next_latents.shape == (n, k, *LATENT)
    for name in ("timesteps", "next_timesteps", "old_log_probs", "transition_mask"):
        assert getattr(batch, name).shape == (n, k)
    assert batch.advantages.shape == (n,) and batch.advantages.dtype == jnp.float32
    grid = ref.grid(6, 2.0)
    np.testing.assert_allclose(np.asarray(batch.timesteps), np.tile(grid[:k], (n, 1)), rtol=1e-6)
    np.testing.assert_allclose(
        np.asarray(batch.next_timesteps), np.tile(grid[1 : k + 1], (n, 1)), rtol=1e-6
    )
    np.testing.assert_array_equal(
        np.asarray(batch.next_latents[:, :-1]), np.asarray(batch.latents[:, 1:])
    )
    assert len(reward.calls) == 1
    samples, rows = reward.calls[0]
    assert samples.shape == (n, *LATENT) and np.abs(samples).max() <= 1.0
    np.testing.assert_array_equal(rows["prompt_id"], [7, 7, 7, 7, 7, 7, 9, 9, 9])
    assert info.rewards.dtype == np.float64 and info.rewards.shape == (n,)
    assert info.reward_mean.dtype == np.float32


def objective_of(rollout):
    """The Flow-GRPO objective that rescores what `rollout` samples."""
    return rollout.objective


def test_groups_are_contiguous_and_not_merged():
    reward = CountingReward()
    rollout = make_rollout(reward)
    variables = objective_of(rollout).init(jax.random.key(0))
    batch, info = rollout.collect(variables.policy, ROWS, jax.random.key(2))
    rewards = info.rewards
    # Rows 0 and 1 have equal conditioning but are separate groups of 3.
    want = ref.group_advantages(rewards, 3)
    np.testing.assert_allclose(np.asarray(batch.advantages), want, rtol=1e-5, atol=1e-6)
    merged = ref.group_advantages(rewards[:6], 6)  # what merging equal rows would give
    assert not np.allclose(np.asarray(batch.advantages)[:6], merged[:6], atol=1e-3)
    cond = np.asarray(batch.cond["cond"])
    np.testing.assert_array_equal(cond[:6], np.repeat(ROWS["cond"][:2], 3, axis=0))


def test_float64_rewards_below_float32_resolution():
    def tiny_steps(samples, rows):
        return 1.0 + 1e-8 * np.arange(samples.shape[0], dtype=np.float64)

    rollout = make_rollout(CountingReward(tiny_steps), groups=3)
    variables = objective_of(rollout).init(jax.random.key(0))
    batch, info = rollout.collect(variables.policy, ROWS, jax.random.key(3))
    expected = ref.group_advantages(1.0 + 1e-8 * np.arange(9), 3)
    np.testing.assert_array_equal(info.rewards, 1.0 + 1e-8 * np.arange(9))
    np.testing.assert_allclose(np.asarray(batch.advantages), expected.astype(np.float32), rtol=1e-6)
    # The float32 rewards would be equal within each group, giving all-zero advantages.
    assert np.abs(np.asarray(batch.advantages)).max() > 5e-5
    np.testing.assert_array_equal(np.asarray(batch.advantages) != 0, np.abs(expected) > 1e-12)


def test_constant_group_fully_masked_and_window_masks_deterministic():
    def constant_first_group(samples, rows):
        values = samples.reshape(samples.shape[0], -1).mean(axis=1).astype(np.float64)
        values[:3] = 0.5
        return values

    grid = fg.RectifiedFlow(2.0).timesteps(6)
    window = fg.window_for_indices(grid, 1, 2)
    rollout = make_rollout(CountingReward(constant_first_group), window=window)
    variables = objective_of(rollout).init(jax.random.key(0))
    batch, info = rollout.collect(variables.policy, ROWS, jax.random.key(4))
    mask = np.asarray(batch.transition_mask)
    assert not mask[:3].any()
    np.testing.assert_array_equal(np.asarray(batch.advantages)[:3], 0.0)
    stochastic = np.array([False, True, True, False, False])
    np.testing.assert_array_equal(mask[3:], np.tile(stochastic, (6, 1)))
    assert info.zero_std_fraction == pytest.approx(1 / 3)


@pytest.mark.parametrize("guidance", [True, False])
def test_rescoring_reproduces_old_log_probs(guidance):
    rollout = make_rollout(CountingReward(), guidance=guidance)
    variables = objective_of(rollout).init(jax.random.key(0))
    batch, _ = rollout.collect(variables.policy, ROWS, jax.random.key(5))
    rescored = objective_of(rollout).log_probs(variables, batch)
    np.testing.assert_allclose(np.asarray(rescored), np.asarray(batch.old_log_probs), atol=1e-5)
    _, aux = objective_of(rollout).loss(variables, batch, fg.Step(0, jax.random.key(0)))
    assert abs(float(aux.ratio.value) - 1.0) < 1e-5
    assert float(aux.clipfrac.value) == 0.0


@pytest.mark.parametrize("train_steps", [0, 6, 10, -1])
def test_train_steps_outside_grid_named(train_steps):
    with pytest.raises(ValueError, match="train_steps"):
        make_rollout(CountingReward(), steps=6, train_steps=train_steps)


def test_recorded_range_without_noise_rejected():
    grid = fg.RectifiedFlow(2.0).timesteps(6)
    window = fg.window_for_indices(grid, 3, 2)
    with pytest.raises(ValueError, match="train_steps"):
        make_rollout(CountingReward(), steps=6, train_steps=2, window=window)


@pytest.mark.parametrize("kwargs, name", [({"groups": 0}, "groups"), ({"steps": 1}, "steps")])
def test_bad_rollout_settings_named(kwargs, name):
    objective = objective_of(make_rollout(CountingReward()))
    with pytest.raises(ValueError, match=name):
        fg.FlowRollout(objective, CountingReward(), **kwargs)


def test_shared_noise_with_an_ode_sampler_is_refused():
    # A deterministic sampler from one start per group draws one sample per group: every
    # advantage would be 0 and nothing would be learned.
    rollout = make_rollout(CountingReward())
    nft, ode = nft_of(rollout), fg.ODESampler(fg.Heun())
    with pytest.raises(ValueError, match="shared_noise"):
        fg.FlowRollout(nft, CountingReward(), groups=4, sampler=ode, shared_noise=True)
    fg.FlowRollout(nft, CountingReward(), groups=4, sampler=ode)
    fg.FlowRollout(objective_of(rollout), CountingReward(), groups=4, shared_noise=True)


@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda s, r: np.zeros(s.shape[0] - 1), "shape"),
        (lambda s, r: np.where(np.arange(s.shape[0]) == 4, np.nan, 0.0), r"rows \[4\]"),
        (lambda s, r: np.where(np.arange(s.shape[0]) == 2, np.inf, 0.0), r"rows \[2\]"),
        (lambda s, r: 1 / 0, "ZeroDivisionError"),
    ],
)
def test_bad_reward_clear_error_variables_untouched(bad, message):
    reward = CountingReward(bad)
    rollout = make_rollout(reward)
    variables = objective_of(rollout).init(jax.random.key(0))
    before = jax.tree.map(np.array, eqx.filter(variables, eqx.is_array))
    with pytest.raises(fg.RewardError, match=message) as error:
        rollout.collect(variables.policy, ROWS, jax.random.key(6))
    assert "counting" in str(error.value)
    after = jax.tree.map(np.array, eqx.filter(variables, eqx.is_array))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(a, b)


def test_collect_compiles_once():
    # groups=5 gives shapes no other test compiles, so the first call must compile.
    rollout = make_rollout(CountingReward(), groups=5)
    variables = objective_of(rollout).init(jax.random.key(0))
    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        counts = []
        for i in range(3):
            before = len(compiles)
            rollout.collect(variables.policy, ROWS, jax.random.key(10 + i))
            counts.append(len(compiles) - before)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert counts[0] >= 1
    assert counts[1] == 0 and counts[2] == 0


def test_preview_png_and_evaluate_scores(tmp_path):
    reward = CountingReward()
    rollout = make_rollout(reward)
    objective = objective_of(rollout)
    variables = objective.init(jax.random.key(0))
    rows = {"cond": jnp.asarray(ROWS["cond"]), "prompt_id": jnp.asarray(ROWS["prompt_id"])}
    evaluation = objective.evaluate(variables, rows, fg.Step(0, jax.random.key(1)), reward=reward)
    assert evaluation.scores.dtype == np.float64 and evaluation.scores.shape == (3,)
    path = tmp_path / "grid" / "preview.png"
    out = objective.preview(
        variables,
        rows,
        fg.Step(0, jax.random.key(1)),
        scored=reward,
        path=str(path),
        captions=["a", "b", "c"],
        title="preview",
    )
    np.testing.assert_array_equal(out.scores, evaluation.scores)
    with Image.open(path) as image:
        image.load()
        assert image.format == "PNG" and image.size[0] > 0 and image.size[1] > 0
        assert len(np.unique(np.asarray(image.convert("L")))) > 2
    # Captions and scores are checked whether or not a picture is written, and before anything
    # is sampled or scored.
    calls = len(reward.calls)
    with pytest.raises(ValueError, match=r"`captions` must have one entry per row \(3\), got 2"):
        objective.preview(
            variables, rows, fg.Step(0, jax.random.key(1)), scored=reward, captions=["a", "b"]
        )
    assert len(reward.calls) == calls
    with pytest.raises(ValueError, match=r"`scored` must have shape \[N\] = \(3,\), got \(2,\)"):
        objective.preview(
            variables, rows, fg.Step(0, jax.random.key(1)), scored=[0.5, 1.0], path=str(path)
        )


def test_shared_noise_one_start_per_group():
    rollout = make_rollout(CountingReward(), groups=3, shared_noise=True)
    variables = objective_of(rollout).init(jax.random.key(0))
    batch, _ = rollout.collect(variables.policy, ROWS, jax.random.key(1))
    starts = np.asarray(batch.latents[:, 0]).reshape(3, 3, -1)  # [source row, member, ...]
    for group in starts:
        np.testing.assert_array_equal(group, np.broadcast_to(group[0], group.shape))
    # Groups differ, also the two of equal conditioning (source rows 0 and 1).
    for first in range(3):
        for second in range(first + 1, 3):
            assert not np.any(starts[first, 0] == starts[second, 0])
    # The SDE's noise still branches the members of a group.
    after = np.asarray(batch.next_latents[:, 0]).reshape(3, 3, -1)
    assert not np.any(after[0, 0] == after[0, 1])


def test_independent_noise_is_the_documented_draw():
    """Without `shared_noise` the starts are `normal(split(key)[0], [N, *latent])`, the draw
    from before the option existed."""
    rollout = make_rollout(CountingReward(), groups=3)
    assert rollout.shared_noise is False
    variables = objective_of(rollout).init(jax.random.key(0))
    key = jax.random.key(1)
    batch, _ = rollout.collect(variables.policy, ROWS, key)
    expected = jax.random.normal(jax.random.split(key)[0], (9, *LATENT), jnp.float32)
    np.testing.assert_array_equal(np.asarray(batch.latents[:, 0]), np.asarray(expected))


def test_shared_noise_needs_whole_groups_and_a_bool():
    rollout = make_rollout(CountingReward(), groups=3, shared_noise=True)
    variables = objective_of(rollout).init(jax.random.key(0))
    rows = {name: np.repeat(value, 3, axis=0)[:4] for name, value in ROWS.items()}
    with pytest.raises(ValueError, match="shared_noise"):
        rollout.generate(variables.policy, rows, jax.random.key(1))
    with pytest.raises(NAMED_ARGUMENT_ERRORS, match="shared_noise"):
        make_rollout(CountingReward(), shared_noise=1)


def test_rewards_normalised_one_by_one_before_the_weighted_sum():
    def huge_contrast(samples, rows):
        return 1e6 * samples.reshape(samples.shape[0], -1).std(axis=1).astype(np.float64)

    terms = [(brightness, 2.0), (huge_contrast, 0.5)]
    rollout = make_rollout(fg.WeightedReward(terms), groups=3)
    each = eqx.tree_at(lambda r: r.reward_combination, rollout, "normalize_each")
    variables = objective_of(rollout).init(jax.random.key(0))
    key = jax.random.key(1)
    summed, summed_info = rollout.collect(variables.policy, ROWS, key)
    batch, info = each.collect(variables.policy, ROWS, key)
    # Same samples and the same reported (weighted-sum) rewards; only the advantages differ.
    np.testing.assert_array_equal(info.rewards, summed_info.rewards)
    samples = np.asarray(info.samples)
    components = np.stack([brightness(samples, None), huge_contrast(samples, None)])
    np.testing.assert_allclose(info.rewards, np.array([2.0, 0.5]) @ components, rtol=1e-12)
    np.testing.assert_allclose(
        np.asarray(batch.advantages),
        ref.per_reward_advantages(components, [2.0, 0.5], 3),
        rtol=1e-5,
        atol=1e-5,
    )
    assert not np.allclose(np.asarray(batch.advantages), np.asarray(summed.advantages))


def test_per_reward_normalisation_needs_a_weighted_reward():
    with pytest.raises(ValueError, match="reward_combination"):
        rollout = make_rollout(CountingReward())
        fg.FlowRollout(objective_of(rollout), CountingReward(), reward_combination="normalize_each")


def nft_of(rollout):
    return fg.DiffusionNFTObjective(rollout.flow)


def test_info_keeps_the_final_latents_that_nft_trains_on():
    rollout = make_rollout(CountingReward(), train_steps=None)
    batch, info = rollout.collect(rollout.flow.model, ROWS, jax.random.key(1))
    np.testing.assert_array_equal(info.final, batch.next_latents[:, -1])
    np.testing.assert_array_equal(rollout.flow.decode(info.final), info.samples)
    nft = nft_of(rollout).training_batch(batch, info)
    np.testing.assert_array_equal(nft.latents, info.final)
    np.testing.assert_array_equal(nft.advantages, batch.advantages)
    np.testing.assert_array_equal(nft.cond["cond"], batch.cond["cond"])
    assert bool(np.all(nft.mask)) and nft.num_rows == batch.num_rows
    per_transition = eqx.tree_at(
        lambda b: b.advantages,
        batch,
        jnp.broadcast_to(batch.advantages[:, None], batch.timesteps.shape),
    )
    with pytest.raises(ValueError, match="one advantage per row"):
        nft_of(rollout).training_batch(per_transition, info)


def test_an_ode_sampler_records_only_the_final_samples():
    rollout = make_rollout(CountingReward(), train_steps=None)
    ode = fg.FlowRollout(
        nft_of(rollout),
        CountingReward(),
        groups=2,
        steps=rollout.steps,
        sampler=fg.ODESampler(fg.Euler()),
    )
    assert ode.recorded_transitions == 0
    key = jax.random.key(3)
    final, info = ode.collect(rollout.flow.model, ROWS, key)
    assert isinstance(final, fg.FinalSamples)
    np.testing.assert_array_equal(final.latents, info.final)
    np.testing.assert_array_equal(rollout.flow.decode(info.final), info.samples)
    rows = jax.tree.map(lambda leaf: jnp.asarray(np.repeat(leaf, 2, axis=0)), ROWS)
    start = jax.random.normal(jax.random.split(key)[0], (6, *LATENT), jnp.float32)
    expected = rollout.flow.sample_latents(rollout.flow.model, rows, start, fg.Euler(), ode.steps)
    np.testing.assert_allclose(final.latents, expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(final.cond["cond"], rows["cond"])
    assert final.advantages.shape == (6,)
    with pytest.raises(ValueError, match="Flow-GRPO trains on recorded transitions"):
        objective_of(rollout).training_batch(final, info)


def test_nft_samples_with_its_own_solver_by_default_and_with_any_sampler():
    nft = nft_of(make_rollout(CountingReward()))
    assert fg.FlowRollout(nft, CountingReward()).active_sampler == fg.ODESampler(nft.solver)
    sde = fg.SDESampler(fg.FlowSDE(0.5))
    assert fg.FlowRollout(nft, CountingReward(), sampler=sde).active_sampler is sde
    # A solver is not a sampler: ODESampler(Heun()) is.
    with pytest.raises(NAMED_ARGUMENT_ERRORS, match="sampler"):
        fg.FlowRollout(nft, CountingReward(), sampler=fg.Heun())


def test_a_flow_grpo_rollout_samples_only_with_its_objectives_sde():
    # Flow-GRPO rescores recorded transitions with the objective's SDE: a rollout that
    # sampled another SDE, or an ODE, is refused when it is built, not after training on it.
    objective = objective_of(make_rollout(CountingReward()))
    default = fg.FlowRollout(objective, CountingReward())
    assert default.sampler is None
    assert default.active_sampler == fg.SDESampler(objective.sde)
    same = fg.SDESampler(fg.FlowSDE(0.7), train_steps=2, record_means=True)
    assert fg.FlowRollout(objective, CountingReward(), sampler=same).recorded_transitions == 2
    for other in (
        fg.SDESampler(fg.FlowSDE(0.5)),
        fg.SDESampler(fg.CoefficientsPreservingSDE(0.7)),
        fg.ODESampler(fg.Heun()),
    ):
        with pytest.raises(ValueError, match="`sampler` must be an SDESampler of the Flow-GRPO"):
            fg.FlowRollout(objective, CountingReward(), sampler=other)
    with pytest.raises(NAMED_ARGUMENT_ERRORS, match="objective"):
        fg.FlowRollout(objective.flow, CountingReward())


def test_samplers_declare_the_transitions_and_means_they_record():
    # An objective that rescores transitions asks the sampler, not a list of sampler types.
    sde, other = fg.FlowSDE(0.7), fg.FlowSDE(0.5)
    window = fg.ProgressiveWindow(2, shift_every=1)
    for plain, with_means in (
        (fg.SDESampler(sde), fg.SDESampler(sde, record_means=True)),
        (fg.MixSampler(sde, window), fg.MixSampler(sde, window, record_means=True)),
    ):
        assert plain.records_transitions_of(sde) and plain.records_transitions_of(fg.FlowSDE())
        assert not plain.records_transitions_of(other)
        assert not plain.records_transitions_of(fg.CoefficientsPreservingSDE(0.7))
        assert (plain.records_means(), with_means.records_means()) == (False, True)
    ode = fg.ODESampler(fg.Heun())
    assert not ode.records_transitions_of(sde) and not ode.records_means()


def test_sde_sampler_settings_are_named():
    sde = fg.FlowSDE(0.7)
    for kwargs, name in (
        ({"train_steps": 1, "window_schedule": fg.FixedWindow(1)}, "train_steps"),
        ({"window_schedule": "fixed"}, "window_schedule"),
        ({"record_means": 1}, "record_means"),
    ):
        with pytest.raises(NAMED_ARGUMENT_ERRORS, match=name):
            fg.SDESampler(sde, **kwargs)
    with pytest.raises(ValueError, match="`window` must be None"):
        fg.SDESampler(fg.FlowSDE(0.7, window=(1.0, 0.5)), window_schedule=fg.FixedWindow(1))
    with pytest.raises(NAMED_ARGUMENT_ERRORS, match="sde"):
        fg.SDESampler(fg.Heun())
    with pytest.raises(NAMED_ARGUMENT_ERRORS, match="solver"):
        fg.ODESampler(sde)
