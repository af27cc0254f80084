"""The objective works with models written by users, not only the ones the library ships."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flowgrpo_eqx as fg
from tests.tolerances import on_policy_ratio_atol


class VectorMLP(eqx.Module):
    """A user MLP on vectors, conditioned on a float vector."""

    layers: list[eqx.nn.Linear]

    def __init__(self, dim, cond_dim, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.layers = [
            eqx.nn.Linear(dim + cond_dim + 1, 32, key=k1),
            eqx.nn.Linear(32, 32, key=k2),
            eqx.nn.Linear(32, dim, key=k3),
        ]

    def __call__(self, x, t, cond):
        h = jnp.concatenate([x, cond, t[None]])
        for layer in self.layers[:-1]:
            h = jax.nn.silu(layer(h))
        return self.layers[-1](h)


class TinyConvNet(eqx.Module):
    """A user conv net on channels-last images, conditioned on a class label via an embedding,
    with one self-attention layer over pixels."""

    embed: eqx.nn.Embedding
    conv_in: eqx.nn.Conv2d
    attention: eqx.nn.MultiheadAttention
    conv_out: eqx.nn.Conv2d

    def __init__(self, channels, classes, key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.embed = eqx.nn.Embedding(classes + 1, 8, key=k1)
        self.conv_in = eqx.nn.Conv2d(channels + 1, 8, 3, padding=1, key=k2)
        self.attention = eqx.nn.MultiheadAttention(2, 8, key=k3)
        self.conv_out = eqx.nn.Conv2d(8, channels, 3, padding=1, key=k4)

    def __call__(self, x, t, label):
        h, w, c = x.shape
        image = jnp.concatenate([jnp.moveaxis(x, -1, 0), jnp.full((1, h, w), t)], axis=0)
        features = jax.nn.gelu(self.conv_in(image)) + self.embed(label)[:, None, None]
        tokens = features.reshape(8, h * w).T
        tokens = tokens + self.attention(tokens, tokens, tokens)
        out = self.conv_out(tokens.T.reshape(8, h, w))
        return jnp.moveaxis(out, 0, -1)


def rollout_like_batch(objective, variables, rows, latent_shape, steps=5, seed=0):
    """Sample SDE transitions with the objective's own pieces, as a rollout would."""
    grid = objective.flow.process.timesteps(steps)
    n = jax.tree.leaves(rows)[0].shape[0]
    key = jax.random.key(seed)
    x = jax.random.normal(key, (n, *latent_shape))
    latents, next_latents, log_probs = [], [], []
    transition = eqx.filter_jit(objective.flow.transition)
    for i in range(steps - 1):
        t = jnp.full((n,), grid[i])
        t_next = jnp.full((n,), grid[i + 1])
        mean, std = transition(objective.sde, variables.policy, x, t, t_next, rows)
        key, sub = jax.random.split(key)
        noise = jax.random.normal(sub, mean.shape)
        x_next = jax.vmap(objective.sde.sample)(mean, std, noise)
        log_probs.append(jax.vmap(objective.sde.log_prob)(x_next, mean, std))
        latents.append(x)
        next_latents.append(x_next)
        x = x_next
    k = steps - 1
    return fg.Transitions(
        latents=jnp.stack(latents, 1),
        next_latents=jnp.stack(next_latents, 1),
        timesteps=jnp.broadcast_to(grid[:-1], (n, k)),
        next_timesteps=jnp.broadcast_to(grid[1:], (n, k)),
        old_log_probs=jnp.stack(log_probs, 1),
        transition_mask=jnp.ones((n, k), bool),
        advantages=jnp.linspace(-1.0, 1.0, n),
        cond=rows,
    )


CASES = {
    "mlp": dict(
        make=lambda key: VectorMLP(6, 3, key),
        rows=lambda: jnp.asarray(np.random.default_rng(0).normal(size=(4, 3)), jnp.float32),
        inputs=lambda: fg.InputSpec(null=jnp.zeros(3), latent_shape=(6,)),
        latent=(6,),
    ),
    "conv_attention": dict(
        make=lambda key: TinyConvNet(3, 5, key),
        rows=lambda: {"label": jnp.array([0, 1, 2, 3]), "caption_id": jnp.arange(4)},
        inputs=lambda: fg.InputSpec(select="label", null=jnp.asarray(5), latent_shape=(6, 6, 3)),
        latent=(6, 6, 3),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("guidance", [None, fg.CFG(4.0)])
def test_user_model_trains(name, guidance):
    case = CASES[name]
    objective = fg.FlowGRPOObjective(
        case["make"](jax.random.key(0)),
        fg.RectifiedFlow(shift=2.0),
        case["inputs"](),
        guidance=guidance,
        beta=0.05,
        clip_range=0.2,
        steps=4,
    )
    variables = objective.init(jax.random.key(1))
    batch = rollout_like_batch(objective, variables, case["rows"](), case["latent"])
    rescored = objective.log_probs(variables, batch)
    np.testing.assert_allclose(np.asarray(rescored), np.asarray(batch.old_log_probs), atol=1e-5)
    step = fg.Step(index=0, key=jax.random.key(2))

    @eqx.filter_jit
    @eqx.filter_value_and_grad(has_aux=True)
    def value(policy):
        total, aux = objective.loss(fg.FlowGRPOVariables(policy, variables.reference), batch, step)
        return total.value, aux

    (loss, aux), grads = value(variables.policy)
    assert np.isfinite(float(loss))
    np.testing.assert_allclose(float(aux.ratio.value), 1.0, atol=on_policy_ratio_atol())
    assert float(aux.counted) == batch.timesteps.size
    grad_leaves = [np.asarray(g) for g in jax.tree.leaves(grads)]
    assert all(np.all(np.isfinite(g)) for g in grad_leaves)
    assert any(np.any(g != 0) for g in grad_leaves)
    evaluation = objective.evaluate(variables, case["rows"](), step)
    assert evaluation.samples.shape == (4, *case["latent"])


class WrongShapeVelocity(eqx.Module):
    """A user model with a bug: it returns one number fewer than the latent has."""

    linear: eqx.nn.Linear

    def __init__(self, dim, cond_dim, key):
        self.linear = eqx.nn.Linear(dim + cond_dim + 1, dim - 1, key=key)

    def __call__(self, x, t, cond):
        return self.linear(jnp.concatenate([x, cond, t[None]]))


GUIDANCE = fg.CFG(2.0)


def _user_objective(model, null, guidance=GUIDANCE):
    return fg.FlowGRPOObjective(
        model,
        fg.RectifiedFlow(),
        fg.InputSpec(select="cond", null=null, latent_shape=(4,)),
        guidance=guidance,
    )


@pytest.mark.parametrize("guidance", [GUIDANCE, None])
def test_wrong_velocity_shape_is_named(guidance):
    objective = _user_objective(WrongShapeVelocity(4, 2, jax.random.key(0)), jnp.zeros(2), guidance)
    rollout = fg.FlowRollout(objective, lambda s, r: np.zeros(len(s)), groups=2, steps=3)
    variables = objective.init(jax.random.key(1))
    rows = {"cond": np.ones((2, 2), np.float32)}
    with pytest.raises(ValueError, match=r"velocity of shape \(3,\) for a latent of shape \(4,\)"):
        rollout.collect(variables.policy, rows, jax.random.key(2))


def test_condition_not_matching_null_is_named():
    # The null condition has 3 numbers, the rows' conditioning 2.
    objective = _user_objective(VectorMLP(4, 2, jax.random.key(0)), jnp.zeros(3))
    rollout = fg.FlowRollout(objective, lambda s, r: np.zeros(len(s)), groups=2, steps=3)
    variables = objective.init(jax.random.key(1))
    rows = {"cond": np.ones((2, 2), np.float32)}
    with pytest.raises(ValueError, match=r"rows give shapes \(2,\), the null condition .* \(3,\)"):
        rollout.collect(variables.policy, rows, jax.random.key(2))
