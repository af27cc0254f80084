"""GRPO-Guard (arXiv:2510.22319): the regulated clipping `FlowGRPOObjective` takes as its
`guard`, in its two forms (`GRPOGuard`, `EmpiricalGuard`), with the per-step statistics they
read."""

import abc
from typing import Literal, TypeAlias, final

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._custom_types import PerTransition, StepRatios, TransitionMask
from .._misc import check_bool


GuardDrift: TypeAlias = Literal["sample", "batch"]
"""Where GRPO-Guard's analytic drift `mean(mu_theta - mu_old)^2 / (2 S^2)` is averaged: per
transition over its coordinates (`"sample"`, the authors' fix), or over the coordinates and
every kept transition of the step (`"batch"`, the released code)."""

GuardScale: TypeAlias = Literal["batch", "sample"]
"""GRPO-Guard's scale `S`: the step's `mean(sqrt(dt)) * mean(sigma_t)` over its kept
transitions (`"batch"`, the released code), or each transition's own std (`"sample"`)."""


@final
class GuardParts(eqx.Module):
    """The per-transition quantities a GRPO-Guard form reads, all `[N, K]`.

    **Arguments:**

    - `log_ratio`: `log p_theta - old_log_prob`, 0 outside the kept set.
    - `drift`: `mean over coordinates (mu_theta - mu_old)^2`, or zeros when the batch has no
        old means (only `GRPOGuard` reads it, and it needs them).
    - `std`: each transition's std `s`.
    - `t`, `t_next`: each transition's start and end times (safe values outside the kept set).
    - `kept`: the kept set.
    """

    log_ratio: PerTransition
    drift: PerTransition
    std: PerTransition
    t: PerTransition
    t_next: PerTransition
    kept: TransitionMask


class AbstractGRPOGuard(eqx.Module):
    """A form of GRPO-Guard's regulated clipping (arXiv:2510.22319): how the log-ratio is
    normalised before the clip, and how each transition's surrogate is weighted.

    Flow-GRPO's log-ratio at a step with transition std `s` is, to second order, a drift
    `-mean(mu_theta - mu_old)^2 / (2 s^2)` plus noise of scale `1/s`: its mean sits below 0 and
    its spread differs from step to step, so the clip catches too few positive-advantage
    updates. `GRPOGuard` removes the drift analytically, as the released code does;
    `EmpiricalGuard` removes the step's empirical mean. The formulas, and how they relate to
    the paper and to the released code, are in `docs/mathematics/flow_grpo.md` (§5a).
    """

    @property
    @abc.abstractmethod
    def needs_old_means(self) -> bool:
        """Whether `normalise` reads the drift `mean(mu_theta - mu_old)^2`, so that the batch
        must carry `Transitions.old_means`."""

    @abc.abstractmethod
    def normalise(self, parts: GuardParts) -> PerTransition:
        """The guarded log-ratio that the ratio `exp` of is clipped.

        **Arguments:**

        - `parts`: the per-transition quantities of a minibatch (`GuardParts`).

        **Returns:**

        `[N, K]` guarded log-ratios, 0 outside the kept set.
        """

    @abc.abstractmethod
    def weights(self, parts: GuardParts) -> PerTransition | None:
        """Each kept transition's surrogate weight, or `None` for no reweighting.

        **Arguments:**

        - `parts`: the per-transition quantities of a minibatch (`GuardParts`).

        **Returns:**

        `[N, K]` weights (0 outside the kept set), or `None`.
        """


@final
class GRPOGuard(AbstractGRPOGuard):
    """GRPO-Guard as released: the analytic drift added back, the log-ratio scaled by `S`, and
    the policy loss divided by `mean(sqrt(dt))^2`.

    With `dt = t - t_next`, `sigma_t = s / sqrt(dt)` (the SDE's diffusion coefficient), and the
    statistics `mean_k` taken over the kept transitions of the same step `k`:

    - `S = mean_k(sqrt(dt)) * mean_k(sigma_t)` (`scale="batch"`) or `S = s` (`"sample"`);
    - `b = mean_coords(mu_theta - mu_old)^2 / (2 S^2)` per transition (`drift="sample"`), or
      its mean over the step's kept transitions (`"batch"`);
    - the guarded log-ratio is `(log_ratio + b) * S`; gradients flow through `b`;
    - with `reweight`, each kept surrogate is divided by `mean_k(sqrt(dt))^2`.

    The three published forms (`docs/mathematics/flow_grpo.md` §5a): the authors' fix, the default,
    `GRPOGuard()`; the released code (the batch-global drift of flow_grpo issue #244),
    `GRPOGuard(drift="batch")`; per-sample `S` without reweighting (as a widely used
    third-party trainer), `GRPOGuard(scale="sample", reweight=False)`. All need the rollout's
    means: `SDESampler(record_means=True)`.

    **Arguments:**

    - `drift`: `"sample"` (default) or `"batch"`.
    - `scale`: `"batch"` (default) or `"sample"`.
    - `reweight`: whether to divide each surrogate by `mean_k(sqrt(dt))^2` (default `True`).

    **Raises:**

    - `ValueError`: naming the argument, for a `drift` or `scale` outside its `Literal`.
    """

    drift: GuardDrift = eqx.field(default="sample", static=True)
    scale: GuardScale = eqx.field(default="batch", static=True)
    reweight: bool = eqx.field(default=True, static=True)

    def __check_init__(self) -> None:
        if self.drift not in ("sample", "batch"):
            raise ValueError(f"`drift` must be 'sample' or 'batch', got {self.drift!r}.")
        if self.scale not in ("batch", "sample"):
            raise ValueError(f"`scale` must be 'batch' or 'sample', got {self.scale!r}.")
        check_bool("reweight", self.reweight)

    @property
    def needs_old_means(self) -> bool:
        return True

    def normalise(self, parts: GuardParts) -> PerTransition:
        kept = parts.kept
        sqrt_dt = jnp.sqrt(jnp.where(kept, parts.t - parts.t_next, 1.0))
        if self.scale == "batch":
            sigma = parts.std / sqrt_dt
            mean_sqrt_dt, _ = step_statistics(sqrt_dt, kept)
            mean_sigma, _ = step_statistics(sigma, kept)
            scale = jnp.broadcast_to((mean_sqrt_dt * mean_sigma)[None, :], kept.shape)
        else:
            scale = parts.std
        scale = jnp.where(kept & (scale > 0), scale, 1.0)
        drift = jnp.where(kept, parts.drift, 0.0)
        if self.drift == "batch":
            step_drift, _ = step_statistics(drift, kept)
            drift = jnp.broadcast_to(step_drift[None, :], kept.shape)
        bias = drift / (2.0 * scale**2)
        return jnp.where(kept, (parts.log_ratio + bias) * scale, 0.0)

    def weights(self, parts: GuardParts) -> PerTransition | None:
        if not self.reweight:
            return None
        kept = parts.kept
        sqrt_dt = jnp.sqrt(jnp.where(kept, parts.t - parts.t_next, 1.0))
        mean_sqrt_dt, _ = step_statistics(sqrt_dt, kept)
        safe = jnp.where(mean_sqrt_dt > 0, mean_sqrt_dt, 1.0)
        return jnp.where(kept, 1.0 / safe[None, :] ** 2, 0.0)


@final
class EmpiricalGuard(AbstractGRPOGuard):
    """GRPO-Guard with an empirical centring: this library's earlier form, kept because it
    needs no recorded means (any `Transitions`, from any rollout) and centres every step's
    guarded log-ratio exactly on 0.

    - RatioNorm scales each kept transition's log-ratio by its std `s` and subtracts that
      scaled log-ratio's mean over the kept transitions of the same step `k` in the minibatch
      (an estimate of the drift); gradients flow through the mean.
    - Step reweighting multiplies each kept surrogate by `1 / dt` (`dt = t - t_next`),
      divided by the mean of `1 / dt` over the kept transitions (mean 1, so the loss keeps
      its scale).

    **Arguments:**

    - `ratio_norm`: whether to normalise the log-ratio per step (RatioNorm).
    - `reweight`: whether to reweight the surrogate by `1 / dt`.

    **Raises:**

    - `ValueError`: if both are off (the guard would do nothing).
    """

    ratio_norm: bool = eqx.field(default=True, static=True)
    reweight: bool = eqx.field(default=True, static=True)

    def __check_init__(self) -> None:
        if not (self.ratio_norm or self.reweight):
            raise ValueError("`ratio_norm` and `reweight` are both False: the guard does nothing.")

    @property
    def needs_old_means(self) -> bool:
        return False

    def normalise(self, parts: GuardParts) -> PerTransition:
        if not self.ratio_norm:
            return parts.log_ratio
        return ratio_norm(parts.log_ratio, parts.std, parts.kept)

    def weights(self, parts: GuardParts) -> PerTransition | None:
        if not self.reweight:
            return None
        return step_weights(parts.t, parts.t_next, parts.kept)


def ratio_norm(log_ratio: PerTransition, std: PerTransition, kept: TransitionMask) -> PerTransition:
    """`EmpiricalGuard`'s RatioNorm: the log-ratio scaled by the transition std, centred per step.

    For each step (column) `k`, `normalised[n, k] = s[n, k] l[n, k] - mean_kept_k(s l)`, where
    the mean is over the kept rows of column `k`; entries outside the kept set are 0.

    **Arguments:**

    - `log_ratio`: `[N, K]` `log p_theta - old_log_prob`.
    - `std`: `[N, K]` each transition's std.
    - `kept`: `[N, K]` the kept set.

    **Returns:**

    `[N, K]` normalised log-ratios, with mean 0 over the kept rows of every column.
    """
    scaled = jnp.where(kept, log_ratio * std, 0.0)
    step_mean, _ = step_statistics(scaled, kept)
    return jnp.where(kept, scaled - step_mean[None, :], 0.0)


def step_weights(t: PerTransition, t_next: PerTransition, kept: TransitionMask) -> PerTransition:
    """`EmpiricalGuard`'s step reweighting: `1 / dt` over its mean on the kept set.

    **Arguments:**

    - `t`, `t_next`: `[N, K]` each transition's start and end times (`t > t_next`).
    - `kept`: `[N, K]` the kept set.

    **Returns:**

    `[N, K]` weights `(1 / dt) / mean_kept(1 / dt)` with `dt = t - t_next`, so their mean over
    the kept set is 1; 0 outside it.
    """
    safe_dt = jnp.where(kept, t - t_next, 1.0)
    inverse = jnp.where(kept, 1.0 / safe_dt, 0.0)
    count = jnp.maximum(jnp.sum(kept, dtype=inverse.dtype), 1.0)
    mean = jnp.sum(inverse) / count
    return inverse / jnp.where(mean > 0, mean, 1.0)


def step_statistics(
    values: PerTransition, kept: TransitionMask
) -> tuple[Float[Array, " K"], Float[Array, " K"]]:
    """Mean and population std of `values` over the kept rows of each column.

    **Arguments:**

    - `values`: `[N, K]` per-transition values.
    - `kept`: `[N, K]` the kept set.

    **Returns:**

    `(mean, std)`, each `[K]`: the mean and population std over the kept rows of each step
    (column), 0 for a step with no kept row.
    """
    count = jnp.sum(kept, axis=0, dtype=values.dtype)
    safe_count = jnp.maximum(count, 1.0)
    mean = jnp.sum(jnp.where(kept, values, 0.0), axis=0) / safe_count
    square = jnp.sum(jnp.where(kept, (values - mean[None, :]) ** 2, 0.0), axis=0) / safe_count
    return mean, jnp.sqrt(square)


def needs_old_means(guard: AbstractGRPOGuard | None, old_means: Array | None) -> bool:
    """Whether `guard` reads the rollout's means (`Transitions.old_means`).

    **Arguments:**

    - `guard`: the objective's guard, or `None`.
    - `old_means`: the batch's `Transitions.old_means`.

    **Returns:**

    `True` when the guard adds back the drift from the rollout's means.

    **Raises:**

    - `ValueError`: naming `guard` and `batch.old_means` when the guard needs the means and
        the batch has none.
    """
    needs_means = guard is not None and guard.needs_old_means
    if needs_means and old_means is None:
        raise ValueError(
            f"`guard`={guard!r} adds back the drift from the rollout's means, but "
            "`batch.old_means` is None: sample with `SDESampler(record_means=True)`."
        )
    return needs_means


def guarded(
    guard: AbstractGRPOGuard | None,
    scored: dict[str, PerTransition],
    inputs: dict[str, Array],
    kept: TransitionMask,
) -> tuple[PerTransition, PerTransition | None]:
    """The log-ratio the clip sees and each transition's weight.

    **Arguments:**

    - `guard`: the objective's guard, or `None`.
    - `scored`: the kept transitions' `"log_ratio"`, `"std"` and (when the guard reads the
        rollout's means) `"drift"`, each `[N, K]`.
    - `inputs`: the kept transitions' `"t"` and `"t_next"`, each `[N, K]`.
    - `kept`: `[N, K]` the kept set.

    **Returns:**

    The raw log-ratio and `None` without a guard; the guard's normalised log-ratio and its
    weights with one.
    """
    if guard is None:
        return scored["log_ratio"], None
    parts = GuardParts(
        log_ratio=scored["log_ratio"],
        drift=scored.get("drift", jnp.zeros_like(scored["log_ratio"])),
        std=scored["std"],
        t=inputs["t"],
        t_next=inputs["t_next"],
        kept=kept,
    )
    return guard.normalise(parts), guard.weights(parts)


def guard_step_ratios(
    log_ratio: PerTransition, ratio: PerTransition, kept: TransitionMask
) -> StepRatios:
    """The policy ratio's per-step statistics before and after the guard's normalisation.

    **Arguments:**

    - `log_ratio`: `[N, K]` the raw `log p_theta - old_log_prob`.
    - `ratio`: `[N, K]` the ratio the clip saw (the exp of the guarded log-ratio).
    - `kept`: `[N, K]` the kept set.

    **Returns:**

    `StepRatios` of `exp(log_ratio)` and of `ratio`, over the kept rows of each step.
    """
    raw_mean, raw_std = step_statistics(jnp.exp(log_ratio), kept)
    normalised_mean, normalised_std = step_statistics(ratio, kept)
    return StepRatios(raw_mean, raw_std, normalised_mean, normalised_std)
