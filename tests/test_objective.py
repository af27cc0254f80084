"""FlowGRPOObjective against an independent float64 NumPy statement (docs/mathematics/, §2-§6)."""

import dataclasses
import math
from collections.abc import Iterator

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flowgrpo_eqx as fg
from flowgrpo_eqx import lora
from tests import numpy_reference as ref
from tests.errors import NAMED_ARGUMENT_ERRORS, exact_message, raises_named
from tests.test_guided_flow import _Doubling
from tests.tolerances import loss_rtol


SDES = {"flow": fg.FlowSDE, "cps": fg.CoefficientsPreservingSDE}
KL_WEIGHTINGS = {"paper": fg.PaperKLWeighting(), "released": fg.ReleasedKLWeighting()}


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
        return LinearParams.of(self).numpy(x, t, cond)


class LinearParams:
    """A `LinearVelocity`'s parameters as float64 arrays (perturbed one by one for central
    differences), with its NumPy velocity."""

    def __init__(self, weight, time, cond_weight):
        self.weight, self.time, self.cond_weight = weight, time, cond_weight

    @classmethod
    def of(cls, model):
        return cls(
            *(np.asarray(a, np.float64) for a in (model.weight, model.time, model.cond_weight))
        )

    def numpy(self, x, t, cond):
        return self.weight @ x + self.time * t + self.cond_weight @ cond


NULL = np.array([0.5, -0.5, 0.0], np.float32)


def numpy_guided(model, x, t, cond, scale):
    v_cond = model.numpy(x, t, cond)
    if scale is None:
        return v_cond
    v_null = model.numpy(x, t, NULL.astype(np.float64))
    return v_null + scale * (v_cond - v_null)


def numpy_transitions(objective, params, batch):
    """Each kept transition of `batch` (masked in and stochastic), in float64 under `params`
    guided as `objective.flow` is: `(kept [N, K], means [N, K, *latent], std [N, K],
    log_ratio [N, K])`, the last to the recorded old log densities; zeros outside `kept`."""
    sde = objective.sde
    scale = None if objective.flow.guidance is None else objective.flow.guidance.scale
    t_all = np.asarray(batch.timesteps, np.float64)
    t_next_all = np.asarray(batch.next_timesteps, np.float64)
    latents = np.asarray(batch.latents, np.float64)
    next_latents = np.asarray(batch.next_latents, np.float64)
    old = np.asarray(batch.old_log_probs, np.float64)
    cond = np.asarray(batch.cond, np.float64)
    mask = np.asarray(batch.transition_mask)
    n, k = t_all.shape
    kept = np.zeros((n, k), bool)
    means, std, log_ratio = np.zeros(latents.shape), np.zeros((n, k)), np.zeros((n, k))
    for i in range(n):
        for j in range(k):
            t, t_next = t_all[i, j], t_next_all[i, j]
            if not (
                mask[i, j] and ref.stochastic(t, t_next, sde.noise_level, kind_of(sde), sde.window)
            ):
                continue
            kept[i, j] = True
            v = numpy_guided(params, latents[i, j], t, cond[i], scale)
            means[i, j], std[i, j] = ref.transition(
                latents[i, j], v, t, t_next, sde.noise_level, kind_of(sde), sde.window
            )
            log_ratio[i, j] = ref.log_prob(next_latents[i, j], means[i, j], std[i, j]) - old[i, j]
    return kept, means, std, log_ratio


def rollout_info(final):
    """A `RolloutInfo` of rows whose final latents (and decoded samples) are `final`, with
    zero rewards: what an objective's `training_batch` reads of a rollout."""
    rows = final.shape[0]
    return fg.RolloutInfo(
        rewards=np.zeros(rows),
        reward_mean=np.float32(0.0),
        zero_std_fraction=0.0,
        mean_group_std=0.0,
        samples=final,
        final=final,
        seconds={},
        reward_calls_here=1,
        window_start=0,
    )


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
                if sde.kl_weighting == fg.ReleasedKLWeighting():
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
        sde=SDES[kind](0.7, window=window, kl_weighting=KL_WEIGHTINGS[weighting]),
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
    rtol = loss_rtol()
    np.testing.assert_allclose(float(total.total), sums["objective"], rtol=rtol, atol=1e-5)
    for name in AUX_NAMES:
        mean = getattr(aux, name)
        assert float(mean.count) == count
        np.testing.assert_allclose(
            float(mean.total), sums[name], rtol=rtol, atol=1e-5, err_msg=name
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
    assert_same_leaves(variables.reference, variables.policy)
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
    assert variables.policy is pretrained
    assert_same_leaves(variables.reference, pretrained)
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


def test_a_remat_that_is_not_a_bool_is_named():
    with pytest.raises(NAMED_ARGUMENT_ERRORS, match="remat"):
        fg.FlowGRPOObjective(
            LinearVelocity(jax.random.key(0)), fg.RectifiedFlow(), fg.InputSpec(), remat=3
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


def test_evaluate_policy_samples_the_policy_it_is_given_on_any_flow():
    # The flow's own model is another velocity: only its guidance, process and inputs count.
    flow = make_objective(guidance=False).flow
    policy = LinearVelocity(jax.random.key(3))
    rows = jnp.asarray(np.random.default_rng(1).normal(size=(2, COND)).astype(np.float32))
    evaluation = fg.evaluate_policy(flow, fg.Euler(), 6, policy, rows, STEP.key)
    noise = np.asarray(jax.random.normal(STEP.key, (2, DIM)), np.float64)
    grid = ref.grid(6, 3.0)
    for i in range(2):
        x = noise[i]
        for a, b in zip(grid[:-1], grid[1:], strict=True):
            x = x + policy.numpy(x, a, np.asarray(rows[i], np.float64)) * (b - a)
        np.testing.assert_allclose(np.asarray(evaluation.latents[i]), x, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="`steps`"):
        fg.evaluate_policy(flow, fg.Euler(), 1, policy, rows, STEP.key)


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
            x, _ = fg.Heun().step(velocity, x, a, b, None)
        errors.append(abs(float(x[0, 0]) - math.exp(-1)))
    assert errors[0] / errors[1] > 3.5 and errors[1] / errors[2] > 3.5


# --------------------------------------------------------------------------------------
# The objectives choose their dtypes themselves: enabling x64 (where a missing `dtype=`
# would mean float64) changes neither the values nor the gradients of float32 inputs.


@eqx.filter_jit
def _value_and_grad(objective, variables, batch, step):
    def value(policy):
        total, aux = objective.loss(eqx.tree_at(lambda v: v.policy, variables, policy), batch, step)
        return total.value, (total, aux)

    return eqx.filter_value_and_grad(value, has_aux=True)(variables.policy)


def _assert_same_trees(got, want):
    """The arrays of `got` and `want`: the same structure, dtypes and shapes, bitwise equal.
    (`assert_trees_all_equal` compares bfloat16 as float32, so the dtypes are checked apart.)"""
    got, want = eqx.filter(got, eqx.is_array), eqx.filter(want, eqx.is_array)
    chex.assert_trees_all_equal_dtypes(got, want)
    chex.assert_trees_all_equal(got, want, strict=True)


@pytest.mark.parametrize("beta, guard", [(0.0, None), (0.3, fg.EmpiricalGuard())])
def test_flow_grpo_loss_is_unchanged_by_x64(beta, guard):

    objective = eqx.tree_at(
        lambda o: o.guard,
        make_objective(beta=beta, old_log_probs="update"),
        guard,
        is_leaf=lambda x: x is None,
    )
    policy = LinearVelocity(jax.random.key(1))
    variables = fg.FlowGRPOVariables(policy=policy, reference=LinearVelocity(jax.random.key(2)))
    batch = make_batch(0, poison=True)
    step = fg.Step(index=0, key=jax.random.key(3))
    want = _value_and_grad(objective, variables, batch, step)
    with jax.enable_x64(True):
        got = _value_and_grad(objective, variables, batch, step)
    _assert_same_trees(got, want)


# --------------------------------------------------------------------------------------
# The frozen reference keeps a model's non-array fields.


class _ScaledVelocity(eqx.Module):
    weight: jax.Array
    scale: float

    def __call__(self, x, t, cond):
        return self.scale * (self.weight * x) * t


def test_the_kl_reference_keeps_non_array_fields():

    def objective(scale):
        model = _ScaledVelocity(jnp.full(DIM, 0.5), scale)
        return fg.FlowGRPOObjective(
            model, fg.RectifiedFlow(), fg.InputSpec(), guidance=None, beta=0.5, clip_range=0.2
        )

    batch = make_batch(0)
    step = fg.Step(index=0, key=jax.random.key(0))
    values = []
    for scale in (2.0, jnp.asarray(2.0)):
        variables = objective(scale).init(jax.random.key(0))
        policy = eqx.tree_at(lambda m: m.weight, variables.policy, jnp.full(DIM, 0.75))
        total, aux = objective(scale).loss(
            eqx.tree_at(lambda v: v.policy, variables, policy), batch, step
        )
        values.append((float(total.value), float(aux.kl.value)))
    assert values[0] == values[1] and values[0][1] > 0


# --------------------------------------------------------------------------------------
# FlowGRPOObjective: the boundaries of its checks, exact messages, arguments passed on, and
# the KL reference of a LoRA policy.


def _flow_grpo(**settings):

    return fg.FlowGRPOObjective(
        LinearVelocity(jax.random.key(0)),
        fg.RectifiedFlow(),
        fg.InputSpec(),
        **settings,
    )


def test_flow_grpo_accepts_its_smallest_settings_and_passes_arguments_on():
    objective = _flow_grpo(
        guidance=None,
        adv_clip_max=0.5,
        steps=2,
        autoencoder=_Doubling(),
        precision="bfloat16",
        remat=False,
        guard=fg.GRPOGuard(),
    )
    assert (objective.adv_clip_max, objective.steps, objective.remat) == (0.5, 2, False)
    assert isinstance(objective.flow.autoencoder, _Doubling)
    assert objective.flow.precision == "bfloat16" and objective.guard == fg.GRPOGuard()


def test_flow_grpo_messages_are_exact():
    with pytest.raises(ValueError, match=exact_message("`steps` must be an int >= 2, got 1.")):
        _flow_grpo(guidance=None, steps=1)
    chunk = "`transition_chunk` must be None or an int >= 1, got 0."
    with pytest.raises(ValueError, match=exact_message(chunk)):
        _flow_grpo(guidance=None, transition_chunk=0)
    with raises_named("`sde` must be an AbstractSDE, got 'flow'."):
        _flow_grpo(guidance=None, sde="flow")
    with raises_named("`sampler` must be an AbstractSolver, got 'euler'."):
        _flow_grpo(guidance=None, sampler="euler")
    with raises_named(
        "`guard` must be an AbstractGRPOGuard (GRPOGuard, EmpiricalGuard) or None, got "
        "'ratio_norm'."
    ):
        _flow_grpo(guidance=None, guard="ratio_norm")


class _LinearModel(eqx.Module):
    linear: eqx.nn.Linear

    def __call__(self, x, t, cond):
        return self.linear(x) * t


def test_the_kl_reference_of_a_lora_policy_is_its_base():

    dim = DIM
    base = _LinearModel(eqx.nn.Linear(dim, dim, key=jax.random.key(0)))
    adapted = lora.add(base, 2, key=jax.random.key(1))
    adapted = lora.with_adapters(
        adapted,
        jax.tree.map(lambda a: a + 0.3, lora.adapters(adapted)),
    )
    objective = fg.FlowGRPOObjective(
        base, fg.RectifiedFlow(), fg.InputSpec(), guidance=None, beta=0.5, clip_range=0.2
    )
    batch = make_batch(0)
    step = fg.Step(index=0, key=jax.random.key(0))
    variables = fg.FlowGRPOVariables(adapted, fg.reference_part(adapted))
    assert jax.tree.leaves(variables.reference) == []
    _, with_lora = objective.loss(variables, batch, step)
    merged = fg.FlowGRPOVariables(lora.merge(adapted), lora.without_adapters(adapted))
    _, with_held = objective.loss(merged, batch, step)
    assert float(with_lora.kl.value) > 0
    np.testing.assert_allclose(float(with_lora.kl.value), float(with_held.kl.value), rtol=1e-5)


# --------------------------------------------------------------------------------------
# FlowGRPOObjective.loss: the clip fractions count ratios strictly outside the clip range,
# and the per-transition log densities are reported when the step asks.


def _single_kept_transition(seed):

    batch = make_batch(seed, n=1, k=2, steps=4)
    return eqx.tree_at(lambda b: b.transition_mask, batch, jnp.asarray([[True, False]]))


@pytest.mark.parametrize("seed", [1, 5])  # ratios 0.78 and 1.32
def test_a_ratio_exactly_at_the_clip_range_is_not_clipped(seed):

    batch = _single_kept_transition(seed)
    variables = fg.FlowGRPOVariables(LinearVelocity(jax.random.key(1)), None)
    step = fg.Step(index=0, key=jax.random.key(0))
    _, aux = make_objective(clip_range=0.2).loss(variables, batch, step)
    ratio = np.float32(aux.ratio.total)
    assert float(aux.counted) == 1.0 and ratio != 1.0
    boundary = float(abs(ratio - np.float32(1.0)))  # exact in float32 for ratios in [0.5, 2]
    _, aux = make_objective(clip_range=boundary).loss(variables, batch, step)
    assert np.float32(aux.ratio.total) == ratio
    assert float(aux.clipfrac.total) == 0.0
    assert float(aux.clipfrac_gt_one.total) == 0.0 and float(aux.clipfrac_lt_one.total) == 0.0
    _, aux = make_objective(clip_range=boundary * 0.99).loss(variables, batch, step)
    assert float(aux.clipfrac.total) == 1.0
    assert float(aux.clipfrac_gt_one.total) == float(ratio > 1)
    assert float(aux.clipfrac_lt_one.total) == float(ratio < 1)


def test_the_loss_reports_log_densities_in_the_update_mode():

    objective = make_objective()
    variables = fg.FlowGRPOVariables(LinearVelocity(jax.random.key(1)), None)
    batch = make_batch(0)
    _, aux = objective.loss(variables, batch, fg.Step(index=0, key=jax.random.key(0)))
    assert aux.log_probs is None
    objective = make_objective(old_log_probs="update")
    _, aux = objective.loss(variables, batch, fg.Step(index=0, key=jax.random.key(0)))
    kept = np.asarray(objective.kept(batch))
    want = np.where(kept, np.asarray(objective.log_probs(variables, batch)), 0.0)
    assert isinstance(aux.log_probs, fg.PerRow)
    np.testing.assert_allclose(np.asarray(aux.log_probs.value), want, rtol=1e-6, atol=1e-6)
    assert np.any(np.asarray(aux.log_probs.value) != 0.0)


def test_transition_allowed_makes_the_forbidden_rows_deterministic():

    objective = make_objective(guidance=False)
    model = LinearVelocity(jax.random.key(1))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(3, DIM)), jnp.float32)
    cond = jnp.asarray(rng.normal(size=(3, COND)), jnp.float32)
    t = jnp.asarray([0.75, 0.5, 0.625], jnp.float32)
    t_next = jnp.asarray([0.5, 0.25, 0.375], jnp.float32)
    allowed = jnp.asarray([True, False, True])
    mean, std = objective.flow.transition(objective.sde, model, x, t, t_next, cond, allowed)
    free_mean, free_std = objective.flow.transition(objective.sde, model, x, t, t_next, cond)
    v = jax.vmap(model)(x, t, cond)
    for row in range(3):
        want_mean, want_std = objective.sde.transition(
            x[row], v[row], t[row], t_next[row], allowed[row]
        )
        np.testing.assert_allclose(np.asarray(mean[row]), np.asarray(want_mean), rtol=1e-6)
        assert float(std[row]) == float(want_std)
    assert float(std[1]) == 0.0 and float(free_std[1]) > 0.0
    np.testing.assert_array_equal(np.asarray(std[::2]), np.asarray(free_std[::2]))
    np.testing.assert_array_equal(np.asarray(mean[::2]), np.asarray(free_mean[::2]))


def assert_same_leaves(part, model):
    """`part` holds exactly `model`'s arrays, the same objects (no copy)."""
    got, want = jax.tree.leaves(part), jax.tree.leaves(eqx.filter(model, eqx.is_array))
    assert len(got) == len(want) > 0 and all(a is b for a, b in zip(got, want, strict=True))


def test_a_lora_policy_holds_no_reference():

    base = _LinearModel(eqx.nn.Linear(3, 3, key=jax.random.key(0)))
    objective = fg.FlowGRPOObjective(
        lora.add(base, 2, key=jax.random.key(1)), fg.RectifiedFlow(), fg.InputSpec(),
        guidance=None, beta=0.5,
    )  # fmt: skip
    assert jax.tree.leaves(objective.init(jax.random.key(0)).reference) == []
    frozen = fg.FlowGRPOObjective(base, fg.RectifiedFlow(), fg.InputSpec(), guidance=None, beta=0.5)
    assert_same_leaves(frozen.init(jax.random.key(0)).reference, base)


# --------------------------------------------------------------------------------------
# FlowGRPOObjective's scan over transitions: chunks padded only when `K` is not a multiple,
# and rematerialised by default exactly when there is more than one chunk.


def _jaxpr_equations(jaxpr) -> Iterator[object]:
    for equation in jaxpr.eqns:
        yield equation
        for param in equation.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _jaxpr_equations(inner)


def _traced_log_probs(chunk, remat, n, k):
    objective = eqx.tree_at(
        lambda o: o.remat,
        make_objective(chunk=chunk),
        remat,
        is_leaf=lambda x: x is None,
    )
    variables = fg.FlowGRPOVariables(LinearVelocity(jax.random.key(1)), None)
    batch = make_batch(0, n=n, k=k, steps=k + 2)
    return list(_jaxpr_equations(eqx.filter_make_jaxpr(objective.log_probs)(variables, batch)[0]))


@pytest.mark.parametrize(
    "chunk, k, num_chunks, per_chunk",
    [(None, 1, 1, 1), (None, 5, 1, 5), (3, 1, 1, 1), (3, 4, 2, 3), (2, 4, 2, 2), (8, 5, 1, 5)],
)
def test_the_scan_evaluates_chunks_of_the_documented_size(chunk, k, num_chunks, per_chunk):
    n = 2
    (scan,) = [e for e in _traced_log_probs(chunk, None, n, k) if e.primitive.name == "scan"]
    first_xs = scan.params["num_consts"] + scan.params["num_carry"]
    assert scan.params["length"] == num_chunks
    for xs in scan.invars[first_xs:]:
        assert xs.aval.shape[:2] == (num_chunks, per_chunk * n)


@pytest.mark.parametrize(
    "chunk, remat, k, expected",
    [
        (None, None, 4, False),
        (4, None, 4, False),
        (2, None, 4, True),
        (1, None, 3, True),
        (None, True, 4, True),
        (2, False, 4, False),
    ],
)
def test_remat_defaults_to_more_than_one_chunk(chunk, remat, k, expected):
    remat_primitive = jax.make_jaxpr(jax.checkpoint(jnp.sin))(1.0).eqns[0].primitive
    equations = _traced_log_probs(chunk, remat, 2, k)
    assert any(e.primitive is remat_primitive for e in equations) == expected
