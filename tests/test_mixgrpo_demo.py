"""The demo's MixGRPO and MixGRPO-Flash (`--algorithm mixgrpo|mixgrpo-flash`): the released
window and solver adapted to the main job (a tiny run of each through the command line is in
test_awm.py, beside AWM's and DGPO's)."""

import jax
import pytest

import flowgrpo_eqx as fg
from flowgrpo_eqx.shapes_demo import ShapesJob, make_config


@pytest.mark.parametrize(
    "algorithm, shift_every, rollout_steps, solver, ratio",
    [("mixgrpo", 25, 6, fg.Euler, None), ("mixgrpo-flash", 20, 11, fg.DPMSolverPP2M, 0.4)],
)
def test_the_mixgrpo_demo_is_the_released_window_on_the_main_jobs_grid(
    tmp_path, algorithm, shift_every, rollout_steps, solver, ratio
):
    config = make_config("default", algorithm=algorithm)
    rollout = config.rollout
    assert (rollout.window_schedule, rollout.window_shift_every) == ("sliding", shift_every)
    assert (rollout.window_stride, rollout.sde_steps, rollout.train_steps) == (2, 2, 2)
    assert rollout.rollout_steps == rollout_steps
    job = ShapesJob(config, tmp_path, quiet=True)
    objective = job.train_objective(job.model)
    assert isinstance(objective, fg.FlowGRPOObjective)
    sampler = job.rollout(objective).sampler
    assert isinstance(sampler, fg.MixSampler)
    assert sampler.sde == objective.sde and sampler.sde.window is None
    assert isinstance(sampler.solver, solver) and sampler.compress_ratio == ratio
    transitions = rollout_steps - 1
    key = jax.random.key(0)
    firsts = [sampler.window_schedule.first(epoch, transitions, key) for epoch in range(1, 301)]
    # The window moves by its length every `shift_every` epochs and starts again from the
    # first transition once its next position would run past the grid (the release's
    # `roll_back`): positions 0, 2 on 5 transitions; 0, 2, 4, 6, 8 on 10.
    positions = list(range(0, transitions - 1, 2))
    expected = [positions[(epoch // shift_every) % len(positions)] for epoch in range(300)]
    assert firsts == expected


def test_a_fixed_window_is_refused_with_mixgrpo():
    with pytest.raises(ValueError, match="`window_schedule` must be 'sliding' or 'random'"):
        make_config("tiny", algorithm="mixgrpo", window_schedule="fixed")
    named = make_config("tiny", algorithm="mixgrpo-flash", window_shift_every=3, rollout_steps=5)
    assert (named.rollout.window_shift_every, named.rollout.rollout_steps) == (3, 5)
