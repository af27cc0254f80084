"""FlowGRPOObjective against an independent float64 NumPy statement (docs/mathematics.md §2-§6)."""

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flowgrpo_eqx as fg
from tests import numpy_reference as ref


SDES = {"flow": fg.FlowSDE, "cps": fg.CoefficientsPreservingSDE}


def kind_of(sde):
    return "cps" if isinstance(sde, fg.CoefficientsPreservingSDE) else "flow"


AUX_NAMES = (
    "policy_loss",
    "kl",
    "clipfrac",
    "clipfrac_gt_one",
    "clipfrac_lt_one",
    "approx_kl",
    "ratio",
)


DIM = 4
COND = 3


class LinearVelocity(eqx.Module):
    """v = W x + b t + U c: simple enough to restate in NumPy."""

    weight: jax.Array
    time: jax.Array
    cond_weight: jax.Array

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.weight = 0.3 * jax.random.normal(k1, (DIM, DIM))
        self.time = jax.random.normal(k2, (DIM,))
        self.cond_weight = jax.random.normal(k3, (DIM, COND))

    def __call__(self, x, t, cond):
        return self.weight @ x + self.time * t + self.cond_weight @ cond

    def numpy(self, x, t, cond):
        w, b, u = (np.asarray(a, np.float64) for a in (self.weight, self.time, self.cond_weight))
        return w @ x + b * t + u @ cond


NULL = np.array([0.5, -0.5, 0.0], np.float32)


def numpy_guided(model, x, t, cond, scale):
    v_cond = model.numpy(x, t, cond)
    if scale is None:
        return v_cond
    v_null = model.numpy(x, t, NULL.astype(np.float64))
    return v_null + scale * (v_cond - v_null)


def make_batch(seed, n=5, k=6, steps=8, advantages_per_transition=False, poison=False):
    rng = np.random.default_rng(seed)
    grid = ref.grid(steps, 3.0)
    start = rng.integers(0, steps - k, size=n) if steps - 1 > k else np.zeros(n, int)
    t = np.stack([grid[s : s + k] for s in start]).astype(np.float32)
    t_next = np.stack([grid[s + 1 : s + k + 1] for s in start]).astype(np.float32)
    latents = rng.normal(size=(n, k, DIM)).astype(np.float32)
    next_latents = (latents + 0.3 * rng.normal(size=(n, k, DIM))).astype(np.float32)
    mask = rng.random((n, k)) < 0.7
    mask[0, 0] = True
    adv_shape = (n, k) if advantages_per_transition else (n,)
    advantages = (rng.normal(size=adv_shape) * 4.0).astype(np.float32)
    old = (rng.normal(size=(n, k)) * 0.3 - 1.0).astype(np.float32)
    if poison:
        latents[~mask] = np.nan
        next_latents[~mask] = np.inf
        old[~mask] = np.nan
        t[~mask] = np.nan
    return fg.Transitions(
        latents=jnp.asarray(latents),
        next_latents=jnp.asarray(next_latents),
        timesteps=jnp.asarray(t),
        next_timesteps=jnp.asarray(t_next),
        old_log_probs=jnp.asarray(old),
        transition_mask=jnp.asarray(mask),
        advantages=jnp.asarray(advantages),
        cond=jnp.asarray(rng.normal(size=(n, COND)).astype(np.float32)),
    )


def numpy_loss(objective, policy, reference, batch):
    """The whole objective, transition by transition, in float64."""
    sde = objective.sde
    scale = None if objective.flow.guidance is None else objective.flow.guidance.scale
    n, k = batch.timesteps.shape
    arrays = {
        f: np.asarray(getattr(batch, f), np.float64)
        for f in (
            "latents",
            "next_latents",
            "timesteps",
            "next_timesteps",
            "old_log_probs",
            "advantages",
        )
    }
    mask = np.asarray(batch.transition_mask)
    cond = np.asarray(batch.cond, np.float64)
    sums = dict.fromkeys(
        ("objective", *AUX_NAMES),
        0.0,
    )
    count = 0
    for i in range(n):
        for j in range(k):
            t = float(arrays["timesteps"][i, j])
            t_next = float(arrays["next_timesteps"][i, j])
            if not (
                mask[i, j] and ref.stochastic(t, t_next, sde.noise_level, kind_of(sde), sde.window)
            ):
                continue
            count += 1
            x = arrays["latents"][i, j]
            v = numpy_guided(policy, x, t, cond[i], scale)
            mean, std = ref.transition(x, v, t, t_next, sde.noise_level, kind_of(sde), sde.window)
            log_p = ref.log_prob(arrays["next_latents"][i, j], mean, std)
            log_ratio = log_p - arrays["old_log_probs"][i, j]
            ratio = math.exp(log_ratio)
            adv = (
                arrays["advantages"][i]
                if arrays["advantages"].ndim == 1
                else arrays["advantages"][i, j]
            )
            surrogate = ref.surrogate(adv, ratio, objective.clip_range, objective.adv_clip_max)
            kl = 0.0
            if objective.beta > 0:
                v_ref = numpy_guided(reference, x, t, cond[i], scale)
                mean_ref, _ = ref.transition(
                    x, v_ref, t, t_next, sde.noise_level, kind_of(sde), sde.window
                )
                kl = ref.kl_paper(mean, mean_ref, std)
                if sde.kl_weighting == "released":
                    kl *= t - t_next
            sums["objective"] += surrogate + objective.beta * kl
            sums["policy_loss"] += surrogate
            sums["kl"] += kl
            sums["clipfrac"] += abs(ratio - 1) > objective.clip_range
            sums["clipfrac_gt_one"] += ratio - 1 > objective.clip_range
            sums["clipfrac_lt_one"] += 1 - ratio > objective.clip_range
            sums["approx_kl"] += 0.5 * log_ratio**2
            sums["ratio"] += ratio
    return sums, count


def make_objective(
    *,
    beta=0.0,
    guidance=True,
    kind="flow",
    window=None,
    clip_range=0.2,
    weighting="paper",
    chunk=None,
    key=0,
    old_log_probs="rollout",
):
    model = LinearVelocity(jax.random.key(key))
    return fg.FlowGRPOObjective(
        model,
        fg.RectifiedFlow(shift=3.0),
        fg.InputSpec(null=jnp.asarray(NULL), latent_shape=(DIM,)),
        sde=SDES[kind](0.7, window=window, kl_weighting=weighting),
        beta=beta,
        clip_range=clip_range,
        adv_clip_max=5.0,
        guidance=fg.CFG(2.5) if guidance else None,
        transition_chunk=chunk,
        old_log_probs=old_log_probs,
    )


def perturbed(model, key, size=0.05):
    leaves, tree = jax.tree.flatten(model)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(
        tree,
        [
            leaf + size * jax.random.normal(k, leaf.shape)
            for leaf, k in zip(leaves, keys, strict=True)
        ],
    )


STEP = fg.Step(index=0, key=jax.random.key(0))
WINDOW = (float(ref.grid(8, 3.0)[1]), float(ref.grid(8, 3.0)[5]))


@pytest.mark.parametrize("kind", ["flow", "cps"])
@pytest.mark.parametrize("beta, weighting", [(0.0, "paper"), (0.3, "paper"), (0.3, "released")])
@pytest.mark.parametrize("guidance", [True, False])
@pytest.mark.parametrize("per_transition", [False, True])
def test_loss_and_aux_match_numpy(kind, beta, weighting, guidance, per_transition):
    objective = make_objective(
        beta=beta, guidance=guidance, kind=kind, window=WINDOW, weighting=weighting, chunk=4
    )
    variables = objective.init(jax.random.key(1))
    policy = perturbed(variables.policy, jax.random.key(2))
    variables = fg.FlowGRPOVariables(policy=policy, reference=variables.reference)
    batch = make_batch(
        seed=hash((kind, beta, guidance, per_transition)) % 1000,
        advantages_per_transition=per_transition,
    )
    # Put the recorded log probs near the policy's so that some ratios clip and some do not.
    rescored = np.asarray(objective.log_probs(variables, batch))
    noise = np.random.default_rng(0).normal(size=rescored.shape) * 0.3
    batch = eqx.tree_at(
        lambda b: b.old_log_probs, batch, jnp.asarray((rescored + noise).astype(np.float32))
    )
    total, aux = objective.loss(variables, batch, STEP)
    sums, count = numpy_loss(objective, policy, variables.reference, batch)
    assert 0 < count < batch.timesteps.size
    assert float(total.count) == count == float(aux.counted)
    np.testing.assert_allclose(float(total.total), sums["objective"], rtol=1e-4, atol=1e-5)
    for name in AUX_NAMES:
        mean = getattr(aux, name)
        assert float(mean.count) == count
        np.testing.assert_allclose(
            float(mean.total), sums[name], rtol=1e-4, atol=1e-5, err_msg=name
        )
    if beta == 0:
        assert float(aux.kl.total) == 0.0
    else:
        assert float(aux.kl.total) > 0.0
    assert 0 < float(aux.clipfrac.value) < 1


def test_default_clip_range_and_clipped_statistics():
    objective = fg.FlowGRPOObjective(
        LinearVelocity(jax.random.key(0)), fg.RectifiedFlow(), fg.InputSpec(), guidance=None
    )
    assert objective.clip_range == 1e-4 and objective.adv_clip_max == 5.0
    assert objective.steps == 41 and objective.beta == 0.0
    variables = objective.init(jax.random.key(0))
    batch = make_batch(seed=4)
    total, aux = objective.loss(variables, batch, STEP)
    sums, count = numpy_loss(objective, variables.policy, variables.reference, batch)
    np.testing.assert_allclose(float(total.total), sums["objective"], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(float(aux.clipfrac.total), sums["clipfrac"])


def test_mean_value_is_global_sum_over_global_count():
    a = fg.Mean(jnp.asarray(3.0), jnp.asarray(1.0))
    b = fg.Mean(jnp.asarray(1.0), jnp.asarray(3.0))
    assert float((a + b).value) == 1.0  # not (3 + 1/3) / 2
    assert float(fg.Mean(jnp.asarray(0.0), jnp.asarray(0.0)).value) == 0.0


def policy_grad(objective, variables, batch):
    def value(policy):
        total, _ = objective.loss(fg.FlowGRPOVariables(policy, variables.reference), batch, STEP)
        return total.value

    return eqx.filter_value_and_grad(value)(variables.policy)


@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_no_kept_transitions_gives_zero_loss_and_finite_zero_grads(beta):
    objective = make_objective(beta=beta)
    variables = objective.init(jax.random.key(0))
    batch = make_batch(seed=5, poison=True)
    batch = eqx.tree_at(lambda b: b.transition_mask, batch, jnp.zeros_like(batch.transition_mask))
    loss, grads = policy_grad(objective, variables, batch)
    assert float(loss) == 0.0
    for leaf in jax.tree.leaves(grads):
        assert np.all(np.asarray(leaf) == 0.0)


def test_zero_transitions_axis():
    objective = make_objective()
    variables = objective.init(jax.random.key(0))
    batch = make_batch(seed=6)
    empty = jax.tree.map(lambda a: a[:, :0] if a.ndim >= 2 and a is not batch.cond else a, batch)
    empty = eqx.tree_at(lambda b: b.advantages, empty, batch.advantages)
    total, aux = objective.loss(variables, empty, STEP)
    assert float(total.value) == 0.0 and float(aux.counted) == 0.0


def test_masked_poison_changes_nothing():
    objective = make_objective(beta=0.2, window=WINDOW)
    variables = objective.init(jax.random.key(0))
    variables = fg.FlowGRPOVariables(
        perturbed(variables.policy, jax.random.key(3)), variables.reference
    )
    clean = make_batch(seed=7)
    poisoned = make_batch(seed=7, poison=True)
    loss_clean, grad_clean = policy_grad(objective, variables, clean)
    loss_poison, grad_poison = policy_grad(objective, variables, poisoned)
    assert np.isfinite(float(loss_poison))
    assert float(loss_clean) == float(loss_poison)
    for a, b in zip(jax.tree.leaves(grad_clean), jax.tree.leaves(grad_poison), strict=True):
        assert np.all(np.isfinite(np.asarray(b)))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_reference_gets_no_gradient_and_exists_only_with_a_kl_term():
    objective = make_objective(beta=0.5)
    assert make_objective(beta=0.0).init(jax.random.key(0)).reference is None
    variables = objective.init(jax.random.key(0))
    assert variables.reference is variables.policy
    variables = fg.FlowGRPOVariables(
        perturbed(variables.policy, jax.random.key(3)), variables.reference
    )
    batch = make_batch(seed=8)

    def value(v):
        return objective.loss(v, batch, STEP)[0].value

    grads = eqx.filter_grad(value)(variables)
    assert all(np.all(np.asarray(g) == 0) for g in jax.tree.leaves(grads.reference))
    assert any(np.any(np.asarray(g) != 0) for g in jax.tree.leaves(grads.policy))


def test_init_uses_pretrained_then_given_variables():
    model = LinearVelocity(jax.random.key(0))
    pretrained = LinearVelocity(jax.random.key(1))
    objective = fg.FlowGRPOObjective(
        model, fg.RectifiedFlow(), fg.InputSpec(), guidance=None, pretrained=pretrained, beta=0.1
    )
    variables = objective.init(jax.random.key(0))
    assert variables.policy is pretrained and variables.reference is pretrained
    other = fg.FlowGRPOVariables(model, pretrained)
    assert objective.init(jax.random.key(0), other) is other


@pytest.mark.parametrize("chunk", [1, 2, 4, 6, None])
def test_chunking_does_not_change_results(chunk):
    reference_objective = make_objective(beta=0.2, chunk=None, window=WINDOW)
    objective = make_objective(beta=0.2, chunk=chunk, window=WINDOW)
    variables = objective.init(jax.random.key(0))
    variables = fg.FlowGRPOVariables(
        perturbed(variables.policy, jax.random.key(3)), variables.reference
    )
    batch = make_batch(seed=9)
    want_loss, want_grad = policy_grad(reference_objective, variables, batch)
    loss, grad = policy_grad(objective, variables, batch)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grad), jax.tree.leaves(want_grad), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(
        np.asarray(objective.log_probs(variables, batch)),
        np.asarray(reference_objective.log_probs(variables, batch)),
        rtol=1e-5,
        atol=1e-5,
    )


def test_log_probs_match_numpy():
    objective = make_objective(kind="flow", window=WINDOW)
    variables = objective.init(jax.random.key(0))
    batch = make_batch(seed=10)
    got = np.asarray(objective.log_probs(variables, batch))
    for i in range(batch.timesteps.shape[0]):
        for j in range(batch.timesteps.shape[1]):
            t = float(batch.timesteps[i, j])
            t_next = float(batch.next_timesteps[i, j])
            x = np.asarray(batch.latents[i, j], np.float64)
            v = numpy_guided(variables.policy, x, t, np.asarray(batch.cond[i], np.float64), 2.5)
            mean, std = ref.transition(x, v, t, t_next, 0.7, "flow", WINDOW)
            want = ref.log_prob(np.asarray(batch.next_latents[i, j]), mean, std)
            np.testing.assert_allclose(got[i, j], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"clip_range": 0.0}, "clip_range"),
        ({"clip_range": -1.0}, "clip_range"),
        ({"adv_clip_max": 0.0}, "adv_clip_max"),
        ({"beta": -0.1}, "beta"),
        ({"steps": 1}, "steps"),
        ({"transition_chunk": 0}, "transition_chunk"),
        ({"guidance": fg.CFG(3.0)}, "guidance"),
    ],
)
def test_constructor_rejects_bad_settings(kwargs, name):
    settings = {"guidance": None, **kwargs}
    with pytest.raises(ValueError, match=name):
        fg.FlowGRPOObjective(
            LinearVelocity(jax.random.key(0)), fg.RectifiedFlow(), fg.InputSpec(), **settings
        )


def test_default_guidance_needs_null_condition():
    with pytest.raises(ValueError, match="guidance"):
        fg.FlowGRPOObjective(LinearVelocity(jax.random.key(0)), fg.RectifiedFlow(), fg.InputSpec())


@pytest.mark.parametrize("bad", [-1.0, float("inf")])
def test_cfg_scale_checked(bad):
    with pytest.raises(ValueError, match="scale"):
        fg.CFG(bad)


@pytest.mark.parametrize(
    "field, value",
    [
        ("latents", jnp.zeros((5, 6, DIM + 1))),
        ("next_latents", jnp.zeros((5, 5, DIM))),
        ("timesteps", jnp.zeros((5, 7))),
        ("next_timesteps", jnp.zeros((4, 6))),
        ("old_log_probs", jnp.zeros((5,))),
        ("transition_mask", jnp.zeros((5, 6), jnp.float32)),
        ("advantages", jnp.zeros((4,))),
        ("cond", jnp.zeros((4, COND))),
    ],
)
def test_wrong_field_shape_names_field(field, value):
    batch = make_batch(seed=11)
    fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(fg.Transitions)}
    fields[field] = value
    with pytest.raises((ValueError, TypeError), match=field):
        fg.Transitions(**fields)


def test_evaluate_prompt_only_rows_and_transitions():
    objective = make_objective()
    variables = objective.init(jax.random.key(0))
    rows = jnp.ones((3, COND))
    evaluation = objective.evaluate(variables, rows, STEP)
    assert evaluation.samples.shape == (3, DIM)
    assert float(jnp.abs(evaluation.samples).max()) <= 1.0
    again = objective.evaluate(variables, make_batch(seed=12), STEP)
    assert again.samples.shape == (5, DIM)
    # Deterministic ODE: the same key gives the same samples, another key others.
    np.testing.assert_array_equal(
        objective.evaluate(variables, rows, STEP).latents, evaluation.latents
    )
    other = objective.evaluate(variables, rows, fg.Step(0, jax.random.key(9)))
    assert not np.allclose(other.latents, evaluation.latents)


def test_evaluate_euler_matches_numpy():
    objective = make_objective(guidance=False)
    objective = eqx.tree_at(lambda o: o.steps, objective, 6)
    variables = objective.init(jax.random.key(0))
    rows = jnp.asarray(np.random.default_rng(0).normal(size=(2, COND)).astype(np.float32))
    evaluation = objective.evaluate(variables, rows, STEP)
    noise = np.asarray(jax.random.normal(STEP.key, (2, DIM)), np.float64)
    grid = ref.grid(6, 3.0)
    for i in range(2):
        x = noise[i]
        for a, b in zip(grid[:-1], grid[1:], strict=True):
            x = x + variables.policy.numpy(x, a, np.asarray(rows[i], np.float64)) * (b - a)
        np.testing.assert_allclose(np.asarray(evaluation.latents[i]), x, rtol=1e-4, atol=1e-4)


def test_evaluate_prompt_only_needs_latent_shape():
    objective = fg.FlowGRPOObjective(
        LinearVelocity(jax.random.key(0)), fg.RectifiedFlow(), fg.InputSpec(), guidance=None
    )
    with pytest.raises(ValueError, match="latent_shape"):
        objective.evaluate(objective.init(jax.random.key(0)), jnp.ones((2, COND)), STEP)


def test_heun_solver_is_second_order():
    # dx/dt = x has x(0) = x(1) e^{-1}; Heun's error falls ~4x per halving of the step.
    def velocity(x, t):
        return x

    errors = []
    for steps in (5, 9, 17):
        grid = fg.RectifiedFlow().timesteps(steps)
        x = jnp.ones((1, 1))
        for a, b in zip(grid[:-1], grid[1:], strict=True):
            x = fg.Heun().step(velocity, x, a, b)
        errors.append(abs(float(x[0, 0]) - math.exp(-1)))
    assert errors[0] / errors[1] > 3.5 and errors[1] / errors[2] > 3.5
