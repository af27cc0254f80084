"""Window schedules: where the stochastic transitions sit, epoch by epoch, without recompiling."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flowgrpo_eqx as fg
from tests import numpy_reference as ref, tolerances
from tests.errors import NAMED_ARGUMENT_ERRORS
from tests.test_rollout import COND, LATENT, ROWS, CountingReward, SmallNet, objective_of


STEPS = 7  # six transitions
COUNT = 2
STEP = fg.Step(index=0, key=jax.random.key(0))


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


# MixGRPO's three released scripts as `ProgressiveWindow`s (tests/numpy_reference.py's
# MIXGRPO_SCRIPTS, each on its 25 transitions).
RELEASED = {
    "MixGRPO": fg.ProgressiveWindow(4, shift_every=25),
    "MixGRPO-Flash": fg.ProgressiveWindow(4, shift_every=20),
    "MixGRPO-Flash*": fg.ProgressiveWindow(4, shift_every=20, stride=0),
}


def library_windows(schedule, epochs, transitions):
    """`(first, count)` of epochs 1 .. `epochs`: the release's step `e - 1` is epoch `e`."""
    key = jax.random.key(0)
    windows = []
    for epoch in range(1, epochs + 1):
        first, stop = schedule.window(epoch, transitions, key)
        windows.append((first, stop - first))
    return windows


@pytest.mark.parametrize("script", list(RELEASED))
def test_the_released_windows_at_every_one_of_the_300_training_steps(script):
    arguments = ref.MIXGRPO_SCRIPTS[script]
    want = ref.mixgrpo_windows(ref.MIXGRPO_TRAIN_STEPS, **arguments)
    got = library_windows(RELEASED[script], ref.MIXGRPO_TRAIN_STEPS, arguments["sampling_steps"])
    assert got == want
    # MixGRPO: starts 0 .. 11, 25 steps each; Flash: 0 .. 14, 20 each; Flash*: 0 throughout.
    last = {"MixGRPO": 11, "MixGRPO-Flash": 14, "MixGRPO-Flash*": 0}[script]
    assert sorted(set(got)) == [(first, 4) for first in range(last + 1)]


@pytest.mark.parametrize("script", list(RELEASED))
def test_past_300_steps_the_released_windows_are_cut_then_empty_then_restart(script):
    # Past the scripts' 300 steps (the release's epoch loop runs on): the window is cut by
    # max_timesteps = 23, holds none at 23 (where the release itself fails), then rolls back.
    arguments = ref.MIXGRPO_SCRIPTS[script]
    steps = 1500
    want = ref.mixgrpo_windows(steps, **arguments)
    assert library_windows(RELEASED[script], steps, 25) == want
    if script != "MixGRPO-Flash*":
        assert {(20, 3), (21, 2), (22, 1), (23, 0)} <= set(want)
        assert want[24 * arguments["iters_per_group"]] == (0, 4)  # rolled back


@pytest.mark.parametrize(
    "sampling_steps, group_size, iters_per_group, prog_overlap, step, roll_back",
    [
        (25, 4, 3, False, 1, True),  # prog_overlap off: moved by the window's length
        (25, 4, 3, False, 1, False),  # and clipped to an empty window at the end
        (25, 4, 2, True, 1, False),
        (25, 4, 2, True, 3, True),  # positions 0, 3, ..., 21, then back
        (25, 4, 2, True, 5, False),
        (25, 4, 1, True, 0, False),
        (5, 2, 25, True, 1, True),  # the demo's grid and window
        (10, 2, 20, True, 1, True),  # the demo's Flash grid
        (6, 4, 1, False, 1, True),  # a window longer than max_timesteps = 4: always cut
    ],
)
def test_progressive_window_is_the_release_for_other_arguments(
    sampling_steps, group_size, iters_per_group, prog_overlap, step, roll_back
):
    steps = 400
    want = ref.mixgrpo_windows(
        steps, sampling_steps, group_size, iters_per_group, prog_overlap, step, roll_back
    )
    schedule = fg.ProgressiveWindow(
        group_size,
        shift_every=iters_per_group,
        stride=step if prog_overlap else group_size,
        at_end="restart" if roll_back else "clip",
    )
    assert library_windows(schedule, steps, sampling_steps) == want


def test_an_empty_window_samples_the_ode_and_trains_nothing():
    # On 6 transitions with max_timesteps = 4: the window 4 .. 3 holds none.
    schedule = fg.ProgressiveWindow(COUNT, shift_every=1)
    assert schedule.window(5, STEPS - 1, jax.random.key(0)) == (4, 4)
    rollout = scheduled_rollout(schedule)
    objective = objective_of(rollout)
    variables = objective.init(jax.random.key(0))
    key = jax.random.key(5)
    batch, info = rollout.collect(variables.policy, ROWS, key, epoch=5)
    assert info.window_start == 4
    assert not np.asarray(batch.transition_mask).any()
    np.testing.assert_allclose(
        np.asarray(batch.timesteps)[0], ref.grid(STEPS, 2.0)[4 : 4 + COUNT], rtol=1e-6
    )
    net = variables.policy
    start = np.asarray(jax.random.normal(jax.random.split(key)[0], (6, *LATENT)), np.float64)
    rows = np.repeat(ROWS["cond"], 2, axis=0).astype(np.float64)
    generated = rollout.generate(
        variables.policy, {k: np.repeat(v, 2, axis=0) for k, v in ROWS.items()}, key, 4
    )
    for row in range(6):
        expected = numpy_ode(net, start[row], ref.grid(STEPS, 2.0), rows[row])
        np.testing.assert_allclose(
            np.asarray(generated.final)[row], expected, atol=tolerances.tanh_model_atol(2e-5)
        )
    value, grads = eqx.filter_value_and_grad(
        lambda policy: (
            objective.loss(eqx.tree_at(lambda v: v.policy, variables, policy), batch, STEP)[0].value
        )
    )(variables.policy)
    assert float(value) == 0.0
    assert all(not np.asarray(leaf).any() for leaf in jax.tree.leaves(grads))


@pytest.mark.parametrize("first", [2, 3])
def test_a_cut_window_records_count_transitions_and_masks_those_outside_it(first):
    # Four transitions on six, max_timesteps = 4: the window at 2 is transitions 2 and 3, at
    # 3 transition 3 only, recorded from 2 (= 6 - 4) so that all four still fit; the recorded
    # transitions outside the window are ODE steps, masked.
    schedule = fg.ProgressiveWindow(4, shift_every=1)
    rollout = scheduled_rollout(schedule)
    variables = objective_of(rollout).init(jax.random.key(0))
    batch, info = rollout.collect(variables.policy, ROWS, jax.random.key(5), epoch=first + 1)
    assert info.window_start == first
    grid = ref.grid(STEPS, 2.0)
    np.testing.assert_allclose(np.asarray(batch.timesteps)[0], grid[2:6], rtol=1e-6)
    kept = np.asarray(batch.transition_mask)
    live = np.asarray(batch.advantages) != 0
    assert live.any()
    want = [True, True, False, False] if first == 2 else [False, True, False, False]
    assert (kept[live] == want).all() and not kept[~live].any()
    # Transition 2 is a noisy step at first = 2, the ODE step at first = 3.
    net = variables.policy
    rows = np.repeat(ROWS["cond"], 2, axis=0).astype(np.float64)
    x = np.asarray(batch.latents, np.float64)[0, 0]
    ode_step = numpy_ode(net, x, grid[2:4], rows[0])
    gap = np.max(np.abs(np.asarray(batch.next_latents)[0, 0] - ode_step))
    assert gap > 1e-2 if first == 2 else gap < 2e-5


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
        (lambda: fg.ProgressiveWindow(0, shift_every=1), "count"),
        (lambda: fg.ProgressiveWindow(2, shift_every=0), "shift_every"),
        (lambda: fg.ProgressiveWindow(2, shift_every=1, stride=-1), "stride"),
        (lambda: fg.ProgressiveWindow(2, shift_every=1, at_end="wrap"), "at_end"),
        (lambda: fg.ProgressiveWindow(2, shift_every=1, end_margin=-1), "end_margin"),
        (
            lambda: fg.ProgressiveWindow(2, 1, end_margin=6).first(1, 6, jax.random.key(0)),
            "end_margin",
        ),
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
        np.testing.assert_allclose(
            np.asarray(generated.final)[row], expected, atol=tolerances.tanh_model_atol(2e-5)
        )


@pytest.mark.parametrize(
    "schedule",
    # The progressive window's positions 3 and 4 are cut to one transition and to none.
    [fg.SlidingWindow(COUNT, shift_every=1), fg.ProgressiveWindow(COUNT, shift_every=1)],
)
def test_moving_the_window_never_recompiles(schedule):
    rollout = scheduled_rollout(schedule)
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


# --------------------------------------------------------------------------------------
# RandomSteps: UniRL's sparse SDE steps (Flow-DPPO's released rollout).


@pytest.mark.parametrize(
    "transitions, fraction, count",
    [(10, (0.0, 0.5), 3), (10, (0.0, 1.0), 4), (25, (0.2, 0.9), 5), (5, (0.0, 0.5), 2)],
)
def test_random_steps_are_the_releases_draw_at_every_rollout(transitions, fraction, count):
    schedule = fg.RandomSteps(count, fraction=fraction)
    key = jax.random.key(0)
    for epoch in range(1, 201):
        want = ref.unirl_sde_indices(transitions, fraction, count, epoch - 1)
        assert list(schedule.steps(epoch, transitions)) == want
        first = schedule.first(epoch, transitions, key)
        assert first == sum(1 << i for i in want)
        chosen = np.asarray(schedule.stochastic_steps(first, transitions))
        assert np.flatnonzero(chosen).tolist() == want
        assert np.asarray(schedule.recorded_steps(first, transitions)).tolist() == want


def test_random_steps_cover_the_pool_and_nothing_else():
    schedule = fg.RandomSteps(3, fraction=(0.0, 0.5))
    seen = np.zeros(10, int)
    for epoch in range(1, 401):
        seen[list(schedule.steps(epoch, 10))] += 1
    assert seen[5:].sum() == 0 and seen[:5].min() > 200  # each of 0..4 about 240 times


def test_random_steps_sample_the_chosen_transitions_and_the_ode_elsewhere():
    schedule = fg.RandomSteps(COUNT, fraction=(0.0, 1.0))
    rollout = scheduled_rollout(schedule)
    objective = objective_of(rollout)
    variables = objective.init(jax.random.key(0))
    key = jax.random.key(5)
    epoch = 3
    chosen = list(schedule.steps(epoch, STEPS - 1))
    batch, info = rollout.collect(variables.policy, ROWS, key, epoch=epoch)
    assert info.window_start == sum(1 << i for i in chosen)
    grid = ref.grid(STEPS, 2.0)
    np.testing.assert_allclose(np.asarray(batch.timesteps)[0], grid[chosen], rtol=1e-6)
    np.testing.assert_allclose(
        np.asarray(batch.next_timesteps)[0], grid[np.add(chosen, 1)], rtol=1e-6
    )
    live = np.asarray(batch.advantages) != 0
    assert live.any() and np.asarray(batch.transition_mask)[live].all()
    rescored = objective.log_probs(variables, batch)
    np.testing.assert_allclose(np.asarray(rescored), np.asarray(batch.old_log_probs), atol=1e-5)
    # The trajectory: ODE steps up to the first chosen transition, a noisy one there.
    net = variables.policy
    start = np.asarray(jax.random.normal(jax.random.split(key)[0], (6, *LATENT)), np.float64)
    rows = np.repeat(ROWS["cond"], 2, axis=0).astype(np.float64)
    for row in range(6):
        expected = numpy_ode(net, start[row], grid[: chosen[0] + 1], rows[row])
        np.testing.assert_allclose(np.asarray(batch.latents)[row, 0], expected, atol=2e-5)
        x = np.asarray(batch.latents, np.float64)[row, 0]
        ode_step = numpy_ode(net, x, grid[chosen[0] : chosen[0] + 2], rows[row])
        assert np.max(np.abs(np.asarray(batch.next_latents)[row, 0] - ode_step)) > 1e-2
    # After the last chosen one: the ODE to t = 0.
    generated = rollout.generate(
        variables.policy,
        {k: np.repeat(v, 2, axis=0) for k, v in ROWS.items()},
        key,
        info.window_start,
    )
    last = np.asarray(generated.next_latents, np.float64)[:, -1]
    for row in range(6):
        expected = numpy_ode(net, last[row], grid[chosen[-1] + 1 :], rows[row])
        np.testing.assert_allclose(
            np.asarray(generated.final)[row], expected, atol=tolerances.tanh_model_atol(2e-5)
        )


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: fg.RandomSteps(3, fraction=(0.0, 0.5)).first(1, 5, jax.random.key(0)),
            "`count`=3 steps do not fit in the pool of `fraction`=(0.0, 0.5) on a trajectory "
            "of 5 transitions (transitions 0 .. 1, 2 of them).",
        ),
        (
            lambda: fg.RandomSteps(2, fraction=(0.5, 1.0)).first(1, 64, jax.random.key(0)),
            "`fraction`=(0.5, 1.0) reaches transition 63 of 64; the chosen steps are a 31-bit "
            "mask, so the pool must end by transition 30.",
        ),
        (
            lambda: fg.RandomSteps(2, fraction=(0.6, 0.5)),
            "`fraction` must be a pair (start, stop) of numbers with 0 <= start <= stop <= 1, "
            "got (0.6, 0.5).",
        ),
        (
            lambda: fg.RandomSteps(0),
            "`count` must be an int >= 1, got 0.",
        ),
        (
            lambda: fg.MixSampler(fg.FlowSDE(), fg.RandomSteps(2)),
            "`window_schedule` must place a window (the solver takes over after its last "
            "step), got RandomSteps(count=2), whose steps are separate: "
            "sample those with an SDESampler.",
        ),
        (
            lambda: fg.RandomSteps(2).stochastic_stop(3, 6),
            "RandomSteps draws separate transitions, not a window: read them with "
            "`stochastic_steps` and `recorded_steps`.",
        ),
    ],
)
def test_random_steps_refusals_are_named(make, message):
    from tests.errors import raises_named

    with raises_named(message):
        make()
