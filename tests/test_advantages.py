import numpy as np
import pytest

import flowgrpo_eqx as fg
from tests import numpy_reference as ref
from tests.errors import NAMED_ARGUMENT_ERRORS


@pytest.mark.parametrize("groups", [1, 2, 4, 7])
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
