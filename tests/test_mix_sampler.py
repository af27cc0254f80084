"""MixGRPO's rollout sampler: the SDESampler's window with Euler steps around it, and for
MixGRPO-Flash DPM-Solver++(2M) on the released compressed grid after the window."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flowgrpo_eqx as fg
from tests import numpy_reference as ref, tolerances
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
            np.testing.assert_allclose(
                np.asarray(got.final)[row], want, rtol=0, atol=tolerances.tanh_model_atol(2e-5)
            )


RELEASED = {
    "MixGRPO": (fg.ProgressiveWindow(4, shift_every=25), fg.Euler(), None),
    "MixGRPO-Flash": (fg.ProgressiveWindow(4, shift_every=20), fg.DPMSolverPP2M(), 0.4),
    "MixGRPO-Flash*": (fg.ProgressiveWindow(4, shift_every=20, stride=0), fg.DPMSolverPP2M(), 0.2),
}


@pytest.mark.parametrize("script", list(RELEASED))
def test_the_mix_rollout_trains_the_released_windows(script):
    # The release's 25 transitions: at every window its script reaches in 1500 steps (those
    # of its 300 steps, then the cut windows 20 .. 22 and the empty one at 23, where the
    # release itself fails), the rollout makes stochastic and keeps exactly the release's
    # transitions.
    schedule, solver, ratio = RELEASED[script]
    transitions = 25
    objective = fg.FlowGRPOObjective(
        SmallNet(jax.random.key(0)),
        fg.RectifiedFlow(shift=3.0),
        fg.InputSpec(select="cond", null=jnp.zeros(COND), latent_shape=LATENT),
        sde=fg.FlowSDE(0.7),
        guidance=None,
        steps=4,
    )
    sampler = fg.MixSampler(objective.sde, schedule, solver, compress_ratio=ratio)
    rollout = fg.FlowRollout(
        objective, CountingReward(), groups=2, steps=transitions + 1, sampler=sampler
    )
    policy = objective.init(jax.random.key(0)).policy
    windows = ref.mixgrpo_windows(1500, **ref.MIXGRPO_SCRIPTS[script])
    seen = {}
    for step, window in enumerate(windows):
        seen.setdefault(window, step + 1)
    for (first, count), epoch in seen.items():
        batch, info = rollout.collect(policy, ROWS, jax.random.key(epoch), epoch=epoch)
        assert info.window_start == first
        recorded = min(first, transitions - 4)
        live = np.asarray(batch.advantages) != 0
        want = [recorded + j in range(first, first + count) for j in range(4)]
        kept = np.asarray(batch.transition_mask)
        assert (kept[live] == want).all() and not kept[~live].any(), (first, count)
        assert bool(np.isfinite(np.asarray(batch.old_log_probs)).all())
    assert len(seen) == {"MixGRPO": 24, "MixGRPO-Flash": 24, "MixGRPO-Flash*": 1}[script]


@pytest.mark.parametrize("ratio", [None, 0.4])
def test_an_empty_window_runs_the_solver_from_the_start(ratio):
    # Ten transitions, max_timesteps = 8: the window at 8 holds none. The release fails there
    # (`last_false_index` is None); the library reads it as l = -1, the solver on the whole
    # (compressed) grid from t = 1: Euler on every step, or DPM-Solver++(2M) on
    # int(11 x 0.4) = 4 points from 1 to 0.
    schedule = fg.ProgressiveWindow(COUNT, shift_every=1)
    assert schedule.window(9, STEPS - 1, jax.random.key(0)) == (8, 8)
    solver = fg.Euler() if ratio is None else fg.DPMSolverPP2M()
    rollout = _rollout(lambda sde: fg.MixSampler(sde, schedule, solver, compress_ratio=ratio))
    net, got = _generate(rollout, 8)
    grid = ref.grid(STEPS, SHIFT)
    post = grid if ratio is None else ref.mixgrpo_post_grid(STEPS - 1, -1, ratio, SHIFT)
    assert post.size == (STEPS if ratio is None else 4)
    start = np.asarray(
        jax.random.normal(jax.random.split(jax.random.key(5))[0], (6, *LATENT)), np.float64
    )
    rows = np.repeat(ROWS["cond"], 2, axis=0).astype(np.float64)
    for row in range(rows.shape[0]):

        def velocity(x, t, row=row, net=net):
            return numpy_velocity(net, x, t, rows[row])

        if ratio is None:
            want = start[row]
            for t, t_next in zip(post[:-1], post[1:], strict=True):
                want = want + (t_next - t) * velocity(want, t)
        else:
            want = ref.dpm_solver_pp_2m(velocity, start[row], post)
        np.testing.assert_allclose(
            np.asarray(got.final)[row], want, rtol=0, atol=tolerances.tanh_model_atol(2e-5)
        )


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
        np.testing.assert_allclose(
            np.asarray(got.final)[row], want, rtol=0, atol=tolerances.tanh_model_atol(2e-5)
        )


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
        fg.RectifiedFlow(shift=SHIFT, grid=fg.DiffusersGrid()),
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


class _Thousandths(eqx.Module):
    """`net` fed `floor(1000 t) / 1000`: the truncation done by the model itself."""

    net: SmallNet

    def __call__(self, x, t, cond):
        return self.net(x, jnp.floor(t * 1000) / 1000, cond)


def test_model_time_thousandths_feeds_the_model_the_releases_integer_timesteps():
    # The release feeds FLUX.1 `int(sigma * 1000) / 1000` (sampling_utils.py lines 64-71,
    # train_grpo_flux.py lines 387 and 132), sigma its float32 shifted grid of 26 points.
    sigma = np.linspace(1.0, 0.0, 26, dtype=np.float32)
    sigma = (np.float32(3.0) * sigma) / (np.float32(1.0) + np.float32(2.0) * sigma)
    released = np.array([int(s * np.float32(1000)) for s in sigma])
    grid = fg.RectifiedFlow(shift=3.0).timesteps(26)
    received = {}
    for model_time in ("exact", "thousandths"):
        flow = fg.GuidedFlow(
            lambda x, t, cond: jnp.full_like(x, t),
            fg.RectifiedFlow(shift=3.0),
            fg.InputSpec(select="cond", latent_shape=(1,)),
            guidance=None,
            model_time=model_time,
        )
        velocity = flow.velocity(flow.model, jnp.zeros((26, 1)), grid, {"cond": np.zeros((26, 1))})
        received[model_time] = np.asarray(velocity)[:, 0]
    np.testing.assert_array_equal(received["exact"], np.asarray(grid))
    # The release's integers, each divided by 1000 in float32 (to one ulp: XLA divides by a
    # constant as a product with its reciprocal).
    thousandths = received["thousandths"]
    np.testing.assert_array_equal(np.rint(thousandths * 1000).astype(np.int64), released)
    want = released.astype(np.float32) / np.float32(1000)
    np.testing.assert_allclose(thousandths, want, rtol=1.2e-7, atol=0)
    assert np.abs(thousandths - np.asarray(grid)).max() > 5e-4
    with raises_named("`model_time` must be one of ('exact', 'thousandths'), got 'rounded'."):
        fg.GuidedFlow(
            SmallNet(jax.random.key(0)),
            fg.RectifiedFlow(),
            fg.InputSpec(select="cond"),
            guidance=None,
            model_time="rounded",
        )


def test_the_rollout_and_the_rescoring_feed_the_model_thousandths():
    # A flow with model_time="thousandths" samples and rescores exactly as a flow whose model
    # truncates the time itself.
    net = SmallNet(jax.random.key(0))
    schedule = fg.ProgressiveWindow(COUNT, shift_every=1)

    def rollout_of(model, model_time):
        objective = fg.FlowGRPOObjective(
            model,
            fg.RectifiedFlow(shift=3.0),
            fg.InputSpec(select="cond", null=jnp.zeros(COND), latent_shape=LATENT),
            sde=fg.FlowSDE(0.7),
            guidance=None,
            steps=4,
            model_time=model_time,
        )
        sampler = fg.MixSampler(objective.sde, schedule, fg.DPMSolverPP2M(), 0.4)
        return fg.FlowRollout(objective, CountingReward(), groups=2, steps=26, sampler=sampler)

    results = {}
    for name, model, model_time in (
        ("option", net, "thousandths"),
        ("model", _Thousandths(net), "exact"),
        ("exact", net, "exact"),
    ):
        rollout = rollout_of(model, model_time)
        variables = rollout.objective.init(jax.random.key(0))
        batch, info = rollout.collect(variables.policy, ROWS, jax.random.key(3), epoch=3)
        rescored = rollout.objective.log_probs(variables, batch)
        results[name] = (batch, rescored, np.asarray(info.final))
    option, model, exact = results["option"], results["model"], results["exact"]
    for field in ("latents", "next_latents", "old_log_probs"):
        np.testing.assert_array_equal(
            np.asarray(getattr(option[0], field)), np.asarray(getattr(model[0], field))
        )
    np.testing.assert_array_equal(np.asarray(option[1]), np.asarray(model[1]))
    np.testing.assert_allclose(
        np.asarray(option[1]), np.asarray(option[0].old_log_probs), atol=1e-5
    )
    np.testing.assert_array_equal(option[2], model[2])
    # The truncation moves the small model's final latents by up to about 8e-5.
    assert np.abs(option[2] - exact[2]).max() > 1e-5
