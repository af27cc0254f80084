"""Property tests of `group_advantages` (docs/mathematics/index.md §7), against independent
NumPy."""

import numpy as np
from hypothesis import assume, given, strategies as st
from hypothesis.extra import numpy as hnp

import flowgrpo_eqx as fg
import flowgrpo_eqx.testing as T
from tests import numpy_reference as ref


EPS = 1e-4
Batch = tuple[np.ndarray, int]  # (rewards [P * G], group size G)

_groups = st.integers(2, 6)  # a group of one sample is refused (advantage 0)
_prompts = st.integers(1, 5)
_rewards = st.floats(-100.0, 100.0, allow_nan=False, allow_infinity=False)


@st.composite
def _batches(draw: st.DrawFn, elements: st.SearchStrategy[float] = _rewards) -> Batch:
    groups = draw(_groups)
    prompts = draw(_prompts)
    rewards = draw(hnp.arrays(np.float64, (prompts * groups,), elements=elements))
    return rewards, groups


@st.composite
def _spread_batches(draw: st.DrawFn) -> Batch:
    """Groups of >= 2 well spread rewards: every group's population std is >= 0.05."""
    groups = draw(st.integers(2, 6))
    prompts = draw(_prompts)
    rewards = draw(hnp.arrays(np.float64, (prompts * groups,), elements=st.floats(-5.0, 5.0)))
    assume(np.all(rewards.reshape(prompts, groups).std(axis=1) >= 0.05))
    return rewards, groups


def _reference(rewards: np.ndarray, groups: int, std: str = "group") -> np.ndarray:
    """Mathematics §7 written out with explicit loops in float64."""
    r = np.asarray(rewards, np.float64).reshape(-1, groups)
    flat = r.reshape(-1)
    out = np.zeros_like(r)
    for p in range(r.shape[0]):
        mean = float(np.sum(r[p])) / groups
        if std == "group":
            spread = float(np.sqrt(np.sum((r[p] - mean) ** 2) / groups))
        else:
            global_mean = float(np.sum(flat)) / flat.size
            spread = float(np.sqrt(np.sum((flat - global_mean) ** 2) / flat.size))
        for i in range(groups):
            out[p, i] = (r[p, i] - mean) / (spread + EPS)
    return out.reshape(-1)


def _scale(advantages: np.ndarray) -> float:
    return max(1.0, float(np.max(np.abs(advantages)))) if advantages.size else 1.0


@T.property_settings(200)
@given(batch=_batches(), std=st.sampled_from(("group", "global")))
def test_matches_reference_and_zero_mean_per_group(batch: Batch, std: str) -> None:
    rewards, groups = batch
    got = fg.group_advantages(rewards, groups, std=std)
    assert got.dtype == np.float32
    assert got.shape == rewards.shape
    want = _reference(rewards, groups, std)
    # Constant groups are exactly zero (checked on its own below); elsewhere the reference.
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * _scale(want))
    means = got.astype(np.float64).reshape(-1, groups).mean(axis=1)
    np.testing.assert_allclose(means, 0.0, atol=1e-5 * _scale(got))


@T.property_settings(200)
@given(
    values=st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=4),
    other=_batches(),
    std=st.sampled_from(("group", "global")),
)
def test_constant_groups_are_exactly_zero(values: list[float], other: Batch, std: str) -> None:
    # Constant groups placed before arbitrary groups of the same size.
    other_rewards, groups = other
    rewards = np.concatenate([np.full(groups, v) for v in values] + [other_rewards])
    got = fg.group_advantages(rewards, groups, std=std)
    constant = got[: len(values) * groups]
    assert np.all(constant == 0.0), constant


@T.property_settings(100)
@given(
    value=st.floats(-1e6, 1e6),
    groups=_groups,
    prompts=_prompts,
    std=st.sampled_from(("group", "global")),
)
def test_all_constant_batch_is_exactly_zero(
    value: float, groups: int, prompts: int, std: str
) -> None:
    rewards = np.full(prompts * groups, value)
    got = fg.group_advantages(rewards, groups, std=std)
    assert np.all(got == 0.0)


@T.property_settings(150)
@given(
    batch=_spread_batches(),
    a=st.floats(0.1, 10.0),
    b=st.floats(-100.0, 100.0),
)
def test_invariant_to_positive_affine_maps(batch: Batch, a: float, b: float) -> None:
    rewards, groups = batch
    base = fg.group_advantages(rewards, groups)
    mapped = fg.group_advantages(a * rewards + b, groups)
    # (r - m) / (s + eps) against a (r - m) / (a s + eps): they differ by the relative
    # amount eps |1/a - 1| / s at most, s >= 0.05 the smallest group std.
    s_min = float(rewards.reshape(-1, groups).std(axis=1).min())
    rtol = 2 * EPS * abs(1 / a - 1) / s_min + 1e-6
    np.testing.assert_allclose(mapped, base, rtol=rtol, atol=1e-5 * _scale(base))


@T.property_settings(150)
@given(
    first=hnp.arrays(np.float64, st.integers(2, 6), elements=st.floats(-10, 10)),
    data=st.data(),
    std=st.just("group"),
)
def test_groups_with_equal_rewards_are_not_merged(
    first: np.ndarray, data: st.DataObject, std: str
) -> None:
    """Two groups sharing reward values: each is normalised on its own, as if alone."""
    groups = first.size
    # The second group reuses some of the first's values (the same "prompt" outcomes).
    pool = np.concatenate([first, np.array([-3.0, 0.0, 7.5])])
    picks = data.draw(st.lists(st.integers(0, pool.size - 1), min_size=groups, max_size=groups))
    second = pool[np.asarray(picks)]
    together = fg.group_advantages(np.concatenate([first, second]), groups)
    alone = np.concatenate(
        [fg.group_advantages(first, groups), fg.group_advantages(second, groups)]
    )
    np.testing.assert_allclose(together, alone, rtol=1e-6, atol=1e-6)
    # Rows holding an equal reward in the two groups get their own group's advantage.
    want = np.concatenate([_reference(first, groups), _reference(second, groups)])
    constant = np.repeat([np.all(first == first[0]), np.all(second == second[0])], groups)
    want[constant] = 0.0
    np.testing.assert_allclose(together, want, rtol=1e-6, atol=1e-6 * _scale(want))


@T.property_settings(150)
@given(batch=_batches(), data=st.data(), std=st.sampled_from(("group", "global")))
def test_permutation_equivariant_within_groups(batch: Batch, data: st.DataObject, std: str) -> None:
    rewards, groups = batch
    prompts = rewards.size // groups
    perm = np.concatenate(
        [
            p * groups + np.asarray(data.draw(st.permutations(range(groups))), dtype=np.int64)
            for p in range(prompts)
        ]
    )
    base = fg.group_advantages(rewards, groups, std=std)
    permuted = fg.group_advantages(rewards[perm], groups, std=std)
    np.testing.assert_allclose(permuted, base[perm], rtol=1e-6, atol=1e-6 * _scale(base))


@T.property_settings(100)
@given(batch=_spread_batches())
def test_global_std_is_population_std_of_whole_batch(batch: Batch) -> None:
    rewards, groups = batch
    got = fg.group_advantages(rewards, groups, std="global")
    grouped = rewards.reshape(-1, groups)
    centred = grouped - grouped.mean(axis=1, keepdims=True)
    want = (centred / (np.std(rewards, ddof=0) + EPS)).reshape(-1)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * _scale(want))
    # ... which differs from the per-group normalisation whenever group spreads differ.
    per_group = fg.group_advantages(rewards, groups, std="group")
    spreads = grouped.std(axis=1)
    if np.ptp(spreads) > 1e-3 * spreads.max() and grouped.shape[0] > 1:
        assert not np.allclose(got, per_group, rtol=1e-4, atol=1e-6)


@T.property_settings(150)
@given(batch=T.reward_groups(), std=st.sampled_from(("group", "global")))
def test_public_invariants_on_groups_with_ties_and_constant_groups(batch: Batch, std: str) -> None:
    rewards, groups = batch
    T.assert_group_advantages_invariants(rewards, groups, std=std)
    # ... and the float64 statement of mathematics §7 (constant groups exactly 0).
    np.testing.assert_allclose(
        fg.group_advantages(rewards, groups, std=std),
        ref.group_advantages(rewards, groups, std=std),
        rtol=1e-6,
        atol=1e-6 * _scale(ref.group_advantages(rewards, groups, std=std)),
    )


@T.property_settings(100)
@given(
    first=_spread_batches(),
    data=st.data(),
    scales=st.lists(st.floats(1e-3, 1e3), min_size=2, max_size=2),
    offsets=st.lists(st.floats(-1e3, 1e3), min_size=2, max_size=2),
    weights=st.lists(st.floats(-3.0, 3.0), min_size=2, max_size=2),
)
def test_per_reward_normalisation_ignores_each_rewards_affine_scale(
    first: Batch,
    data: st.DataObject,
    scales: list[float],
    offsets: list[float],
    weights: list[float],
) -> None:
    """With `eps = 0`, `r_k -> a_k r_k + b_k` (`a_k > 0`) leaves the advantages unchanged."""
    rewards, groups = first
    second = data.draw(
        hnp.arrays(np.float64, rewards.shape, elements=st.floats(-5.0, 5.0)), label="second"
    )
    assume(np.all(second.reshape(-1, groups).std(axis=1) >= 0.05))
    components = np.stack([rewards, second])
    rescaled = np.asarray(scales)[:, None] * components + np.asarray(offsets)[:, None]
    plain = fg.per_reward_advantages(components, weights, groups, eps=0.0)
    moved = fg.per_reward_advantages(rescaled, weights, groups, eps=0.0)
    np.testing.assert_allclose(moved, plain, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(
        plain, ref.per_reward_advantages(components, weights, groups, eps=0.0), atol=1e-5
    )
