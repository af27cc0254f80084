"""Mixed precision (`precision="bfloat16"`): the model computes in bfloat16, the rest does not."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flowgrpo_eqx as fg
import flowgrpo_eqx.testing as fgt
from flowgrpo_eqx.models import MLPVelocity
from flowgrpo_eqx.train import Trainer, minibatch_indices, minibatches, rl_epoch
from tests.cli_rewards import brightness
from tests.errors import NAMED_ARGUMENT_ERRORS
from tests.test_objective import STEP, make_batch


DIM, COND = 4, 3


class BfloatProbe(eqx.Module):
    """v = W x + U c, refusing (at trace time) to run in anything but `dtype` (bfloat16)."""

    weight: jax.Array
    cond_weight: jax.Array
    dtype: str = eqx.field(static=True, default="bfloat16")

    def __init__(self, key, dtype="bfloat16"):
        k1, k2 = jax.random.split(key)
        self.weight = 0.3 * jax.random.normal(k1, (DIM, DIM))
        self.cond_weight = jax.random.normal(k2, (DIM, COND))
        self.dtype = dtype

    def __call__(self, x, t, cond):
        for name, value in (("weight", self.weight), ("x", x), ("t", t), ("cond", cond)):
            if value.dtype != jnp.dtype(self.dtype):
                raise AssertionError(f"{name} reached the model as {value.dtype}")
        return self.weight @ x + self.cond_weight @ cond + t


def objective(precision, old_log_probs="rollout"):
    return fg.FlowGRPOObjective(
        BfloatProbe(jax.random.key(0), "bfloat16" if precision == "bfloat16" else "float32"),
        fg.RectifiedFlow(shift=3.0),
        fg.InputSpec(latent_shape=(DIM,)),
        sde=fg.FlowSDE(0.7),
        guidance=None,
        clip_range=0.2,
        precision=precision,
        old_log_probs=old_log_probs,
    )


def test_model_computes_in_bfloat16_and_everything_around_it_in_float32():
    bf16 = objective("bfloat16")
    variables = bf16.init(jax.random.key(1))
    batch = make_batch(seed=2)
    mean, std = bf16.flow.transition(
        bf16.sde,
        variables.policy,
        batch.latents[:, 0],
        batch.timesteps[:, 0],
        batch.next_timesteps[:, 0],
        batch.cond,
    )
    assert mean.dtype == std.dtype == jnp.float32
    log_probs = bf16.log_probs(variables, batch)
    assert log_probs.dtype == jnp.float32
    value, total, aux, grads = fgt.loss_value_and_grad(bf16, variables, batch)
    assert value.dtype == total.total.dtype == aux.ratio.total.dtype == jnp.float32
    # Gradients reach the float32 master weights, in float32.
    for leaf in jax.tree.leaves(eqx.filter(grads, eqx.is_array)):
        assert leaf.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(leaf)))
    with pytest.raises(AssertionError, match="reached the model as float32"):
        objective("float32").log_probs(variables, batch)


def test_bfloat16_velocity_is_close_to_float32_and_updates_keep_float32_weights():
    batch = make_batch(seed=3)
    bf16 = objective("bfloat16")
    variables = bf16.init(jax.random.key(1))
    low = np.asarray(bf16.log_probs(variables, batch))
    x, t, cond = batch.latents[:, 0], batch.timesteps[:, 0], batch.cond
    probe = variables.policy
    velocity = jax.vmap(lambda x, t, c: probe.weight @ x + probe.cond_weight @ c + t)(x, t, cond)
    low_velocity = bf16.flow.velocity(probe, x, t, cond)
    np.testing.assert_allclose(low_velocity, velocity, rtol=3e-2, atol=3e-2)
    assert low.dtype == np.float32 and np.all(np.isfinite(low))
    trainer = Trainer(bf16)
    state = trainer.init(jax.random.key(0), variables)
    state, metrics = trainer.update(state, batch)
    for leaf in jax.tree.leaves(eqx.filter(state.variables.policy, eqx.is_array)):
        assert leaf.dtype == jnp.float32
    assert np.isfinite(float(metrics["loss"]))
    _, aux = bf16.loss(state.variables, batch, STEP)
    assert aux.ratio.total.dtype == jnp.float32


def test_unknown_precision_is_named():
    with pytest.raises(NAMED_ARGUMENT_ERRORS, match="precision"):
        objective("float16")


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_old_log_probs_from_the_update_program_make_the_first_ratio_exactly_one(precision):
    # make_batch's old log densities are random: only a recomputation makes the ratio 1.
    batch = make_batch(seed=4, n=6)
    flow = objective(precision, old_log_probs="update")
    variables = flow.init(jax.random.key(1))
    trainer = Trainer(flow)
    state = trainer.init(jax.random.key(0), variables)
    key = jax.random.key(5)
    request = fg.Rescore(batch, fill=flow.with_rescored_rows)
    rescored = trainer.rescore(state, request, minibatch_indices(batch.num_rows, 3, key))
    kept = np.asarray(flow.kept(batch))
    old, new = np.asarray(batch.old_log_probs), np.asarray(rescored.old_log_probs)
    np.testing.assert_array_equal(new[~kept], old[~kept])
    assert np.all(np.abs(new[kept] - old[kept]) > 1e-3)
    rescoring = np.asarray(flow.log_probs(variables, batch))[kept]
    np.testing.assert_allclose(new[kept], rescoring, rtol=2e-2, atol=2e-2)
    first = next(minibatches(rescored, 3, key))
    _, metrics = trainer.update(state, first)
    assert float(metrics["approx_kl"]) == 0.0
    assert float(metrics["ratio"]) == 1.0
    assert float(metrics["clipfrac"]) == 0.0


def test_the_rollout_mode_keeps_the_recorded_log_probs():
    flow = objective("bfloat16")
    trainer = Trainer(flow)
    state = trainer.init(jax.random.key(0))
    batch = make_batch(seed=1)
    assert trainer.run_update(state, batch).log_probs is None
    with pytest.raises(ValueError, match="aux.log_probs"):
        flow.with_rescored_rows(batch, jnp.arange(2), trainer.run_update(state, batch))
    with pytest.raises(NAMED_ARGUMENT_ERRORS, match="old_log_probs"):
        objective("float32", old_log_probs="recorded")


def bfloat16_epoch(old_log_probs):
    latent, cond = 6, 2
    model = MLPVelocity(latent, cond, hidden=32, depth=2, time_features=8, key=jax.random.key(0))
    flow = fg.FlowGRPOObjective(
        model,
        fg.RectifiedFlow(shift=3.0),
        fg.InputSpec(null=jnp.zeros(cond), latent_shape=(latent,)),
        clip_range=1e-4,
        guidance=fg.CFG(2.0),
        steps=4,
        precision="bfloat16",
        old_log_probs=old_log_probs,
    )

    rollout = fg.FlowRollout(flow, brightness, groups=4, steps=5)
    trainer = Trainer(flow)
    state = trainer.init(jax.random.key(1))
    rows = np.array([[1.0, 0.0], [0.0, 1.0]], np.float32)
    _, metrics, _ = rl_epoch(trainer, state, rollout, rows, jax.random.key(2))
    return metrics


def test_a_bfloat16_epoch_starts_from_ratio_one_with_old_log_probs_from_the_update():
    # One update per epoch (all rows at once): the epoch's metrics are the first update's.
    recorded = bfloat16_epoch("rollout")
    recomputed = bfloat16_epoch("update")
    assert recorded["approx_kl"] > 0.0
    assert recomputed["approx_kl"] == 0.0
    assert recomputed["ratio"] == 1.0
    assert recomputed["clipfrac"] == 0.0
