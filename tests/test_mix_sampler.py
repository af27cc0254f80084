"""MixGRPO's rollout sampler: the SDESampler's window with Euler steps around it, and for
MixGRPO-Flash DPM-Solver++(2M) on the released compressed grid after the window."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flowgrpo_eqx as fg
from tests import numpy_reference as ref
from tests.errors import raises_named
from tests.test_rollout import COND, LATENT, ROWS, CountingReward, SmallNet
from tests.test_windows import numpy_velocity


STEPS = 11  # ten transitions
COUNT = 2
SHIFT = 2.0


def _rollout(sampler_of):
    return _rollout_with_sde(fg.FlowSDE(0.7), sampler_of)


def _rollout_with_sde(sde, sampler_of):
    objective = fg.FlowGRPOObjective(
        SmallNet(jax.random.key(0)),
        fg.RectifiedFlow(shift=SHIFT),
        fg.InputSpec(select="cond", null=jnp.zeros(COND), latent_shape=LATENT),
        sde=sde,
        guidance=None,
        steps=4,
    )
    return fg.FlowRollout(
        objective, CountingReward(), groups=2, steps=STEPS, sampler=sampler_of(objective.sde)
    )


def _generate(rollout, first):
    variables = rollout.objective.init(jax.random.key(0))
    rows = {k: np.repeat(v, 2, axis=0) for k, v in ROWS.items()}
    return variables.policy, rollout.generate(variables.policy, rows, jax.random.key(5), first)


@pytest.mark.parametrize("ratio", [None, 1.0])
def test_keeping_every_step_with_euler_it_is_the_sde_sampler(ratio):
    # One rollout each, every window position (the position is traced: no recompilation).
    schedule = fg.FixedWindow(COUNT)
    sde_rollout = _rollout(lambda sde: fg.SDESampler(sde, window_schedule=schedule))
    mix_rollout = _rollout(lambda sde: fg.MixSampler(sde, schedule, compress_ratio=ratio))
    for first in (0, 3, STEPS - 1 - COUNT):
        _, want = _generate(sde_rollout, first)
        _, got = _generate(mix_rollout, first)
        for name in ("latents", "next_latents", "log_probs", "final", "samples"):
            a, b = np.asarray(getattr(got, name)), np.asarray(getattr(want, name))
            if ratio is None:  # the same grid and operations, in two programs XLA fuses apart
                np.testing.assert_allclose(a, b, rtol=0, atol=2e-6, err_msg=name)
            else:  # the rebuilt grid equals the grid up to float32 rounding
                np.testing.assert_allclose(a, b, rtol=0, atol=2e-5, err_msg=name)


def test_flash_runs_dpm_solver_pp_2m_on_the_released_compressed_grid():
    schedule = fg.FixedWindow(COUNT)
    rollout = _rollout(
        lambda sde: fg.MixSampler(sde, schedule, fg.DPMSolverPP2M(), compress_ratio=0.4)
    )
    grid = ref.grid(STEPS, SHIFT)
    rows = np.repeat(ROWS["cond"], 2, axis=0).astype(np.float64)
    # first 0: two steps after the window (the first of second order, from the window's
    # last data prediction); 3: one (first order, to 0); 7: n = int(0.8) = 1 point, where
    # the release stops at the window's end, before t = 0.
    for first in (0, 3, 7):
        net, got = _generate(rollout, first)
        last = first + COUNT - 1
        post = ref.mixgrpo_post_grid(STEPS - 1, last, 0.4, SHIFT)
        assert post.size < STEPS - 1 - last  # compressed
        for row in range(rows.shape[0]):

            def velocity(x, t, row=row, net=net):
                return numpy_velocity(net, x, t, rows[row])

            x_last = np.asarray(got.latents, np.float64)[row, -1]
            previous = (x_last - grid[last] * velocity(x_last, grid[last]), grid[last])
            x_end = np.asarray(got.next_latents, np.float64)[row, -1]
            want = ref.dpm_solver_pp_2m(velocity, x_end, post, previous)
            np.testing.assert_allclose(np.asarray(got.final)[row], want, rtol=0, atol=2e-5)


@pytest.mark.parametrize("iters_per_group", [25, 20])  # MixGRPO; Flash and Flash*
def test_the_released_windows_are_the_schedule_cut_by_the_sdes_window(iters_per_group):
    # The release's 25 steps, windows of 4 moved by 4, back to 0 past max_timesteps = 23,
    # which also cuts the last window to 3 transitions: the SDE's window ends the noise there.
    transitions = 25
    grid = ref.grid(transitions + 1, 3.0)
    sde = fg.FlowSDE(0.7, window=fg.window_for_indices(grid, 0, transitions - 2))
    schedule = fg.SlidingWindow(4, shift_every=iters_per_group, stride=4, at_end="restart")
    stochastic = np.asarray(sde.is_stochastic(grid[:-1], grid[1:]))
    key = jax.random.key(0)
    got = []
    for epoch in range(1, 601):
        first = schedule.first(epoch, transitions, key)
        got.append([i for i in range(first, first + 4) if stochastic[i]])
    assert got == ref.mixgrpo_windows(600, transitions, 4, iters_per_group)
    assert [20, 21, 22] in got  # the cut window


@pytest.mark.parametrize("ratio", [0.4, 1.0])
def test_a_window_cut_by_the_sde_hands_over_at_its_last_stochastic_transition(ratio):
    # Transitions 6, 7 and 8 are scheduled; the SDE's window ends the noise before 8 (as
    # the release's max_timesteps does), so 8 is recorded but masked, and the solver after
    # the window starts where the release's does: after 7.
    grid = ref.grid(STEPS, SHIFT)
    cut = fg.window_for_indices(grid, 0, STEPS - 3)
    rollout = _rollout_with_sde(
        fg.FlowSDE(0.7, window=cut),
        lambda sde: fg.MixSampler(sde, fg.FixedWindow(3, start=6), fg.DPMSolverPP2M(), ratio),
    )
    variables = rollout.objective.init(jax.random.key(0))
    batch, info = rollout.collect(variables.policy, ROWS, jax.random.key(5), epoch=1)
    recorded = rollout.objective.sde.is_stochastic(batch.timesteps, batch.next_timesteps)
    assert np.asarray(recorded).tolist() == [[True, True, False]] * len(recorded)
    assert not np.asarray(batch.transition_mask)[:, 2].any() and info.window_start == 6
    net, got = _generate(rollout, 6)
    post = ref.mixgrpo_post_grid(STEPS - 1, 7, ratio, SHIFT)
    rows = np.repeat(ROWS["cond"], 2, axis=0).astype(np.float64)
    for row in range(rows.shape[0]):

        def velocity(x, t, row=row, net=net):
            return numpy_velocity(net, x, t, rows[row])

        x_last = np.asarray(got.latents, np.float64)[row, 1]
        previous = (x_last - grid[7] * velocity(x_last, grid[7]), grid[7])
        x_end = np.asarray(got.next_latents, np.float64)[row, 1]
        want = ref.dpm_solver_pp_2m(velocity, x_end, post, previous)
        np.testing.assert_allclose(np.asarray(got.final)[row], want, rtol=0, atol=2e-5)


def test_the_batch_is_the_windows_transitions():
    schedule = fg.FixedWindow(COUNT, start=3)
    rollout = _rollout(lambda sde: fg.MixSampler(sde, schedule, fg.DPMSolverPP2M(), 0.4))
    variables = rollout.objective.init(jax.random.key(0))
    batch, info = rollout.collect(variables.policy, ROWS, jax.random.key(5), epoch=1)
    assert info.window_start == 3
    np.testing.assert_allclose(
        np.asarray(batch.timesteps)[0], ref.grid(STEPS, SHIFT)[3 : 3 + COUNT], rtol=1e-6
    )
    rescored = rollout.objective.log_probs(variables, batch)
    np.testing.assert_allclose(np.asarray(rescored), np.asarray(batch.old_log_probs), atol=1e-5)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"sde": fg.Euler()}, "`sde` must be an AbstractSDE, got Euler()."),
        ({"window_schedule": 2}, "`window_schedule` must be an AbstractWindowSchedule, got 2."),
        ({"solver": "euler"}, "`solver` must be an AbstractSolver, got 'euler'."),
        ({"compress_ratio": 0.0}, "`compress_ratio` must be None or a float in (0, 1], got 0.0."),
        ({"compress_ratio": 1.5}, "`compress_ratio` must be None or a float in (0, 1], got 1.5."),
    ],
)
def test_bad_settings_are_named(kwargs, message):
    settings = {"sde": fg.FlowSDE(0.7), "window_schedule": fg.FixedWindow(COUNT)} | kwargs
    with raises_named(message):
        fg.MixSampler(**settings)


def test_a_compressed_grid_needs_the_uniform_rectified_flow_grid():
    objective = fg.FlowGRPOObjective(
        SmallNet(jax.random.key(0)),
        fg.RectifiedFlow(shift=SHIFT, grid="diffusers"),
        fg.InputSpec(select="cond", null=jnp.zeros(COND), latent_shape=LATENT),
        sde=fg.FlowSDE(0.7),
        guidance=None,
        steps=4,
    )
    sampler = fg.MixSampler(objective.sde, fg.FixedWindow(COUNT), compress_ratio=0.4)
    with pytest.raises(ValueError, match="`compress_ratio` needs a RectifiedFlow"):
        fg.FlowRollout(objective, CountingReward(), groups=2, steps=STEPS, sampler=sampler)
    with pytest.raises(ValueError, match="`count`=11 stochastic transitions do not fit"):
        _rollout(lambda sde: fg.MixSampler(sde, fg.FixedWindow(11)))


def test_the_sliding_window_moves_without_recompiling_the_flash_rollout():
    # The compressed grid after the window is a row of a table read at the traced position.
    schedule = fg.SlidingWindow(COUNT, shift_every=1)
    rollout = _rollout(lambda sde: fg.MixSampler(sde, schedule, fg.DPMSolverPP2M(), 0.4))
    policy = rollout.objective.init(jax.random.key(0)).policy
    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    rollout.collect(policy, ROWS, jax.random.key(1), epoch=1)  # warm-up
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        starts = [
            rollout.collect(policy, ROWS, jax.random.key(1 + epoch), epoch=epoch)[1].window_start
            for epoch in (2, 3, 9, 12)
        ]
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert starts == [1, 2, 8, 8]
    assert compiles == []
