"""DiffusionNFT as released (docs/mathematics/nft.md §8) against the float64 NumPy statement
`numpy_reference.nft_released_row`: the loss and its gradient, the adaptive weights held
without gradient, and the ramped old-policy decay."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flowgrpo_eqx as fg
from tests import numpy_reference as ref
from tests.test_objective import DIM, NULL, LinearVelocity, perturbed


N, K = 5, 6


def setup(beta, guidance=None, kl_beta=1e-4):
    inputs = fg.InputSpec(null=jnp.asarray(NULL), latent_shape=(DIM,))
    flow = fg.GuidedFlow(LinearVelocity(jax.random.key(0)), fg.RectifiedFlow(), inputs, guidance)
    objective = fg.DiffusionNFTObjective(
        flow, beta=beta, adv_max=5.0, kl_beta=kl_beta, old_decay=None
    )
    variables = objective.init(jax.random.key(0))
    variables = fg.NFTVariables(
        policy=perturbed(variables.policy, jax.random.key(1), 0.1),
        old_policy=perturbed(variables.policy, jax.random.key(2), 0.05),
        reference=variables.reference,
    )
    rng = np.random.default_rng(0)
    grid = np.asarray(fg.RectifiedFlow().timesteps(K + 1))[:-1]
    mask = np.array([True, True, False, True, True])
    batch = fg.FinalSamples(
        latents=jnp.asarray(rng.normal(size=(N, DIM)).astype(np.float32)),
        advantages=jnp.asarray((rng.normal(size=N) * 4).astype(np.float32)),
        cond=jnp.asarray(rng.normal(size=(N, 3)).astype(np.float32)),
        mask=jnp.asarray(mask),
        timesteps=jnp.asarray(np.broadcast_to(grid, (N, K)).astype(np.float32)),
    )
    return objective, variables, batch


def draws(objective, batch, step):
    """The times and noise `loss` draws from `step.key` (as its docstring states)."""
    noise_key, time_key = jax.random.split(step.key)
    m = max(1, int(objective.time_fraction * K))
    order = np.asarray(jnp.argsort(jax.random.uniform(time_key, (N, K)), axis=1))[:, :m]
    t = np.take_along_axis(np.asarray(batch.timesteps, np.float64), order, axis=1)
    noise = np.asarray(jax.random.normal(noise_key, (N * m, DIM), jnp.float32), np.float64)
    return t, noise.reshape(N, m, DIM)


def params_of(model):
    return [np.asarray(a, np.float64) for a in (model.weight, model.time, model.cond_weight)]


def velocity(params, x, t, c):
    w, b, u = params
    return w @ x + b * t + u @ c


def guided(params, x, t, c, scale):
    if scale is None:
        return velocity(params, x, t, c)
    null = velocity(params, x, t, np.asarray(NULL, np.float64))
    return null + scale * (velocity(params, x, t, c) - null)


def numpy_total(objective, params, old, reference, batch, t, noise, scale, weights=None):
    """Sum over counted rows of each row's mean over its times; the weights found (or held)."""
    data = np.asarray(batch.latents, np.float64)
    cond = np.asarray(batch.cond, np.float64)
    advantages = np.asarray(batch.advantages, np.float64)
    found = {}
    total = 0.0
    for i in np.nonzero(np.asarray(batch.mask))[0]:
        row = 0.0
        for j in range(t.shape[1]):
            x_t = (1 - t[i, j]) * data[i] + t[i, j] * noise[i, j]
            loss, found[i, j] = ref.nft_released_row(
                data[i],
                noise[i, j],
                t[i, j],
                guided(params, x_t, t[i, j], cond[i], scale),
                guided(old, x_t, t[i, j], cond[i], scale),
                guided(reference, x_t, t[i, j], cond[i], scale),
                advantages[i],
                objective.beta,
                objective.adv_max,
                objective.kl_beta,
                None if weights is None else weights[i, j],
            )
            row += loss / t.shape[1]
        total += row
    return total, found


@pytest.mark.parametrize("beta, guidance", [(1.0, None), (0.1, None), (0.5, fg.CFG(2.0))])
def test_released_nft_loss_and_gradient_match_numpy(beta, guidance):
    objective, variables, batch = setup(beta, guidance)
    step = fg.Step(index=3, key=jax.random.key(4))

    def value(policy):
        variables_ = fg.NFTVariables(policy, variables.old_policy, variables.reference)
        total, _ = objective.loss(variables_, batch, step)
        return total.total, total.count

    (total, count), grads = jax.value_and_grad(value, has_aux=True)(variables.policy)
    t, noise = draws(objective, batch, step)
    assert t.shape == (N, 5)  # int(0.99 * 6) of the grid's 6 start times
    scale = None if guidance is None else guidance.scale
    params = params_of(variables.policy)
    old, reference = params_of(variables.old_policy), params_of(variables.reference)
    want, weights = numpy_total(objective, params, old, reference, batch, t, noise, scale)
    assert float(count) == 4
    np.testing.assert_allclose(float(total), want, rtol=1e-4)

    # The gradient, with the adaptive weights held at their values (stop-gradient): central
    # differences of the float64 statement.
    numeric = ref.central_differences(
        lambda ps: numpy_total(objective, ps, old, reference, batch, t, noise, scale, weights)[0],
        params,
    )
    grads = (grads.weight, grads.time, grads.cond_weight)
    for got, want in zip(grads, numeric, strict=True):
        np.testing.assert_allclose(
            np.asarray(got, np.float64), want, rtol=1e-3, atol=1e-3 * np.abs(want).max()
        )


def test_the_ramped_decay_is_the_released_one_over_optimizer_steps():
    decay = fg.RampedDecay()
    for step in (1, 7, 499, 500, 501, 2000):
        assert decay(step) == pytest.approx(ref.nft_decay(step, 0, 0.001, 0.5))
    ocr = fg.RampedDecay(rate=0.0075, maximum=0.999, flat=75)
    for step in (2, 74, 76, 120, 600):
        assert ocr(step) == pytest.approx(ref.nft_decay(step, 75, 0.0075, 0.999))

    objective, variables, _ = setup(1.0)
    objective = fg.DiffusionNFTObjective(objective.flow, old_decay=fg.RampedDecay(rate=0.1))
    moved = objective.end_epoch(variables, 3)
    eta = 0.3
    np.testing.assert_allclose(
        np.asarray(moved.old_policy.weight),
        eta * np.asarray(variables.old_policy.weight)
        + (1 - eta) * np.asarray(variables.policy.weight),
        rtol=1e-6,
    )


def test_grid_times_need_the_batch_grid():
    objective, variables, batch = setup(1.0)
    batch = fg.FinalSamples(batch.latents, batch.advantages, batch.cond)
    with pytest.raises(ValueError, match="batch.timesteps"):
        objective.loss(variables, batch, fg.Step(index=0, key=jax.random.key(0)))
