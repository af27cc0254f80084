"""Edges of the mathematical modules that the formula tests pass over: exact draws, dtypes
kept through low-precision inputs, the boundaries of argument checks, and error messages.
Each kills mutants that survived the formula tests, or was written against the diff of one
not yet run (docs/mutation.md)."""

import contextlib
import re
from collections.abc import Iterator

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flowgrpo_eqx as fg
from flowgrpo_eqx import lora
from tests import numpy_reference as ref, test_nft as nft_tests, test_objective as objective_tests
from tests.errors import NAMED_ARGUMENT_ERRORS


# --------------------------------------------------------------------------------------
# AbstractSDE.sample: exactly `mean + std z` for the given draw, in the mean's dtype.


@pytest.mark.parametrize("sde", [fg.FlowSDE(), fg.CoefficientsPreservingSDE()])
def test_sample_is_mean_plus_std_times_the_given_draw(sde):
    mean = jnp.asarray([1.0, 2.0, -3.0], jnp.float32)
    noise = jnp.asarray([1.0, -2.0, 0.5], jnp.float32)
    got = sde.sample(mean, jnp.asarray(0.5, jnp.float32), noise)
    np.testing.assert_array_equal(np.asarray(got), [1.5, 1.0, -2.75])


def test_sample_keeps_a_bfloat16_mean_bfloat16():
    mean = jnp.asarray([1.0, 2.0], jnp.bfloat16)
    noise = jnp.asarray([1.0, -2.0], jnp.float32)
    got = fg.FlowSDE().sample(mean, jnp.asarray(0.5, jnp.float32), noise)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), [1.5, 1.0])


# --------------------------------------------------------------------------------------
# RectifiedFlow.interpolate keeps the data's dtype whatever the time's.


def test_interpolate_keeps_a_bfloat16_state_bfloat16():
    data = jnp.asarray([1.0, -2.0], jnp.bfloat16)
    noise = jnp.asarray([0.5, 0.5], jnp.bfloat16)
    got = fg.RectifiedFlow().interpolate(data, noise, jnp.asarray(0.25, jnp.float32))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), [0.875, -1.375])


# --------------------------------------------------------------------------------------
# window_for_indices: the whole grid is a window; one transition more is not.


def test_window_for_indices_accepts_exactly_the_grid():
    grid = fg.RectifiedFlow().timesteps(6)  # five transitions
    assert fg.window_for_indices(grid, 0, 5) == (1.0, 0.0)
    assert fg.window_for_indices(grid, 4, 1) == (float(grid[4]), 0.0)
    for first, count in ((0, 6), (1, 5), (5, 1), (-1, 2), (2, 0)):
        with pytest.raises(ValueError, match="`first`"):
            fg.window_for_indices(grid, first, count)


# --------------------------------------------------------------------------------------
# group_advantages: statistics in float64 whatever the rewards' dtype, eps = 0 allowed,
# inexact constant groups exactly 0, and messages that name the argument and the rows.


def test_float32_rewards_get_float64_statistics():
    # Near 1e8 a float32 sum rounds by tens: float32 statistics would move every advantage.
    rewards = np.array([1e8, 1e8 + 8, 1e8 + 16, 1e8 + 40], np.float32)
    got = fg.group_advantages(rewards, groups=4)
    exact = rewards.astype(np.float64)
    want = (exact - exact.mean()) / (exact.std() + 1e-4)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_eps_zero_is_allowed():
    got = fg.group_advantages(np.array([1.0, 3.0, 5.0, 9.0]), groups=2, eps=0.0)
    np.testing.assert_array_equal(got, [-1.0, 1.0, -1.0, 1.0])


@pytest.mark.parametrize("std", ["group", "global"])
def test_inexact_constant_group_is_exactly_zero(std):
    # 0.1 three times has a float64 mean of 0.1 + 1.4e-17: the zero must not be arithmetic.
    rewards = np.array([0.1, 0.1, 0.1, 1.0, 2.0, 4.0])
    got = fg.group_advantages(rewards, groups=3, std=std)
    assert np.all(got[:3] == 0.0), got[:3]
    assert np.all(got[3:] != 0.0)


def test_group_size_message_names_the_argument():
    with pytest.raises(ValueError, match="`groups` must be an int >= 1, got 0"):
        fg.group_advantages(np.zeros(4), groups=0)


def test_non_finite_message_names_the_rows():
    rewards = np.array([0.0, np.nan, 1.0, np.inf])
    with pytest.raises(ValueError, match=r"non-finite values at rows \[1, 3\]"):
        fg.group_advantages(rewards, groups=2)


# --------------------------------------------------------------------------------------
# RectifiedFlow.timesteps is float32 by its own choice, not by JAX's default dtype.


def test_grid_is_float32_with_x64_enabled():
    with jax.enable_x64(True):
        grid = fg.RectifiedFlow(3.0).timesteps(5)
        assert grid.dtype == jnp.float32
        assert float(grid[0]) == 1.0 and float(grid[-1]) == 0.0


# --------------------------------------------------------------------------------------
# The SDEs: window boundaries and tolerance, float64 when any input is float64, messages.


def test_window_may_span_the_whole_grid_and_no_more():
    assert fg.FlowSDE(0.7, window=(1.0, 0.0)).window == (1.0, 0.0)
    assert fg.CoefficientsPreservingSDE(1.0).noise_level == 1.0
    for window in ((0.5, 0.5), (0.4, 0.5), (1.5, 0.5), (0.5, -0.25)):
        with pytest.raises(ValueError, match=r"^`window` must be \(start, stop\) times"):
            fg.FlowSDE(0.7, window=window)


def test_window_tolerance_is_inclusive_at_one_millionth():
    sde = fg.FlowSDE(0.7, window=(0.5, 0.25))
    start = np.float32(0.5) + np.float32(1e-6)
    stop = np.float32(0.25) - np.float32(1e-6)
    assert bool(sde.is_stochastic(start, np.float32(0.3)))
    assert bool(sde.is_stochastic(np.float32(0.4), stop))
    assert not bool(sde.is_stochastic(np.nextafter(start, np.float32(1)), np.float32(0.3)))
    assert not bool(sde.is_stochastic(np.float32(0.4), np.nextafter(stop, np.float32(0))))


@pytest.mark.parametrize("sde", [fg.FlowSDE(0.7), fg.CoefficientsPreservingSDE(0.7)])
def test_any_float64_input_computes_in_float64(sde):
    with jax.enable_x64(True):
        low = jnp.asarray([0.25, -0.5], jnp.float32)
        high = jnp.asarray([0.5, 0.125], jnp.float64)
        for x, v in ((low, high), (high, low)):
            mean, std = sde.transition(x, v, 0.75, 0.5)
            assert mean.dtype == jnp.float64 and std.dtype == jnp.float64
        assert sde.log_prob(low, high, std).dtype == jnp.float64
        assert sde.log_prob(high, low, std).dtype == jnp.float64
        assert sde.kl(low, high, std).dtype == jnp.float64
        assert sde.kl(high, low, std).dtype == jnp.float64
        assert fg.FlowSDE(kl_weighting="released").kl(low, high, std, -0.25).dtype == jnp.float64
        assert sde.transition(low, low, 0.75, 0.5)[0].dtype == jnp.float32


@pytest.mark.parametrize("sde", [fg.FlowSDE(0.7), fg.CoefficientsPreservingSDE(0.7)])
def test_log_prob_takes_a_bfloat16_std_in_float32(sde):
    # In bfloat16 `log std` and `std^2` would be off by about 0.4%.
    rng = np.random.default_rng(0)
    x_next = rng.normal(size=5).astype(np.float32)
    mean = rng.normal(size=5).astype(np.float32)
    std = jnp.asarray(0.3, jnp.bfloat16)
    got = sde.log_prob(jnp.asarray(x_next), jnp.asarray(mean), std)
    assert got.dtype == jnp.float32
    want = ref.log_prob(x_next, mean, float(np.float32(std)))
    np.testing.assert_allclose(float(got), want, rtol=1e-6)


@pytest.mark.parametrize(
    "sde, kind", [(fg.FlowSDE(0.7), "flow"), (fg.CoefficientsPreservingSDE(0.7), "cps")]
)
def test_transition_takes_bfloat16_times_in_float32(sde, kind):
    # In bfloat16, t / (1 - t) and the other time terms would be off by up to 0.4%.
    rng = np.random.default_rng(1)
    x = rng.normal(size=4).astype(np.float32)
    v = rng.normal(size=4).astype(np.float32)
    t = jnp.asarray(0.9, jnp.bfloat16)
    t_next = jnp.asarray(0.7, jnp.bfloat16)
    mean, std = sde.transition(jnp.asarray(x), jnp.asarray(v), t, t_next)
    assert mean.dtype == jnp.float32 and std.dtype == jnp.float32
    want_mean, want_std = ref.transition(x, v, float(t), float(t_next), 0.7, kind)
    np.testing.assert_allclose(np.asarray(mean), want_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(std), want_std, rtol=1e-5)


def test_is_stochastic_has_the_broadcast_shape_of_its_times():
    sde = fg.FlowSDE(0.7)
    times = jnp.asarray([0.9, 0.5, 0.3], jnp.float32)
    end = jnp.asarray(0.2, jnp.float32)
    for t, t_next in ((times, end), (end + 0.7, times - 0.1)):
        got = sde.is_stochastic(t, t_next)
        assert got.shape == (3,)
        want = [
            ref.stochastic(a, b, 0.7) for a, b in np.broadcast(np.asarray(t), np.asarray(t_next))
        ]
        np.testing.assert_array_equal(np.asarray(got), want)


def test_a_window_that_is_not_a_pair_is_named():
    for window in ([0.8, 0.2], (0.8,), (0.8, 0.5, 0.2)):
        with raises_named(f"`window` must be a pair (start, stop), got {window!r}."):
            fg.FlowSDE(window=window)


def test_sde_messages_name_the_argument_first():
    with pytest.raises(ValueError, match=r"^`noise_level` must be a number >= 0, got -0.5"):
        fg.FlowSDE(-0.5)
    with pytest.raises(ValueError, match=r"^`noise_level` must be in \[0, 1\] for coeff"):
        fg.CoefficientsPreservingSDE(1.5)
    released = fg.FlowSDE(kl_weighting="released")
    m = jnp.zeros(2)
    with pytest.raises(ValueError, match=r"^`dt` is required by kl when kl_weighting="):
        released.kl(m, m, 0.5)
    grid = fg.RectifiedFlow().timesteps(4)
    with pytest.raises(ValueError, match=r"^`first`=2 and `count`=2 select transitions outside"):
        fg.window_for_indices(grid, 2, 2)


def exact_message(message: str) -> str:
    """A `pytest.raises(match=...)` pattern for exactly `message`, case and all."""
    return "^" + re.escape(message) + "$"


@contextlib.contextmanager
def raises_named(message: str) -> Iterator[None]:
    """The library's exact `ValueError` for an argument of the wrong type, or, when the
    runtime type checker of the test suite's default options is on, the checker's error
    (which comes first)."""
    with pytest.raises(NAMED_ARGUMENT_ERRORS) as error:
        yield
    if error.type is ValueError:
        assert str(error.value) == message


# --------------------------------------------------------------------------------------
# per_reward_advantages: float64 terms whatever the inputs' dtype, and its messages.


def test_per_reward_terms_are_float64_for_float32_components():
    # Near 1e8 a float32 mean rounds by tens: each term must be computed from float64 values.
    components = np.array([[1e8, 1e8 + 8, 1e8 + 16, 1e8 + 40], [0.0, 1.0, 3.0, 2.0]], np.float32)
    got = fg.per_reward_advantages(components, np.array([1.0, 0.5], np.float32), groups=4)
    exact = components.astype(np.float64)
    terms = (exact - exact.mean(axis=1, keepdims=True)) / (exact.std(axis=1, keepdims=True) + 1e-4)
    np.testing.assert_allclose(got, terms[0] + 0.5 * terms[1], rtol=1e-6)


def test_per_reward_messages_give_the_expected_shapes():
    with pytest.raises(
        ValueError, match=exact_message("`weights` must have shape [R] = (2,), got (3,).")
    ):
        fg.per_reward_advantages(np.zeros((2, 4)), [1.0, 2.0, 3.0], groups=2)
    with pytest.raises(
        ValueError, match=exact_message("`components` must have shape [R, N], got (4,).")
    ):
        fg.per_reward_advantages(np.zeros(4), [1.0], groups=2)
    with pytest.raises(
        ValueError, match=exact_message("`weights` must be finite, got [1.0, nan].")
    ):
        fg.per_reward_advantages(np.zeros((2, 4)), [1.0, np.nan], groups=2)


# --------------------------------------------------------------------------------------
# GuidedFlow: the decoder's clip to [-1, 1], the bfloat16 cast of what the model sees, and
# the time the ODE sampler passes in the state's dtype.


def _times_model(x, t, cond):
    return x * t


class _Doubling(fg.AbstractAutoEncoder):
    """A decoder whose samples leave [-1, 1] (the identity one clips on its own)."""

    def encode(self, sample):
        return sample / 2

    def decode(self, latent):
        return latent * 2


def test_decode_clips_to_minus_one_and_one():
    flow = fg.GuidedFlow(
        _times_model, fg.RectifiedFlow(), fg.InputSpec(), guidance=None, autoencoder=_Doubling()
    )
    latents = jnp.asarray([[-3.0, -0.5, -0.125], [0.375, 0.5, 2.0]], jnp.float32)
    np.testing.assert_array_equal(
        np.asarray(flow.decode(latents)), [[-1.0, -1.0, -0.25], [0.75, 1.0, 1.0]]
    )


def test_bfloat16_precision_casts_only_wide_floats_for_the_model():
    seen = {}

    def model(x, t, cond):
        seen.update(x=x.dtype, t=t.dtype, scale=cond["scale"].dtype, label=cond["label"].dtype)
        seen["half"] = cond["half"].dtype
        return x * t * cond["scale"] * cond["half"].astype(x.dtype)

    flow = fg.GuidedFlow(
        model,
        fg.RectifiedFlow(),
        fg.InputSpec(),
        guidance=None,
        precision="bfloat16",
    )
    cond = {
        "scale": jnp.full((2,), 2.0, jnp.float32),
        "label": jnp.asarray([3, 4], jnp.int32),
        "half": jnp.ones((2,), jnp.float16),
    }
    x = jnp.asarray([[1.0, -0.5], [0.25, 4.0]], jnp.float32)
    got = flow.call_model(model, x, jnp.asarray([0.5, 0.5], jnp.float32), cond)
    assert seen == dict(
        x=jnp.bfloat16, t=jnp.bfloat16, scale=jnp.bfloat16, label=jnp.int32, half=jnp.float16
    )
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), [[1.0, -0.5], [0.25, 4.0]])


def test_the_sampler_gets_times_in_the_state_dtype():
    seen = []

    def model(x, t, cond):
        seen.append(t.dtype)
        return x * t

    flow = fg.GuidedFlow(model, fg.RectifiedFlow(), fg.InputSpec(), guidance=None)
    # The solvers' float32 time steps meet a float64 state only under standard promotion.
    with jax.enable_x64(True), jax.numpy_dtype_promotion("standard"):
        noise = jnp.ones((2, 3), jnp.float64)
        got = flow.sample_latents(model, jnp.zeros((2, 1)), noise, fg.Euler(), 3)
        assert got.dtype == jnp.float64 and set(seen) == {jnp.dtype(jnp.float64)}
        low = flow.sample_latents(
            model, jnp.zeros((2, 1)), noise.astype(jnp.bfloat16), fg.Euler(), 3
        )
        assert low.dtype == jnp.float32
    # Two Euler steps of v = x t from t = 1: x (1 - 1/2) (1 - 1/4).
    np.testing.assert_allclose(np.asarray(got), np.full((2, 3), 0.375), rtol=0, atol=1e-12)


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
    got_leaves = jax.tree.leaves(eqx.filter(got, eqx.is_array))
    want_leaves = jax.tree.leaves(eqx.filter(want, eqx.is_array))
    assert len(got_leaves) == len(want_leaves)
    for g, w in zip(got_leaves, want_leaves, strict=True):
        assert g.dtype == w.dtype, (g.dtype, w.dtype)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("beta, guard", [(0.0, None), (0.3, fg.GRPOGuard())])
def test_flow_grpo_loss_is_unchanged_by_x64(beta, guard):

    objective = eqx.tree_at(
        lambda o: o.guard,
        objective_tests.make_objective(beta=beta, old_log_probs="update"),
        guard,
        is_leaf=lambda x: x is None,
    )
    policy = objective_tests.LinearVelocity(jax.random.key(1))
    variables = fg.FlowGRPOVariables(
        policy=policy, reference=objective_tests.LinearVelocity(jax.random.key(2))
    )
    batch = objective_tests.make_batch(0, poison=True)
    step = fg.Step(index=0, key=jax.random.key(3))
    want = _value_and_grad(objective, variables, batch, step)
    with jax.enable_x64(True):
        got = _value_and_grad(objective, variables, batch, step)
    _assert_same_trees(got, want)


def test_nft_loss_is_unchanged_by_x64():

    objective = nft_tests.make_objective(guidance=fg.CFG(2.0), kl_beta=0.1)
    variables = fg.NFTVariables(
        policy=objective_tests.LinearVelocity(jax.random.key(1)),
        old_policy=objective_tests.LinearVelocity(jax.random.key(2)),
        reference=objective_tests.LinearVelocity(jax.random.key(4)),
    )
    batch = nft_tests.make_batch(0, poison=True)
    want = _value_and_grad(objective, variables, batch, nft_tests.STEP)
    with jax.enable_x64(True):
        got = _value_and_grad(objective, variables, batch, nft_tests.STEP)
    _assert_same_trees(got, want)


# --------------------------------------------------------------------------------------
# DiffusionNFT's training batch and the guard's settings.


def test_the_nft_training_batch_takes_the_final_latents_the_rows_and_their_advantages():

    batch = objective_tests.make_batch(1, n=3, k=2, steps=4)
    final = jnp.arange(3 * objective_tests.DIM, dtype=jnp.float32).reshape(3, -1)
    info = fg.RolloutInfo(
        rewards=np.zeros(3),
        reward_mean=np.float32(0.0),
        zero_std_fraction=0.0,
        mean_group_std=0.0,
        samples=final,
        final=final,
        seconds={},
        reward_calls_here=1,
        window_start=0,
    )
    nft = nft_tests.make_objective().training_batch(batch, info)
    np.testing.assert_array_equal(nft.latents, final)
    np.testing.assert_array_equal(nft.advantages, batch.advantages)
    np.testing.assert_array_equal(nft.cond, batch.cond)
    np.testing.assert_array_equal(nft.mask, [True, True, True])
    per_transition = objective_tests.make_batch(
        1, n=3, k=2, steps=4, advantages_per_transition=True
    )
    message = (
        "DiffusionNFT needs one advantage per row, got Transitions.advantages of shape (3, 2)."
    )
    with pytest.raises(ValueError, match=exact_message(message)):
        nft_tests.make_objective().training_batch(per_transition, info)


def test_a_guard_that_does_nothing_is_refused_by_name():
    message = "`ratio_norm` and `reweight` are both False: the guard does nothing."
    with pytest.raises(ValueError, match=exact_message(message)):
        fg.GRPOGuard(ratio_norm=False, reweight=False)
    assert fg.GRPOGuard(ratio_norm=False).reweight and fg.GRPOGuard(reweight=False).ratio_norm


# --------------------------------------------------------------------------------------
# DiffusionNFT: documented defaults, the boundaries of its checks, and the LoRA old policy.


def _nft(**settings):

    return fg.DiffusionNFTObjective(
        objective_tests.LinearVelocity(jax.random.key(0)),
        fg.RectifiedFlow(),
        fg.InputSpec(),
        **settings,
    )


def test_nft_defaults_are_the_documented_ones():
    objective = _nft(guidance=None)
    assert (objective.beta, objective.adv_max, objective.steps) == (1.0, 5.0, 41)
    assert objective.pretrained is None and isinstance(objective.sampler, fg.Euler)
    assert objective.flow.precision == "float32"
    assert isinstance(objective.flow.autoencoder, fg.IdentityAutoEncoder)

    guided = fg.DiffusionNFTObjective(
        objective_tests.LinearVelocity(jax.random.key(0)),
        fg.RectifiedFlow(),
        fg.InputSpec(null=jnp.asarray(objective_tests.NULL)),
    )
    assert guided.flow.guidance == fg.CFG(3.0)


def test_nft_passes_its_arguments_on():

    pretrained = objective_tests.LinearVelocity(jax.random.key(7))
    objective = _nft(
        guidance=None,
        autoencoder=_Doubling(),
        precision="bfloat16",
        pretrained=pretrained,
        sampler=fg.Heun(),
        adv_max=0.5,
        steps=2,
    )
    assert isinstance(objective.flow.autoencoder, _Doubling)
    assert objective.flow.precision == "bfloat16" and objective.pretrained is pretrained
    assert isinstance(objective.sampler, fg.Heun)
    assert (objective.adv_max, objective.steps) == (0.5, 2)


def test_nft_messages_are_exact():
    with raises_named("`sampler` must be an AbstractSolver, got 'euler'."):
        _nft(guidance=None, sampler="euler")
    message = (
        "`variables.reference` is None, but `kl_beta` > 0 needs the frozen reference of a policy "
        "without LoRA adapters: build the variables with `init`."
    )
    policy = _nft(guidance=None).initial_policy()
    with pytest.raises(ValueError, match=exact_message(message)):
        _nft(guidance=None).reference(fg.NFTVariables(policy, policy, None))


def test_final_samples_accept_scalar_latents_and_one_dimensional_rows():
    batch = fg.FinalSamples(latents=jnp.ones(3), advantages=jnp.ones(3), cond=jnp.arange(3.0))
    assert batch.num_rows == 3
    with raises_named("FinalSamples.latents has shape (), expected [N, *latent]."):
        fg.FinalSamples(latents=jnp.ones(()), advantages=jnp.ones(3), cond=jnp.ones(3))
    with raises_named("FinalSamples.mask must be a bool array, got dtype int32."):
        fg.FinalSamples(
            latents=jnp.ones(3), advantages=jnp.ones(3), cond=jnp.ones(3),
            mask=jnp.ones(3, jnp.int32),
        )  # fmt: skip


def test_nft_old_policy_of_a_lora_policy_is_the_policy_with_the_old_adapters():

    def adapted(seed):
        model = lora.add(eqx.nn.MLP(2, 2, 4, 1, key=jax.random.key(0)), 2, key=jax.random.key(1))
        noisy = jax.tree.map(
            lambda a: a + jax.random.normal(jax.random.key(seed), a.shape), lora.adapters(model)
        )
        return lora.with_adapters(model, noisy)

    policy, old = adapted(2), adapted(3)
    got = _nft(guidance=None).old_policy(fg.NFTVariables(policy, lora.adapters(old), None))
    _assert_same_trees(lora.adapters(got), lora.adapters(old))
    _assert_same_trees(lora.without_adapters(got), lora.without_adapters(policy))


# --------------------------------------------------------------------------------------
# The KL computes in float32 for low-precision means, whatever JAX's default dtype.


@pytest.mark.parametrize("sde", [fg.FlowSDE(0.7), fg.CoefficientsPreservingSDE(0.7)])
def test_kl_of_bfloat16_means_is_float32_with_x64_enabled(sde):
    mean = np.array([0.5, -1.0, 0.75])
    mean_ref = np.array([0.25, 0.0, 1.0])
    want = ref.kl_paper(mean, mean_ref, 0.5)
    released = fg.FlowSDE(0.7, kl_weighting="released")
    with jax.enable_x64(True):
        low, low_ref = jnp.asarray(mean, jnp.bfloat16), jnp.asarray(mean_ref, jnp.bfloat16)
        # The std and dt as a bfloat16 array and a NumPy float64 (not weakly typed): cast too.
        std = jnp.asarray(0.5, jnp.bfloat16)
        got = sde.kl(low, low_ref, std)
        weighted = released.kl(low, low_ref, std, np.float64(-0.25))
    assert got.dtype == jnp.float32 and weighted.dtype == jnp.float32
    np.testing.assert_allclose(float(got), want, rtol=1e-6)
    np.testing.assert_allclose(float(weighted), 0.25 * want, rtol=1e-6)


# --------------------------------------------------------------------------------------
# The null condition's per-example shapes are checked against the rows'.


def test_a_null_condition_of_another_shape_is_named():
    flow = fg.GuidedFlow(
        _times_model, fg.RectifiedFlow(), fg.InputSpec(null=jnp.zeros(3)), guidance=fg.CFG(2.0)
    )
    message = (
        "The rows' conditioning does not match the null condition: per example the rows give "
        "shapes (2,), the null condition (InputSpec.null) (3,)."
    )
    with pytest.raises(ValueError, match=exact_message(message)):
        flow.null_like(jnp.zeros((4, 2)))
    with pytest.raises(
        ValueError, match=r"rows give shapes \(2, 3\), the null condition .* \(2, 4\)"
    ):
        fg.GuidedFlow(
            _times_model, fg.RectifiedFlow(), fg.InputSpec(null=jnp.zeros((2, 4))),
        ).null_like(jnp.zeros((1, 2, 3)))  # fmt: skip
    assert flow.null_like(jnp.ones((4, 3))).shape == (4, 3)


def test_guided_flow_messages_are_exact():
    def flow(**settings):
        arguments = dict(
            model=_times_model, process=fg.RectifiedFlow(), inputs=fg.InputSpec(), guidance=None
        )
        return fg.GuidedFlow(**(arguments | settings))

    with raises_named("`model` must be callable as model(x, t, cond), got 3."):
        flow(model=3)
    with raises_named("`process` must be an AbstractProcess, got 'rectified'."):
        flow(process="rectified")
    with raises_named("`inputs` must be an InputSpec, got None."):
        flow(inputs=None)
    with raises_named("`guidance` must be a CFG or None, got 3.0."):
        flow(guidance=3.0)
    with raises_named("`autoencoder` must be an AbstractAutoEncoder, got 'vae'."):
        flow(autoencoder="vae")
    precisions = "('float32', 'bfloat16')"
    with raises_named(f"`precision` must be one of {precisions}, got 'float16'."):
        flow(precision="float16")
    needs_null = (
        "`guidance` needs a null condition, but `inputs` has none: pass InputSpec(null=...) or "
        "guidance=None."
    )
    with pytest.raises(ValueError, match=exact_message(needs_null)):
        flow(guidance=fg.CFG(2.0))


def test_a_velocity_of_the_wrong_shape_is_named_with_both_shapes():
    flow = fg.GuidedFlow(_times_model, fg.RectifiedFlow(), fg.InputSpec(), guidance=None)
    message = (
        "The model returned a velocity of shape (2, 4) for a latent of shape (3, 4); "
        "model(x, t, cond) must return one velocity shaped like its x."
    )
    with pytest.raises(ValueError, match=exact_message(message)):
        flow.call_model(lambda x, t, cond: x[:-1], jnp.ones((2, 3, 4)), jnp.ones(2), None)


def test_flow_matching_trains_in_float32():
    objective = fg.train.FlowMatchingObjective(
        _times_model, fg.RectifiedFlow(), fg.InputSpec(), guidance=None, cond_dropout=0.0
    )
    assert objective.flow.precision == "float32"


# --------------------------------------------------------------------------------------
# The frozen reference keeps a model's non-array fields.


class _ScaledVelocity(eqx.Module):
    weight: jax.Array
    scale: float

    def __call__(self, x, t, cond):
        return self.scale * (self.weight * x) * t


def test_the_kl_reference_keeps_non_array_fields():

    def objective(scale):
        model = _ScaledVelocity(jnp.full(objective_tests.DIM, 0.5), scale)
        return fg.FlowGRPOObjective(
            model, fg.RectifiedFlow(), fg.InputSpec(), guidance=None, beta=0.5, clip_range=0.2
        )

    batch = objective_tests.make_batch(0)
    step = fg.Step(index=0, key=jax.random.key(0))
    values = []
    for scale in (2.0, jnp.asarray(2.0)):
        variables = objective(scale).init(jax.random.key(0))
        policy = eqx.tree_at(
            lambda m: m.weight, variables.policy, jnp.full(objective_tests.DIM, 0.75)
        )
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
        objective_tests.LinearVelocity(jax.random.key(0)),
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
    with raises_named("`guard` must be a GRPOGuard or None, got 'ratio_norm'."):
        _flow_grpo(guidance=None, guard="ratio_norm")


class _LinearModel(eqx.Module):
    linear: eqx.nn.Linear

    def __call__(self, x, t, cond):
        return self.linear(x) * t


def test_the_kl_reference_of_a_lora_policy_is_its_base():

    dim = objective_tests.DIM
    base = _LinearModel(eqx.nn.Linear(dim, dim, key=jax.random.key(0)))
    adapted = lora.add(base, 2, key=jax.random.key(1))
    adapted = lora.with_adapters(
        adapted,
        jax.tree.map(lambda a: a + 0.3, lora.adapters(adapted)),
    )
    objective = fg.FlowGRPOObjective(
        base, fg.RectifiedFlow(), fg.InputSpec(), guidance=None, beta=0.5, clip_range=0.2
    )
    batch = objective_tests.make_batch(0)
    step = fg.Step(index=0, key=jax.random.key(0))
    _, with_lora = objective.loss(fg.FlowGRPOVariables(adapted, None), batch, step)
    merged = fg.FlowGRPOVariables(lora.merge(adapted), lora.without_adapters(adapted))
    _, with_held = objective.loss(merged, batch, step)
    assert float(with_lora.kl.value) > 0
    np.testing.assert_allclose(float(with_lora.kl.value), float(with_held.kl.value), rtol=1e-5)


# --------------------------------------------------------------------------------------
# FlowGRPOObjective.loss: the clip fractions count ratios strictly outside the clip range,
# and the per-transition log densities are reported when the step asks.


def _single_kept_transition(seed):

    batch = objective_tests.make_batch(seed, n=1, k=2, steps=4)
    return eqx.tree_at(lambda b: b.transition_mask, batch, jnp.asarray([[True, False]]))


@pytest.mark.parametrize("seed", [1, 5])  # ratios 0.78 and 1.32
def test_a_ratio_exactly_at_the_clip_range_is_not_clipped(seed):

    batch = _single_kept_transition(seed)
    variables = fg.FlowGRPOVariables(objective_tests.LinearVelocity(jax.random.key(1)), None)
    step = fg.Step(index=0, key=jax.random.key(0))
    _, aux = objective_tests.make_objective(clip_range=0.2).loss(variables, batch, step)
    ratio = np.float32(aux.ratio.total)
    assert float(aux.counted) == 1.0 and ratio != 1.0
    boundary = float(abs(ratio - np.float32(1.0)))  # exact in float32 for ratios in [0.5, 2]
    _, aux = objective_tests.make_objective(clip_range=boundary).loss(variables, batch, step)
    assert np.float32(aux.ratio.total) == ratio
    assert float(aux.clipfrac.total) == 0.0
    assert float(aux.clipfrac_gt_one.total) == 0.0 and float(aux.clipfrac_lt_one.total) == 0.0
    _, aux = objective_tests.make_objective(clip_range=boundary * 0.99).loss(variables, batch, step)
    assert float(aux.clipfrac.total) == 1.0
    assert float(aux.clipfrac_gt_one.total) == float(ratio > 1)
    assert float(aux.clipfrac_lt_one.total) == float(ratio < 1)


def test_the_loss_reports_log_densities_in_the_update_mode():

    objective = objective_tests.make_objective()
    variables = fg.FlowGRPOVariables(objective_tests.LinearVelocity(jax.random.key(1)), None)
    batch = objective_tests.make_batch(0)
    _, aux = objective.loss(variables, batch, fg.Step(index=0, key=jax.random.key(0)))
    assert aux.log_probs is None
    objective = objective_tests.make_objective(old_log_probs="update")
    _, aux = objective.loss(variables, batch, fg.Step(index=0, key=jax.random.key(0)))
    kept = np.asarray(objective.kept(batch))
    want = np.where(kept, np.asarray(objective.log_probs(variables, batch)), 0.0)
    np.testing.assert_allclose(np.asarray(aux.log_probs), want, rtol=1e-6, atol=1e-6)
    assert np.any(np.asarray(aux.log_probs) != 0.0)


def test_transition_allowed_makes_the_forbidden_rows_deterministic():

    objective = objective_tests.make_objective(guidance=False)
    model = objective_tests.LinearVelocity(jax.random.key(1))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(3, objective_tests.DIM)), jnp.float32)
    cond = jnp.asarray(rng.normal(size=(3, objective_tests.COND)), jnp.float32)
    t = jnp.asarray([0.75, 0.5, 0.625], jnp.float32)
    t_next = jnp.asarray([0.5, 0.25, 0.375], jnp.float32)
    allowed = jnp.asarray([True, False, True])
    mean, std = objective.transition(model, x, t, t_next, cond, allowed)
    free_mean, free_std = objective.transition(model, x, t, t_next, cond)
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


def test_a_lora_policy_holds_no_reference():

    base = _LinearModel(eqx.nn.Linear(3, 3, key=jax.random.key(0)))
    objective = fg.FlowGRPOObjective(
        lora.add(base, 2, key=jax.random.key(1)), fg.RectifiedFlow(), fg.InputSpec(),
        guidance=None, beta=0.5,
    )  # fmt: skip
    assert objective.init(jax.random.key(0)).reference is None
    frozen = fg.FlowGRPOObjective(base, fg.RectifiedFlow(), fg.InputSpec(), guidance=None, beta=0.5)
    assert frozen.init(jax.random.key(0)).reference is base


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
        objective_tests.make_objective(chunk=chunk),
        remat,
        is_leaf=lambda x: x is None,
    )
    variables = fg.FlowGRPOVariables(objective_tests.LinearVelocity(jax.random.key(1)), None)
    batch = objective_tests.make_batch(0, n=n, k=k, steps=k + 2)
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
