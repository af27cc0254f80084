"""The demo's MixGRPO, MixGRPO-Flash and MixGRPO-Flash* (`--algorithm
mixgrpo|mixgrpo-flash|mixgrpo-flash-star`): the released window, time input and solver adapted
to the main job (a tiny run of each through the command line is in test_awm.py, beside AWM's
and DGPO's)."""

import jax
import pytest

import flowgrpo_eqx as fg
from flowgrpo_eqx.shapes_demo import ShapesJob, make_config
from tests import numpy_reference as ref


@pytest.mark.parametrize(
    "algorithm, shift_every, stride, rollout_steps, solver, ratio",
    [
        ("mixgrpo", 25, 1, 6, fg.Euler, None),
        ("mixgrpo-flash", 20, 1, 26, fg.DPMSolverPP2M, 0.4),
        ("mixgrpo-flash-star", 20, 0, 23, fg.DPMSolverPP2M, 0.2),
    ],
)
def test_the_mixgrpo_demo_is_the_released_window_on_the_main_jobs_grid(
    tmp_path, algorithm, shift_every, stride, rollout_steps, solver, ratio
):
    config = make_config("default", algorithm=algorithm)
    rollout = config.rollout
    assert (rollout.window_schedule, rollout.window_shift_every) == ("progressive", shift_every)
    assert (rollout.window_stride, rollout.sde_steps, rollout.train_steps) == (stride, 2, 2)
    assert rollout.rollout_steps == rollout_steps
    assert config.training.epochs == ref.MIXGRPO_TRAIN_STEPS  # an epoch is a released step
    job = ShapesJob(config, tmp_path, quiet=True)
    objective = job.objective(job.model)
    assert isinstance(objective, fg.FlowGRPOObjective)
    # The released time input, in the rollout, the update and the ratios' rescoring.
    assert objective.flow.model_time == "thousandths"
    assert job.flow_grpo_objective(job.model).flow.model_time == "thousandths"
    assert job.evaluation_flow().model_time == "exact"
    sampler = job.rollout(objective).sampler
    assert isinstance(sampler, fg.MixSampler)
    assert sampler.sde == objective.sde and sampler.sde.window is None
    assert isinstance(sampler.solver, solver) and sampler.compress_ratio == ratio
    schedule = sampler.window_schedule
    assert schedule == fg.ProgressiveWindow(2, shift_every=shift_every, stride=stride)
    # Epoch e is the release's step e - 1 on the job's grid: the release's windows of 2
    # transitions at every one of the 300 epochs.
    transitions = rollout_steps - 1
    key = jax.random.key(0)
    got = []
    for epoch in range(1, ref.MIXGRPO_TRAIN_STEPS + 1):
        first, stop = schedule.window(epoch, transitions, key)
        got.append((first, stop - first))
    want = ref.mixgrpo_windows(
        ref.MIXGRPO_TRAIN_STEPS, transitions, 2, shift_every, True, stride, True
    )
    assert got == want
    if algorithm == "mixgrpo":
        # On 5 transitions: 0-1, 1-2, 2 (cut), none (empty), 25 epochs each, three times.
        cycle = [(0, 2)] * 25 + [(1, 2)] * 25 + [(2, 1)] * 25 + [(3, 0)] * 25
        assert got == cycle * 3


def test_the_other_algorithms_keep_the_exact_time():
    for algorithm in ("flow_grpo", "awm", "dgpo", "nft"):
        config = make_config("tiny", algorithm=algorithm)
        assert config.chosen_algorithm.model_time == "exact"


def test_a_fixed_window_is_refused_with_mixgrpo():
    message = "`window_schedule` must be 'progressive', 'sliding' or 'random'"
    with pytest.raises(ValueError, match=message):
        make_config("tiny", algorithm="mixgrpo", window_schedule="fixed")
    named = make_config("tiny", algorithm="mixgrpo-flash", window_shift_every=3, rollout_steps=5)
    assert (named.rollout.window_shift_every, named.rollout.rollout_steps) == (3, 5)


def test_a_window_that_never_moves_is_the_progressive_windows_only():
    with pytest.raises(ValueError, match="`window_stride` must be an int >= 1 with window_sch"):
        make_config("tiny", window_schedule="sliding", window_stride=0)
    with pytest.raises(ValueError, match="`window_stride` must be an int >= 1"):
        make_config("tiny", window_stride=0)
    star = make_config("tiny", algorithm="mixgrpo-flash-star")
    assert (star.rollout.window_schedule, star.rollout.window_stride) == ("progressive", 0)


def post_window_steps(points, count, shift_every, stride, ratio, shift, steps):
    """The solver steps after the window at each of the released steps, and where the last
    ends, on a grid of `points` (float64, the release's `run_sample_step` lines 44-49)."""
    transitions = points - 1
    windows = ref.mixgrpo_windows(steps, transitions, count, shift_every, True, stride, True)
    rests = []
    for first, length in windows:
        last = first + length - 1 if length else -1
        post = ref.mixgrpo_post_grid(transitions, last, ratio, shift)
        rests.append((len(post) - 1, float(post[-1])))
    return rests


def test_flash_keeps_the_releases_solver_steps_after_its_window():
    # The release (25 transitions, shift 3, a window of 4): 7 down to 2 solver steps after the
    # window over its 300 steps, always to t = 0.
    released = post_window_steps(26, 4, 20, 1, 0.4, 3.0, ref.MIXGRPO_TRAIN_STEPS)
    assert {steps for steps, _ in released} == {7, 6, 5, 4, 3, 2}
    assert all(end == 0.0 for _, end in released)
    # The demo's 26 points and window of 2: 8 down to 3, always to t = 0.
    demo = post_window_steps(26, 2, 20, 1, 0.4, 1.0, ref.MIXGRPO_TRAIN_STEPS)
    assert min(steps for steps, _ in demo) == 3 and all(end == 0.0 for _, end in demo)
    # A grid of 11 points leaves one step from epoch 41 and none from epoch 101 (the sample
    # decoded at t = 0.3, then 0.2): the grid on which Flash collapses.
    short = post_window_steps(11, 2, 20, 1, 0.4, 1.0, ref.MIXGRPO_TRAIN_STEPS)
    assert [steps for steps, _ in short[40:100]] == [1] * 60
    assert [steps for steps, _ in short[100:160]] == [0] * 60
    assert short[100][1] > 0.29 and short[120][1] > 0.19
