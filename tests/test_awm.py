"""AWM as released (docs/mathematics/awm.md §9) against the float64 NumPy statements `awm_*` of
`numpy_reference`: the loss and its gradient, the trained grid indices, the advantages, the
EMA schedule, the on-policy ratio, the defaults and messages, and the demo's command line."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flowgrpo_eqx as fg
from flowgrpo_eqx.shapes_demo import make_config
from flowgrpo_eqx.train import MetricsLog
from tests import numpy_reference as ref
from tests.cli_helpers import run_cli, with_base
from tests.errors import NAMED_ARGUMENT_ERRORS, exact_message, raises_named
from tests.test_objective import DIM, LinearVelocity, perturbed, rollout_info


N, K = 5, 10
MASK = np.array([True, True, False, True, True])


def make_objective(**kwargs):
    flow = fg.GuidedFlow(
        LinearVelocity(jax.random.key(0)), fg.RectifiedFlow(), fg.InputSpec(), guidance=None
    )
    return fg.AWMObjective(flow, **kwargs)


def setup(**kwargs):
    """An objective, variables whose policy, EMA and reference all differ, and a batch with
    one masked row (holding NaN) on a shifted grid."""
    objective = make_objective(**kwargs)
    variables = objective.init(jax.random.key(0))
    initial = variables.policy
    variables = fg.AWMVariables(
        policy=perturbed(initial, jax.random.key(1), 0.1),
        ema=perturbed(initial, jax.random.key(2), 0.05) if variables.ema is not None else None,
        reference=variables.reference,
    )
    rng = np.random.default_rng(0)
    grid = np.asarray(fg.RectifiedFlow(shift=3.0).timesteps(K + 1))[:-1]
    latents = rng.normal(size=(N, DIM)).astype(np.float32)
    latents[2] = np.nan
    batch = fg.FinalSamples(
        latents=jnp.asarray(latents),
        advantages=jnp.asarray((rng.normal(size=N) * 4).astype(np.float32)),
        cond=jnp.asarray(rng.normal(size=(N, 3)).astype(np.float32)),
        mask=jnp.asarray(MASK),
        timesteps=jnp.asarray(np.broadcast_to(grid, (N, K)).astype(np.float32)),
    )
    return objective, variables, batch


def draws(objective, batch, step):
    """The indices and noise `loss` draws from `step.key`, as its docstring states."""
    index_key, noise_key = jax.random.split(step.key)
    first = isinstance(objective.times, fg.DiscreteTimesWithInit)
    strata = objective.train_timesteps - (1 if first else 0)
    u = np.asarray(jax.random.uniform(index_key, (strata,), jnp.float32))
    index = ref.awm_indices(
        u, K, objective.train_timesteps, objective.time_fraction, RELEASED[type(objective.times)]
    )
    count = len(index)
    noise = np.asarray(jax.random.normal(noise_key, (N * count, DIM), jnp.float32), np.float64)
    t = np.asarray(batch.timesteps, np.float64)[:, index]
    return t, noise.reshape(N, count, DIM)


def params_of(model):
    return [np.asarray(a, np.float64) for a in (model.weight, model.time, model.cond_weight)]


def velocity(params, x, t, c):
    w, b, u = params
    return w @ x + b * t + u @ c


def numpy_loss(objective, params, ema, reference, batch, t, noise, old=None):
    """The released total over the counted rows (lines 1265-1354) in float64, with the old
    log-likelihoods `old` `[T, B]` held fixed when given (on-policy: `log p` itself)."""
    rows = np.nonzero(MASK)[0]
    data = np.asarray(batch.latents, np.float64)[rows]
    cond = np.asarray(batch.cond, np.float64)[rows]
    t, noise = t[rows], noise[rows]
    count = t.shape[1]
    lp, ema_lp = np.zeros((count, len(rows))), np.zeros((count, len(rows)))
    kl, ema_kl = 0.0, 0.0
    for b in range(len(rows)):
        for j in range(count):
            x_t = (1 - t[b, j]) * data[b] + t[b, j] * noise[b, j]
            v = velocity(params, x_t, t[b, j], cond[b])
            args = (data[b], noise[b, j], t[b, j], *released_weighting(objective.weighting))
            lp[j, b] = ref.awm_log_prob(v, *args)
            if ema is not None:
                v_ema = velocity(ema, x_t, t[b, j], cond[b])
                ema_lp[j, b] = ref.awm_log_prob(v_ema, *args)
                ema_kl += ref.awm_kl(v, v_ema, t[b, j], RELEASED[type(objective.ema_kl_weight)])
            v_ref = velocity(reference, x_t, t[b, j], cond[b])
            kl += ref.awm_kl(v, v_ref, t[b, j], RELEASED[type(objective.kl_weight)])
    if old is None:
        old = ema_lp if objective.off_policy else lp
    advantages = ref.awm_advantages(
        np.asarray(batch.advantages, np.float64)[rows],
        objective.adv_clip_max,
        objective.advantage_max,
    )
    loss_type = RELEASED[type(objective.ratio)]
    policy, _ = ref.awm_policy_loss(lp, old, advantages, objective.clip_range, loss_type)
    total = policy + objective.kl_beta * kl / lp.size + objective.ema_beta * ema_kl / lp.size
    return total * len(rows), old


RELEASED = {
    fg.PerTimeRatio: "exp_first",
    fg.PerRowRatio: "sum_first",
    fg.DiscreteTimesWithoutInit: "discrete_wo_init",
    fg.DiscreteTimes: "discrete",
    fg.DiscreteTimesWithInit: "discrete_with_init",
    fg.UniformKLWeight: "uniform",
    fg.ELBOKLWeight: "elbo",
}
"""The release's `loss_type`, `time_type` and KL weighting string that each variant class
stands for (the float64 statement takes the release's names)."""


def released_weighting(weighting):
    """The release's `weighting` and `ghuber_power` that a weighting class stands for (the
    float64 statement takes the release's names)."""
    if isinstance(weighting, fg.GHuberWeighting):
        return "ghuber", weighting.power
    names = {
        fg.HuberWeighting: "huber",
        fg.TimeWeighting: "t",
        fg.TimeSquaredWeighting: "t**2",
        fg.UniformWeighting: "uniform",
    }
    return names[type(weighting)], None


CASES = [
    {},  # the released GenEval recipe
    {
        "weighting": fg.HuberWeighting(),
        "ratio": fg.PerRowRatio(),
        "kl_weight": fg.ELBOKLWeight(),
        "ema_kl_weight": fg.ELBOKLWeight(),
    },
    {
        "weighting": fg.TimeWeighting(),
        "off_policy": True,
        "clip_range": 0.02,
        "times": fg.DiscreteTimes(),
    },
    {
        "weighting": fg.TimeSquaredWeighting(),
        "off_policy": True,
        "clip_range": 0.05,
        "ratio": fg.PerRowRatio(),
    },
    {
        "weighting": fg.UniformWeighting(),
        "off_policy": True,
        "clip_range": 0.2,
        "advantage_max": None,
        "times": fg.DiscreteTimesWithInit(),
        "train_timesteps": 4,
        "kl_beta": 0.1,
    },
    {"weighting": fg.GHuberWeighting(power=0.5), "ema_beta": 0.0, "time_fraction": 1.0},
]


@pytest.mark.parametrize("kwargs", CASES)
def test_awm_loss_and_gradient_match_the_released_statement(kwargs):
    objective, variables, batch = setup(**kwargs)
    step = fg.Step(index=3, key=jax.random.key(4))

    def value(policy):
        both = fg.AWMVariables(policy, variables.ema, variables.reference)
        total, _ = objective.loss(both, batch, step)
        return total.total, total.count

    (total, count), grads = jax.value_and_grad(value, has_aux=True)(variables.policy)
    t, noise = draws(objective, batch, step)
    params = params_of(variables.policy)
    ema = None if variables.ema is None else params_of(variables.ema)
    reference = params_of(variables.reference_policy())
    want, old = numpy_loss(objective, params, ema, reference, batch, t, noise)
    assert float(count) == MASK.sum()
    np.testing.assert_allclose(float(total), want, rtol=2e-4, atol=1e-6)

    numeric = ref.central_differences(
        lambda ps: numpy_loss(objective, ps, ema, reference, batch, t, noise, old)[0], params
    )
    grads = (grads.weight, grads.time, grads.cond_weight)
    for got, want in zip(grads, numeric, strict=True):
        np.testing.assert_allclose(
            np.asarray(got, np.float64), want, rtol=2e-3, atol=2e-3 * np.abs(want).max()
        )


@pytest.mark.parametrize(
    "times", [fg.DiscreteTimesWithoutInit(), fg.DiscreteTimes(), fg.DiscreteTimesWithInit()]
)
@pytest.mark.parametrize(
    "grid_size, count, fraction", [(14, 6, 0.9), (10, 3, 1.0), (40, 7, 0.5), (5, 6, 1.0)]
)
def test_trained_indices_are_the_released_strata(times, grid_size, count, fraction):
    objective = make_objective(times=times, train_timesteps=count, time_fraction=fraction)
    strata = count - 1 if isinstance(times, fg.DiscreteTimesWithInit) else count
    for seed in range(5):
        key = jax.random.key(seed)
        got = np.asarray(objective.trained_indices(grid_size, key))
        u = np.asarray(jax.random.uniform(key, (strata,), jnp.float32))
        want = ref.awm_indices(u, grid_size, count, fraction, RELEASED[type(times)])
        assert got.tolist() == want
        assert got.dtype == np.int32 and got.shape == (count,)
        assert np.all((got >= 0) & (got < int(grid_size * fraction)))
        assert np.all(np.diff(got) >= 0)  # one per stratum, strata in order


def test_the_released_geneval_strata_never_train_the_first_step():
    objective = make_objective()
    seen = {int(i) for s in range(40) for i in objective.trained_indices(14, jax.random.key(s))}
    # linspace(1, 12, 7).long() = [1, 2, 4, 6, 8, 10, 12]: strata [1,2) [2,4) ... [10,12).
    assert seen <= set(range(1, 12)) and 1 in seen
    assert np.asarray(objective.trained_indices(14, jax.random.key(0)))[0] == 1


def test_a_grid_too_small_for_the_strata_is_named():
    objective = make_objective(time_fraction=0.5)
    with pytest.raises(ValueError, match="`time_fraction`=0.5 of a grid of 2 start times"):
        objective.trained_indices(2, jax.random.key(0))


def test_advantages_are_clipped_and_rescaled_as_released():
    a = np.array([-9.0, -5.0, -1.0, 0.0, 0.5, 4.9, 12.0], np.float32)
    for clip_max, top in [(5.0, 1.0), (2.0, 3.0), (5.0, None)]:
        objective = make_objective(adv_clip_max=clip_max, advantage_max=top)
        got = np.asarray(objective.scaled_advantages(jnp.asarray(a)), np.float64)
        np.testing.assert_allclose(got, ref.awm_advantages(a, clip_max, top), rtol=1e-6)


def test_on_policy_the_ratio_is_exactly_one_and_the_loss_is_minus_the_mean_advantage():
    """The release's on-policy form (lines 1282-1284, `old = log p` detached): the ratio is 1
    exactly, so nothing clips, and at the initial policy (EMA and reference equal to it) both
    KLs are 0 and the loss is `-mean(A')` over the counted rows."""
    objective = make_objective()
    _, _, batch = setup()
    variables = objective.init(jax.random.key(0))
    loss, aux = objective.loss(variables, batch, fg.Step(index=0, key=jax.random.key(9)))
    assert float(aux["ratio"].value) == 1.0
    assert float(aux["clipfrac"].value) == 0.0
    assert float(aux["kl"].value) == 0.0 and float(aux["ema_kl"].value) == 0.0
    a = ref.awm_advantages(np.asarray(batch.advantages)[MASK], 5.0, 1.0)
    np.testing.assert_allclose(float(loss.value), -a.mean(), rtol=1e-6)
    np.testing.assert_allclose(float(aux["policy_loss"].value), -a.mean(), rtol=1e-6)


def test_the_ema_follows_the_released_linear_schedule_once_per_epoch():
    decay = fg.RampedDecay(rate=0.001, maximum=0.3)
    for step in (0, 1, 7, 299, 300, 301, 5000):
        assert decay(step) == pytest.approx(ref.awm_ema_decay(step, "linear", 0.3))
    objective, variables, _ = setup()
    assert objective.ema_decay == decay
    for step in (0, 120, 900):
        moved = objective.end_epoch(variables, step)
        d = ref.awm_ema_decay(step, "linear", 0.3)
        for name in ("weight", "time", "cond_weight"):
            want = ref.awm_ema_update(
                getattr(variables.ema, name), getattr(variables.policy, name), d
            )
            np.testing.assert_allclose(
                np.asarray(getattr(moved.ema, name)), want, rtol=1e-6, atol=1e-7
            )
        assert eqx.tree_equal(moved.policy, variables.policy)
        assert eqx.tree_equal(moved.reference, variables.reference)
    constant = make_objective(ema_decay=0.25).end_epoch(variables, 77)
    want = ref.awm_ema_update(variables.ema.weight, variables.policy.weight, 0.25)
    np.testing.assert_allclose(np.asarray(constant.ema.weight), want, rtol=1e-6, atol=1e-7)
    assert make_objective(ema_decay=None).end_epoch(variables, 50) is variables


def test_awm_defaults_are_the_released_geneval_recipe():
    objective = make_objective()
    assert objective.weighting == fg.GHuberWeighting(power=0.25)
    assert objective.ratio == fg.PerTimeRatio()
    assert (objective.clip_range, objective.adv_clip_max, objective.advantage_max) == (1, 5, 1)
    assert (objective.times, objective.train_timesteps, objective.time_fraction) == (
        fg.DiscreteTimesWithoutInit(),
        6,
        0.9,
    )
    assert (objective.kl_beta, objective.kl_weight) == (0.001, fg.UniformKLWeight())
    assert (objective.ema_beta, objective.ema_kl_weight) == (1.0, fg.UniformKLWeight())
    assert objective.off_policy is False
    sampler = objective.rollout_sampler(None)
    assert isinstance(sampler, fg.SDESampler)
    assert sampler.sde == fg.FlowSDE(noise_level=0.4, window=(0.9, 0.3))
    requested = fg.ODESampler(fg.Heun())
    assert objective.rollout_sampler(requested) is requested


def test_the_ema_and_reference_are_kept_only_when_weighted():
    bare = make_objective(kl_beta=0.0, ema_beta=0.0).init(jax.random.key(0))
    assert bare.ema is None and bare.reference is None
    off = make_objective(kl_beta=0.0, ema_beta=0.0, off_policy=True)
    variables = off.init(jax.random.key(0))
    assert variables.ema is not None
    assert off.sampling_policy(variables) is not variables.policy
    assert make_objective().sampling_policy(variables) is variables.policy


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"clip_range": -1.0}, "`clip_range` must be a finite number > 0, got -1.0."),
        ({"adv_clip_max": 0.0}, "`adv_clip_max` must be a finite number > 0, got 0.0."),
        ({"advantage_max": 0.0}, "`advantage_max` must be None or a finite number > 0, got 0.0."),
        ({"train_timesteps": 0}, "`train_timesteps` must be an int >= 1, got 0."),
        ({"time_fraction": 1.5}, "`time_fraction` must be a finite number in (0, 1], got 1.5."),
        ({"kl_beta": -0.1}, "`kl_beta` must be a finite number >= 0, got -0.1."),
        ({"ema_beta": float("nan")}, "`ema_beta` must be a finite number >= 0, got nan."),
        (
            {"ema_decay": 1.0},
            "`ema_decay` must be None or a finite number in [0, 1), got 1.0.",
        ),
    ],
)
def test_awm_arguments_are_checked_by_name(kwargs, message):
    with pytest.raises(ValueError, match=exact_message(message)):
        make_objective(**kwargs)


@pytest.mark.parametrize("power", [0.0, -0.25, float("nan")])
def test_the_ghuber_power_is_checked_by_name(power):
    message = f"`power` must be a finite number > 0, got {power!r}."
    with pytest.raises(ValueError, match=exact_message(message)):
        fg.GHuberWeighting(power=power)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"weighting": "ghuber"},
            "`weighting` must be an AbstractAWMWeighting (GHuberWeighting, HuberWeighting, "
            "TimeWeighting, TimeSquaredWeighting, UniformWeighting), got 'ghuber'.",
        ),
        (
            {"ratio": "per_row"},
            "`ratio` must be an AbstractAWMRatio (PerTimeRatio(), PerRowRatio()), got 'per_row'.",
        ),
        (
            {"times": "discrete"},
            "`times` must be an AbstractAWMTimes (DiscreteTimesWithoutInit(), DiscreteTimes(), "
            "DiscreteTimesWithInit()), got 'discrete'.",
        ),
        (
            {"kl_weight": "elbo"},
            "`kl_weight` must be an AbstractAWMKLWeight (UniformKLWeight(), ELBOKLWeight()), "
            "got 'elbo'.",
        ),
        (
            {"ema_kl_weight": fg.PerRowRatio()},
            "`ema_kl_weight` must be an AbstractAWMKLWeight (UniformKLWeight(), ELBOKLWeight()), "
            "got PerRowRatio().",
        ),
        ({"off_policy": 1}, "`off_policy` must be a bool, got 1."),
        ({"sde": fg.Euler()}, "`sde` must be an AbstractSDE, got Euler()."),
    ],
)
def test_awm_modes_and_types_are_checked_by_name(kwargs, message):
    with raises_named(message):
        make_objective(**kwargs)


@pytest.mark.parametrize(
    "objective_type, settings",
    [
        (fg.AWMObjective, {}),
        (fg.DGPOObjective, {"group_size": 4}),
        (fg.DiffusionNFTObjective, {}),
        (fg.train.FlowMatchingObjective, {}),
    ],
)
def test_a_model_in_place_of_the_flow_is_named(objective_type, settings):
    model = LinearVelocity(jax.random.key(0))
    with pytest.raises(NAMED_ARGUMENT_ERRORS, match="flow"):
        objective_type(model, **settings)


def run_checks_in_equinoxs_order(module):
    """Equinox's checks at construction: each class's own `__check_init__`, subclass first."""
    for kls in type(module).__mro__:
        if "__check_init__" in kls.__dict__:
            kls.__check_init__(module)


@pytest.mark.parametrize(
    "objective_type, settings",
    [
        (fg.AWMObjective, {}),
        (fg.DGPOObjective, {"group_size": 4, "reference_guidance": fg.CFG(4.5)}),
        (fg.DiffusionNFTObjective, {}),
        (fg.train.FlowMatchingObjective, {"cond_dropout": 0.5}),
    ],
)
def test_every_objective_check_that_reads_the_flow_checks_it_first(objective_type, settings):
    # Under this suite's runtime type checker the field's type refuses a model before any
    # check runs; without it, Equinox runs a subclass's `__check_init__` (DGPO's and flow
    # matching's read `flow.inputs` with these settings) before the base's. So the model is
    # put in place of a valid objective's flow and the checks run as Equinox runs them.
    model = LinearVelocity(jax.random.key(0))
    inputs = fg.InputSpec(null=jnp.zeros(DIM))
    objective = objective_type(fg.GuidedFlow(model, fg.RectifiedFlow(), inputs), **settings)
    run_checks_in_equinoxs_order(objective)
    object.__setattr__(objective, "flow", model)
    with pytest.raises(ValueError, match="`flow` must be a GuidedFlow"):
        run_checks_in_equinoxs_order(objective)


def test_awm_trains_on_the_final_samples_of_an_sde_rollout():
    objective, variables, batch = setup()
    transitions = fg.Transitions(
        latents=jnp.zeros((N, K, DIM)),
        next_latents=jnp.zeros((N, K, DIM)),
        timesteps=batch.timesteps,
        next_timesteps=batch.timesteps / 2,  # below `timesteps`, as `Transitions` requires
        old_log_probs=jnp.zeros((N, K)),
        transition_mask=jnp.ones((N, K), bool),
        advantages=batch.advantages,
        cond=batch.cond,
    )
    info = rollout_info(batch.latents)
    got = objective.training_batch(transitions, info)
    assert isinstance(got, fg.FinalSamples) and bool(np.all(np.asarray(got.mask)))
    assert got.latents is batch.latents and got.timesteps is batch.timesteps
    assert objective.training_batch(batch, info) is batch
    per_transition = eqx.tree_at(lambda b: b.advantages, transitions, jnp.zeros((N, K)))
    with pytest.raises(ValueError, match="AWM needs one advantage per row"):
        objective.training_batch(per_transition, info)
    with pytest.raises(ValueError, match="batch.timesteps"):
        no_grid = fg.FinalSamples(batch.latents, batch.advantages, batch.cond)
        objective.loss(variables, no_grid, fg.Step(index=0, key=jax.random.key(0)))


def test_a_masked_row_of_nan_reaches_neither_the_loss_nor_its_gradient():
    objective, variables, batch = setup(
        kl_weight=fg.ELBOKLWeight(), ema_kl_weight=fg.ELBOKLWeight()
    )

    def value(policy):
        both = fg.AWMVariables(policy, variables.ema, variables.reference)
        return objective.loss(both, batch, fg.Step(index=0, key=jax.random.key(2)))[0].value

    loss, grads = jax.value_and_grad(value)(variables.policy)
    assert np.isfinite(float(loss))
    assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(grads))
    changed = eqx.tree_at(lambda b: b.latents, batch, batch.latents.at[2].set(1e30))
    again = objective.loss(variables, changed, fg.Step(index=0, key=jax.random.key(2)))[0]
    assert float(again.value) == float(value(variables.policy))


def test_the_awm_demo_settings_are_the_released_recipe_adapted():
    config = make_config("tiny", algorithm="awm")
    assert (config.objective.beta, config.objective.clip_range) == (0.001, 1.0)
    assert (config.rollout.noise_level, config.rollout.shared_noise) == (0.4, False)
    named = make_config("tiny", algorithm="awm", beta=0.0, noise_level=0.7)
    assert (named.objective.beta, named.rollout.noise_level) == (0.0, 0.7)
    with pytest.raises(ValueError, match="`rollout_steps` must be at least 4 with algorithm 'awm'"):
        make_config("tiny", algorithm="awm", rollout_steps=3)


@pytest.mark.parametrize(
    "algorithm, reported",
    [
        ("awm", ("ema_kl", "kl", "log_likelihood", "ratio")),
        ("dgpo", ("kl", "weight", "clipfrac", "error", "reference_error")),
        ("mixgrpo", ("clipfrac",)),
        ("mixgrpo-flash", ("clipfrac",)),
        ("mixgrpo-flash-star", ("clipfrac",)),
        ("dppo", ("kl", "masked_fraction", "high_kl_fraction", "ratio")),
        ("dancegrpo", ("clipfrac", "ratio", "approx_kl")),
    ],
)
def test_the_tiny_preset_trains_with_each_new_algorithm_through_the_command_line(
    tiny_base, tmp_path, algorithm, reported
):
    """AWM, DGPO (test_dgpo.py), MixGRPO (test_mixgrpo_demo.py), Flow-DPPO (test_dppo.py) and
    DanceGRPO (test_dancegrpo.py) train the tiny preset from the session's base model."""
    out = with_base(tiny_base, tmp_path / algorithm)
    result = run_cli("train", "--preset", "tiny", "--quiet", "--algorithm", algorithm, "--out", out)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f'algorithm = "{algorithm}"' in (out / "config.toml").read_text().splitlines()
    records = [r for r in MetricsLog(out / "metrics.jsonl").read() if "reward_mean" in r]
    assert [r["epoch"] for r in records] == [1, 2, 3, 4]
    assert all(np.isfinite(r["loss"]) and all(name in r for name in reported) for r in records)
    if algorithm == "awm":
        assert all(r["ratio"] == 1.0 for r in records)
    assert (out / "summary.json").exists() and (out / "policy.eqx").exists()
