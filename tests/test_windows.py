"""Window schedules: where the stochastic transitions sit, epoch by epoch, without recompiling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flowgrpo_eqx as fg
from tests import numpy_reference as ref
from tests.errors import NAMED_ARGUMENT_ERRORS
from tests.test_rollout import COND, LATENT, ROWS, CountingReward, SmallNet, objective_of


STEPS = 7  # six transitions
COUNT = 2


def scheduled_rollout(schedule):
    objective = fg.FlowGRPOObjective(
        SmallNet(jax.random.key(0)),
        fg.RectifiedFlow(shift=2.0),
        fg.InputSpec(select="cond", null=jnp.zeros(COND), latent_shape=LATENT),
        sde=fg.FlowSDE(0.7),
        guidance=None,
        steps=4,
    )
    return fg.FlowRollout(
        objective,
        CountingReward(),
        groups=2,
        steps=STEPS,
        sampler=fg.SDESampler(objective.sde, window_schedule=schedule),
    )


def numpy_velocity(net, x, t, cond):
    """`SmallNet` in float64 NumPy, one latent."""
    weight = np.asarray(net.linear.weight, np.float64)
    bias = np.asarray(net.linear.bias, np.float64)
    features = np.concatenate([x.reshape(-1), cond, [t]])
    return np.tanh(weight @ features + bias).reshape(x.shape)


def numpy_ode(net, x, grid, cond):
    """Deterministic (level 0) steps of the SDE along `grid`, from `x`."""
    for t, t_next in zip(grid[:-1], grid[1:], strict=True):
        x, _ = ref.gaussian(x, numpy_velocity(net, x, t, cond), t, t_next, 0.0)
    return x


def test_fixed_window_position_and_bounds():
    assert fg.FixedWindow(2, start=3).first(5, 6, jax.random.key(0)) == 3
    with pytest.raises(ValueError, match="start"):
        fg.FixedWindow(2, start=5).first(1, 6, jax.random.key(0))


@pytest.mark.parametrize(
    "at_end, expected",
    [
        ("clip", [0, 0, 0, 2, 2, 2, 4, 4, 4, 4, 4, 4]),
        ("restart", [0, 0, 0, 2, 2, 2, 4, 4, 4, 0, 0, 0]),
    ],
)
def test_sliding_window_moves_every_shift_and_then_clips_or_restarts(at_end, expected):
    schedule = fg.SlidingWindow(COUNT, shift_every=3, stride=2, at_end=at_end)
    key = jax.random.key(0)
    assert [schedule.first(epoch, 6, key) for epoch in range(1, 13)] == expected


def test_random_window_is_uniform_over_positions_and_follows_the_key():
    schedule = fg.RandomWindow(COUNT)
    keys = jax.random.split(jax.random.key(1), 400)
    draws = np.array([schedule.first(1, 6, key) for key in keys])
    counts = np.bincount(draws, minlength=5)
    assert counts.shape == (5,) and counts.min() > 50  # positions 0..4, each ~80 times
    assert schedule.first(9, 6, keys[3]) == draws[3]  # the key decides, not the epoch


@pytest.mark.parametrize(
    "make, name",
    [
        (lambda: fg.SlidingWindow(0, shift_every=1), "count"),
        (lambda: fg.SlidingWindow(2, shift_every=0), "shift_every"),
        (lambda: fg.SlidingWindow(2, shift_every=1, stride=0), "stride"),
        (lambda: fg.SlidingWindow(2, shift_every=1, at_end="wrap"), "at_end"),
        (lambda: fg.FixedWindow(2, start=-1), "start"),
    ],
)
def test_bad_schedules_named(make, name):
    with pytest.raises(NAMED_ARGUMENT_ERRORS, match=name):
        make()


def test_window_longer_than_the_trajectory_named():
    with pytest.raises(ValueError, match="count"):
        scheduled_rollout(fg.RandomWindow(STEPS))


def test_schedule_excludes_train_steps_and_an_sde_window():
    with pytest.raises(ValueError, match="train_steps"):
        fg.SDESampler(fg.FlowSDE(0.7), train_steps=2, window_schedule=fg.RandomWindow(COUNT))
    with pytest.raises(ValueError, match="window"):
        fg.SDESampler(fg.FlowSDE(0.7, window=(1.0, 0.5)), window_schedule=fg.FixedWindow(1))


@pytest.mark.parametrize("first", [0, 2, 4])
def test_only_the_windows_transitions_are_stochastic_and_recorded(first):
    rollout = scheduled_rollout(fg.FixedWindow(COUNT, start=first))
    variables = objective_of(rollout).init(jax.random.key(0))
    key = jax.random.key(5)
    batch, info = rollout.collect(variables.policy, ROWS, key, epoch=1)
    assert info.window_start == first
    grid = ref.grid(STEPS, 2.0)
    np.testing.assert_allclose(
        np.asarray(batch.timesteps)[0], grid[first : first + COUNT], rtol=1e-6
    )
    assert bool(
        np.all(np.asarray(batch.transition_mask) | (np.asarray(batch.advantages) == 0)[:, None])
    )
    # Before the window: the ODE from the documented starting draw.
    net = variables.policy
    start = np.asarray(jax.random.normal(jax.random.split(key)[0], (6, *LATENT)), np.float64)
    rows = np.repeat(ROWS["cond"], 2, axis=0).astype(np.float64)
    for row in range(6):
        expected = numpy_ode(net, start[row], grid[: first + 1], rows[row])
        np.testing.assert_allclose(np.asarray(batch.latents)[row, 0], expected, atol=2e-5)
    # Inside: stochastic (the recorded step is not the ODE step) and rescored exactly.
    x = np.asarray(batch.latents, np.float64)[0, 0]
    ode_step = numpy_ode(net, x, grid[first : first + 2], rows[0])
    assert np.max(np.abs(np.asarray(batch.next_latents)[0, 0] - ode_step)) > 1e-2
    rescored = objective_of(rollout).log_probs(variables, batch)
    np.testing.assert_allclose(np.asarray(rescored), np.asarray(batch.old_log_probs), atol=1e-5)
    # After it: the ODE to t = 0.
    generated = rollout.generate(
        variables.policy, {k: np.repeat(v, 2, axis=0) for k, v in ROWS.items()}, key, first
    )
    last = np.asarray(generated.next_latents, np.float64)[:, -1]
    for row in range(6):
        expected = numpy_ode(net, last[row], grid[first + COUNT :], rows[row])
        np.testing.assert_allclose(np.asarray(generated.final)[row], expected, atol=2e-5)


def test_moving_the_window_never_recompiles():
    rollout = scheduled_rollout(fg.SlidingWindow(COUNT, shift_every=1))
    variables = objective_of(rollout).init(jax.random.key(0))
    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    rollout.collect(variables.policy, ROWS, jax.random.key(1), epoch=1)  # warm-up
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        starts = [
            rollout.collect(variables.policy, ROWS, jax.random.key(1 + epoch), epoch=epoch)[
                1
            ].window_start
            for epoch in (2, 3, 4, 5)
        ]
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert starts == [1, 2, 3, 4]
    assert compiles == []
