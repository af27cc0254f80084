"""DGPO as released (docs/mathematics/dgpo.md §10) against the float64 NumPy statements `dgpo_*` of
`numpy_reference`: the loss and its gradient, the quantised times, the epoch's indices, the
EMA reference and the rollout's switch to it, the defaults and messages, and the demo."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import flowgrpo_eqx as fg
from flowgrpo_eqx.shapes_demo import make_config
from flowgrpo_eqx.train import Trainer
from tests import numpy_reference as ref
from tests.errors import NAMED_ARGUMENT_ERRORS, exact_message, raises_named
from tests.test_objective import DIM, NULL, LinearVelocity, perturbed, rollout_info


N, K, G = 8, 10, 4
MASK = np.array([True, True, True, True, True, False, True, True])
GROUP = np.arange(N) // G
SIGMAS = ref.dgpo_rollout_sigmas(K)  # the released recipe's 10-step grid, float64
STEP = fg.Step(index=0, key=jax.random.key(0))


RELEASED_GUIDANCE = fg.CFG(4.5)


def make_objective(guidance=RELEASED_GUIDANCE, **kwargs):
    """DGPO on a linear velocity, guided as the released recipe's rollout by default."""
    kwargs.setdefault("group_size", G)
    model = LinearVelocity(jax.random.key(0))
    flow = fg.GuidedFlow(model, fg.RectifiedFlow(), fg.InputSpec(null=jnp.asarray(NULL)), guidance)
    return fg.DGPOObjective(flow, **kwargs)


def setup(**kwargs):
    """An objective, variables whose policy, EMA and base all differ, and a batch of two
    groups on the release's grid, with one masked row (holding NaN) in the second."""
    objective = make_objective(**kwargs)
    variables = objective.init(jax.random.key(0))
    initial = variables.policy
    ema = None if variables.ema is None else perturbed(initial, jax.random.key(2), 0.05)
    variables = eqx.tree_at(
        lambda v: (v.policy, v.ema),
        variables,
        (perturbed(initial, jax.random.key(1), 0.1), ema),
        is_leaf=lambda x: x is None,
    )
    rng = np.random.default_rng(0)
    latents = rng.normal(size=(N, DIM)).astype(np.float32)
    latents[5] = np.nan
    samples = fg.FinalSamples(
        latents=jnp.asarray(latents),
        advantages=jnp.asarray((rng.normal(size=N) * 3).astype(np.float32)),
        cond=jnp.asarray(rng.normal(size=(N, 3)).astype(np.float32)),
        mask=jnp.asarray(MASK),
        timesteps=jnp.asarray(np.broadcast_to(SIGMAS, (N, K)).astype(np.float32)),
    )
    return objective, variables, fg.GroupedSamples(samples, jnp.asarray(GROUP, jnp.int32))


@eqx.filter_jit
def _value_and_grad(objective, variables, batch, step):
    def total(policy):
        mean, aux = objective.loss(eqx.tree_at(lambda v: v.policy, variables, policy), batch, step)
        return mean.total, (mean, aux)

    return jax.value_and_grad(total, has_aux=True)(variables.policy)


def draws(objective, variables, step):
    """The times and noise `loss` draws, as its docstrings state: the epoch's indices on the
    float64 grid, quantised as released, and one noise per (group, time) from `step.key`."""
    index = np.asarray(variables.indices)
    t = SIGMAS[index]
    if objective.quantize is not None:
        t = ref.dgpo_time(t)
    else:
        t = SIGMAS.astype(np.float32).astype(np.float64)[index]
    count = len(index)
    if objective.shared_noise:
        noise = np.stack(
            [
                np.asarray(jax.random.normal(jax.random.fold_in(step.key, int(g)), (count, DIM)))
                for g in GROUP
            ]
        )
    else:
        noise = np.asarray(jax.random.normal(step.key, (N * count, DIM))).reshape(N, count, DIM)
    return np.broadcast_to(t, (N, count)), noise.astype(np.float64)


def params_of(model):
    return [np.asarray(a, np.float64) for a in (model.weight, model.time, model.cond_weight)]


def velocity(params, x, t, c):
    w, b, u = params
    return w @ x + b * t + u @ c


def velocities(params, x, t, cond):
    """`velocity` of each row of `x` `[B, DIM]` at its time `t` `[B]`; `cond` `[B, 3]` or one
    condition for every row."""
    cond = np.broadcast_to(cond, (len(x), np.shape(cond)[-1]))
    return np.stack([velocity(params, *row) for row in zip(x, t, cond, strict=True)])


def numpy_loss(objective, params, ema, base, batch, t, noise, held=None):
    """The released total over the counted rows (lines 1098-1158) in float64: one
    micro-step per trained time, its loss the DGPO term plus `beta` times the KL, averaged
    over the times. `held` fixes what the release detaches (the sigmoid weights, and the
    clip mask with the clipped errors' values) for a numerical gradient; the group DPO form
    detaches no weight."""
    rows = np.nonzero(MASK)[0]
    data = np.asarray(batch.samples.latents, np.float64)[rows]
    cond = np.asarray(batch.samples.cond, np.float64)[rows]
    t, noise = t[rows], noise[rows]
    group = GROUP[rows]
    a = ref.dgpo_advantages(
        np.asarray(batch.samples.advantages, np.float64)[rows], objective.adv_clip_max
    )
    guide = objective.reference_guidance
    losses, kept = [], []
    for j in range(t.shape[1]):
        x_t = (1 - t[:, j, None]) * data + t[:, j, None] * noise[:, j]
        target = noise[:, j] - data
        v = velocities(params, x_t, t[:, j], cond)
        v_base = velocities(base, x_t, t[:, j], cond)
        if guide is not None:
            v_null = velocities(base, x_t, t[:, j], NULL)
            v_base = v_null + guide.scale * (v_base - v_null)
        e = ref.dgpo_error(v, target)
        e_ema = None
        if ema is not None:
            v_ema = velocities(ema, x_t, t[:, j], cond)
            e_ema = ref.dgpo_error(v_ema, target)
        clip = np.zeros(len(rows), bool)
        if objective.clip_range is not None:
            clip = ref.dgpo_should_clip(e, e_ema, a, objective.clip_range)
        if held is not None:
            clip, fixed = held[j][1], held[j][2]
            e = np.where(clip, fixed, e)
        e_ref = e_ema if objective.dpo_reference == "ema" else ref.dgpo_error(v_base, target)
        args = (a, e, e_ref, group, objective.beta_dpo, objective.group_size)
        if isinstance(objective.loss_form, fg.GroupDPOLoss):
            weights = None
            policy = ref.dgpo_group_dpo(*args)
        else:
            weights = ref.dgpo_group_weights(*args) if held is None else held[j][0]
            policy = ref.dgpo_policy_loss(weights, a, e)
        kl = ref.dgpo_kl(v, v_base)
        if objective.clip_kl and held is not None:
            kl = np.where(clip, held[j][3], kl)
        loss = policy + (objective.kl_beta * kl.mean() if objective.kl_beta > 0 else 0.0)
        losses.append(loss)
        kept.append((weights, clip, e, kl))
    return float(np.mean(losses)) * len(rows), kept


CASES = [
    {},  # the released default recipe (config/dgpo.py, general_ocr_sd3_4gpu)
    {"loss_form": fg.GroupDPOLoss()},
    {"dpo_reference": "ema", "beta_dpo": 2000.0, "clip_range": 1e-5, "kl_beta": 0.001},
    {"reference_guidance": fg.CFG(4.5), "clip_kl": True, "shared_noise": False, "quantize": None},
    {"clip_range": None, "kl_beta": 0.0, "beta_dpo": 10.0, "train_timesteps": 2, "trunc_steps": 3},
]


@pytest.mark.parametrize("kwargs", CASES)
def test_dgpo_loss_and_gradient_match_the_released_statement(kwargs):
    objective, variables, batch = setup(**kwargs)
    step = fg.Step(index=3, key=jax.random.key(4))
    (_, (mean, aux)), grads = _value_and_grad(objective, variables, batch, step)
    t, noise = draws(objective, variables, step)
    params = params_of(variables.policy)
    ema = None if variables.ema is None else params_of(variables.ema_policy())
    base = params_of(variables.reference_policy())
    want, held = numpy_loss(objective, params, ema, base, batch, t, noise)
    assert float(mean.count) == MASK.sum()
    np.testing.assert_allclose(float(mean.total), want, rtol=2e-4, atol=1e-6)
    if isinstance(objective.loss_form, fg.DGPOSurrogateLoss):
        weights = np.stack([h[0] for h in held], axis=1).mean(axis=1)
        np.testing.assert_allclose(float(aux["weight"].value), weights.mean(), rtol=1e-4)
    if objective.clip_range is not None:
        clipped = np.mean([h[1].mean() for h in held])
        assert float(aux["clipfrac"].value) == pytest.approx(clipped, abs=1e-6)
        assert 0 < clipped < 1  # both branches of the clip are exercised

    numeric = ref.central_differences(
        lambda ps: numpy_loss(objective, ps, ema, base, batch, t, noise, held)[0], params
    )
    grads = (grads.weight, grads.time, grads.cond_weight)
    for got, want in zip(grads, numeric, strict=True):
        np.testing.assert_allclose(
            np.asarray(got, np.float64), want, rtol=2e-3, atol=2e-3 * np.abs(want).max()
        )


@pytest.mark.parametrize("loss", [fg.DGPOSurrogateLoss(), fg.GroupDPOLoss()])
def test_the_group_dpo_form_is_the_surrogate_in_gradient(loss):
    """The release computes the gradient of the group DPO loss through a surrogate (line
    166): here both forms give the same gradient, and the group DPO value is the oracle's."""
    objective, variables, batch = setup(loss_form=loss)
    surrogate = isinstance(loss, fg.DGPOSurrogateLoss)
    other = make_objective(loss_form=fg.GroupDPOLoss() if surrogate else fg.DGPOSurrogateLoss())
    step = fg.Step(index=0, key=jax.random.key(7))
    _, grads = _value_and_grad(objective, variables, batch, step)
    _, others = _value_and_grad(other, variables, batch, step)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(others), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_trained_times_are_the_released_integer_timesteps():
    """`int64(1000 sigma) / 1000` of the release's shifted DPM grids, from their float32
    values; with `quantize=None` the grid's own times."""
    objective = make_objective(trunc_steps=0, train_timesteps=1)
    sigmas = np.concatenate([ref.dgpo_rollout_sigmas(steps) for steps in range(2, 41)])
    grid = jnp.asarray(sigmas.astype(np.float32))[None, :]
    got = objective.training_times(grid, jnp.arange(sigmas.size, dtype=jnp.int32))
    got = np.round(np.asarray(got)[0].astype(np.float64) * 1000)
    np.testing.assert_array_equal(got, ref.dgpo_time(sigmas) * 1000)
    exact = make_objective(quantize=None)
    grid = jnp.asarray(SIGMAS.astype(np.float32))[None, :]
    index = jnp.asarray([0, 6, 3], jnp.int32)
    got = exact.training_times(grid, index)
    np.testing.assert_array_equal(np.asarray(got)[0], np.asarray(grid)[0, [0, 6, 3]])


def test_the_loss_trains_at_the_epochs_indices_and_refuses_a_short_grid():
    objective, variables, batch = setup()
    step = fg.Step(index=0, key=jax.random.key(1))
    moved = eqx.tree_at(lambda v: v.indices, variables, jnp.asarray([1, 2, 3, 4], jnp.int32))
    (first, _), _ = _value_and_grad(objective, variables, batch, step)
    (second, _), _ = _value_and_grad(objective, moved, batch, step)
    assert float(first) != float(second)
    short = eqx.tree_at(lambda b: b.samples.timesteps, batch, batch.samples.timesteps[:, :6])
    with pytest.raises(ValueError, match=r"`trunc_steps`=6 needs a grid of more than 6"):
        _value_and_grad(objective, variables, short, step)
    outside = eqx.tree_at(lambda v: v.indices, variables, jnp.asarray([0, 1, 2, 12], jnp.int32))
    with pytest.raises(eqx.EquinoxRuntimeError, match="outside the grid"):
        _value_and_grad(objective, outside, batch, step)


def test_the_epochs_indices_are_drawn_once_per_epoch_as_stated():
    """Distinct indices of `0..trunc_steps` (lines 1062-1064), from `fold_in(key(seed),
    step)`: the same for every update of an epoch (the trainer moves the policy alone),
    redrawn by `end_epoch`."""
    objective, variables, batch = setup(seed=3)
    for s in (0, 1, 17, 400):
        key = jax.random.fold_in(jax.random.key(3), s)
        want = np.asarray(jax.random.permutation(key, 7))[:4]
        got = np.asarray(objective.epoch_indices(s))
        assert got.tolist() == want.tolist() and got.dtype == np.int32
        assert len(set(got.tolist())) == 4 and set(got.tolist()) <= ref.dgpo_index_choices(6)
    assert np.asarray(variables.indices).tolist() == np.asarray(objective.epoch_indices(0)).tolist()
    trainer = Trainer(objective, optax.sgd(0.01))
    state = trainer.init(jax.random.key(0), variables)
    for _ in range(2):
        state, _ = trainer.update(state, batch)
    assert np.asarray(state.variables.indices).tolist() == np.asarray(variables.indices).tolist()
    ended = objective.end_epoch(state.variables, int(state.step))
    assert np.asarray(ended.indices).tolist() == np.asarray(objective.epoch_indices(2)).tolist()
    assert int(ended.step) == 2


def test_the_ema_reference_follows_the_released_schedule():
    """Once per epoch with the decay of its last update (line 1176, `global_step = step -
    1`), `ema += (1 - d)(live - ema)` (flow_grpo/ema.py)."""
    objective, variables, _ = setup()
    assert objective.ema_decay == fg.RampedDecay(rate=0.001, maximum=0.3)
    for step in (1, 2, 150, 300, 301, 302, 5000):
        moved = objective.end_epoch(variables, step)
        d = ref.dgpo_ema_decay(step - 1)
        for name in ("weight", "time", "cond_weight"):
            want = ref.dgpo_ema_update(
                getattr(variables.ema, name), getattr(variables.policy, name), d
            )
            np.testing.assert_allclose(
                np.asarray(getattr(moved.ema, name)), want, rtol=1e-6, atol=1e-7
            )
        assert eqx.tree_equal(moved.policy, variables.policy)
        assert eqx.tree_equal(moved.reference, variables.reference)
    first = objective.end_epoch(variables, 1)
    assert eqx.tree_equal(first.ema.weight, variables.policy.weight)  # d = 0: the live policy
    constant = make_objective(ema_decay=0.25).end_epoch(variables, 9)
    want = ref.dgpo_ema_update(variables.ema.weight, variables.policy.weight, 0.25)
    np.testing.assert_allclose(np.asarray(constant.ema.weight), want, rtol=1e-6, atol=1e-7)
    kept = make_objective(ema_decay=None).end_epoch(variables, 50)
    assert eqx.tree_equal(kept.ema, variables.ema)


def test_the_rollout_samples_with_the_ema_reference_after_the_released_step():
    objective, variables, _ = setup()
    assert objective.switch_ema_ref == 200
    for step in (0, 1, 199, 200, 201, 900):
        at = eqx.tree_at(lambda v: v.step, variables, jnp.asarray(step, jnp.int32))
        policy = objective.sampling_policy(at)
        if ref.dgpo_samples_with_ema(step, 200):
            assert eqx.tree_equal(policy, at.ema_policy())
            assert policy is not at.policy
        else:
            assert policy is at.policy
    never = make_objective(switch_ema_ref=None, clip_range=None).init(jax.random.key(0))
    assert never.ema is None
    never = eqx.tree_at(lambda v: v.step, never, jnp.asarray(10**6, jnp.int32))
    assert make_objective(switch_ema_ref=None, clip_range=None).sampling_policy(never) is (
        never.policy
    )


def test_dgpo_defaults_are_the_released_recipe():
    objective = make_objective()
    assert (objective.group_size, objective.beta_dpo, objective.loss_form) == (
        G,
        100,
        fg.DGPOSurrogateLoss(),
    )
    assert (objective.dpo_reference, objective.reference_guidance) == ("base", None)
    assert (objective.clip_range, objective.clip_kl, objective.adv_clip_max) == (0.01, False, 5)
    assert (objective.kl_beta, objective.train_timesteps, objective.trunc_steps) == (0.02, 4, 6)
    assert (objective.shared_noise, objective.quantize, objective.switch_ema_ref) == (
        True,
        1000,
        200,
    )
    sampler = objective.rollout_sampler(None)
    assert isinstance(sampler, fg.ODESampler) and isinstance(sampler.solver, fg.DPMSolverPP2M)
    requested = fg.ODESampler(fg.Heun())
    assert objective.rollout_sampler(requested) is requested
    assert objective.loss_sums_over_rows() is False
    with pytest.raises(ValueError, match="`microbatches`"):
        Trainer(objective, optax.sgd(0.1), microbatches=2)


def test_the_loss_never_guides_the_live_policy():
    """The release trains the conditional velocity (`predict_v(..., cfg=False)`): the
    rollout's guidance does not change the loss."""
    objective, variables, batch = setup()
    unguided = make_objective(guidance=None)
    step = fg.Step(index=0, key=jax.random.key(5))
    (guided_total, _), _ = _value_and_grad(objective, variables, batch, step)
    (unguided_total, _), _ = _value_and_grad(unguided, variables, batch, step)
    assert float(guided_total) == float(unguided_total)


def test_the_training_batch_groups_runs_of_group_size_rows():
    objective, _, batch = setup()
    samples = batch.samples
    info = rollout_info(samples.latents)
    got = objective.training_batch(samples, info)
    assert isinstance(got, fg.GroupedSamples) and got.samples is samples
    assert np.asarray(got.group).tolist() == GROUP.tolist() and got.num_rows == N
    transitions = fg.Transitions(
        latents=jnp.zeros((N, K, DIM)),
        next_latents=jnp.zeros((N, K, DIM)),
        timesteps=samples.timesteps,
        next_timesteps=samples.timesteps / 2,  # below `timesteps`, as `Transitions` requires
        old_log_probs=jnp.zeros((N, K)),
        transition_mask=jnp.ones((N, K), bool),
        advantages=samples.advantages,
        cond=samples.cond,
    )
    assert objective.training_batch(transitions, info).samples.latents is samples.latents
    with pytest.raises(ValueError, match="DGPO needs one advantage per row"):
        per_transition = eqx.tree_at(lambda b: b.advantages, transitions, jnp.zeros((N, K)))
        objective.training_batch(per_transition, info)
    with pytest.raises(ValueError, match=r"^`group_size`=3 must divide the rollout's 8 rows"):
        make_objective(group_size=3).training_batch(samples, info)
    with pytest.raises(ValueError, match=r"GroupedSamples.group must be \[N\] = \(8,\) integers"):
        fg.GroupedSamples(samples, jnp.zeros(N + 1, jnp.int32))
    with pytest.raises(NAMED_ARGUMENT_ERRORS, match="group"):
        fg.GroupedSamples(samples, jnp.zeros(N))
    too_big = fg.GroupedSamples(samples, jnp.zeros(N, jnp.int32))
    with pytest.raises(eqx.EquinoxRuntimeError, match="more counted rows than `group_size`"):
        _value_and_grad(objective, objective.init(jax.random.key(0)), too_big, STEP)


def test_a_masked_row_of_nan_reaches_neither_the_loss_nor_its_gradient():
    objective, variables, batch = setup(loss_form=fg.GroupDPOLoss(), clip_kl=True)
    step = fg.Step(index=0, key=jax.random.key(2))
    (_, (mean, _)), grads = _value_and_grad(objective, variables, batch, step)
    assert np.isfinite(float(mean.value))
    assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(grads))
    changed = eqx.tree_at(lambda b: b.samples.latents, batch, batch.samples.latents.at[5].set(1e30))
    (_, (again, _)), _ = _value_and_grad(objective, variables, changed, step)
    assert float(again.total) == float(mean.total)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"group_size": 0}, "`group_size` must be an int >= 1, got 0."),
        ({"beta_dpo": 0.0}, "`beta_dpo` must be a finite number > 0, got 0.0."),
        ({"clip_range": 0.0}, "`clip_range` must be None or a finite number > 0, got 0.0."),
        ({"adv_clip_max": -1.0}, "`adv_clip_max` must be a finite number > 0, got -1.0."),
        ({"kl_beta": -0.1}, "`kl_beta` must be a finite number >= 0, got -0.1."),
        ({"trunc_steps": -1}, "`trunc_steps` must be an int >= 0, got -1."),
        ({"train_timesteps": 0}, "`train_timesteps` must be an int >= 1, got 0."),
        (
            {"train_timesteps": 8},
            "`train_timesteps` must be at most `trunc_steps` + 1 = 7 (distinct indices of "
            "0..6), got 8.",
        ),
        ({"quantize": 0}, "`quantize` must be None or an int >= 1, got 0."),
        ({"ema_decay": 1.0}, "`ema_decay` must be None or a finite number in [0, 1), got 1.0."),
        ({"switch_ema_ref": -1}, "`switch_ema_ref` must be None or an int >= 0, got -1."),
        ({"seed": -2}, "`seed` must be an int >= 0, got -2."),
        (
            {"clip_kl": True, "clip_range": None},
            "`clip_kl` needs `clip_range`: it detaches the KL of the examples the ratio clip "
            "stops, and with `clip_range=None` none is.",
        ),
    ],
)
def test_dgpo_arguments_are_checked_by_name(kwargs, message):
    with pytest.raises(ValueError, match=exact_message(message)):
        make_objective(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"loss_form": "surrogate"},
            "`loss_form` must be an AbstractDGPOLoss (DGPOSurrogateLoss, GroupDPOLoss), got "
            "'surrogate'.",
        ),
        ({"dpo_reference": "old"}, "`dpo_reference` must be one of 'base', 'ema', got 'old'."),
        ({"clip_kl": 1}, "`clip_kl` must be a bool, got 1."),
        ({"shared_noise": "yes"}, "`shared_noise` must be a bool, got 'yes'."),
        ({"reference_guidance": 4.5}, "`reference_guidance` must be a CFG or None, got 4.5."),
        ({"solver": fg.FlowSDE()}, f"`solver` must be an AbstractSolver, got {fg.FlowSDE()!r}."),
    ],
)
def test_dgpo_modes_and_types_are_checked_by_name(kwargs, message):
    with raises_named(message):
        make_objective(**kwargs)


def test_reference_guidance_without_a_null_condition_is_named():
    flow = fg.GuidedFlow(
        LinearVelocity(jax.random.key(0)), fg.RectifiedFlow(), fg.InputSpec(), guidance=None
    )
    with pytest.raises(ValueError, match="`reference_guidance` needs a null condition"):
        fg.DGPOObjective(flow, group_size=G, reference_guidance=fg.CFG(4.5))


def test_the_dgpo_demo_settings_are_the_released_recipe_adapted():
    """The tiny run itself is a parametrization of test_awm.py's command-line test."""
    config = make_config("tiny", algorithm="dgpo")
    assert (config.objective.beta, config.objective.clip_range) == (0.02, 0.01)
    assert config.rollout.shared_noise is False and config.training.minibatch_rows == 4
    assert make_config("default", algorithm="dgpo").training.minibatch_rows is None
    named = make_config("tiny", algorithm="dgpo", beta=0.0, clip_range=0.2)
    assert (named.objective.beta, named.objective.clip_range) == (0.0, 0.2)
    with pytest.raises(ValueError, match="`shared_noise` must be false with algorithm 'dgpo'"):
        make_config("tiny", algorithm="dgpo", shared_noise=True)
