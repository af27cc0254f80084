"""Invariants of objectives, SDEs and advantages, as assertions a user's tests can call.

They state properties, not formulas: a rescored unchanged policy has ratio 1, masked entries
are inert, the denominator is the kept count, a permutation of rows changes nothing. Each
raises `AssertionError` with what differed; each returns nothing.
"""

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jaxtyping import ArrayLike

from .._advantages import group_advantages
from .._custom_types import Aux, Transitions
from .._process import AbstractProcess
from .._sde import AbstractSDE
from ..objectives import FlowGRPOObjective, FlowGRPOVariables
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


_AUX_MEANS = ("policy_loss", "kl", "clipfrac", "clipfrac_gt_one", "clipfrac_lt_one")


def _stochastic(objective: FlowGRPOObjective, batch: Transitions) -> npt.NDArray[np.bool_]:
    return np.asarray(objective.sde.is_stochastic(batch.timesteps, batch.next_timesteps))


def assert_denominator_is_kept_count(
    objective: FlowGRPOObjective, variables: FlowGRPOVariables, batch: Transitions
) -> None:
    """The loss is a mean over the kept set, `mask AND stochastic`, and nothing else.

    `total.count`, `aux.counted` and every auxiliary mean's count equal the number of masked-in
    transitions that the SDE makes stochastic; `objective.kept` is that set; the value is
    finite, and 0 when nothing is kept.
    """
    expected = np.asarray(batch.transition_mask) & _stochastic(objective, batch)
    np.testing.assert_array_equal(np.asarray(objective.kept(batch)), expected)
    total, aux = loss_only(objective, variables, batch)
    want = float(expected.sum())
    assert float(total.count) == want, (float(total.count), want)
    assert float(aux.counted) == want, (float(aux.counted), want)
    for name in _AUX_MEANS:
        assert float(getattr(aux, name).count) == want, name
    assert math.isfinite(float(total.value))
    if want == 0:
        assert float(total.value) == 0.0
        assert float(total.total) == 0.0


def _poisoned(objective: FlowGRPOObjective, batch: Transitions, poison: float) -> Transitions:
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
    return replace_fields(
        batch,
        latents=fill(batch.latents, masked),
        next_latents=fill(batch.next_latents, masked),
        timesteps=fill(batch.timesteps, masked),
        next_timesteps=fill(batch.next_timesteps, masked),
        old_log_probs=fill(batch.old_log_probs, masked),
        advantages=fill(batch.advantages, advantage_where),
        cond=jax.tree.map(fill_condition, batch.cond),
    )


def assert_masked_entries_inert(
    objective: FlowGRPOObjective,
    variables: FlowGRPOVariables,
    batch: Transitions,
    *,
    poison: float = math.nan,
) -> None:
    """NaN or inf written into masked entries reaches neither the loss nor its gradient.

    Every masked entry of every per-transition field, `[N]` advantages of wholly masked
    rows, and the float conditioning of rows with no kept transition are set to `poison`;
    the value, every auxiliary statistic and the gradient must be exactly as before, and
    finite. With nothing kept, the gradient is exactly 0.

    **Arguments:**

    - `objective`, `variables`, `batch`: what to evaluate.
    - `poison`: the value written (NaN, inf, -inf, or a huge finite number).
    """
    value, total, aux, grad = loss_value_and_grad(objective, variables, batch)
    bad = _poisoned(objective, batch, poison)
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
    objective: FlowGRPOObjective,
    variables: FlowGRPOVariables,
    batch: Transitions,
    *,
    atol: float = 1e-6,
) -> None:
    """Rescoring the policy that recorded a batch gives ratio 1 and clips nothing.

    `old_log_probs` are replaced by `objective.log_probs(variables, batch)`; then the mean
    ratio over kept transitions is 1 within `atol`, every clip fraction is exactly 0, the
    approximate KL is at most `atol**2`, and deterministic transitions score exactly 0.
    """
    own = log_probs(objective, variables, batch)
    deterministic = ~_stochastic(objective, batch)
    assert np.all(np.asarray(own)[deterministic] == 0.0), "a deterministic transition scored"
    rescored = replace_fields(batch, old_log_probs=own)
    total, aux = loss_only(objective, variables, rescored)
    if float(total.count) == 0:
        return
    assert abs(float(aux.ratio.value) - 1.0) <= atol, float(aux.ratio.value)
    for name in ("clipfrac", "clipfrac_gt_one", "clipfrac_lt_one"):
        assert float(getattr(aux, name).value) == 0.0, name
    assert float(aux.approx_kl.value) <= atol**2, float(aux.approx_kl.value)


def _assert_means_close(
    got: Aux, want: Aux, field: str, scale: float, rtol: float, atol: float
) -> None:
    """`got`'s statistics (each `Mean`'s `field`) are `scale` times `want`'s."""
    for name in ("kl", "clipfrac", "ratio", "approx_kl", "policy_loss"):
        np.testing.assert_allclose(
            float(getattr(getattr(got, name), field)),
            scale * float(getattr(getattr(want, name), field)),
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
    objective: FlowGRPOObjective,
    variables: FlowGRPOVariables,
    batch: Transitions,
    permutation: ArrayLike,
    *,
    rtol: float = 1e-5,
    atol: float = 1e-6,
) -> None:
    """Permuting the rows (every field and the conditioning together) changes neither the
    loss, its statistics nor its gradient, beyond summation order."""
    order = np.asarray(permutation, np.int32)
    permuted = map_rows(batch, lambda leaf: leaf[order])
    _assert_same_loss(
        loss_value_and_grad(objective, variables, permuted),
        loss_value_and_grad(objective, variables, batch),
        rtol,
        atol,
    )


def assert_duplication_doubles_total(
    objective: FlowGRPOObjective,
    variables: FlowGRPOVariables,
    batch: Transitions,
    *,
    rtol: float = 1e-5,
    atol: float = 1e-6,
) -> None:
    """The batch twice over doubles every total and count and keeps every mean and the
    gradient: the objective is an exactly reducible mean, as shards need."""
    doubled = map_rows(batch, lambda leaf: jnp.concatenate([leaf, leaf], axis=0))
    value, total, aux, grad = loss_value_and_grad(objective, variables, batch)
    d_value, d_total, d_aux, d_grad = loss_value_and_grad(objective, variables, doubled)
    assert float(d_total.count) == 2 * float(total.count)
    assert float(d_aux.counted) == 2 * float(aux.counted)
    np.testing.assert_allclose(float(d_total.total), 2 * float(total.total), rtol=rtol, atol=atol)
    np.testing.assert_allclose(float(d_value), float(value), rtol=rtol, atol=atol)
    _assert_means_close(d_aux, aux, "total", 2.0, rtol, atol)
    assert_trees_close(d_grad, grad)


def assert_transition_chunk_agrees(
    objective: FlowGRPOObjective,
    chunked: FlowGRPOObjective,
    variables: FlowGRPOVariables,
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
