"""LoRA in the library's training: the reference for free, adapter-only training, the EMA of the
adapters, and states stored without their frozen base.

The KL and EMA are compared with float64 NumPy statements (`tests/numpy_reference.py`) on a
user model of two `eqx.nn.Linear` layers.
"""

import json
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import flowgrpo_eqx as fg
from flowgrpo_eqx import lora
from flowgrpo_eqx.models import DiT, MLPVelocity
from flowgrpo_eqx.train import (
    Checkpointer,
    Trainer,
    default_optimizer,
    load_model,
    rl_epoch,
    save_model,
)
from tests import numpy_reference as ref
from tests.cli_rewards import brightness


LATENT = 4
COND = 2
ROWS = np.array([[1.0, 0.0], [0.0, 1.0]], np.float32)


def mlp_objective(policy, beta):
    return fg.FlowGRPOObjective(
        policy,
        fg.RectifiedFlow(),
        fg.InputSpec(null=jnp.zeros(COND), latent_shape=(LATENT,)),
        beta=beta,
        clip_range=0.2,
        guidance=fg.CFG(2.0),
        steps=4,
    )


def mlp_base():
    return MLPVelocity(LATENT, COND, hidden=16, depth=2, time_features=8, key=jax.random.key(0))


def arrays(tree):
    def host(x):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x)

    return [host(x) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


def assert_bit_identical(left, right):
    a, b = arrays(left), arrays(right)
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(x, y)


def test_first_update_of_a_lora_run_has_ratio_one_and_kl_zero():
    base = mlp_base()
    policy = lora.add(base, 2, key=jax.random.key(3))
    objective = mlp_objective(policy, beta=0.1)
    trainer = Trainer(objective, default_optimizer(1e-2, 0.0), ema_decay=0.9)
    # Both a reference (beta > 0) and an EMA: the reference is the policy with its adapters
    # off, so no copy is kept, and the EMA holds the adapters alone.
    state = trainer.init(jax.random.key(0))
    assert jax.tree.leaves(state.variables.reference) == []
    assert len(jax.tree.leaves(state.ema)) == 2 * len(policy.adapters)
    rollout = fg.FlowRollout(objective, brightness, groups=4, steps=5)
    batch, _ = rollout.collect(state.variables.policy, ROWS, jax.random.key(1))
    state, metrics = trainer.update(state, batch)
    assert float(metrics["counted"]) > 0
    assert float(metrics["ratio"]) == 1.0
    assert float(metrics["kl"]) == 0.0
    assert float(metrics["clipfrac"]) == 0.0
    assert float(metrics["grad_norm"]) > 0


def test_without_adapters_nothing_changes():
    objective = mlp_objective(mlp_base(), beta=0.1)
    trainer = Trainer(objective, default_optimizer(1e-2, 0.0), ema_decay=0.9)
    state = trainer.init(jax.random.key(0))
    # The reference is a full copy of the base, the EMA another, and every float array trains.
    assert_bit_identical(state.variables.reference, mlp_base())
    assert_bit_identical(state.ema, mlp_base())
    assert sum(x.size for x in arrays(state.opt_state)) == 2 * sum(
        x.size for x in arrays(mlp_base())
    ) + sum(x.size for x in arrays(state.opt_state) if x.ndim == 0)


def test_trainer_trains_adapters_only_and_base_stays_bit_identical():
    base = mlp_base()
    policy = lora.add(base, 2, key=jax.random.key(3))
    objective = mlp_objective(policy, beta=0.1)
    trainer = Trainer(objective, default_optimizer(3e-2, 0.0))
    state = trainer.init(jax.random.key(0))
    # No EMA, and the reference is the policy with its adapters off: nothing else is kept.
    assert jax.tree.leaves(state.variables.reference) == [] and state.ema is None
    # The optimizer state holds adapter-shaped arrays only (AdamW: two per adapter array).
    adapter_shapes = sorted(x.shape for x in arrays(policy.adapters))
    state_shapes = sorted(x.shape for x in arrays(state.opt_state) if x.ndim > 0)
    assert state_shapes == sorted(adapter_shapes * 2)
    rollout = fg.FlowRollout(objective, brightness, groups=4, steps=5)
    for epoch in range(2):
        state, metrics, _ = rl_epoch(
            trainer,
            state,
            rollout,
            ROWS,
            jax.random.key(10 + epoch),
            inner_epochs=2,
            minibatch_rows=4,
        )
    trained = state.variables.policy
    assert_bit_identical(lora.base(trained), base)
    assert_bit_identical(
        eqx.filter(trained, lora.adapter_filter(trained), inverse=True),
        eqx.filter(policy, lora.adapter_filter(policy), inverse=True),
    )
    assert all(np.any(np.asarray(adapter.b) != 0) for adapter in trained.adapters)
    assert float(metrics["kl"]) > 0


class TwoLinears(eqx.Module):
    """v = W x + c t + U cond, with W and U in `eqx.nn.Linear` layers (no bias)."""

    state: eqx.nn.Linear
    cond: eqx.nn.Linear
    time: jax.Array

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.state = eqx.nn.Linear(LATENT, LATENT, use_bias=False, key=k1)
        self.cond = eqx.nn.Linear(COND, LATENT, use_bias=False, key=k2)
        self.time = jax.random.normal(k3, (LATENT,))

    def __call__(self, x, t, cond):
        return self.state(x) + self.time * t + self.cond(cond)


def numpy_velocity(weights, x, t, cond):
    return weights["state"] @ x + weights["time"] * t + weights["cond"] @ cond


def numpy_weights(model, adapters=None, scale=0.0):
    """float64 weights of `TwoLinears`, with `W + scale B A` on the adapted layers."""
    out = {
        "state": np.asarray(model.state.weight, np.float64),
        "cond": np.asarray(model.cond.weight, np.float64),
        "time": np.asarray(model.time, np.float64),
    }
    for name, adapter in (adapters or {}).items():
        out[name] = out[name] + scale * (
            np.asarray(adapter.b, np.float64) @ np.asarray(adapter.a, np.float64)
        )
    return out


def random_batch(seed, n=4, k=3, steps=6):
    rng = np.random.default_rng(seed)
    grid = ref.grid(steps)
    t = np.tile(grid[:k], (n, 1)).astype(np.float32)
    t_next = np.tile(grid[1 : k + 1], (n, 1)).astype(np.float32)
    latents = rng.normal(size=(n, k, LATENT)).astype(np.float32)
    return fg.Transitions(
        latents=jnp.asarray(latents),
        next_latents=jnp.asarray(latents + 0.2 * rng.normal(size=latents.shape), jnp.float32),
        timesteps=jnp.asarray(t),
        next_timesteps=jnp.asarray(t_next),
        old_log_probs=jnp.asarray(rng.normal(size=(n, k)) * 0.3 + 1.0, jnp.float32),
        transition_mask=jnp.ones((n, k), bool),
        advantages=jnp.asarray(rng.normal(size=(n,)), jnp.float32),
        cond=jnp.asarray(rng.normal(size=(n, COND)), jnp.float32),
    )


def test_kl_to_adapters_off_and_ema_of_adapters_match_numpy_float64():
    rank, alpha, beta, decay, noise = 2, 3.0, 0.5, 0.8, 0.7
    base = TwoLinears(jax.random.key(0))
    policy = lora.add(base, rank, key=jax.random.key(1), alpha=alpha)
    rng = np.random.default_rng(2)
    policy = lora.with_adapters(
        policy,
        jax.tree.map(
            lambda leaf: jnp.asarray(0.4 * rng.normal(size=leaf.shape), leaf.dtype),
            lora.adapters(policy),
        ),
    )
    objective = fg.FlowGRPOObjective(
        policy,
        fg.RectifiedFlow(),
        fg.InputSpec(latent_shape=(LATENT,)),
        sde=fg.FlowSDE(noise),
        beta=beta,
        clip_range=0.2,
        guidance=None,
    )
    trainer = Trainer(objective, optax.sgd(0.05), ema_decay=decay)
    state = trainer.init(jax.random.key(0))
    # The EMA holds the adapters alone, not a copy of the base.
    held_before = [np.asarray(x, np.float64) for x in jax.tree.leaves(state.ema)]
    assert len(held_before) == 2 * len(policy.adapters)
    batch = random_batch(3)
    state, metrics = trainer.update(state, batch)

    by_path = dict(zip(policy.layer_paths, policy.adapters, strict=True))
    adapted = numpy_weights(
        base, {"state": by_path[".state"], "cond": by_path[".cond"]}, alpha / rank
    )
    reference = numpy_weights(base)
    arrays_np = {
        name: np.asarray(getattr(batch, name), np.float64)
        for name in ("latents", "next_latents", "timesteps", "next_timesteps", "old_log_probs")
    }
    cond = np.asarray(batch.cond, np.float64)
    advantages = np.asarray(batch.advantages, np.float64)
    kls, objectives = [], []
    n, k = batch.timesteps.shape
    for i in range(n):
        for j in range(k):
            x = arrays_np["latents"][i, j]
            t, t_next = arrays_np["timesteps"][i, j], arrays_np["next_timesteps"][i, j]
            mean, std = ref.transition(x, numpy_velocity(adapted, x, t, cond[i]), t, t_next, noise)
            mean_ref, _ = ref.transition(
                x, numpy_velocity(reference, x, t, cond[i]), t, t_next, noise
            )
            kl = ref.kl_paper(mean, mean_ref, std)
            ratio = math.exp(
                ref.log_prob(arrays_np["next_latents"][i, j], mean, std)
                - arrays_np["old_log_probs"][i, j]
            )
            kls.append(kl)
            objectives.append(ref.surrogate(advantages[i], ratio, 0.2, 5.0) + beta * kl)
    assert np.mean(kls) > 1e-3
    np.testing.assert_allclose(float(metrics["kl"]), np.mean(kls), rtol=2e-5)
    np.testing.assert_allclose(float(metrics["loss"]), np.mean(objectives), rtol=2e-5, atol=1e-6)

    after = [np.asarray(x, np.float64) for x in jax.tree.leaves(state.variables.policy.adapters)]
    held_after = [np.asarray(x, np.float64) for x in jax.tree.leaves(state.ema)]
    assert any(not np.array_equal(a, b) for a, b in zip(after, held_before, strict=True))
    for old, new, got in zip(held_before, after, held_after, strict=True):
        np.testing.assert_allclose(got, decay * old + (1 - decay) * new, rtol=1e-6, atol=1e-7)
    assert_bit_identical(lora.base(state.variables.policy), base)


def test_variables_with_adapters_for_an_objective_without_them_name_variables():
    base = mlp_base()
    trainer = Trainer(mlp_objective(base, beta=0.1))
    adapted = lora.add(base, 2, key=jax.random.key(0))
    with pytest.raises(ValueError, match="`variables"):
        trainer.init(jax.random.key(0), fg.FlowGRPOVariables(policy=adapted, reference=None))


def default_sized_dit():
    """The main job's DiT (width 64, depth 4, patch 4 on 16x16x3 images)."""
    model = DiT(
        16, 3, 4, width=64, depth=4, heads=4, vocab_size=16, prompt_length=4, key=jax.random.key(0)
    )
    rng = np.random.default_rng(0)
    return jax.tree.map(
        lambda w: (
            w + jnp.asarray(0.02 * rng.normal(size=w.shape), w.dtype)
            if eqx.is_inexact_array(w)
            else w
        ),
        model,
    )


def test_state_without_its_base_is_small_and_round_trips(tmp_path):
    base = default_sized_dit()
    base_bytes = sum(x.nbytes for x in arrays(base))
    policy = lora.add(base, 2, key=jax.random.key(1))
    objective = fg.FlowGRPOObjective(
        policy,
        fg.RectifiedFlow(),
        fg.InputSpec(select="tokens", null=jnp.zeros(4, jnp.int32), latent_shape=(16, 16, 3)),
        beta=0.1,
    )
    trainer = Trainer(objective, ema_decay=0.9)
    state = trainer.init(jax.random.key(0))
    rng = np.random.default_rng(1)
    state = lora.with_adapters(
        state,
        jax.tree.map(
            lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), lora.adapters(state)
        ),
    )
    checkpoints = Checkpointer(tmp_path / "checkpoints")
    folder = checkpoints.save(1, lora.without_bases(state), {"base": lora.fingerprint(base)})
    stored_bytes = sum(
        np.prod(shape, dtype=np.int64) * np.dtype(dtype).itemsize
        for _, shape, dtype, _ in json.loads((folder / "meta.json").read_text())["state_arrays"]
    )
    # Adapters, their EMA and AdamW's two moments: 4 x the adapters, about 7% of the base each.
    assert stored_bytes < 0.3 * base_bytes
    lora.save_adapters(tmp_path / "policy.lora", state.variables.policy)
    assert (tmp_path / "policy.lora").stat().st_size < 0.1 * base_bytes
    stored, _ = checkpoints.restore(lora.without_bases(trainer.init(jax.random.key(5))))
    restored = lora.with_bases(stored, trainer.init(jax.random.key(5)))
    assert_bit_identical(restored, state)
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    with pytest.raises(ValueError, match="`tree`"):
        lora.with_bases(stored, base)


def test_merged_policy_saves_as_an_ordinary_model(tmp_path):
    base = mlp_base()
    policy = lora.add(base, 2, key=jax.random.key(1))
    policy = lora.with_adapters(policy, jax.tree.map(lambda x: x + 0.1, lora.adapters(policy)))
    save_model(tmp_path / "merged.eqx", lora.merge(policy))
    loaded = load_model(tmp_path / "merged.eqx", base)
    assert_bit_identical(loaded, lora.merge(policy))
    assert not lora.has_adapters(loaded)


def test_a_filter_of_adapters_and_base_weights_moves_both_in_the_ema_and_the_old_policy():
    """The trainer splits the policy once: with a filter that trains the adapters and one base
    weight, the optimizer, the EMA and DiffusionNFT's old policy all hold both, and the KL
    reference keeps that base weight at its initial value with the adapters off."""
    policy = lora.add(mlp_base(), 2, key=jax.random.key(3))
    filter_spec = eqx.tree_at(
        lambda model: model.base.layers[0].weight, lora.adapter_filter(policy), True
    )
    inputs = fg.InputSpec(null=jnp.zeros(COND), latent_shape=(LATENT,))
    objective = fg.DiffusionNFTObjective(
        fg.GuidedFlow(policy, fg.RectifiedFlow(), inputs, guidance=None),
        old_decay=0.25,
        kl_beta=0.1,
        times="uniform",
    )
    trainer = Trainer(objective, optax.sgd(0.5), trainable=filter_spec, ema_decay=0.5)
    state = trainer.init(jax.random.key(0))
    trained = [*arrays(policy.adapters), np.asarray(policy.base.layers[0].weight)]
    for part in (state.ema, state.variables.old_policy):
        assert sorted(x.shape for x in arrays(part)) == sorted(x.shape for x in trained)
    assert [x.shape for x in arrays(state.variables.reference)] == [trained[-1].shape]
    rng = np.random.default_rng(0)
    batch = fg.FinalSamples(
        latents=jnp.asarray(rng.normal(size=(4, LATENT)), jnp.float32),
        advantages=jnp.asarray([2.0, -1.0, 0.5, -2.0], jnp.float32),
        cond=jnp.asarray(rng.normal(size=(4, COND)), jnp.float32),
    )
    state, _ = trainer.update(state, batch)
    state = eqx.tree_at(
        lambda s: s.variables, state, objective.end_epoch(state.variables, int(state.step))
    )
    live = state.variables.policy
    before_weight, after_weight = trained[-1], np.asarray(live.base.layers[0].weight)
    assert not np.array_equal(before_weight, after_weight)
    # b starts at 0, so the first step moves b (a's gradient is b^T ... = 0).
    before_b = np.asarray(policy.adapters[0].b)
    after_b = np.asarray(live.adapters[0].b)
    assert not np.array_equal(before_b, after_b)
    averaged = fg.with_part(live, state.ema)
    old = objective.old_policy(state.variables)
    for model, keep in ((averaged, 0.5), (old, 0.25)):
        for before, after, got in (
            (before_weight, after_weight, model.base.layers[0].weight),
            (before_b, after_b, model.adapters[0].b),
        ):
            want = keep * before.astype(np.float64) + (1 - keep) * after.astype(np.float64)
            np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-6, atol=1e-7)
    reference = state.variables.reference_policy()
    assert not lora.has_adapters(reference)
    np.testing.assert_array_equal(reference.layers[0].weight, before_weight)
    np.testing.assert_array_equal(reference.layers[1].weight, live.base.layers[1].weight)
