"""Properties of the released algorithms (docs/mathematics/flow_grpo.md §5a, nft.md §8):
DiffusionNFT's loss where the policy is still the old policy, and GRPO-Guard's guarded
log-ratio under the old transition."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, strategies as st

import flowgrpo_eqx as fg
import flowgrpo_eqx.testing as T
from tests.test_nft_released import N, draws, numpy_total, params_of, setup
from tests.test_objective import perturbed


@eqx.filter_jit
def _nft_loss(
    objective: fg.DiffusionNFTObjective, variables: fg.NFTVariables, batch, step: fg.Step
):
    def total(policy):
        both = fg.NFTVariables(policy, variables.old_policy, variables.reference)
        value, _ = objective.loss(both, batch, step)
        return value.total

    return jax.value_and_grad(total)(variables.policy)


@T.property_settings(20)
@given(
    seed=st.integers(0, 2**16),
    beta=st.sampled_from([0.1, 0.5, 1.0]),
    spread=st.floats(0.5, 8.0, width=32),
)
def test_nft_loss_at_the_old_policy_ignores_the_advantages(seed, beta, spread):
    """With `v_theta = v_old` the implicit policies `v+` and `v-` are both `v_old`, so with
    `kl_beta = 0` every row's loss is `(adv_max / beta) mean(e^2) / max(mean|e|, 1e-5)` whatever
    its advantage, and a batch of zero advantages (`r = 1/2`) has no gradient."""
    objective, variables, batch = setup(beta, kl_beta=0.0)
    policy = perturbed(variables.policy, jax.random.key(seed), 0.1)
    variables = fg.NFTVariables(policy=policy, old_policy=policy, reference=None)
    rng = np.random.default_rng(seed)

    def with_advantages(advantages: np.ndarray) -> fg.FinalSamples:
        return eqx.tree_at(lambda b: b.advantages, batch, jnp.asarray(advantages, jnp.float32))

    step = fg.Step(index=0, key=jax.random.key(seed))
    first = with_advantages(rng.normal(size=N) * spread)
    value, _ = _nft_loss(objective, variables, first, step)
    other, _ = _nft_loss(objective, variables, with_advantages(rng.normal(size=N) * spread), step)
    zero, zero_grad = _nft_loss(objective, variables, with_advantages(np.zeros(N)), step)
    np.testing.assert_allclose(float(other), float(value), rtol=1e-5)
    np.testing.assert_allclose(float(zero), float(value), rtol=1e-5)
    t, noise = draws(objective, first, step)
    params = params_of(policy)
    want, _ = numpy_total(objective, params, params, params, first, t, noise, None)
    np.testing.assert_allclose(float(value), want, rtol=1e-4)
    for leaf in jax.tree.leaves(zero_grad):
        np.testing.assert_allclose(np.asarray(leaf), 0.0, atol=1e-5 * max(1.0, abs(want)))


_DRAWS = 4096
_COORDINATES = 8


@T.property_settings(20)
@given(
    seed=st.integers(0, 2**16),
    rows=st.integers(1, 4),
    std=st.sampled_from([0.05, 0.3, 1.0]),
    shift=st.floats(0.015625, 1.0, width=32),
    drift=st.sampled_from(["sample", "batch"]),
    scale=st.sampled_from(["sample", "batch"]),
)
def test_guarded_log_ratio_under_the_old_transition(seed, rows, std, shift, drift, scale):
    """Draw `x'` from the old transition `N(mu_old, s^2)`: the mean-coordinate log-ratio has
    expectation `-mean(mu_theta - mu_old)^2 / (2 s^2)`, exactly what `GRPOGuard` adds back. With
    every row of the step sharing `s` and `dt` (as in a rollout), `S = s` for both scales; the
    per-sample drift (the authors' fix) centres every row's guarded log-ratio on 0, and the
    released batch drift centres only their mean: row `n`'s expectation is
    `(mean_n d - d_n) / (2 s)` with `d_n = mean(mu_theta - mu_old)^2`."""
    rng = np.random.default_rng(seed)
    mu_old = rng.normal(size=(rows, _COORDINATES))
    mu_theta = mu_old + shift * rng.normal(size=(rows, _COORDINATES))
    x_next = mu_old + std * rng.normal(size=(_DRAWS, rows, _COORDINATES))
    sde = fg.FlowSDE()

    def log_ratio(x: jax.Array, theta: jax.Array, old: jax.Array) -> jax.Array:
        return sde.log_prob(x, theta, std) - sde.log_prob(x, old, std)

    flat_x = jnp.asarray(x_next.reshape(-1, _COORDINATES), jnp.float32)
    theta = jnp.asarray(np.tile(mu_theta, (_DRAWS, 1)), jnp.float32)
    old = jnp.asarray(np.tile(mu_old, (_DRAWS, 1)), jnp.float32)
    squared = np.mean((mu_theta - mu_old) ** 2, axis=1)
    column = (_DRAWS * rows, 1)
    t = 0.8
    dt = 0.2
    parts = fg.GuardParts(
        log_ratio=jax.vmap(log_ratio)(flat_x, theta, old).reshape(column),
        drift=jnp.asarray(np.tile(squared, _DRAWS).reshape(column), jnp.float32),
        std=jnp.full(column, std, jnp.float32),
        t=jnp.full(column, t, jnp.float32),
        t_next=jnp.full(column, t - dt, jnp.float32),
        kept=jnp.ones(column, bool),
    )
    guarded = np.asarray(fg.GRPOGuard(drift=drift, scale=scale).normalise(parts), np.float64)
    per_row = guarded.reshape(_DRAWS, rows)
    mean = per_row.mean(axis=0)
    standard_error = per_row.std(axis=0) / np.sqrt(_DRAWS)
    want = np.zeros(rows) if drift == "sample" else (squared.mean() - squared) / (2 * std)
    assert np.all(np.abs(mean - want) <= 5 * standard_error + 1e-4 * (1 + np.abs(want)))
