"""Mixed precision (`precision="bfloat16"`): the model computes in bfloat16, the rest does not."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flowgrpo_eqx as fg
import flowgrpo_eqx.testing as fgt
from flowgrpo_eqx.train import Trainer
from tests.errors import NAMED_ARGUMENT_ERRORS
from tests.test_objective import STEP, make_batch


DIM, COND = 4, 3


class BfloatProbe(eqx.Module):
    """v = W x + U c, refusing (at trace time) to run in anything but bfloat16."""

    weight: jax.Array
    cond_weight: jax.Array

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.weight = 0.3 * jax.random.normal(k1, (DIM, DIM))
        self.cond_weight = jax.random.normal(k2, (DIM, COND))

    def __call__(self, x, t, cond):
        for name, value in (("weight", self.weight), ("x", x), ("t", t), ("cond", cond)):
            if value.dtype != jnp.bfloat16:
                raise AssertionError(f"{name} reached the model as {value.dtype}")
        return self.weight @ x + self.cond_weight @ cond + t


def objective(precision):
    return fg.FlowGRPOObjective(
        BfloatProbe(jax.random.key(0)),
        fg.RectifiedFlow(shift=3.0),
        fg.InputSpec(latent_shape=(DIM,)),
        sde=fg.FlowSDE(0.7),
        guidance=None,
        clip_range=0.2,
        precision=precision,
    )


def test_model_computes_in_bfloat16_and_everything_around_it_in_float32():
    bf16 = objective("bfloat16")
    variables = bf16.init(jax.random.key(1))
    batch = make_batch(seed=2)
    mean, std = bf16.transition(
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
