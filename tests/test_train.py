"""The trainer: reference and EMA, filters, flow matching, checkpoints, and crash recovery."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flowgrpo_eqx as fg
from flowgrpo_eqx._misc import keys_to_data, own_copy
from flowgrpo_eqx.models import MLPVelocity
from flowgrpo_eqx.train import (
    Checkpointer,
    FlowMatchingObjective,
    MetricsLog,
    SupervisedBatch,
    Trainer,
    _checkpoint,
    default_optimizer,
    load_model,
    rl_epoch,
    save_model,
)
from tests.cli_helpers import run_cli
from tests.cli_rewards import brightness
from tests.errors import NAMED_ARGUMENT_ERRORS
from tests.tolerances import optimizer_rtol


LATENT = 4
COND = 2


def make_setup(beta, ema_decay=None, trainable=eqx.is_inexact_array, lr=1e-2):
    model = MLPVelocity(LATENT, COND, hidden=16, depth=2, time_features=8, key=jax.random.key(0))
    objective = fg.FlowGRPOObjective(
        model,
        fg.RectifiedFlow(),
        fg.InputSpec(null=jnp.zeros(COND), latent_shape=(LATENT,)),
        beta=beta,
        clip_range=0.2,
        guidance=fg.CFG(2.0),
        steps=4,
    )
    rollout = fg.FlowRollout(objective, brightness, groups=4, steps=5)
    trainer = Trainer(
        objective, default_optimizer(lr, 0.0), trainable=trainable, ema_decay=ema_decay
    )
    return objective, rollout, trainer


ROWS = np.array([[1.0, 0.0], [0.0, 1.0]], np.float32)


def run_epochs(trainer, rollout, state, epochs=2, minibatch_rows=4):
    for epoch in range(epochs):
        state, metrics, _ = rl_epoch(
            trainer,
            state,
            rollout,
            ROWS,
            jax.random.key(100 + epoch),
            inner_epochs=2,
            minibatch_rows=minibatch_rows,
        )
    return state, metrics


def arrays(tree):
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


def test_reference_bit_identical_and_never_ema_written():
    objective, rollout, trainer = make_setup(beta=0.1, ema_decay=0.5)
    state = trainer.init(jax.random.key(0))
    reference = arrays(state.variables.reference)
    policy_before = arrays(state.variables.policy)
    np.testing.assert_array_equal(arrays(state.ema)[0], policy_before[0])
    state, metrics = run_epochs(trainer, rollout, state)
    assert not np.array_equal(arrays(state.ema)[0], policy_before[0])
    for a, b in zip(reference, arrays(state.variables.reference), strict=True):
        np.testing.assert_array_equal(a, b)
        assert a.dtype == b.dtype
    assert any(
        not np.array_equal(a, b)
        for a, b in zip(policy_before, arrays(state.variables.policy), strict=True)
    )
    assert metrics["kl"] > 0


def test_ema_updated_as_configured():
    objective, rollout, trainer = make_setup(beta=0.0, ema_decay=0.75)
    state = trainer.init(jax.random.key(0))
    assert state.variables.reference is None
    batch, _ = rollout.collect(state.variables.policy, ROWS, jax.random.key(1))
    ema_before = arrays(state.ema)
    state, _ = trainer.update(state, batch)
    policy_after = arrays(state.variables.policy)
    for before, policy, ema in zip(ema_before, policy_after, arrays(state.ema), strict=True):
        want = 0.75 * before.astype(np.float64) + 0.25 * policy.astype(np.float64)
        np.testing.assert_allclose(ema, want, rtol=1e-6, atol=1e-7)
    assert any(not np.array_equal(a, b) for a, b in zip(ema_before, arrays(state.ema), strict=True))


def test_no_ema_and_no_kl_keep_nothing_but_the_policy():
    objective, rollout, trainer = make_setup(beta=0.0, ema_decay=None)
    state = trainer.init(jax.random.key(0))
    assert state.ema is None and state.variables.reference is None
    state, _ = run_epochs(trainer, rollout, state, epochs=1)
    assert state.ema is None and state.variables.reference is None


def test_filter_freezes_parameters():
    model = MLPVelocity(LATENT, COND, hidden=16, depth=2, time_features=8, key=jax.random.key(0))
    only_last = jax.tree.map(lambda _: False, model)
    only_last = eqx.tree_at(lambda m: m.layers[-1].weight, only_last, True)
    objective, rollout, trainer = make_setup(beta=0.0, trainable=only_last)
    state = trainer.init(jax.random.key(0))
    # The update donates the state's buffers, so keep host copies.
    before = jax.tree.map(np.array, eqx.filter(state.variables.policy, eqx.is_array))
    state, _ = run_epochs(trainer, rollout, state, epochs=1)
    after = state.variables.policy
    assert not np.array_equal(before.layers[-1].weight, after.layers[-1].weight)
    np.testing.assert_array_equal(before.layers[-1].bias, after.layers[-1].bias)
    np.testing.assert_array_equal(before.layers[0].weight, after.layers[0].weight)


def test_minibatch_rows_must_divide():
    objective, rollout, trainer = make_setup(beta=0.0)
    state = trainer.init(jax.random.key(0))
    with pytest.raises(ValueError, match="minibatch_rows"):
        run_epochs(trainer, rollout, state, epochs=1, minibatch_rows=3)


def test_update_matches_manual_optax_step():
    objective, rollout, trainer = make_setup(beta=0.0)
    state = trainer.init(jax.random.key(0))
    batch, _ = rollout.collect(state.variables.policy, ROWS, jax.random.key(3))
    policy = state.variables.policy
    optimizer = default_optimizer(1e-2, 0.0)
    params = eqx.filter(policy, eqx.is_inexact_array)

    def value(p):
        variables = fg.FlowGRPOVariables(eqx.combine(p, policy), None)
        step = fg.Step(0, jax.random.split(state.key)[1])
        return objective.loss(variables, batch, step)[0].value

    grads = eqx.filter_grad(value)(params)
    with jax.numpy_dtype_promotion("standard"):  # optax's own arithmetic, as in the Trainer
        updates, _ = optimizer.update(grads, optimizer.init(params), params)
    want = eqx.apply_updates(params, updates)
    want_arrays = arrays(want)
    new_state, metrics = trainer.update(state, batch)
    for a, b in zip(want_arrays, arrays(new_state.variables.policy), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert int(new_state.step) == 1
    np.testing.assert_allclose(
        float(metrics["grad_norm"]),
        float(jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grads)))),
        rtol=1e-5,
    )


def test_flow_matching_loss_matches_numpy():
    model = MLPVelocity(LATENT, COND, hidden=8, depth=1, time_features=4, key=jax.random.key(0))
    inputs = fg.InputSpec(null=jnp.zeros(COND), latent_shape=(LATENT,))
    objective = FlowMatchingObjective(
        fg.GuidedFlow(model, fg.RectifiedFlow(), inputs, guidance=None),
        cond_dropout=0.0,
        time_sampling="uniform",
    )
    data = jax.random.normal(jax.random.key(1), (6, LATENT))
    cond = jax.random.normal(jax.random.key(2), (6, COND))
    step = fg.Step(0, jax.random.key(3))
    total, aux = objective.loss(objective.init(step.key), SupervisedBatch(data, cond), step)
    noise_key, time_key, _ = jax.random.split(step.key, 3)
    noise = np.asarray(jax.random.normal(noise_key, data.shape), np.float64)
    t = np.asarray(jax.random.uniform(time_key, (6,), minval=1e-4, maxval=1 - 1e-4), np.float64)
    x0 = np.asarray(data, np.float64)
    x_t = (1 - t[:, None]) * x0 + t[:, None] * noise
    prediction = np.asarray(
        jax.vmap(model)(jnp.asarray(x_t, jnp.float32), jnp.asarray(t, jnp.float32), cond),
        np.float64,
    )
    want = np.mean((prediction - (noise - x0)) ** 2, axis=1).sum()
    np.testing.assert_allclose(float(total.total), want, rtol=1e-4)
    assert float(total.count) == 6 and float(aux["dropped"].total) == 0


def test_flow_matching_pretraining_reduces_loss_and_drops_conditions():
    model = MLPVelocity(LATENT, COND, hidden=32, depth=2, time_features=8, key=jax.random.key(0))
    inputs = fg.InputSpec(null=jnp.zeros(COND), latent_shape=(LATENT,))
    objective = FlowMatchingObjective(
        fg.GuidedFlow(model, fg.RectifiedFlow(), inputs), cond_dropout=0.5
    )
    trainer = Trainer(objective, default_optimizer(3e-3, 0.0))
    state = trainer.init(jax.random.key(0))
    cond = jnp.tile(jnp.eye(COND), (16, 1))
    data = jnp.concatenate([cond, -cond], axis=1) * 0.8
    batch = SupervisedBatch(data=data, cond=cond)
    losses, dropped = [], []
    for _ in range(150):
        state, metrics = trainer.update(state, batch)
        losses.append(float(metrics["loss"]))
        dropped.append(float(metrics["dropped"]))
    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:10])
    assert 0.35 < np.mean(dropped) < 0.65


def test_bad_trainer_and_flow_matching_settings():
    objective, _, _ = make_setup(beta=0.0)
    with pytest.raises(ValueError, match="ema_decay"):
        Trainer(objective, ema_decay=1.0)
    with pytest.raises(ValueError, match="learning_rate"):
        default_optimizer(0.0)
    for bad in (0, True):
        with pytest.raises(ValueError, match="decay_steps"):
            default_optimizer(1e-3, decay_steps=bad)
    with pytest.raises(ValueError, match="cond_dropout"):
        FlowMatchingObjective(objective.flow, cond_dropout=1.0)
    unconditional = fg.GuidedFlow(
        objective.flow.model, fg.RectifiedFlow(), fg.InputSpec(), guidance=None
    )
    with pytest.raises(ValueError, match="null"):
        FlowMatchingObjective(unconditional)


def test_checkpointer_keeps_latest_and_restores(tmp_path):
    objective, rollout, trainer = make_setup(beta=0.0)
    state = trainer.init(jax.random.key(0))
    checkpoints = Checkpointer(tmp_path, keep=2)
    for step in range(1, 5):
        checkpoints.save(step, state, {"epoch": step})
    assert [p.name for p in checkpoints.paths()] == ["ckpt_00000003", "ckpt_00000004"]
    restored, meta = checkpoints.restore(trainer.init(jax.random.key(9)))
    assert meta["epoch"] == 4
    assert eqx.tree_equal(eqx.filter(restored, eqx.is_array), eqx.filter(state, eqx.is_array))


def test_interrupted_checkpoint_write_keeps_previous_loadable(tmp_path, monkeypatch):
    objective, rollout, trainer = make_setup(beta=0.0)
    state = trainer.init(jax.random.key(0))
    checkpoints = Checkpointer(tmp_path, keep=3)
    checkpoints.save(1, state, {"epoch": 1})
    newer, _ = run_epochs(trainer, rollout, trainer.init(jax.random.key(0)), epochs=1)

    def crash_midway(folder, leaves, plan):
        folder.mkdir()
        (folder / "shard").write_bytes(b"partial bytes of a checkpoint")
        raise KeyboardInterrupt("killed while writing")

    monkeypatch.setattr(_checkpoint, "write_state", crash_midway)
    with pytest.raises(KeyboardInterrupt):
        checkpoints.save(2, newer, {"epoch": 2})
    monkeypatch.undo()
    assert any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())
    unfinished = checkpoints.unfinished_writes()
    assert len(unfinished) == 1 and unfinished[0].name.startswith(".tmp-00000002")
    assert checkpoints.latest().name == "ckpt_00000001"
    restored, meta = Checkpointer(tmp_path).restore(trainer.init(jax.random.key(5)))
    assert meta["epoch"] == 1
    assert eqx.tree_equal(eqx.filter(restored, eqx.is_array), eqx.filter(state, eqx.is_array))
    checkpoints.save(2, newer, {"epoch": 2})
    assert checkpoints.latest().name == "ckpt_00000002"


def test_model_export_round_trip(tmp_path):
    objective, _, _ = make_setup(beta=0.0)
    save_model(tmp_path / "m.eqx", objective.flow.model)
    like = MLPVelocity(LATENT, COND, hidden=16, depth=2, time_features=8, key=jax.random.key(5))
    loaded = load_model(tmp_path / "m.eqx", like)
    assert eqx.tree_equal(loaded, objective.flow.model)


def test_metrics_log_keep_only(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    for epoch in range(5):
        log.write({"epoch": epoch, "loss": epoch * 0.5})
    log.keep_only(lambda r: r["epoch"] <= 2)
    assert [r["epoch"] for r in log.read()] == [0, 1, 2]


def test_cli_rejects_unknown_preset(tmp_path):
    result = run_cli("train", "--preset", "huge", "--out", str(tmp_path))
    assert result.returncode == 2 and "preset" in result.stderr


def test_sde_steps_makes_only_leading_transitions_stochastic(tmp_path):
    from flowgrpo_eqx.shapes_demo import ShapesJob, make_config

    job = ShapesJob(make_config("tiny", rollout_steps=5, sde_steps=2), tmp_path, quiet=True)
    sde = job.objective(job.model).sde
    grid = np.asarray(fg.RectifiedFlow().timesteps(5))
    stochastic = np.asarray(sde.is_stochastic(grid[:-1], grid[1:]))
    assert stochastic.tolist() == [True, True, False, False]
    everywhere = ShapesJob(
        make_config("tiny", rollout_steps=5, sde_steps=None), tmp_path, quiet=True
    )
    assert everywhere.objective(everywhere.model).sde.window is None
    for bad in (0, 5):
        with pytest.raises(ValueError, match="sde_steps"):
            make_config("tiny", rollout_steps=5, sde_steps=bad)


def test_cosine_decay_step_sizes_match_numpy():
    # With a constant gradient, Adam's bias-corrected update is one step size per update, so
    # each parameter moves by the schedule: lr * (1 + cos(pi * i / decay_steps)) / 2, then 0.
    optimizer = default_optimizer(1e-2, weight_decay=0.0, max_grad_norm=None, decay_steps=4)
    params = jnp.zeros(3)
    grads = jnp.array([1.0, -2.0, 0.5])
    state = optimizer.init(params)
    moves = []
    for _ in range(6):
        with jax.numpy_dtype_promotion("standard"):  # optax's own arithmetic
            updates, state = optimizer.update(grads, state, params)
        moves.append(np.asarray(updates))
    index = np.arange(6)
    want = 1e-2 * 0.5 * (1.0 + np.cos(np.pi * np.minimum(index, 4) / 4))
    np.testing.assert_allclose(
        np.abs(np.stack(moves)),
        np.repeat(want[:, None], 3, axis=1),
        rtol=optimizer_rtol(),
        atol=1e-9,
    )
    assert np.all(np.sign(np.stack(moves)[:4]) == -np.sign(np.asarray(grads)))


def test_job_cosine_schedule_spans_the_run_and_bad_schedule_named(tmp_path):
    from flowgrpo_eqx.shapes_demo import ShapesJob, make_config

    job = ShapesJob(make_config("tiny", epochs=3, inner_epochs=2, minibatch_rows=4), tmp_path)
    # tiny: 2 prompts x 4 groups = 8 rows -> 2 minibatches, x 2 inner epochs, x 3 epochs
    assert job.updates() == 12
    with pytest.raises(NAMED_ARGUMENT_ERRORS, match="lr_schedule"):
        make_config("tiny", lr_schedule="linear")
    for bad in (3, 16):  # 8 rows a rollout
        with pytest.raises(ValueError, match="minibatch_rows"):
            make_config("tiny", minibatch_rows=bad)


def test_every_setting_has_a_described_flag():
    from flowgrpo_eqx.shapes_demo import SETTINGS, setting_help

    names = set(SETTINGS)
    assert all(len(setting_help(name)) > 5 for name in names)
    train = run_cli("train", "--help")
    assert train.returncode == 0
    for name in names:
        assert "--" + name.replace("_", "-") in train.stdout


class TwoPartModel(eqx.Module):
    """A user model with an `eqx.nn.MLP` (whose activation is a non-array leaf) and a head."""

    mlp: eqx.nn.MLP
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.mlp = eqx.nn.MLP(LATENT + COND + 1, 8, width_size=8, depth=1, key=k1)
        self.head = eqx.nn.Linear(8, LATENT, key=k2)

    def __call__(self, x, t, cond):
        return self.head(self.mlp(jnp.concatenate([x, cond, t[None]])))


def test_equinox_faq_filter_spec_trains_exactly_the_selected_submodule():
    model = TwoPartModel(jax.random.key(0))
    # The Equinox FAQ's idiom for training part of a model: a spec of bools shaped like the
    # model (its non-array leaves, such as the MLP's activation, included), True on `mlp`.
    spec = eqx.tree_at(lambda m: m.mlp, jax.tree.map(lambda _: False, model), replace=True)
    objective = fg.FlowGRPOObjective(
        model,
        fg.RectifiedFlow(),
        fg.InputSpec(null=jnp.zeros(COND), latent_shape=(LATENT,)),
        clip_range=0.2,
        guidance=fg.CFG(2.0),
        steps=4,
    )
    rollout = fg.FlowRollout(objective, brightness, groups=4, steps=5)
    trainer = Trainer(objective, default_optimizer(1e-2, 0.0), trainable=spec)
    state = trainer.init(jax.random.key(1))
    state, _ = run_epochs(trainer, rollout, state, epochs=1)
    after = state.variables.policy
    # The activation survived, so the policy still runs.
    assert after.mlp.activation is model.mlp.activation
    changed = [
        not np.array_equal(a, b) for a, b in zip(arrays(model.mlp), arrays(after.mlp), strict=True)
    ]
    assert all(changed)
    assert eqx.tree_equal(after.head, model.head)
    trainable, _ = trainer.split_policy(model)
    assert jax.tree.leaves(trainable.head) == []


def test_a_diverging_epoch_is_named_with_its_metrics():
    objective, rollout, _ = make_setup(beta=0.0)
    trainer = Trainer(objective, default_optimizer(1e30, 0.0, max_grad_norm=None))
    state = trainer.init(jax.random.key(0))
    with pytest.raises(fg.train.TrainingDiverged, match="Training diverged in epoch") as caught:
        for epoch in range(1, 4):
            state, _, _ = rl_epoch(
                trainer, state, rollout, ROWS, jax.random.key(epoch), epoch=epoch,
                inner_epochs=2, minibatch_rows=4,
            )  # fmt: skip
    error = caught.value
    assert error.epoch >= 1 and error.what in ("loss", "grad_norm", "the policy's parameters")
    assert {"loss", "grad_norm"} <= set(error.metrics)
    assert not all(np.isfinite(v) for v in error.metrics.values()) or "parameters" in error.what


def test_check_finite_names_the_parameters():
    from flowgrpo_eqx.train._diverged import check_finite

    policy = {"w": jnp.asarray([1.0, np.inf])}
    with pytest.raises(fg.train.TrainingDiverged, match="the policy's parameters"):
        check_finite(3, {"loss": 0.5, "grad_norm": 1.0}, policy)
    with pytest.raises(fg.train.TrainingDiverged, match="epoch 3: loss is not finite"):
        check_finite(3, {"loss": float("nan"), "grad_norm": 1.0}, {"w": jnp.ones(2)})
    check_finite(3, {"loss": 0.5, "grad_norm": 1.0}, {"w": jnp.ones(2), "n": jnp.arange(2)})


def test_microbatches_accumulate_to_the_whole_batch_update():
    objective, rollout, trainer = make_setup(beta=0.1)
    state = trainer.init(jax.random.key(0))
    batch, _ = rollout.collect(state.variables.policy, ROWS, jax.random.key(1))
    # Perturb the recorded densities so that ratios move and some clip.
    noise = np.random.default_rng(0).normal(size=batch.old_log_probs.shape).astype(np.float32)
    batch = eqx.tree_at(lambda b: b.old_log_probs, batch, batch.old_log_probs + 0.3 * noise)

    def floats(tree):
        return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array))]

    start = floats(state)
    results = {}
    for parts in (1, 2, 4):
        accumulating = Trainer(objective, default_optimizer(1e-2, 0.0), microbatches=parts)
        new_state, metrics = accumulating.update(own_copy(state), batch)
        aux = accumulating.run_update(new_state, batch)
        results[parts] = (floats(new_state), metrics, floats(aux))
    assert any(not np.array_equal(a, b) for a, b in zip(results[1][0], start, strict=True))
    assert 0 < results[1][1]["clipfrac"] < 1
    for parts in (2, 4):
        for got, want in zip(results[parts][0], results[1][0], strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        assert results[parts][1].keys() == results[1][1].keys()
        for name, value in results[1][1].items():
            np.testing.assert_allclose(results[parts][1][name], value, rtol=1e-5, err_msg=name)
        for got, want in zip(results[parts][2], results[1][2], strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="`microbatches`"):
        Trainer(objective, microbatches=3).update(own_copy(state), batch)
    with pytest.raises(NAMED_ARGUMENT_ERRORS, match="microbatches"):
        Trainer(objective, microbatches=0)
    guarded = fg.FlowGRPOObjective(
        objective.initial_policy(),
        fg.RectifiedFlow(),
        fg.InputSpec(null=jnp.zeros(COND), latent_shape=(LATENT,)),
        beta=0.0, clip_range=0.2, guidance=None, steps=4, guard=fg.GRPOGuard(),
    )  # fmt: skip
    with pytest.raises(ValueError, match="`microbatches`.*GRPO-Guard"):
        Trainer(guarded, microbatches=2)


def test_an_optimizer_that_is_not_a_gradient_transformation_is_named():
    """`Trainer(objective, "adam")` failed later with a raw AttributeError."""
    objective, _, _ = make_setup(beta=0.0)
    # This suite's runtime type checker refuses it first; both name `optimizer`.
    with pytest.raises(NAMED_ARGUMENT_ERRORS, match="optimizer"):
        Trainer(objective, "adam")
    trainer = Trainer(objective)
    object.__setattr__(trainer, "optimizer", "adam")
    with pytest.raises(ValueError, match="`optimizer` must be an optax.GradientTransformation"):
        trainer.__check_init__()


def test_non_finite_advantages_are_refused_by_name():
    """NaN advantages made every trained parameter NaN without a word."""
    objective, rollout, trainer = make_setup(beta=0.0)
    state = trainer.init(jax.random.key(0))
    batch, _ = rollout.collect(state.variables.policy, ROWS, jax.random.key(3))
    for bad in (np.nan, np.inf):
        poisoned = eqx.tree_at(lambda b: b.advantages, batch, batch.advantages.at[1].set(bad))
        with pytest.raises(ValueError, match=r"`batch.advantages` holds a NaN or infinite"):
            trainer.update(own_copy(state), poisoned)
    new_state, _ = trainer.update(state, batch)
    assert all(np.all(np.isfinite(a)) for a in arrays(new_state.variables.policy))


def test_a_refused_update_leaves_the_callers_state_usable_and_says_why_first():
    """The state was donated before the NaN advantages were refused: its arrays then said
    "Array has been deleted", and the message came after JAX's "Above is the stack outside of
    JIT"."""
    objective, rollout, trainer = make_setup(beta=0.0)
    state = trainer.init(jax.random.key(0))
    batch, _ = rollout.collect(state.variables.policy, ROWS, jax.random.key(3))
    # Copies: a NumPy view of a buffer would keep JAX from donating it.
    before = [np.array(a, copy=True) for a in arrays(keys_to_data(state))]
    for poisoned in (
        eqx.tree_at(lambda b: b.advantages, batch, batch.advantages.at[2].set(np.nan)),
        eqx.tree_at(lambda b: b.advantages, batch, np.asarray(batch.advantages * np.inf)),
    ):
        with pytest.raises(ValueError) as caught:
            trainer.update(state, poisoned)
        first_line = str(caught.value).splitlines()[0]
        assert first_line.startswith("`batch.advantages` holds a NaN or infinite value")
    # Nothing was donated: the state reads as it was, and trains on a good batch.
    for got, want in zip(arrays(keys_to_data(state)), before, strict=True):
        np.testing.assert_array_equal(got, want)
    new_state, metrics = trainer.update(state, batch)
    assert np.isfinite(float(metrics["loss"])) and int(new_state.step) == 1
    # Traced inside the caller's own jit, the values are only known when the program runs:
    # the program checks them itself.
    poisoned = eqx.tree_at(lambda b: b.advantages, batch, batch.advantages.at[0].set(np.nan))
    with pytest.raises(Exception, match=r"`batch.advantages` holds a NaN or infinite"):
        eqx.filter_jit(trainer.update)(own_copy(new_state), poisoned)
