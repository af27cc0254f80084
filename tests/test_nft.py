"""DiffusionNFTObjective against an independent float64 NumPy statement (mathematics/nft.md §8),
its exact identities, and `--algorithm nft` through the command line."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import flowgrpo_eqx as fg
from flowgrpo_eqx import lora
from flowgrpo_eqx.shapes_demo import JobConfig
from flowgrpo_eqx.train import MetricsLog, Trainer, rl_epoch
from tests import numpy_reference as ref
from tests.cli_helpers import run_cli
from tests.errors import NAMED_ARGUMENT_ERRORS, exact_message, raises_named
from tests.test_guided_flow import _Doubling
from tests.test_objective import (
    COND,
    DIM,
    NULL,
    LinearVelocity,
    _assert_same_trees,
    _value_and_grad,
    make_batch as make_transitions,
    numpy_guided,
    rollout_info,
)


# The velocity-space form with one uniform time per row, no KL and a fixed old policy: the
# library's first form, kept as options (loss_form=VelocityLoss(), times="uniform"); these
# tests state it. The released form (the default) is tested in test_nft_released.py.
VELOCITY_FORM = {
    "loss_form": fg.VelocityLoss(),
    "times": "uniform",
    "kl_beta": 0.0,
    "old_decay": None,
}


def make_objective(beta=0.7, adv_max=2.0, guidance=None, **settings):
    flow = fg.GuidedFlow(
        LinearVelocity(jax.random.key(0)),
        fg.RectifiedFlow(),
        fg.InputSpec(null=jnp.asarray(NULL), latent_shape=(DIM,)),
        guidance,
    )
    return fg.DiffusionNFTObjective(
        flow, beta=beta, adv_max=adv_max, **{**VELOCITY_FORM, **settings}
    )


def nft_variables(policy, old, reference=None):
    return fg.NFTVariables(policy=policy, old_policy=old, reference=reference)


def make_batch(seed, n=6, poison=False):
    rng = np.random.default_rng(seed)
    latents = rng.normal(size=(n, DIM)).astype(np.float32)
    advantages = (rng.normal(size=n) * 2.0).astype(np.float32)
    advantages[0] = 5.0  # beyond adv_max: r saturates at 1
    cond = rng.normal(size=(n, COND)).astype(np.float32)
    mask = rng.random(n) < 0.7
    mask[:2] = True
    mask[-1] = False
    if poison:
        latents[~mask] = np.nan
        advantages[~mask] = np.inf
        cond[~mask] = np.nan
    return fg.FinalSamples(
        latents=jnp.asarray(latents),
        advantages=jnp.asarray(advantages),
        cond=jnp.asarray(cond),
        mask=jnp.asarray(mask),
    )


def draws(step, batch):
    """The noise and times `loss` draws from `step.key`, as its docstring states them."""
    noise_key, time_key = jax.random.split(step.key)
    noise = jax.random.normal(noise_key, batch.latents.shape, jnp.float32)
    t = jax.random.uniform(time_key, (batch.num_rows,), jnp.float32, 1e-4, 1.0 - 1e-4)
    return np.asarray(noise, np.float64), np.asarray(t, np.float64)


STEP = fg.Step(index=0, key=jax.random.key(3))


@pytest.mark.parametrize("beta, guidance", [(0.7, None), (1.0, fg.CFG(2.5)), (0.2, None)])
def test_loss_matches_numpy_statement(beta, guidance):
    objective = make_objective(beta=beta, guidance=guidance)
    policy, old = LinearVelocity(jax.random.key(1)), LinearVelocity(jax.random.key(2))
    batch = make_batch(0)
    total, aux = objective.loss(nft_variables(policy, old), batch, STEP)
    noise, t = draws(STEP, batch)
    data = np.asarray(batch.latents, np.float64)
    cond = np.asarray(batch.cond, np.float64)
    x_t = (1 - t)[:, None] * data + t[:, None] * noise
    scale = None if guidance is None else guidance.scale
    v_theta = [numpy_guided(policy, x_t[i], t[i], cond[i], scale) for i in range(batch.num_rows)]
    v_old = [numpy_guided(old, x_t[i], t[i], cond[i], scale) for i in range(batch.num_rows)]
    mask = np.asarray(batch.mask)
    want_total, want_count = ref.nft_loss(
        data, noise, t, v_theta, v_old, np.asarray(batch.advantages), mask, beta, 2.0
    )
    assert float(total.count) == want_count == int(mask.sum())
    np.testing.assert_allclose(float(total.total), want_total, rtol=2e-5)
    np.testing.assert_allclose(float(total.value), want_total / want_count, rtol=2e-5)
    assert float(aux["drift"].value) > 0


def test_unchanged_policy_is_flow_matching_with_an_advantage_weighted_gradient():
    """With v_theta = v_old: v+ = v- = v_old, so the value is the old policy's flow-matching
    error whatever the rewards, and the gradient is that of
    `beta (2 r - 1) mean||v_theta - v||^2`, summed over counted rows over their count."""
    beta = 0.6
    objective = make_objective(beta=beta, guidance=fg.CFG(2.0))
    policy = LinearVelocity(jax.random.key(1))
    variables = nft_variables(policy, policy)
    batch = make_batch(1)

    def nft(model):
        return objective.loss(nft_variables(model, policy), batch, STEP)

    total, aux = objective.loss(variables, batch, STEP)
    np.testing.assert_allclose(float(total.value), float(aux["old_mse"].value), rtol=1e-6)
    grad = eqx.filter_grad(lambda m: nft(m)[0].value)(policy)

    noise, t = (jnp.asarray(a, jnp.float32) for a in draws(STEP, batch))
    mask = batch.mask
    x_t = (1 - t)[:, None] * batch.latents + t[:, None] * noise
    target = noise - batch.latents
    r = 0.5 + 0.5 * jnp.clip(batch.advantages / 2.0, -1.0, 1.0)

    def weighted_flow_matching(model):
        v = objective.flow.velocity(model, x_t, t, batch.cond)
        mse = jnp.mean((v - target) ** 2, axis=1)
        weight = beta * (2 * r - 1)
        return jnp.sum(jnp.where(mask, weight * mse, 0.0)) / jnp.sum(mask, dtype=jnp.float32)

    want = eqx.filter_grad(weighted_flow_matching)(policy)
    for got_leaf, want_leaf in zip(jax.tree.leaves(grad), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(got_leaf, want_leaf, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("advantage, closer", [(1.5, True), (-1.5, False)])
def test_a_gradient_step_moves_the_velocity_towards_the_target_for_positive_advantage(
    advantage, closer
):
    objective = make_objective()
    policy = LinearVelocity(jax.random.key(1))
    batch = fg.FinalSamples(
        latents=jnp.ones((1, DIM)), advantages=jnp.asarray([advantage]), cond=jnp.ones((1, COND))
    )
    noise, t = (jnp.asarray(a, jnp.float32) for a in draws(STEP, batch))
    x_t = (1 - t)[:, None] * batch.latents + t[:, None] * noise

    def error(model):
        v = objective.flow.velocity(model, x_t, t, batch.cond)
        return float(jnp.mean((v - (noise - batch.latents)) ** 2))

    grad = eqx.filter_grad(
        lambda m: objective.loss(nft_variables(m, policy), batch, STEP)[0].value
    )(policy)
    moved = eqx.apply_updates(policy, jax.tree.map(lambda g: -1e-2 * g, grad))
    assert (error(moved) < error(policy)) == closer


def test_masked_rows_reach_neither_value_nor_gradient():
    objective = make_objective(guidance=fg.CFG(2.0))
    policy, old = LinearVelocity(jax.random.key(1)), LinearVelocity(jax.random.key(2))

    def value_and_grad(batch):
        def value(model):
            return objective.loss(nft_variables(model, old), batch, STEP)[0].value

        return eqx.filter_value_and_grad(value)(policy)

    clean_value, clean_grad = value_and_grad(make_batch(2))
    value, grad = value_and_grad(make_batch(2, poison=True))
    assert np.isfinite(float(value)) and float(value) == float(clean_value)
    for leaf, clean_leaf in zip(jax.tree.leaves(grad), jax.tree.leaves(clean_grad), strict=True):
        assert np.all(np.isfinite(leaf))
        np.testing.assert_array_equal(leaf, clean_leaf)
    nothing = make_batch(2, poison=True)
    nothing = eqx.tree_at(lambda b: b.mask, nothing, jnp.zeros_like(nothing.mask))
    value, grad = value_and_grad(nothing)
    assert float(value) == 0.0 and all(not np.any(leaf) for leaf in jax.tree.leaves(grad))


@pytest.mark.parametrize(
    "settings, named",
    [
        ({"beta": 0.0}, "beta"),
        ({"beta": 1.5}, "beta"),
        ({"beta": -0.5}, "beta"),
        ({"adv_max": 0.0}, "adv_max"),
        ({"adv_max": -1.0}, "adv_max"),
        ({"kl_beta": -1e-4}, "kl_beta"),
        ({"kl_beta": float("inf")}, "kl_beta"),
        ({"kl_beta": True}, "kl_beta"),
        ({"old_decay": 1.0}, "old_decay"),
        ({"old_decay": -0.1}, "old_decay"),
        ({"old_decay": True}, "old_decay"),
    ],
)
def test_bad_settings_are_named(settings, named):
    with pytest.raises(NAMED_ARGUMENT_ERRORS, match=f"`?{named}`?"):
        _nft(**settings)


def test_malformed_batches_and_a_missing_reference_are_named():
    with pytest.raises(NAMED_ARGUMENT_ERRORS, match="advantages"):
        fg.FinalSamples(latents=jnp.ones((3, DIM)), advantages=jnp.ones(2), cond=jnp.ones((3, 1)))
    with pytest.raises(ValueError, match=r"FinalSamples.cond\['c'\]"):
        fg.FinalSamples(latents=jnp.ones((3, DIM)), advantages=jnp.ones(3), cond={"c": jnp.ones(2)})
    with pytest.raises(NAMED_ARGUMENT_ERRORS, match="mask"):
        fg.FinalSamples(
            latents=jnp.ones((3, DIM)), advantages=jnp.ones(3), cond=jnp.ones((3, 1)),
            mask=jnp.ones(3),
        )  # fmt: skip
    objective = make_objective(kl_beta=1e-2)
    policy = LinearVelocity(jax.random.key(0))
    with pytest.raises(ValueError, match="`variables.reference` is None"):
        objective.loss(nft_variables(policy, policy), make_batch(3), STEP)


def test_the_old_policy_follows_the_live_one_once_per_epoch():
    objective = make_objective(old_decay=0.25)
    trainer = Trainer(objective, optax.sgd(0.1))
    state = trainer.init(jax.random.key(0))
    assert state.variables.reference is None and state.ema is None
    before = np.array(state.variables.old_policy.weight)
    state, metrics = trainer.update(state, make_batch(3))
    np.testing.assert_array_equal(state.variables.old_policy.weight, before)
    moved = objective.end_epoch(state.variables, 1)
    want = 0.25 * before + 0.75 * np.asarray(state.variables.policy.weight)
    np.testing.assert_allclose(moved.old_policy.weight, want, rtol=1e-6)
    np.testing.assert_array_equal(moved.policy.weight, state.variables.policy.weight)
    assert make_objective().end_epoch(state.variables, 1) is state.variables
    assert {"loss", "positive_mse", "negative_mse", "old_mse", "drift", "optimality"} <= set(
        metrics
    )


def test_an_old_policy_and_a_kl_reference_at_once():
    """`kl_beta > 0` keeps a frozen reference beside the old policy; the loss adds
    `kl_beta mean||v_theta - v_ref||^2` per counted row (float64 NumPy statement)."""
    kl_beta = 0.3
    objective = make_objective(kl_beta=kl_beta, old_decay=0.5, guidance=fg.CFG(2.0))
    variables = objective.init(jax.random.key(0))
    assert variables.reference is not None and variables.old_policy is not None
    policy, old, reference = (LinearVelocity(jax.random.key(i)) for i in (1, 2, 3))
    batch = make_batch(4)
    with_kl, aux = objective.loss(nft_variables(policy, old, reference), batch, STEP)
    without, _ = make_objective(guidance=fg.CFG(2.0)).loss(nft_variables(policy, old), batch, STEP)
    noise, t = draws(STEP, batch)
    data = np.asarray(batch.latents, np.float64)
    cond = np.asarray(batch.cond, np.float64)
    x_t = (1 - t)[:, None] * data + t[:, None] * noise
    mask = np.asarray(batch.mask)
    kl = [
        np.mean(
            (numpy_guided(policy, x_t[i], t[i], cond[i], 2.0)
             - numpy_guided(reference, x_t[i], t[i], cond[i], 2.0)) ** 2
        )
        for i in range(batch.num_rows)
    ]  # fmt: skip
    want_kl = float(np.sum(np.where(mask, kl, 0.0)))
    np.testing.assert_allclose(float(aux["kl"].total), want_kl, rtol=2e-5)
    np.testing.assert_allclose(
        float(with_kl.total), float(without.total) + kl_beta * want_kl, rtol=2e-5
    )
    grads = eqx.filter_grad(lambda v: objective.loss(v, batch, STEP)[0].value)(
        nft_variables(policy, old, reference)
    )
    for frozen in (grads.old_policy, grads.reference):
        assert all(not np.any(leaf) for leaf in jax.tree.leaves(frozen))
    assert any(np.any(leaf) for leaf in jax.tree.leaves(grads.policy))
    trainer = Trainer(objective, optax.sgd(0.1))
    state = trainer.init(jax.random.key(0))
    reference_before = np.array(state.variables.reference.weight)
    state, _ = trainer.update(state, batch)
    state = dataclasses.replace(state, variables=objective.end_epoch(state.variables, 1))
    np.testing.assert_array_equal(state.variables.reference.weight, reference_before)
    assert not np.array_equal(state.variables.old_policy.weight, reference_before)


def test_an_unknown_algorithm_is_named():
    with pytest.raises(NAMED_ARGUMENT_ERRORS, match="algorithm"):
        JobConfig.from_settings({"algorithm": "bogus"})
    with pytest.raises(ValueError, match="`nft_beta`"):
        JobConfig.from_settings({"algorithm": "nft", "nft_beta": 0.0})
    result = run_cli("train", "--preset", "tiny", "--algorithm", "bogus", "--print-config")
    assert result.returncode == 2
    assert "--algorithm" in result.stderr and "Traceback" not in result.stderr


def test_the_tiny_preset_trains_with_nft_through_the_command_line(tmp_path):
    out = tmp_path / "nft"
    result = run_cli("train", "--preset", "tiny", "--quiet", "--algorithm", "nft", "--out", out)
    assert result.returncode == 0, result.stderr[-3000:]
    assert 'algorithm = "nft"' in (out / "config.toml").read_text().splitlines()
    records = [r for r in MetricsLog(out / "metrics.jsonl").read() if "reward_mean" in r]
    assert [r["epoch"] for r in records] == [1, 2, 3, 4]
    assert all(np.isfinite(r["loss"]) and "positive_mse" in r for r in records)
    assert (out / "summary.json").exists() and (out / "policy.eqx").exists()


def test_one_epoch_function_trains_nft_from_an_ode_rollout_that_records_no_transitions():
    objective = make_objective(old_decay=0.5)
    rollout = fg.FlowRollout(
        objective,
        lambda samples, rows: samples.reshape(len(samples), -1).mean(axis=1).astype(np.float64),
        groups=3,
        steps=4,
        sampler=fg.ODESampler(fg.Heun()),
    )
    assert rollout.recorded_transitions == 0
    trainer = Trainer(objective, optax.sgd(0.1))
    state = trainer.init(jax.random.key(0))
    old_before = np.array(state.variables.old_policy.weight)
    rows = np.eye(2, COND, dtype=np.float32)
    seen = []
    state, summary, info = rl_epoch(
        trainer,
        state,
        rollout,
        rows,
        jax.random.key(1),
        minibatch_rows=3,
        after_updates=lambda state, batch, info: seen.append(batch),
    )
    assert isinstance(seen[0], fg.FinalSamples) and seen[0].num_rows == 6
    np.testing.assert_array_equal(seen[0].latents, info.final)
    assert int(state.step) == 2 and np.isfinite(summary["loss"])
    assert {"positive_mse", "reward_mean", "window_start"} <= set(summary)
    live = np.asarray(state.variables.policy.weight)
    np.testing.assert_allclose(
        state.variables.old_policy.weight, 0.5 * old_before + 0.5 * live, rtol=1e-6
    )


# --------------------------------------------------------------------------------------
# DiffusionNFT chooses its dtypes itself: enabling x64 changes neither the value nor the
# gradients of float32 inputs.


def test_nft_loss_is_unchanged_by_x64():

    objective = make_objective(guidance=fg.CFG(2.0), kl_beta=0.1)
    variables = fg.NFTVariables(
        policy=LinearVelocity(jax.random.key(1)),
        old_policy=LinearVelocity(jax.random.key(2)),
        reference=LinearVelocity(jax.random.key(4)),
    )
    batch = make_batch(0, poison=True)
    want = _value_and_grad(objective, variables, batch, STEP)
    with jax.enable_x64(True):
        got = _value_and_grad(objective, variables, batch, STEP)
    _assert_same_trees(got, want)


# --------------------------------------------------------------------------------------
# DiffusionNFT's training batch.


def test_the_nft_training_batch_takes_the_final_latents_the_rows_and_their_advantages():

    batch = make_transitions(1, n=3, k=2, steps=4)
    final = jnp.arange(3 * DIM, dtype=jnp.float32).reshape(3, -1)
    info = rollout_info(final)
    nft = make_objective().training_batch(batch, info)
    np.testing.assert_array_equal(nft.latents, final)
    np.testing.assert_array_equal(nft.advantages, batch.advantages)
    np.testing.assert_array_equal(nft.cond, batch.cond)
    np.testing.assert_array_equal(nft.mask, [True, True, True])
    per_transition = make_transitions(1, n=3, k=2, steps=4, advantages_per_transition=True)
    message = (
        "DiffusionNFT needs one advantage per row, got Transitions.advantages of shape (3, 2)."
    )
    with pytest.raises(ValueError, match=exact_message(message)):
        make_objective().training_batch(per_transition, info)


# --------------------------------------------------------------------------------------
# DiffusionNFT: documented defaults, the boundaries of its checks, and the LoRA old policy.


def _nft(autoencoder=None, precision="float32", **settings):
    flow = fg.GuidedFlow(
        LinearVelocity(jax.random.key(0)),
        fg.RectifiedFlow(),
        fg.InputSpec(),
        guidance=None,
        autoencoder=fg.IdentityAutoEncoder() if autoencoder is None else autoencoder,
        precision=precision,
    )
    return fg.DiffusionNFTObjective(flow, **settings)


def test_nft_defaults_are_the_documented_ones():
    objective = _nft()
    assert (objective.beta, objective.adv_max) == (1.0, 5.0)
    assert objective.pretrained is None and isinstance(objective.solver, fg.Euler)
    # The released defaults: the adaptive x0-space loss on the sampler's grid, KL 1e-4 to the
    # reference, the ramped old-policy decay.
    assert (objective.loss_form, objective.times, objective.time_fraction) == (
        fg.AdaptiveX0Loss(),
        "grid",
        0.99,
    )
    assert objective.kl_beta == 1e-4 and objective.old_decay == fg.RampedDecay(0.001, 0.5, 0)


def test_nft_passes_its_arguments_on():

    pretrained = LinearVelocity(jax.random.key(7))
    objective = _nft(
        autoencoder=_Doubling(),
        precision="bfloat16",
        pretrained=pretrained,
        solver=fg.Heun(),
        adv_max=0.5,
    )
    assert isinstance(objective.flow.autoencoder, _Doubling)
    assert objective.flow.precision == "bfloat16" and objective.pretrained is pretrained
    assert isinstance(objective.solver, fg.Heun)
    assert isinstance(objective.rollout_sampler(None).solver, fg.Heun)
    assert objective.adv_max == 0.5


def test_nft_messages_are_exact():
    with raises_named("`solver` must be an AbstractSolver, got 'euler'."):
        _nft(solver="euler")
    with raises_named(
        "`loss_form` must be an AbstractNFTLoss (AdaptiveX0Loss, VelocityLoss), got 'released'."
    ):
        _nft(loss_form="released")
    message = (
        "`variables.reference` is None, but the objective's KL or DPO reference needs it: build "
        "the variables with `init`."
    )
    policy = _nft().initial_policy()
    with pytest.raises(ValueError, match=exact_message(message)):
        fg.NFTVariables(policy, policy, None).reference_policy()


def test_final_samples_accept_scalar_latents_and_one_dimensional_rows():
    batch = fg.FinalSamples(latents=jnp.ones(3), advantages=jnp.ones(3), cond=jnp.arange(3.0))
    assert batch.num_rows == 3
    with raises_named("FinalSamples.latents has shape (), expected [N, *latent]."):
        fg.FinalSamples(latents=jnp.ones(()), advantages=jnp.ones(3), cond=jnp.ones(3))
    with raises_named("FinalSamples.mask must be a bool array, got dtype int32."):
        fg.FinalSamples(
            latents=jnp.ones(3), advantages=jnp.ones(3), cond=jnp.ones(3),
            mask=jnp.ones(3, jnp.int32),
        )  # fmt: skip


def test_nft_old_policy_of_a_lora_policy_is_the_policy_with_the_old_adapters():

    def adapted(seed):
        model = lora.add(eqx.nn.MLP(2, 2, 4, 1, key=jax.random.key(0)), 2, key=jax.random.key(1))
        noisy = jax.tree.map(
            lambda a: a + jax.random.normal(jax.random.key(seed), a.shape), lora.adapters(model)
        )
        return lora.with_adapters(model, noisy)

    policy, old = adapted(2), adapted(3)
    got = _nft().old_policy(fg.NFTVariables(policy, lora.adapters(old), None))
    _assert_same_trees(lora.adapters(got), lora.adapters(old))
    _assert_same_trees(lora.without_adapters(got), lora.without_adapters(policy))
