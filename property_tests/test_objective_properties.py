"""Property tests of `FlowGRPOObjective.loss` / `log_probs` (docs/mathematics/flow_grpo.md §5, §6).

The model is a tiny MLP defined in `_strategies.py`; batches are rollout-like (next latents
sampled from the configuration's own transitions). See `_strategies.py` for why shapes and
configurations come from small sets.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import assume, given, strategies as st

import flowgrpo_eqx.testing as T
from property_tests import _strategies as S
from tests.tolerances import rollout_log_prob_tolerance


# --------------------------------------------------------------------------------------
# 1. The denominator is the kept count: mask AND stochastic.


@st.composite
def _count_cases(draw: st.DrawFn) -> tuple[S.Config, int, float]:
    kind = draw(st.sampled_from(("flow", "cps")))
    steps = draw(st.sampled_from((4, 6)))
    shift = draw(st.sampled_from((1.0, 3.0)))
    transitions = steps - 1
    if draw(st.integers(0, 5)) == 0:
        window = None
        noise_level = draw(st.sampled_from((0.0, 0.7)))
    else:
        first = draw(st.integers(0, transitions - 1))
        count = draw(st.integers(1, transitions - first))
        window = (first, count)
        noise_level = 0.7
    config = S.Config(
        "count",
        kind=kind,
        noise_level=noise_level,
        steps=steps,
        shift=shift,
        window_indices=window,
        dim=4,
    )
    return config, draw(T.seeds()), draw(st.sampled_from(T.MASK_PROBABILITIES))


@T.property_settings(25)
@given(case=_count_cases())
def test_denominator_is_the_kept_stochastic_count(case: tuple[S.Config, int, float]) -> None:
    config, seed, mask_p = case
    rows, transitions = 3, 4
    rollout = S.make_rollout(config, seed, rows, transitions, mask_p=mask_p)
    batch = rollout.batch
    mask = np.asarray(batch.transition_mask)

    # Independent expectation from the grid times and the window rule.
    t = np.asarray(batch.timesteps)
    t_next = np.asarray(batch.next_timesteps)
    expected = S.kept_numpy(mask, t, t_next, config.noise_level, config.kind, config.window)
    # ... and once more from the grid indices alone.
    by_index = np.full(mask.shape, config.noise_level > 0)
    if config.window_indices is not None:
        first, count = config.window_indices
        by_index &= (rollout.indices >= first) & (rollout.indices < first + count)
    if config.kind == "cps":
        by_index &= rollout.indices < config.steps - 2
    np.testing.assert_array_equal(expected, mask & by_index)

    obj = config.objective()
    total, aux = T.loss_only(obj, config.variables(obj), batch)
    want = float(expected.sum())
    assert float(total.count) == want
    assert float(aux.counted) == want
    for name in ("policy_loss", "kl", "clipfrac", "clipfrac_gt_one", "clipfrac_lt_one"):
        assert float(getattr(aux, name).count) == want, name
    assert np.isfinite(float(total.value))
    if want == 0:
        assert float(total.value) == 0.0
        assert float(total.total) == 0.0

    # The objective's own kept set agrees entry by entry, and so does the public invariant.
    np.testing.assert_array_equal(np.asarray(obj.kept(batch)), expected)
    T.assert_denominator_is_kept_count(obj, config.variables(obj), batch)


# --------------------------------------------------------------------------------------
# 2. Masked entries holding NaN / inf change neither value nor gradient.

_poisons = st.sampled_from((math.nan, math.inf, -math.inf, 3e38))


@T.property_settings(30)
@given(
    config=S.configs,
    shape=st.sampled_from(T.SHAPES),
    seed=T.seeds(),
    mask_p=st.sampled_from((0.0, 0.4, 0.8)),
    per_transition=st.booleans(),
    poisons=st.fixed_dictionaries({f: _poisons for f in T.TRANSITION_FIELDS[:5] + ("advantages",)}),
)
def test_masked_entries_never_leak(
    config: S.Config,
    shape: tuple[int, int],
    seed: int,
    mask_p: float,
    per_transition: bool,
    poisons: dict[str, float],
) -> None:
    rows, transitions = shape
    rollout = S.make_rollout(
        config, seed, rows, transitions, mask_p=mask_p, per_transition_advantages=per_transition
    )
    batch = rollout.batch
    masked = ~np.asarray(batch.transition_mask)

    def poison(field: str, where: np.ndarray) -> jax.Array:
        value = np.array(getattr(batch, field))
        value[where] = poisons[field]
        return jnp.asarray(value)

    advantage_where: np.ndarray = masked
    if not per_transition:
        advantage_where = np.all(masked, axis=1)  # an [N] advantage only of wholly masked rows
    bad = T.replace_fields(
        batch,
        latents=poison("latents", masked),
        next_latents=poison("next_latents", masked),
        timesteps=poison("timesteps", masked),
        next_timesteps=poison("next_timesteps", masked),
        old_log_probs=poison("old_log_probs", masked),
        advantages=poison("advantages", advantage_where),
    )

    obj = config.objective()
    variables = config.variables(obj)
    value, total, aux, grad = T.loss_value_and_grad(obj, variables, batch)
    bad_value, bad_total, bad_aux, bad_grad = T.loss_value_and_grad(obj, variables, bad)

    assert np.isfinite(float(bad_value))
    assert T.all_finite(bad_grad)
    assert float(bad_value) == float(value)
    assert float(bad_total.count) == float(total.count) == float(rollout.kept.sum())
    for leaf, bad_leaf in zip(jax.tree.leaves(aux), jax.tree.leaves(bad_aux), strict=True):
        np.testing.assert_array_equal(np.asarray(bad_leaf), np.asarray(leaf))
    T.assert_trees_equal(bad_grad, grad)

    if rollout.kept.sum() == 0:  # D = 0: loss 0 and zero gradients, never NaN
        assert float(bad_value) == 0.0
        assert all(np.all(g == 0) for g in T.gradient_leaves(bad_grad))
    # The public invariant poisons the conditioning of unkept rows as well.
    T.assert_masked_entries_inert(obj, variables, batch, poison=poisons["latents"])


# --------------------------------------------------------------------------------------
# 3. Invariance to row permutation and to duplicating the batch.


@T.property_settings(25)
@given(
    config=S.configs,
    shape=st.sampled_from(T.SHAPES),
    seed=T.seeds(),
    per_transition=st.booleans(),
    data=st.data(),
)
def test_row_permutation_invariance(
    config: S.Config,
    shape: tuple[int, int],
    seed: int,
    per_transition: bool,
    data: st.DataObject,
) -> None:
    rows, transitions = shape
    rollout = S.make_rollout(
        config, seed, rows, transitions, mask_p=0.8, per_transition_advantages=per_transition
    )
    perm = np.asarray(data.draw(st.permutations(range(rows))), dtype=np.int32)
    obj = config.objective()
    T.assert_row_permutation_invariant(obj, config.variables(obj), rollout.batch, perm)


@T.property_settings(20)
@given(
    config=S.configs, shape=st.sampled_from(T.SHAPES), seed=T.seeds(), per_transition=st.booleans()
)
def test_duplicated_batch_doubles_total_and_count(
    config: S.Config, shape: tuple[int, int], seed: int, per_transition: bool
) -> None:
    rows, transitions = shape
    rollout = S.make_rollout(
        config, seed, rows, transitions, mask_p=0.8, per_transition_advantages=per_transition
    )
    obj = config.objective()
    T.assert_duplication_doubles_total(obj, config.variables(obj), rollout.batch)


# --------------------------------------------------------------------------------------
# 4. clipfrac = clipfrac_gt_one + clipfrac_lt_one, against an independent count.


def _log_ratios(rng: np.random.Generator, shape: tuple[int, int], clip: float) -> np.ndarray:
    """Log ratios in [-0.4, 0.4], none within 2e-3 of a clip boundary."""
    u = rng.uniform(-0.4, 0.4, size=shape)
    near = np.abs(np.abs(np.expm1(u)) - clip) < 2e-3
    return np.where(near, u + 0.01, u)


@T.property_settings(25)
@given(
    config=S.configs,
    shape=st.sampled_from(T.SHAPES),
    seed=T.seeds(),
    mask_p=st.sampled_from(T.MASK_PROBABILITIES),
    per_transition=st.booleans(),
)
def test_clipfrac_decomposes_and_matches_numpy(
    config: S.Config,
    shape: tuple[int, int],
    seed: int,
    mask_p: float,
    per_transition: bool,
) -> None:
    rows, transitions = shape
    rollout = S.make_rollout(
        config, seed, rows, transitions, mask_p=mask_p, per_transition_advantages=per_transition
    )
    obj = config.objective()
    variables = config.variables(obj)
    own = np.asarray(T.log_probs(obj, variables, rollout.batch))
    u = _log_ratios(np.random.default_rng(seed), shape, config.clip_range)
    batch = T.replace_fields(rollout.batch, old_log_probs=jnp.asarray(own - u, jnp.float32))
    _, total, aux, _ = T.loss_value_and_grad(obj, variables, batch)

    kept = rollout.kept
    ratio = np.exp(u)
    gt = kept & (ratio - 1 > config.clip_range)
    lt = kept & (1 - ratio > config.clip_range)
    assert float(aux.clipfrac_gt_one.total) == float(gt.sum())
    assert float(aux.clipfrac_lt_one.total) == float(lt.sum())
    assert float(aux.clipfrac.total) == float((gt | lt).sum())
    clipfrac = float(aux.clipfrac.value)
    gt_value = float(aux.clipfrac_gt_one.value)
    lt_value = float(aux.clipfrac_lt_one.value)
    np.testing.assert_allclose(clipfrac, gt_value + lt_value, rtol=1e-6, atol=1e-7)
    for fraction in (clipfrac, gt_value, lt_value):
        assert 0.0 <= fraction <= 1.0
    if kept.any():
        np.testing.assert_allclose(float(aux.ratio.value), ratio[kept].mean(), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(
            float(aux.approx_kl.value), (0.5 * u[kept] ** 2).mean(), rtol=1e-3, atol=1e-5
        )


# --------------------------------------------------------------------------------------
# 5. An unchanged policy rescored on its own log probs has ratio 1.


@T.property_settings(25)
@given(
    config=S.configs,
    shape=st.sampled_from(T.SHAPES),
    seed=T.seeds(),
    per_transition=st.booleans(),
)
def test_unchanged_policy_has_ratio_one(
    config: S.Config, shape: tuple[int, int], seed: int, per_transition: bool
) -> None:
    rows, transitions = shape
    rollout = S.make_rollout(
        config, seed, rows, transitions, mask_p=1.0, per_transition_advantages=per_transition
    )
    obj = config.objective()
    variables = config.variables(obj)
    T.assert_unchanged_policy_ratio_one(obj, variables, rollout.batch)
    own = T.log_probs(obj, variables, rollout.batch)
    batch = T.replace_fields(rollout.batch, old_log_probs=own)
    _, total, aux, _ = T.loss_value_and_grad(obj, variables, batch)
    kept = rollout.kept
    assume(kept.any())
    assert float(aux.approx_kl.value) <= 1e-11
    # With r = 1 the surrogate is -clip(A): the policy loss is minus the mean kept advantage.
    advantages = np.asarray(rollout.batch.advantages, np.float64)
    if advantages.ndim == 1:
        advantages = np.repeat(advantages[:, None], transitions, axis=1)
    advantages = np.clip(advantages, -config.adv_clip_max, config.adv_clip_max)
    np.testing.assert_allclose(
        float(aux.policy_loss.value), -advantages[kept].mean(), rtol=1e-5, atol=2e-6
    )
    # Deterministic transitions score exactly 0.
    stochastic = S.kept_numpy(
        np.ones(kept.shape, bool),
        np.asarray(batch.timesteps),
        np.asarray(batch.next_timesteps),
        config.noise_level,
        config.kind,
        config.window,
    )
    assert np.all(np.asarray(own)[~stochastic] == 0.0)


# --------------------------------------------------------------------------------------
# 6. Transitions clipped in the advantage's direction give exactly zero gradient.


@T.property_settings(25)
@given(
    config=st.sampled_from(S.BETA_FREE_CONFIGS + (S.CONFIGS[1].replace(beta=0.0),)),
    shape=st.sampled_from(T.SHAPES),
    seed=T.seeds(),
    per_transition=st.booleans(),
    mask_p=st.sampled_from((0.5, 1.0)),
)
def test_clipped_in_advantage_direction_has_zero_gradient(
    config: S.Config,
    shape: tuple[int, int],
    seed: int,
    per_transition: bool,
    mask_p: float,
) -> None:
    rows, transitions = shape
    rollout = S.make_rollout(
        config, seed, rows, transitions, mask_p=mask_p, per_transition_advantages=per_transition
    )
    rng = np.random.default_rng(seed)
    obj = config.objective()
    variables = config.variables(obj)
    own = np.asarray(T.log_probs(obj, variables, rollout.batch))
    clip = config.clip_range

    # The direction of each advantage (per row or per transition), and its magnitude (some
    # beyond adv_clip_max).
    direction = rng.choice((-1.0, 1.0), size=(rows, transitions) if per_transition else (rows,))
    magnitude = rng.uniform(0.2, 8.0, size=direction.shape)
    advantage = direction * magnitude
    per_entry = direction if per_transition else np.repeat(direction[:, None], transitions, 1)
    margin = rng.uniform(0.02, 0.5, size=(rows, transitions))
    # r > 1 + clip where A > 0 and r < 1 - clip where A < 0.
    u = np.where(per_entry > 0, math.log1p(clip) + margin, math.log1p(-clip) - margin)
    old = jnp.asarray(own - u, jnp.float32)

    aligned = T.replace_fields(rollout.batch, old_log_probs=old, advantages=jnp.asarray(advantage))
    value, total, aux, grad = T.loss_value_and_grad(obj, variables, aligned)
    assert all(np.all(g == 0) for g in T.gradient_leaves(grad)), "clipped transitions leak gradient"
    kept = rollout.kept
    if kept.any():
        entry = advantage if per_transition else np.repeat(advantage[:, None], transitions, 1)
        a = np.clip(entry, -config.adv_clip_max, config.adv_clip_max)
        want = (-a * (1 + per_entry * clip))[kept].mean()
        np.testing.assert_allclose(float(value), want, rtol=1e-5, atol=1e-6)
        assert float(aux.clipfrac.value) == 1.0

    opposite = T.replace_fields(aligned, advantages=jnp.asarray(-advantage))
    _, _, _, opposite_grad = T.loss_value_and_grad(obj, variables, opposite)
    assert T.all_finite(opposite_grad)
    assume(kept.any())
    largest = max(float(np.max(np.abs(g))) for g in T.gradient_leaves(opposite_grad))
    assert largest > 1e-6, "unclipped transitions give no gradient"


# --------------------------------------------------------------------------------------
# log_probs scores each entry as the SDE's mean-coordinate Gaussian density (mathematics §3).


@T.property_settings(25)
@given(config=S.configs, shape=st.sampled_from(T.SHAPES), seed=T.seeds())
def test_log_probs_match_numpy_per_entry(
    config: S.Config, shape: tuple[int, int], seed: int
) -> None:
    rows, transitions = shape
    rollout = S.make_rollout(config, seed, rows, transitions)
    obj = config.objective()
    got = np.asarray(T.log_probs(obj, config.variables(obj), rollout.batch))
    assert got.shape == (rows, transitions)
    rtol, atol = rollout_log_prob_tolerance()
    np.testing.assert_allclose(got, rollout.own, rtol=rtol, atol=atol)


# --------------------------------------------------------------------------------------
# 10. transition_chunk does not change the loss or its gradient.


@T.property_settings(12)
@given(
    config=st.sampled_from((S.CONFIGS[1], S.CONFIGS[3])),
    shape=st.sampled_from(T.SHAPES[:2]),
    seed=T.seeds(),
    chunk=st.sampled_from((1, 2)),
    mask_p=st.sampled_from((0.8, 1.0)),
)
def test_transition_chunk_agrees(
    config: S.Config, shape: tuple[int, int], seed: int, chunk: int, mask_p: float
) -> None:
    rows, transitions = shape
    rollout = S.make_rollout(
        config, seed, rows, transitions, mask_p=mask_p, per_transition_advantages=True
    )
    whole = config.objective()
    chunked = config.objective(transition_chunk=chunk)
    variables = config.variables(whole)
    T.assert_transition_chunk_agrees(whole, chunked, variables, rollout.batch)
    # Entry by entry, both agree with the sample's own NumPy log density.
    rtol, atol = rollout_log_prob_tolerance()
    for obj in (whole, chunked):
        np.testing.assert_allclose(
            np.asarray(T.log_probs(obj, variables, rollout.batch)),
            rollout.own,
            rtol=rtol,
            atol=atol,
        )


# --------------------------------------------------------------------------------------
# The public strategy of `flowgrpo_eqx.testing`: batches sampled by the objective itself.

_SAMPLED = S.CONFIGS[1]  # a window (deterministic intervals), guidance and a KL reference
_SAMPLED_OBJECTIVE = _SAMPLED.objective()
_SAMPLED_VARIABLES = _SAMPLED.variables(_SAMPLED_OBJECTIVE)


@T.property_settings(15)
@given(
    batch=T.transitions(_SAMPLED_OBJECTIVE, _SAMPLED_VARIABLES, steps=_SAMPLED.steps),
    poison=st.sampled_from((math.nan, math.inf, -math.inf)),
)
def test_invariants_hold_on_batches_the_objective_samples(batch, poison: float) -> None:
    obj, variables = _SAMPLED_OBJECTIVE, _SAMPLED_VARIABLES
    T.assert_denominator_is_kept_count(obj, variables, batch)
    T.assert_masked_entries_inert(obj, variables, batch, poison=poison)
    T.assert_unchanged_policy_ratio_one(obj, variables, batch)
    # Sampled from the grid: deterministic intervals (outside the window) occur and score 0.
    stochastic = S.kept_numpy(
        np.ones(batch.transition_mask.shape, bool),
        np.asarray(batch.timesteps),
        np.asarray(batch.next_timesteps),
        _SAMPLED.noise_level,
        _SAMPLED.kind,
        _SAMPLED.window,
    )
    own = np.asarray(T.log_probs(obj, variables, batch))
    assert np.all(own[~stochastic] == 0.0)
    assert np.all(own[stochastic] != 0.0)
