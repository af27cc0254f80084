"""Faults the fault probe (`tools/fault_probe`, docs/faults.md) found in the library, each
refused by name."""

import json
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flowgrpo_eqx as fg
from flowgrpo_eqx import lora
from flowgrpo_eqx._custom_types import check_transitions
from flowgrpo_eqx.models import MLPVelocity
from flowgrpo_eqx.train import Checkpointer, Trainer, default_optimizer, rl_epoch
from tests.errors import NAMED_ARGUMENT_ERRORS


N, K, LATENT, COND = 8, 3, 4, 2


def tiny_model(seed=0):
    return MLPVelocity(LATENT, COND, hidden=16, depth=1, time_features=8, key=jax.random.key(seed))


MODEL = tiny_model()
SPEC = fg.InputSpec(select="cond", null=jnp.zeros(COND), latent_shape=(LATENT,))
OBJECTIVE = fg.FlowGRPOObjective(MODEL, fg.RectifiedFlow(), SPEC, clip_range=0.2, steps=4)
ROWS = {"cond": np.eye(COND, dtype=np.float32)[[0, 1, 0]], "goal": np.array([0.5, -0.5, 0.5])}


def reward(samples, rows):
    return -np.abs(samples.mean(axis=1) - rows["goal"])


def rollout(groups=4):
    return fg.FlowRollout(OBJECTIVE, reward, groups=groups, steps=4)


def fields():
    """A hand-made batch of `N` rows and `K` transitions on the uniform grid (as the probe's)."""
    rng = np.random.default_rng(0)
    grid = np.linspace(1.0, 0.0, K + 1, dtype=np.float32)
    return {
        "latents": jnp.asarray(rng.normal(size=(N, K, LATENT)), jnp.float32),
        "next_latents": jnp.asarray(rng.normal(size=(N, K, LATENT)), jnp.float32),
        "timesteps": jnp.asarray(np.broadcast_to(grid[:-1], (N, K))),
        "next_timesteps": jnp.asarray(np.broadcast_to(grid[1:], (N, K))),
        "old_log_probs": jnp.zeros((N, K), jnp.float32),
        "transition_mask": jnp.ones((N, K), bool),
        "advantages": jnp.asarray(rng.normal(size=N), jnp.float32),
        "cond": {"cond": jnp.asarray(np.eye(COND, dtype=np.float32)[rng.integers(0, COND, N)])},
    }


@pytest.fixture(scope="module")
def trainer_and_state():
    trainer = Trainer(OBJECTIVE, default_optimizer(1e-3))
    return trainer, trainer.init(jax.random.key(1))


# --------------------------------------------------------------------------------------
# Settings.


def test_infinite_noise_level_is_refused():
    for sde in (fg.FlowSDE, fg.CoefficientsPreservingSDE):
        for level in (float("inf"), float("nan")):
            with pytest.raises(ValueError, match=r"^`noise_level` must be .*, got (inf|nan)\.$"):
                sde(noise_level=level)
    assert fg.FlowSDE(noise_level=0.0).noise_level == 0.0
    assert fg.CoefficientsPreservingSDE(noise_level=1.0).noise_level == 1.0


def test_infinite_shift_is_refused():
    for shift in (float("inf"), float("nan"), 0.0, -1.0):
        with pytest.raises(ValueError, match=r"^`shift` must be a finite number > 0, got"):
            fg.RectifiedFlow(shift=shift)
    grid = np.asarray(fg.RectifiedFlow(shift=1e6).timesteps(5))
    assert np.all(np.isfinite(grid)) and grid[0] == 1.0 and grid[-1] == 0.0


@pytest.mark.parametrize(
    "settings, name",
    [
        ({"select": 5}, "select"),
        ({"select": ("cond", 1)}, "select"),
        ({"latent_shape": (True, 4)}, "latent_shape"),
        ({"latent_shape": (4, 0)}, "latent_shape"),
    ],
)
def test_a_malformed_input_spec_is_named(settings, name):
    with pytest.raises(NAMED_ARGUMENT_ERRORS, match=name):
        fg.InputSpec(**settings)


def test_groups_of_one_are_refused():
    rewards = np.array([0.1, 0.7, 0.3, 0.9])
    why = r"^`groups` must be an int >= 2, got 1: .*a group of one sample has advantage 0"
    with pytest.raises(ValueError, match=why):
        fg.group_advantages(rewards, groups=1)
    with pytest.raises(ValueError, match=why):
        fg.per_reward_advantages(rewards[None], [1.0], groups=1)
    with pytest.raises(ValueError, match=why):
        rollout(groups=1)
    assert np.any(fg.group_advantages(rewards, groups=2) != 0.0)
    assert rollout(groups=2).groups == 2


# --------------------------------------------------------------------------------------
# Rollouts and epochs: refused before any sampling.


def test_collect_refuses_zero_source_rows():
    empty = {"cond": np.zeros((0, COND), np.float32), "goal": np.zeros(0)}
    with pytest.raises(ValueError, match=r"^`rows` is empty \(every leaf has 0 rows\)"):
        rollout().collect(MODEL, empty, jax.random.key(2))


def test_collect_refuses_rows_of_unequal_lengths():
    ragged = {**ROWS, "goal": np.array([0.5, -0.5])}
    message = "`rows`['goal'] has 2 rows on its leading axis, but `rows`['cond'] has 3"
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        rollout().collect(MODEL, ragged, jax.random.key(2))
    with pytest.raises(ValueError, match=r"^`rows`\['goal'\] is a scalar"):
        rollout().collect(MODEL, {**ROWS, "goal": np.float32(0.5)}, jax.random.key(2))


def test_rl_epoch_refuses_inner_epochs_below_one(trainer_and_state):
    trainer, state = trainer_and_state
    for inner_epochs in (0, -1):
        with pytest.raises(
            ValueError, match=rf"^`inner_epochs` must be an int >= 1, got {inner_epochs}"
        ):
            rl_epoch(trainer, state, rollout(), ROWS, jax.random.key(3), inner_epochs=inner_epochs)


# --------------------------------------------------------------------------------------
# Batches.


def test_latents_of_a_lower_rank_are_named_not_timesteps():
    flat = {**fields(), "latents": fields()["latents"][:, 0]}
    flat["next_latents"] = flat["latents"]
    expected = "Transitions.latents has shape (8, 4), expected [N, K, *latent] with [N, K] = (8, 3)"
    # Under the test suite's runtime type checker, its error comes first and names latents.
    with pytest.raises(NAMED_ARGUMENT_ERRORS, match="latents"):
        fg.Transitions(**flat)
    # The library's own check, on a batch whose fields were swapped after construction.
    batch = fg.Transitions(**fields())
    bad = eqx.tree_at(lambda b: (b.latents, b.next_latents), batch, (flat["latents"],) * 2)
    with pytest.raises(ValueError, match="^" + re.escape(expected)):
        check_transitions(bad)
    # A [N, K] field that disagrees with the others is the one named.
    odd = eqx.tree_at(lambda b: b.timesteps, batch, batch.timesteps[:, :2])
    with pytest.raises(
        ValueError,
        match=r"^Transitions\.timesteps has shape \(8, 2\), expected \[N, K\] = \(8, 3\)",
    ):
        check_transitions(odd)


def test_transition_times_increasing_are_refused():
    good = fields()
    reversed_times = {
        **good,
        "timesteps": good["next_timesteps"],
        "next_timesteps": good["timesteps"],
    }
    with pytest.raises(
        ValueError, match=r"`next_timesteps` is 1\.0 and `timesteps` 0\.66"
    ) as raised:
        fg.Transitions(**reversed_times)
    assert str(raised.value).startswith(
        "Transitions.next_timesteps must be below Transitions.timesteps at every kept transition"
    )
    # A transition the mask drops may hold anything; a traced batch is not read on the host.
    mask = jnp.ones((N, K), bool).at[0].set(False)
    times = good["next_timesteps"].at[0].set(good["timesteps"][0])
    fg.Transitions(**{**good, "next_timesteps": times, "transition_mask": mask})
    traced = eqx.filter_jit(lambda t: fg.Transitions(**{**good, "next_timesteps": t}).num_rows)
    assert traced(good["timesteps"]) == N


def test_final_samples_in_a_flow_grpo_update_names_batch(trainer_and_state):
    trainer, state = trainer_and_state
    good = fields()
    samples = fg.FinalSamples(good["latents"][:, -1], good["advantages"], good["cond"])
    message = (
        "`batch` must be Transitions for FlowGRPOObjective (the recorded transitions of an "
        "SDESampler rollout), got FinalSamples."
    )
    # Under the test suite's runtime type checker, its error on `loss(batch: Transitions)`
    # comes first; without it, the library's own.
    with pytest.raises(NAMED_ARGUMENT_ERRORS, match="batch") as raised:
        trainer.update(jax.tree.map(jnp.copy, state), samples)
    if raised.type is ValueError:
        assert str(raised.value) == message
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        check_transitions(samples, "FlowGRPOObjective")


def test_trainable_filter_selecting_nothing_is_refused(trainer_and_state):
    for nothing in (lambda leaf: False, jax.tree.map(lambda _: False, MODEL)):
        trainer = Trainer(OBJECTIVE, default_optimizer(1e-3), trainable=nothing)
        with pytest.raises(
            ValueError, match=r"^`trainable` \(.*\) selects no floating-point array"
        ):
            trainer.init(jax.random.key(1))
    _, state = trainer_and_state  # the default filter selects every float array
    assert jax.tree.leaves(eqx.filter(state.opt_state, eqx.is_inexact_array))


# --------------------------------------------------------------------------------------
# Files.


@pytest.fixture()
def adapter_file(tmp_path):
    path = tmp_path / "policy.lora"
    lora.save_adapters(path, lora.add(MODEL, 2, key=jax.random.key(3)))
    assert lora.load_adapters(path, MODEL).rank == 2
    return path


def test_truncated_adapter_file_is_named(adapter_file):
    saved = adapter_file.read_bytes()
    adapter_file.write_bytes(saved[: len(saved) - 40])
    with pytest.raises(ValueError, match=r"policy\.lora' does not hold the adapters its header"):
        lora.load_adapters(adapter_file, MODEL)


def test_adapter_file_with_bytes_appended_is_named(adapter_file):
    adapter_file.write_bytes(adapter_file.read_bytes() + b"appended by another writer")
    with pytest.raises(ValueError, match=r"policy\.lora' holds 26 bytes more than the adapters"):
        lora.load_adapters(adapter_file, MODEL)


@pytest.mark.parametrize("key", ["fingerprint", "rank", "alpha", "layers"])
def test_adapter_file_header_without_a_key_is_named(adapter_file, key):
    header, arrays = adapter_file.read_bytes().split(b"\n", 1)
    fields = json.loads(header)
    del fields[key]
    adapter_file.write_bytes(json.dumps(fields).encode() + b"\n" + arrays)
    expected = rf"policy\.lora' is not a LoRA adapter file \(.*\): its header lacks '{key}'\.$"
    with pytest.raises(ValueError, match=expected):
        lora.load_adapters(adapter_file, MODEL)


def test_checkpoint_step_must_be_an_int_of_at_least_zero(tmp_path):
    checkpoints = Checkpointer(tmp_path / "checkpoints")
    state = {"weights": jnp.arange(4.0)}
    with pytest.raises(ValueError, match=r"^`step` must be an int >= 0, got -1\.$"):
        checkpoints.save(-1, state, {})
    # The runtime type checker of the test suite, or the library, names the float step.
    with pytest.raises(NAMED_ARGUMENT_ERRORS, match="step"):
        checkpoints.save(1.5, state, {})  # type: ignore[arg-type]
    assert not checkpoints.directory.exists()
    saved = checkpoints.save(0, state, {"reward_mean": 0.5})
    assert checkpoints.paths() == [saved]
    restored, metadata = checkpoints.restore(state)
    assert metadata["step"] == 0 and metadata["reward_mean"] == 0.5
    np.testing.assert_array_equal(np.asarray(restored["weights"]), np.arange(4.0))


def test_checkpoint_metadata_must_be_json(tmp_path):
    checkpoints = Checkpointer(tmp_path / "checkpoints")
    state = {"weights": jnp.arange(4.0)}
    with pytest.raises(
        ValueError, match=r"^`metadata`\['reward_mean'\] is not JSON-serialisable \(float32"
    ):
        checkpoints.save(1, state, {"reward_mean": np.float32(0.5)})
    with pytest.raises(NAMED_ARGUMENT_ERRORS, match="metadata"):
        checkpoints.save(1, state, {3: "three"})  # type: ignore[dict-item]
    # Refused before anything was written.
    assert not checkpoints.directory.exists()


@pytest.mark.parametrize(
    "objective_class, settings, given",
    [
        (fg.DiffusionNFTObjective, {}, "Transitions"),
        (fg.AWMObjective, {}, "Transitions"),
        (fg.DGPOObjective, {"group_size": 2}, "FinalSamples"),
    ],
)
def test_a_batch_of_another_kind_in_a_final_sample_objective_names_batch(
    objective_class, settings, given
):
    flow = fg.GuidedFlow(MODEL, fg.RectifiedFlow(), SPEC, guidance=None)
    objective = objective_class(flow, **settings)
    variables = objective.init(jax.random.key(0))
    good = fields()
    batch = (
        fg.Transitions(**good)
        if given == "Transitions"
        else fg.FinalSamples(good["latents"][:, -1], good["advantages"], good["cond"])
    )
    # The suite's runtime type checker would answer first; the library's own check is what a
    # user without it gets.
    loss = getattr(objective_class.loss, "__wrapped__", objective_class.loss)
    with pytest.raises(ValueError, match=rf"^`batch` must be \w+ for {objective_class.__name__} "):
        loss(objective, variables, batch, fg.Step(index=0, key=jax.random.key(1)))
