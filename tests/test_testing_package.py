"""`flowgrpo_eqx.testing`: loaded only on request, and its assertions fail on what breaks them."""

import subprocess
import sys

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given

import flowgrpo_eqx as fg
import flowgrpo_eqx.testing as fgt
from tests.test_seams import concrete_objective_classes, porting_setup


@pytest.mark.several_processes("imports the library in a fresh process")
def test_hypothesis_loads_with_the_testing_package_only():
    code = (
        "import sys, flowgrpo_eqx, flowgrpo_eqx.train\n"
        "print('hypothesis' in sys.modules)\n"
        "import flowgrpo_eqx.testing\n"
        "print('hypothesis' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "True"]


def _uncentred(rewards, groups, std="group"):
    """A broken advantage: divides by the spread but forgets to subtract the mean."""
    grouped = np.asarray(rewards, np.float64).reshape(-1, groups)
    return (grouped / (grouped.std(axis=1, keepdims=True) + 1e-4)).reshape(-1).astype(np.float32)


def test_group_advantage_invariants_catch_a_missing_mean():
    rewards = np.array([1.0, 2.0, 3.0, 5.0, 5.0, 5.0])
    fgt.assert_group_advantages_invariants(rewards, 3)
    with pytest.raises(AssertionError):
        fgt.assert_group_advantages_invariants(rewards, 3, advantages_fn=_uncentred)


class _OffGrid(fg.AbstractProcess):
    """A broken process whose grid stops short of 0."""

    def interpolate(self, data, noise, t):
        return (1 - t) * data + t * noise

    def velocity_target(self, data, noise):
        return noise - data

    def timesteps(self, steps):
        return jnp.linspace(1.0, 0.01, steps, dtype=jnp.float32)


def test_grid_invariant_catches_a_grid_that_stops_short():
    fgt.assert_grid_endpoints(fg.RectifiedFlow(3.0), 7)
    with pytest.raises(AssertionError, match="ends at"):
        fgt.assert_grid_endpoints(_OffGrid(), 7)


@fgt.property_settings(30)
@given(batch=fgt.reward_groups())
def test_reward_groups_are_float64_and_whole_groups(batch):
    rewards, groups = batch
    assert rewards.dtype == np.float64
    assert rewards.size % groups == 0 and rewards.size >= groups


@fgt.property_settings(20)
@given(advantages=fgt.advantages(3, 2), mask=fgt.transition_masks(3, 2))
def test_advantage_and_mask_strategies_have_the_batch_shapes(advantages, mask):
    assert advantages.dtype == np.float32 and advantages.shape in ((3,), (3, 2))
    assert mask.dtype == np.bool_ and mask.shape == (3, 2)


def test_trees_close_takes_its_scale_from_want_above_the_floor():
    """An error of 5e-8 on entries of 1e-3 is within `atol=1e-6` of the default floor of 1,
    and 50 times too large once the floor lets the scale be the entries' own."""
    want = {"w": jnp.full((3,), 1e-3, jnp.float32)}
    got = {"w": want["w"].at[1].add(5e-8)}
    fgt.assert_trees_close(got, want, rtol=0.0, atol=1e-6)
    with pytest.raises(AssertionError, match="leaf 0"):
        fgt.assert_trees_close(got, want, rtol=0.0, atol=1e-6, scale_floor=0.0)
    with pytest.raises(ValueError, match="scale_floor"):
        fgt.assert_trees_close(got, want, scale_floor=-1.0)


@pytest.mark.parametrize("cls", concrete_objective_classes(), ids=lambda cls: cls.__name__)
def test_the_invariants_run_on_every_objective(cls):
    """`check_objective_invariants` takes every concrete objective of the objectives package
    (read from its modules, so a new objective without a setup in `porting_setup` fails
    here): the invariants of every objective hold on a correct setup, and those of the
    transition objectives apply exactly to the `AbstractTransitionObjective`s and are named
    as not applicable to the rest."""
    objective, rollout, variables, rows = porting_setup(cls)
    sample = fgt.collected_batch(objective, variables, rollout, rows, seed=3)
    report = fgt.check_objective_invariants(objective, variables, sample)
    assert report.objective == cls.__name__
    skipped = dict(report.not_applicable)
    assert set(report.checked) | set(skipped) == set(fgt.EVERY_OBJECTIVE + fgt.TRANSITION_OBJECTIVE)
    assert set(fgt.EVERY_OBJECTIVE) <= set(report.checked)
    if issubclass(cls, fg.AbstractTransitionObjective):
        assert set(fgt.TRANSITION_OBJECTIVE) <= set(report.checked)
        assert not skipped
    else:
        assert set(skipped) == set(fgt.TRANSITION_OBJECTIVE)
        assert all(cls.__name__ in why for why in skipped.values())


def test_the_group_invariant_catches_uncentred_rollout_advantages():
    objective, rollout, variables, rows = porting_setup(fg.FlowGRPOObjective)
    sample = fgt.collected_batch(objective, variables, rollout, rows, seed=3)
    fgt.assert_advantages_group_normalised(sample)
    shifted = eqx.tree_at(
        lambda s: s.collected.advantages, sample, sample.collected.advantages + 1.0
    )
    with pytest.raises(AssertionError, match="mean"):
        fgt.assert_advantages_group_normalised(shifted)


def test_a_failing_invariant_names_the_objective_and_the_invariant():
    objective, rollout, variables, rows = porting_setup(fg.FlowGRPOObjective)
    sample = fgt.collected_batch(objective, variables, rollout, rows, seed=3)
    broken = eqx.tree_at(
        lambda s: s.batch.old_log_probs, sample, jnp.full_like(sample.batch.old_log_probs, -1e30)
    )
    with pytest.raises(AssertionError, match="FlowGRPOObjective: loss finite"):
        fgt.check_objective_invariants(objective, variables, broken)


_NFT = porting_setup(fg.DiffusionNFTObjective)


@fgt.property_settings(2)
@given(sample=fgt.training_batches(_NFT[0], _NFT[2], _NFT[1], _NFT[3]))
def test_training_batches_draw_batches_of_an_objective_over_final_samples(sample):
    assert isinstance(sample.batch, fg.FinalSamples)
    report = fgt.check_objective_invariants(_NFT[0], _NFT[2], sample)
    assert report.checked == fgt.EVERY_OBJECTIVE
