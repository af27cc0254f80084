import jax.numpy as jnp
import numpy as np
import pytest

import flowgrpo_eqx as fg
from flowgrpo_eqx._advantages import check_std
from tests import numpy_reference as ref
from tests.errors import NAMED_ARGUMENT_ERRORS, exact_message


@pytest.mark.parametrize("groups", [2, 4, 7])
@pytest.mark.parametrize("std", ["group", "global"])
def test_matches_numpy_statement(groups, std):
    rng = np.random.default_rng(groups)
    rewards = rng.normal(size=groups * 5) * 3.0 + 1.0
    rewards[:groups] = 0.25  # one constant group
    got = fg.group_advantages(rewards, groups=groups, std=std)
    assert got.dtype == np.float32 and got.shape == rewards.shape
    np.testing.assert_allclose(
        got, ref.group_advantages(rewards, groups, 1e-4, std), rtol=1e-6, atol=1e-6
    )
    assert np.all(got[:groups] == 0.0)


def test_float64_resolution_is_kept():
    rewards = 1.0 + 1e-8 * np.arange(8, dtype=np.float64)
    got = fg.group_advantages(rewards, groups=4)
    want = ref.group_advantages(rewards, 4)
    np.testing.assert_allclose(got, want.astype(np.float32), rtol=1e-6)
    # float32 rewards would collapse these eight values onto at most two.
    assert len(np.unique(np.float32(rewards))) <= 2 < len(np.unique(rewards))
    assert np.all(
        np.diff(got.reshape(2, 4), axis=1) > 0
    )  # every distinct float64 reward keeps its own advantage


def test_equal_rows_in_different_groups_do_not_merge():
    rewards = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    got = fg.group_advantages(rewards, groups=3)
    np.testing.assert_allclose(got[:3], got[3:], rtol=1e-6)
    np.testing.assert_allclose(got[:3], ref.group_advantages(rewards[:3], 3), rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"rewards": np.zeros((2, 2)), "groups": 2}, "rewards"),
        ({"rewards": np.zeros(5), "groups": 2}, "groups"),
        ({"rewards": np.zeros(4), "groups": 0}, "groups"),
        ({"rewards": np.zeros(4), "groups": 2, "std": "batch"}, "std"),
        ({"rewards": np.zeros(4), "groups": 2, "eps": -1.0}, "eps"),
        ({"rewards": np.zeros(4), "groups": 2, "eps": np.inf}, "eps"),
        ({"rewards": np.zeros(0), "groups": 2}, "rewards"),
        ({"rewards": np.array([0.0, np.nan]), "groups": 2}, "rewards"),
    ],
)
def test_bad_arguments_named(kwargs, name):
    with pytest.raises(NAMED_ARGUMENT_ERRORS, match=name):
        fg.group_advantages(**kwargs)


def test_per_reward_normalisation_matches_numpy_statement():
    rng = np.random.default_rng(3)
    # Three rewards on very different scales; the second group of the first reward is constant.
    components = np.stack(
        [rng.normal(size=12), 1e4 * rng.normal(size=12), 1e-3 * rng.normal(size=12) + 7.0]
    )
    components[0, 4:8] = 2.5
    weights = np.array([1.0, 0.5, -2.0])
    got = fg.per_reward_advantages(components, weights, 4)
    assert got.dtype == np.float32
    np.testing.assert_allclose(
        got, ref.per_reward_advantages(components, weights, 4), rtol=1e-6, atol=1e-6
    )
    # Every reward constant within a group: that group's advantages are exactly zero.
    components[:, 8:] = components[:, 8:9]
    assert np.all(fg.per_reward_advantages(components, weights, 4)[8:] == 0.0)


@pytest.mark.parametrize(
    "components, weights, name",
    [
        (np.zeros(8), [1.0], "components"),
        (np.zeros((2, 8)), [1.0], "weights"),
        (np.zeros((2, 8)), [1.0, np.inf], "weights"),
        (np.zeros((1, 7)), [1.0], "groups"),
    ],
)
def test_per_reward_bad_arguments_named(components, weights, name):
    with pytest.raises(ValueError, match=name):
        fg.per_reward_advantages(components, weights, 4)


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
    for groups in (0, 1):
        with pytest.raises(ValueError, match=f"^`groups` must be an int >= 2, got {groups}: "):
            fg.group_advantages(np.zeros(4), groups=groups)


def test_non_finite_message_names_the_rows():
    rewards = np.array([0.0, np.nan, 1.0, np.inf])
    with pytest.raises(ValueError, match=r"non-finite values at rows \[1, 3\]"):
        fg.group_advantages(rewards, groups=2)


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
# The unbiased statistics of DanceGRPO and of UniRL's Flow-DPPO recipe (torch's
# `x.std() + 1e-8`), against their float64 statements.

RELEASED_UNBIASED = {
    "group_unbiased": ref.dancegrpo_advantages,
    "global_unbiased": ref.unirl_global_std_advantages,
}


@pytest.mark.parametrize("std", sorted(RELEASED_UNBIASED))
@pytest.mark.parametrize("groups, prompts, spread", [(16, 48, 1.0), (16, 48, 0.02), (4, 6, 1.0)])
def test_unbiased_statistics_are_the_releases(std, groups, prompts, spread):
    rng = np.random.default_rng(groups + prompts)
    rewards = rng.normal(size=groups * prompts) * spread + 0.5
    got = fg.group_advantages(rewards, groups, std=std)
    want = RELEASED_UNBIASED[std](rewards, groups)
    # A float32 cast of the float64 statement: agreement to float32 round-off.
    np.testing.assert_allclose(got, want, rtol=2e-7, atol=2e-7)
    device = np.asarray(
        fg.device_group_advantages(jnp.asarray(rewards, jnp.float32), groups, std=std)
    )
    np.testing.assert_allclose(device, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_the_population_statistic_is_not_the_release_of_flow_dppo():
    # What `"global"` (population std + 1e-4) moves against UniRL's `"global_unbiased"`: more
    # than float32 round-off, so Flow-DPPO's recipe needs the unbiased one.
    rng = np.random.default_rng(0)
    for prompts, groups, spread, least in (
        (48, 16, 1.0, 4e-4),
        (48, 16, 0.02, 3e-3),
        (6, 4, 1.0, 1e-2),
    ):
        rewards = rng.normal(size=prompts * groups) * spread
        population = fg.group_advantages(rewards, groups, std="global")
        unbiased = ref.unirl_global_std_advantages(rewards, groups)
        moved = np.max(np.abs(population - unbiased)) / np.max(np.abs(unbiased))
        assert moved > least, (prompts, groups, spread, moved)


def test_reward_advantages_are_each_terms_group_advantages():
    rng = np.random.default_rng(5)
    components = np.stack([rng.normal(size=12), 3.0 * rng.normal(size=12)])
    got = fg.reward_advantages(components, 4, std="group_unbiased")
    assert got.shape == (2, 12) and got.dtype == np.float32
    for term, row in zip(got, components, strict=True):
        np.testing.assert_allclose(term, ref.dancegrpo_advantages(row, 4), rtol=2e-7, atol=2e-7)
    weights = np.array([1.0, 0.5])
    np.testing.assert_allclose(
        weights @ got.astype(np.float64),
        fg.per_reward_advantages(components, weights, 4, std="group_unbiased"),
        rtol=1e-6,
        atol=1e-6,
    )
    with pytest.raises(
        ValueError, match=exact_message("`components` must have shape [R, N], got (4,).")
    ):
        fg.reward_advantages(np.zeros(4), groups=2)


def test_an_unknown_std_is_refused_with_the_choices():
    message = (
        "`std` must be one of 'group', 'global', 'group_unbiased', 'global_unbiased', got 'batch'."
    )
    with pytest.raises(ValueError, match=exact_message(message)):
        check_std("batch")
    with pytest.raises(NAMED_ARGUMENT_ERRORS, match="std"):
        fg.group_advantages(np.zeros(4), groups=2, std="batch")
