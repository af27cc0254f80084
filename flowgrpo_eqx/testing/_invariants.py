"""Invariants of objectives, SDEs and advantages, as assertions a user's tests can call.

They state properties, not formulas. Every objective (`AbstractRLObjective`): its loss and
gradient are finite, zero advantages give a zero policy gradient at initialisation where the
loss is a policy gradient, one update moves the policy's trainable part alone, and the
rollout's advantages are normalised within their groups. An objective whose loss rescores
recorded transitions (`AbstractTransitionObjective`) besides: a rescored unchanged policy
has ratio 1 and clips nothing, masked entries are inert, the denominator is the kept count,
a permutation of rows changes nothing. Each raises `AssertionError` with what differed; each
returns nothing.
"""

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jaxtyping import ArrayLike

from .._advantages import group_advantages
from .._custom_types import Mean, Transitions
from .._process import AbstractProcess
from .._sde import AbstractSDE
from ..objectives import AbstractRLObjective, AbstractTransitionObjective, AbstractVariables
from ..train import Trainer
from ._helpers import (
    all_finite,
    assert_trees_close,
    assert_trees_equal,
    gradient_leaves,
    log_probs,
    loss_only,
    loss_value_and_grad,
    map_rows,
    replace_fields,
)
from ._strategies import CollectedBatch


def _is_transitions(node: Any) -> bool:
    return isinstance(node, Transitions)


def recorded_transitions(batch: Any) -> Transitions:
    """The `Transitions` a transition objective's training batch holds: the batch itself
    (Flow-GRPO, Flow-DPPO) or the one inside it (DanceGRPO's `RewardTransitions`).

    **Raises:**

    - `ValueError`: naming `batch`, when it holds no `Transitions` or more than one.
    """
    found = [
        node
        for node in jax.tree.leaves(batch, is_leaf=_is_transitions)
        if isinstance(node, Transitions)
    ]
    if len(found) != 1:
        raise ValueError(
            f"`batch` must hold one Transitions, found {len(found)} in {type(batch).__name__}."
        )
    return found[0]


def with_transitions(batch: Any, transitions: Transitions) -> Any:
    """`batch` with its `Transitions` (`recorded_transitions`) replaced by `transitions`."""
    return jax.tree.map(
        lambda node: transitions if _is_transitions(node) else node,
        batch,
        is_leaf=_is_transitions,
    )


def aux_means(aux: Any) -> dict[str, Mean]:
    """The `Mean` statistics a loss reports, by field name (the metrics of its aux)."""
    if not dataclasses.is_dataclass(aux):
        return {}
    fields = ((f.name, getattr(aux, f.name)) for f in dataclasses.fields(aux))
    return {name: value for name, value in fields if isinstance(value, Mean)}


def _stochastic(
    objective: AbstractTransitionObjective[Any, Any], batch: Transitions
) -> npt.NDArray[np.bool_]:
    return np.asarray(objective.sde.is_stochastic(batch.timesteps, batch.next_timesteps))


# ------------------------------------------------------------------------------------------
# Every objective.


def assert_loss_finite(
    objective: AbstractRLObjective[Any, Any], variables: AbstractVariables, batch: Any
) -> None:
    """The loss, every `Mean` statistic it reports, and its gradient with respect to the
    policy are finite.

    **Arguments:**

    - `objective`, `variables`: any RL objective and its variables.
    - `batch`: what its loss trains on (`CollectedBatch.batch`).
    """
    value, total, aux, grad = loss_value_and_grad(objective, variables, batch)
    assert math.isfinite(float(value)), f"loss {float(value)}"
    assert float(total.count) >= 0, float(total.count)
    for name, mean in aux_means(aux).items():
        assert math.isfinite(float(mean.value)), f"{name}: {float(mean.value)}"
    assert all_finite(grad), "non-finite gradient"


def _zero_advantages(batch: Any) -> Any:
    zeroed = eqx.tree_at(lambda b: b.advantages, batch, jnp.zeros_like(batch.advantages))
    if isinstance(batch, Transitions):
        return zeroed
    inner = recorded_transitions(zeroed)
    return with_transitions(
        zeroed, replace_fields(inner, advantages=jnp.zeros_like(inner.advantages))
    )


def assert_zero_advantages_zero_gradient(
    objective: AbstractTransitionObjective[Any, Any],
    variables: AbstractVariables,
    batch: Any,
    *,
    atol: float = 1e-6,
) -> None:
    """With every advantage 0, the policy gradient at initialisation is 0: the surrogate
    vanishes, and a KL or divergence term is at its minimum where the policy is its own
    reference and old policy.

    **Arguments:**

    - `objective`: an `AbstractTransitionObjective` (a policy-gradient loss).
    - `variables`: its variables at `init` (policy, reference and old policy equal).
    - `batch`: its training batch, recorded by the same policy.
    - `atol`: the largest allowed gradient entry.
    """
    value, _, _, grad = loss_value_and_grad(objective, variables, _zero_advantages(batch))
    assert math.isfinite(float(value)), float(value)
    largest = max([float(np.max(np.abs(g))) for g in gradient_leaves(grad) if g.size] + [0.0])
    assert largest <= atol, f"largest gradient entry {largest} with zero advantages"


def _host_arrays(tree: Any, prefix: str) -> dict[str, npt.NDArray[Any]]:
    leaves = jax.tree_util.tree_leaves_with_path(eqx.filter(tree, eqx.is_array))
    return {prefix + jax.tree_util.keystr(path): np.array(leaf) for path, leaf in leaves}


def _frozen(trainer: Trainer, variables: AbstractVariables) -> dict[str, npt.NDArray[Any]]:
    arrays = _host_arrays(trainer.split_policy(variables.policy)[1], "policy")
    for field in dataclasses.fields(variables):
        if field.name != "policy":
            arrays.update(_host_arrays(getattr(variables, field.name), field.name))
    return arrays


def assert_update_leaves_frozen(
    objective: AbstractRLObjective[Any, Any],
    variables: AbstractVariables,
    batch: Any,
    *,
    trainer: Trainer | None = None,
) -> None:
    """One `Trainer.update` changes neither the frozen part of the policy nor any other
    field of the variables (a KL reference, an EMA, an old policy): the optimizer writes the
    policy's trainable part alone, and no gradient reaches the rest.

    **Arguments:**

    - `objective`, `variables`, `batch`: what to update.
    - `trainer`: the `Trainer` (its `trainable` filter splits the policy);
        `Trainer(objective)` when `None`. Its update donates the state's buffers, so it
        runs on a copy of `variables`.
    """
    trainer = Trainer(objective) if trainer is None else trainer
    copied = jax.tree.map(
        lambda leaf: jnp.array(leaf, copy=True) if eqx.is_array(leaf) else leaf, variables
    )
    state = trainer.init(jax.random.key(0), copied)
    before = _frozen(trainer, state.variables)
    new_state, _ = trainer.update(state, batch)
    after = _frozen(trainer, new_state.variables)
    changed = [
        path
        for path, array in before.items()
        if path not in after or not np.array_equal(array, after[path], equal_nan=True)
    ]
    assert not changed, f"one update changed frozen arrays: {changed}"


def assert_advantages_group_normalised(sample: CollectedBatch, *, atol: float = 1e-5) -> None:
    """The rollout's advantages (`sample.collected.advantages`, one per row) are relative to
    their group of `sample.groups` consecutive rows: finite, summing to 0 within each group
    (relative to the largest), exactly 0 in a group of equal rewards, and ordered as the
    group's rewards (a higher reward never has a lower advantage).

    **Arguments:**

    - `sample`: from `collected_batch` or `training_batches`.
    - `atol`: the largest allowed group mean, relative to the largest advantage (>= 1).
    """
    got = np.asarray(sample.collected.advantages, np.float64)
    rewards = np.asarray(sample.info.rewards, np.float64)
    assert got.shape == rewards.shape, (got.shape, rewards.shape)
    assert np.all(np.isfinite(got)), "non-finite advantages"
    groups = sample.groups
    grouped, grouped_rewards = got.reshape(-1, groups), rewards.reshape(-1, groups)
    scale = max(1.0, float(np.max(np.abs(got)))) if got.size else 1.0
    np.testing.assert_allclose(grouped.mean(axis=1), 0.0, atol=atol * scale, err_msg="mean")
    constant = np.all(grouped_rewards == grouped_rewards[:, :1], axis=1)
    assert np.all(grouped[constant] == 0.0), grouped[constant]
    for values, scores in zip(grouped, grouped_rewards, strict=True):
        order = np.argsort(scores, kind="stable")
        ranked, ranked_scores = values[order], scores[order]
        lower = np.diff(ranked) < -atol * scale
        assert not np.any(lower & (np.diff(ranked_scores) > 0)), (scores, values)


# ------------------------------------------------------------------------------------------
# Objectives that rescore recorded transitions (`AbstractTransitionObjective`).


def assert_denominator_is_kept_count(
    objective: AbstractTransitionObjective[Any, Any], variables: AbstractVariables, batch: Any
) -> None:
    """The loss is a mean over the kept set, `objective.kept`, and nothing else.

    The kept set lies within `mask AND stochastic` (masked-in transitions that the SDE
    makes stochastic); `total.count` and every auxiliary `Mean`'s count equal its size; the
    value is finite, and 0 when nothing is kept.

    **Arguments:**

    - `objective`: an `AbstractTransitionObjective`.
    - `variables`: its variables.
    - `batch`: its training batch (`Transitions`, or one holding them).
    """
    transitions = recorded_transitions(batch)
    kept = np.asarray(objective.kept(transitions))
    allowed = np.asarray(transitions.transition_mask) & _stochastic(objective, transitions)
    assert not np.any(kept & ~allowed), "a masked or deterministic transition is kept"
    total, aux = loss_only(objective, variables, batch)
    want = float(kept.sum())
    assert float(total.count) == want, (float(total.count), want)
    for name, mean in aux_means(aux).items():
        assert float(mean.count) == want, (name, float(mean.count), want)
    assert math.isfinite(float(total.value))
    if want == 0:
        assert float(total.value) == 0.0
        assert float(total.total) == 0.0


def _poisoned(
    objective: AbstractTransitionObjective[Any, Any], batch: Transitions, poison: float
) -> Transitions:
    masked = ~np.asarray(batch.transition_mask)
    unkept_rows = ~np.any(np.asarray(objective.kept(batch)), axis=1)

    def fill(value: Any, where: npt.NDArray[np.bool_]) -> Any:
        host = np.array(value)
        host[where] = poison
        return jnp.asarray(host)

    def fill_condition(leaf: Any) -> Any:
        if not np.issubdtype(np.asarray(leaf).dtype, np.inexact):
            return leaf
        return fill(leaf, unkept_rows)

    advantage_where = masked if np.ndim(batch.advantages) == 2 else np.all(masked, axis=1)
    means = None if batch.old_means is None else fill(batch.old_means, masked)
    return replace_fields(
        batch,
        latents=fill(batch.latents, masked),
        next_latents=fill(batch.next_latents, masked),
        timesteps=fill(batch.timesteps, masked),
        next_timesteps=fill(batch.next_timesteps, masked),
        old_log_probs=fill(batch.old_log_probs, masked),
        advantages=fill(batch.advantages, advantage_where),
        cond=jax.tree.map(fill_condition, batch.cond),
        old_means=means,
    )


def assert_masked_entries_inert(
    objective: AbstractTransitionObjective[Any, Any],
    variables: AbstractVariables,
    batch: Any,
    *,
    poison: float = math.nan,
) -> None:
    """NaN or inf written into masked entries reaches neither the loss nor its gradient.

    Every masked entry of every per-transition field, `[N]` advantages of wholly masked
    rows, and the float conditioning of rows with no kept transition are set to `poison`;
    the value, every auxiliary statistic and the gradient must be exactly as before, and
    finite. With nothing kept, the gradient is exactly 0.

    **Arguments:**

    - `objective`: an `AbstractTransitionObjective`.
    - `variables`, `batch`: what to evaluate (`batch`: `Transitions`, or one holding them).
    - `poison`: the value written (NaN, inf, -inf, or a huge finite number).
    """
    value, total, aux, grad = loss_value_and_grad(objective, variables, batch)
    bad = with_transitions(batch, _poisoned(objective, recorded_transitions(batch), poison))
    bad_value, bad_total, bad_aux, bad_grad = loss_value_and_grad(objective, variables, bad)
    assert math.isfinite(float(bad_value)), float(bad_value)
    assert all_finite(bad_grad), "non-finite gradient from masked entries"
    assert float(bad_value) == float(value), (float(bad_value), float(value))
    assert float(bad_total.count) == float(total.count)
    for leaf, bad_leaf in zip(jax.tree.leaves(aux), jax.tree.leaves(bad_aux), strict=True):
        np.testing.assert_array_equal(np.asarray(bad_leaf), np.asarray(leaf))
    assert_trees_equal(bad_grad, grad)
    if float(total.count) == 0:
        assert float(bad_value) == 0.0
        assert all(np.all(g == 0) for g in gradient_leaves(bad_grad))


def assert_unchanged_policy_ratio_one(
    objective: AbstractTransitionObjective[Any, Any],
    variables: AbstractVariables,
    batch: Any,
    *,
    atol: float = 1e-6,
) -> None:
    """Rescoring the policy that recorded a batch gives ratio 1 and clips nothing.

    `old_log_probs` are replaced by `objective.log_probs(variables, batch)`; then, over the
    statistics the loss reports, the mean `ratio` over kept transitions is 1 within `atol`,
    every clip fraction (`clipfrac...`) is exactly 0, the `approx_kl` is at most `atol**2`;
    and deterministic transitions score exactly 0.

    **Arguments:**

    - `objective`: an `AbstractTransitionObjective`.
    - `variables`, `batch`: what to evaluate (`batch`: `Transitions`, or one holding them).
    - `atol`: the tolerance of the ratio.
    """
    transitions = recorded_transitions(batch)
    own = log_probs(objective, variables, transitions)
    deterministic = ~_stochastic(objective, transitions)
    assert np.all(np.asarray(own)[deterministic] == 0.0), "a deterministic transition scored"
    rescored = with_transitions(batch, replace_fields(transitions, old_log_probs=own))
    total, aux = loss_only(objective, variables, rescored)
    if float(total.count) == 0:
        return
    for name, mean in aux_means(aux).items():
        if name == "ratio":
            assert abs(float(mean.value) - 1.0) <= atol, float(mean.value)
        elif name.startswith("clipfrac"):
            assert float(mean.value) == 0.0, name
        elif name == "approx_kl":
            assert float(mean.value) <= atol**2, float(mean.value)


def _assert_means_close(
    got: Any, want: Any, field: str, scale: float, rtol: float, atol: float
) -> None:
    """`got`'s statistics (each `Mean`'s `field`) are `scale` times `want`'s."""
    wanted = aux_means(want)
    for name, mean in aux_means(got).items():
        np.testing.assert_allclose(
            float(getattr(mean, field)),
            scale * float(getattr(wanted[name], field)),
            rtol=rtol,
            atol=atol,
            err_msg=name,
        )


def _assert_same_loss(got: Any, want: Any, rtol: float, atol: float) -> None:
    """Two `loss_value_and_grad` results agree: the count exactly, the value, the statistics
    and the gradient to tolerance."""
    value, total, aux, grad = want
    got_value, got_total, got_aux, got_grad = got
    assert float(got_total.count) == float(total.count)
    np.testing.assert_allclose(float(got_value), float(value), rtol=rtol, atol=atol)
    _assert_means_close(got_aux, aux, "value", 1.0, rtol, atol)
    assert_trees_close(got_grad, grad)


def assert_row_permutation_invariant(
    objective: AbstractTransitionObjective[Any, Any],
    variables: AbstractVariables,
    batch: Any,
    permutation: ArrayLike,
    *,
    rtol: float = 1e-5,
    atol: float = 1e-6,
) -> None:
    """Permuting the rows (every array of the batch, the conditioning included) changes
    neither the loss, its statistics nor its gradient, beyond summation order.

    **Arguments:**

    - `objective`: an `AbstractTransitionObjective` (its loss draws nothing per row).
    - `variables`, `batch`: what to evaluate.
    - `permutation`: `[N]` a permutation of the rows.
    - `rtol`, `atol`: the tolerances.
    """
    order = np.asarray(permutation, np.int32)
    permuted = map_rows(batch, lambda leaf: leaf[order])
    _assert_same_loss(
        loss_value_and_grad(objective, variables, permuted),
        loss_value_and_grad(objective, variables, batch),
        rtol,
        atol,
    )


def assert_duplication_doubles_total(
    objective: AbstractTransitionObjective[Any, Any],
    variables: AbstractVariables,
    batch: Any,
    *,
    rtol: float = 1e-5,
    atol: float = 1e-6,
) -> None:
    """The batch twice over doubles every total and count and keeps every mean and the
    gradient: the objective is an exactly reducible mean, as shards need.

    **Arguments:**

    - `objective`: an `AbstractTransitionObjective` (its loss draws nothing per row).
    - `variables`, `batch`: what to evaluate.
    - `rtol`, `atol`: the tolerances.
    """
    doubled = map_rows(batch, lambda leaf: jnp.concatenate([leaf, leaf], axis=0))
    value, total, aux, grad = loss_value_and_grad(objective, variables, batch)
    d_value, d_total, d_aux, d_grad = loss_value_and_grad(objective, variables, doubled)
    assert float(d_total.count) == 2 * float(total.count)
    np.testing.assert_allclose(float(d_total.total), 2 * float(total.total), rtol=rtol, atol=atol)
    np.testing.assert_allclose(float(d_value), float(value), rtol=rtol, atol=atol)
    _assert_means_close(d_aux, aux, "count", 2.0, 0.0, 0.0)
    _assert_means_close(d_aux, aux, "total", 2.0, rtol, atol)
    assert_trees_close(d_grad, grad)


def assert_transition_chunk_agrees(
    objective: AbstractTransitionObjective[Any, Any],
    chunked: AbstractTransitionObjective[Any, Any],
    variables: AbstractVariables,
    batch: Transitions,
    *,
    rtol: float = 1e-5,
    atol: float = 1e-6,
) -> None:
    """Two objectives that differ only in `transition_chunk` (or `remat`) agree on the log
    densities, the loss, its statistics and its gradient."""
    _assert_same_loss(
        loss_value_and_grad(chunked, variables, batch),
        loss_value_and_grad(objective, variables, batch),
        rtol,
        atol,
    )
    np.testing.assert_allclose(
        np.asarray(log_probs(chunked, variables, batch)),
        np.asarray(log_probs(objective, variables, batch)),
        rtol=rtol,
        atol=10 * atol,
    )


def assert_group_advantages_invariants(
    rewards: ArrayLike,
    groups: int,
    *,
    advantages_fn: Callable[..., Any] = group_advantages,
    std: str = "group",
) -> None:
    """What any group-relative advantage must satisfy, whatever its exact normalisation.

    The result is float32 `[P * G]`; each group's advantages sum to 0; a constant group's
    are exactly 0; permuting rewards within a group permutes its advantages; with
    `std="group"` each group is normalised as if alone (equal rewards in two groups never
    merge them).

    **Arguments:**

    - `rewards`: `[P * G]` rewards.
    - `groups`: `G`.
    - `advantages_fn`: `(rewards, groups, std=...) -> advantages`; default the library's.
    - `std`: passed on to `advantages_fn`.
    """
    values = np.asarray(rewards, np.float64)
    got = np.asarray(advantages_fn(values, groups, std=std))
    assert got.dtype == np.float32, got.dtype
    assert got.shape == values.shape, (got.shape, values.shape)
    assert np.all(np.isfinite(got))
    grouped = values.reshape(-1, groups)
    scale = max(1.0, float(np.max(np.abs(got)))) if got.size else 1.0
    means = got.astype(np.float64).reshape(-1, groups).mean(axis=1)
    np.testing.assert_allclose(means, 0.0, atol=1e-5 * scale)
    constant = np.repeat(np.all(grouped == grouped[:, :1], axis=1), groups)
    assert np.all(got[constant] == 0.0), got[constant]
    reverse = (np.arange(values.size).reshape(-1, groups)[:, ::-1]).reshape(-1)
    permuted = np.asarray(advantages_fn(values[reverse], groups, std=std))
    np.testing.assert_allclose(permuted, got[reverse], rtol=1e-6, atol=1e-6 * scale)
    if std == "group":
        alone = np.concatenate(
            [np.asarray(advantages_fn(group, groups, std=std)) for group in grouped]
        )
        np.testing.assert_allclose(got, alone, rtol=1e-6, atol=1e-6 * scale)


def assert_sde_invariants(
    sde: AbstractSDE,
    x: ArrayLike,
    v: ArrayLike,
    t: float,
    t_next: float,
    noise: ArrayLike,
    mean_ref: ArrayLike,
) -> None:
    """What any SDE transition must satisfy, whatever its coefficients.

    The std is 0 exactly when the transition is deterministic (`is_stochastic`), positive
    otherwise; the sampled next latent `mean + std noise` has a log density no greater than
    the mean's own; a deterministic transition has log density 0 and no KL; the KL to another
    mean is non-negative, and 0 to the same mean.

    **Arguments:**

    - `sde`: the SDE.
    - `x`, `v`: one latent and its velocity.
    - `t`, `t_next`: the interval, `t_next < t`.
    - `noise`: a standard normal draw shaped like `x`.
    - `mean_ref`: another mean shaped like `x`, for the KL.
    """
    latent = jnp.asarray(x, jnp.float32)
    mean, std = sde.transition(latent, jnp.asarray(v, jnp.float32), t, t_next)
    stochastic = bool(sde.is_stochastic(jnp.asarray(t), jnp.asarray(t_next)))
    assert mean.shape == latent.shape, (mean.shape, latent.shape)
    assert bool(jnp.all(jnp.isfinite(mean))), "non-finite mean"
    assert (float(std) > 0) == stochastic, (float(std), stochastic)
    reference = jnp.asarray(mean_ref, mean.dtype)
    sample = sde.sample(mean, std, jnp.asarray(noise, mean.dtype))
    if not stochastic:
        assert float(std) == 0.0
        assert float(sde.log_prob(sample, mean, std)) == 0.0
        assert float(sde.kl(mean, reference, std, t_next - t)) == 0.0
        return
    at_mean = float(sde.log_prob(mean, mean, std))
    assert float(sde.log_prob(sample, mean, std)) <= at_mean + 1e-6 * max(1.0, abs(at_mean))
    assert float(sde.kl(mean, reference, std, t_next - t)) >= 0.0
    assert float(sde.kl(mean, mean, std, t_next - t)) == 0.0


def assert_grid_endpoints(process: AbstractProcess, steps: int) -> None:
    """The process's grid is float32, `steps` long, strictly decreasing, and starts at 1 and
    ends at 0 exactly (so that the first and last transitions are where they claim)."""
    grid = np.asarray(process.timesteps(steps))
    assert grid.shape == (steps,), grid.shape
    assert grid.dtype == np.float32, grid.dtype
    assert grid[0] == 1.0, f"grid starts at {grid[0]!r}"
    assert grid[-1] == 0.0, f"grid ends at {grid[-1]!r}"
    assert np.all(np.diff(grid) < 0), "grid is not strictly decreasing"
