"""Properties of DanceGRPO (docs/mathematics/dancegrpo.md §13) and of Flow-DPPO's released
rollout and statistics (dppo.md §12, index.md §7): the sparse SDE steps are the release's draw,
DanceGRPO's step is Flow-GRPO's at a constant noise level, its surrogates at ratio 1 are the
weighted advantages, and the unbiased advantages ignore a positive affine map of the
rewards."""

import math

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import assume, given, strategies as st

import flowgrpo_eqx as fg
import flowgrpo_eqx.testing as T
from tests import numpy_reference as ref


@T.property_settings(40)
@given(
    transitions=st.integers(1, 30),
    start=st.floats(0.0, 1.0),
    stop=st.floats(0.0, 1.0),
    rollout=st.integers(0, 10_000),
    data=st.data(),
)
def test_random_steps_are_the_releases_draw(transitions, start, stop, rollout, data):
    start, stop = min(start, stop), max(start, stop)
    pool = range(int(transitions * start), int(transitions * stop))
    assume(len(pool) >= 1)
    count = data.draw(st.integers(1, len(pool)))
    schedule = fg.RandomSteps(count, fraction=(start, stop))
    steps = schedule.steps(rollout + 1, transitions)
    assert list(steps) == ref.unirl_sde_indices(transitions, (start, stop), count, rollout)
    assert len(steps) == count and set(steps) <= set(pool) and list(steps) == sorted(set(steps))
    first = schedule.first(rollout + 1, transitions, jax.random.key(0))
    assert np.flatnonzero(
        np.asarray(schedule.stochastic_steps(first, transitions))
    ).tolist() == list(steps)
    assert np.asarray(schedule.recorded_steps(first, transitions)).tolist() == list(steps)


@T.property_settings(40)
@given(
    t=st.floats(0.05, 1.0),
    gap=st.floats(0.01, 0.9),
    eta=st.floats(0.05, 1.0),
    seed=st.integers(0, 2**16),
)
def test_the_dance_step_is_flow_grpos_at_a_constant_noise_level(t, gap, eta, seed):
    t_next = max(t - gap, 0.01)
    assume(t_next < t)
    rng = np.random.default_rng(seed)
    x, v = rng.normal(size=(2, 6))
    mean, std = fg.DanceSDE(eta).transition(
        jnp.asarray(x, jnp.float32), jnp.asarray(v, jnp.float32), t, t_next
    )
    dt = t_next - t
    want = x * (1 + eta**2 * dt / (2 * t)) + v * (1 + eta**2 * (1 - t) / (2 * t)) * dt
    scale = 1 + np.abs(x).max() + np.abs(v).max() * (1 + eta**2 / t)
    np.testing.assert_allclose(np.asarray(mean), want, atol=2e-6 * scale)
    np.testing.assert_allclose(float(std), eta * math.sqrt(-dt), rtol=1e-5)
    release_mean, release_std, _ = ref.dance_step(x, v, [t, t_next], 0, eta)
    np.testing.assert_allclose(want, release_mean, rtol=1e-9, atol=1e-9 * scale)
    np.testing.assert_allclose(release_std, eta * math.sqrt(-dt), rtol=1e-12)


@T.property_settings(30)
@given(
    rows=st.integers(1, 6),
    rewards=st.integers(1, 3),
    seed=st.integers(0, 2**16),
    adv_clip_max=st.floats(0.5, 5.0),
)
def test_the_surrogates_at_ratio_one_are_the_weighted_clipped_advantages(
    rows, rewards, seed, adv_clip_max
):
    rng = np.random.default_rng(seed)
    advantages = rng.normal(size=(rows, rewards)) * 3.0
    weights = tuple(float(w) for w in rng.uniform(0.1, 2.0, size=rewards))
    flow = fg.GuidedFlow(lambda x, t, c: x, fg.RectifiedFlow(), fg.InputSpec(), guidance=None)
    objective = fg.DanceGRPOObjective(flow, adv_clip_max=adv_clip_max)
    clipped = np.clip(advantages, -adv_clip_max, adv_clip_max)
    want = -(clipped @ np.asarray(weights))

    def total(log_ratio):
        return objective.surrogate(log_ratio, jnp.asarray(advantages, jnp.float32), weights).sum()

    zero = jnp.zeros((rows, 1))
    np.testing.assert_allclose(float(total(zero)), want.sum(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(jax.grad(total)(zero))[:, 0], want, rtol=1e-5, atol=1e-5)


@T.property_settings(40)
@given(
    batch=T.reward_groups(),
    std=st.sampled_from(("group_unbiased", "global_unbiased")),
    a=st.floats(0.1, 100.0),
    b=st.floats(-100.0, 100.0),
)
def test_unbiased_advantages_ignore_a_positive_affine_map(batch, std, a, b):
    rewards, groups = batch
    spreads = np.ptp(np.asarray(rewards).reshape(-1, groups), axis=1)
    assume(np.all((spreads == 0) | (spreads > 1e-3)) and np.any(spreads > 0))
    base = fg.group_advantages(rewards, groups, eps=0.0, std=std)
    mapped = fg.group_advantages(a * np.asarray(rewards) + b, groups, eps=0.0, std=std)
    np.testing.assert_allclose(mapped, base, rtol=1e-5, atol=1e-5)
