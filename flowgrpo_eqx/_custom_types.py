"""The one module of type aliases and small data modules shared by the whole library.

Shapes use jaxtyping's notation: `N` rows (samples), `K` selected transitions, `P` source rows
(prompts), `*latent` the shape of one latent, any rank: `[H, W, C]` for an image, `[F, H, W, C]`
for a video (`Wan`), so a trajectory of video latents is `[N, K, F, H, W, C]`.
"""

from typing import Any, TypeAlias, final

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jaxtyping import Array, ArrayLike, Bool, Float, Int, PRNGKeyArray, PyTree

from ._misc import check_leading_rows


Scalar: TypeAlias = Float[Array, ""]
RealScalarLike: TypeAlias = float | int | Float[ArrayLike, ""] | Int[ArrayLike, ""]
Latent: TypeAlias = Float[Array, " *latent"]
Latents: TypeAlias = Float[Array, " N *latent"]
Times: TypeAlias = Float[Array, " N"]
PerTransition: TypeAlias = Float[Array, " N K"]
"""One number per row and transition."""
TransitionMask: TypeAlias = Bool[Array, " N K"]
"""One flag per row and transition."""
PerExample: TypeAlias = Float[Array, " F"]
"""One number per training example of an objective on final samples (AWM, DGPO,
DiffusionNFT): the rows at each of their trained times, flattened row-major."""
ExampleMask: TypeAlias = Bool[Array, " F"]
"""One flag per training example (`PerExample`)."""
ScalarLike: TypeAlias = Float[ArrayLike, ""]
"""A float scalar: an array of shape `()` or a Python float."""
Condition: TypeAlias = PyTree[Any]
"""One example's conditioning (unbatched), or a batch of them with a leading `N` axis."""
Model: TypeAlias = Any
"""Any callable `model(x, t, cond) -> v` on one unbatched example, usually an `eqx.Module`."""


class Mean(eqx.Module):
    """A mean kept as a sum and a count, so that it reduces exactly across shards.

    The global value is `sum(total) / sum(count)` over all shards, not a mean of per-shard means.
    An empty mean (count 0) has value 0.

    **Arguments:**

    - `total`: the sum of the averaged quantity.
    - `count`: how many items the sum is over.
    """

    total: Float[Array, ""]
    count: Float[Array, ""]

    @property
    def value(self) -> Float[Array, ""]:
        """The mean, `total / count`, or 0 when `count == 0` (never NaN)."""
        safe_count = jnp.where(self.count > 0, self.count, 1.0)
        return jnp.where(self.count > 0, self.total / safe_count, 0.0)

    def __add__(self, other: "Mean") -> "Mean":
        return Mean(self.total + other.total, self.count + other.count)


@final
class PerRow(eqx.Module):
    """Marks an auxiliary output of a loss that has one entry per row of the batch.

    The trainer reports none of it as a metric and, when it splits a batch into
    microbatches, puts its rows back in the batch's order (where a `Mean` is summed as a
    total and a count).

    **Arguments:**

    - `value`: `[M, ...]`, one entry per row of the batch the loss saw.
    """

    value: Float[Array, " M *rest"]


class Step(eqx.Module):
    """Where training is: the update index and a PRNG key for whatever the step samples.

    **Arguments:**

    - `index`: the optimizer step index.
    - `key`: a JAX PRNG key.
    """

    index: Int[ArrayLike, ""]
    key: PRNGKeyArray


class StepRatios(eqx.Module):
    """The policy ratio per transition index (step) before and after GRPO-Guard's RatioNorm.

    Statistics over the kept transitions of each step `k` of one minibatch (a step with none
    has mean and std 0); the std is the population one. They describe the whole minibatch, so
    unlike a `Mean` they are not reduced across shards but computed from the global batch.

    **Arguments:**

    - `raw_mean`, `raw_std`: `[K]` mean and std of `r = exp(log p_theta - old_log_prob)`.
    - `normalised_mean`, `normalised_std`: `[K]` the same of the normalised ratio (equal to
        the raw ones when RatioNorm is off).
    """

    raw_mean: Float[Array, " K"]
    raw_std: Float[Array, " K"]
    normalised_mean: Float[Array, " K"]
    normalised_std: Float[Array, " K"]


class Aux(eqx.Module):
    """Diagnostics of one loss evaluation, each a `Mean` over the kept transitions.

    **Arguments:**

    - `policy_loss`: the clipped surrogate.
    - `kl`: the conditional Gaussian KL to the frozen reference (0 when `beta == 0`).
    - `clipfrac`: fraction of kept transitions with `|r - 1| > clip_range`.
    - `clipfrac_gt_one`: fraction with `r - 1 > clip_range`.
    - `clipfrac_lt_one`: fraction with `1 - r > clip_range`.
    - `approx_kl`: `0.5 * (log p_theta - old_log_prob)^2`.
    - `ratio`: the policy ratio `r`.
    - `counted`: the number of kept stochastic transitions `D`.
    - `step_ratios`: with GRPO-Guard (`FlowGRPOObjective(guard=...)`), the ratio's mean and
        std per step before and after normalisation; `None` without it.
    - `log_probs`: `[N, K]` the policy's log density of each kept transition as this very
        evaluation computed it (0 where not kept; no gradient), marked `PerRow`, when
        `FlowGRPOObjective(old_log_probs="update")` asks for it, else `None`. Not a metric:
        the objective records it as the old log densities, so that the update's ratio starts
        from exactly 1 whatever the model's precision.
    """

    policy_loss: Mean
    kl: Mean
    clipfrac: Mean
    clipfrac_gt_one: Mean
    clipfrac_lt_one: Mean
    approx_kl: Mean
    ratio: Mean
    counted: Float[Array, ""]
    step_ratios: StepRatios | None = None
    log_probs: PerRow | None = None


class Transitions(eqx.Module):
    """A batch of recorded rectified-flow transitions: what the rollout gives and `loss` takes.

    `N` is the number of rows (samples), `K` the number of selected transitions per row.

    **Arguments:**

    - `latents`: `[N, K, *latent]`, the state before each transition.
    - `next_latents`: `[N, K, *latent]`, the state after it.
    - `timesteps`: `[N, K]`, the time `t` of each transition's start (noise is `t = 1`).
    - `next_timesteps`: `[N, K]`, the time it ends at, `t_next < t`.
    - `old_log_probs`: `[N, K]`, the joint (mean-coordinate) log density recorded in the rollout.
    - `transition_mask`: `[N, K]` bool, whether each transition may count.
    - `advantages`: `[N]` (broadcast over K) or `[N, K]`.
    - `cond`: the conditioning, a PyTree whose leaves have a leading `N` axis.
    - `old_means`: `[N, K, *latent]`, the mean of each transition's Gaussian under the policy
        that sampled it (`SDESampler(record_means=True)`), or `None` (the default). The
        released GRPO-Guard (`GRPOGuard`) adds back the drift `|mu_theta - mu_old|^2 / (2 S^2)`
        and needs them.

    **Raises:**

    - `ValueError`: naming the field, when a field's shape or dtype disagrees with
        `[N, K, ...]` (`N` and `K` from the `[N, K]` fields); naming `next_timesteps` and
        `timesteps` when, with concrete (untraced) arrays, a transition the mask keeps does
        not have `t_next < t`.
    """

    latents: Float[Array, " N K *latent"]
    next_latents: Float[Array, " N K *latent"]
    timesteps: Float[Array, " N K"]
    next_timesteps: Float[Array, " N K"]
    old_log_probs: Float[Array, " N K"]
    transition_mask: Bool[Array, " N K"]
    advantages: Float[Array, " N"] | Float[Array, " N K"]
    cond: PyTree[Any]
    old_means: Float[Array, " N K *latent"] | None = None

    def __check_init__(self) -> None:
        check_transitions(self)

    @property
    def num_rows(self) -> int:
        """`N`, the number of rows (samples)."""
        return int(self.latents.shape[0])

    @property
    def num_transitions(self) -> int:
        """`K`, the number of recorded transitions per row."""
        return int(self.latents.shape[1])

    @property
    def latent_shape(self) -> tuple[int, ...]:
        """The shape of one latent, `latents.shape[2:]`."""
        return tuple(int(d) for d in self.latents.shape[2:])


class FinalSamples(eqx.Module):
    """Final clean latents with their rows and advantages: a rollout without a trajectory.

    What `FlowRollout.collect` gives with an ODE `sampler`, and what DiffusionNFT trains on.
    No trajectory and no likelihood: any sampler may have drawn the latents.

    **Arguments:**

    - `latents`: `[N, *latent]` final clean latents `x_0` (at t = 0).
    - `advantages`: `[N]` group-normalised advantages.
    - `cond`: the rows that conditioned them (leaves with a leading axis `N`).
    - `mask`: `[N]` bools, whether each row counts; `None` (the default) counts every row.
    - `timesteps`: `[N, K]` the start times of the `K` steps of the sampler's grid that drew
        each row (what `FlowRollout.collect` records with an ODE sampler: the grid without
        its final 0), or `None`. DiffusionNFT's released form trains on these times.

    **Raises:**

    - `ValueError`: naming the field whose leading axis is not `N`, or a `mask` that is not
        bool.
    """

    latents: Float[Array, " N *latent"]
    advantages: Float[Array, " N"]
    cond: PyTree[Any]
    mask: Bool[Array, " N"]
    timesteps: Float[Array, " N K"] | None

    def __init__(
        self,
        latents: Float[Array, " N *latent"],
        advantages: Float[Array, " N"],
        cond: PyTree[Any],
        mask: Bool[Array, " N"] | None = None,
        timesteps: Float[Array, " N K"] | None = None,
    ):
        self.latents = latents
        self.advantages = advantages
        self.cond = cond
        self.mask = jnp.ones(jnp.shape(latents)[:1], bool) if mask is None else mask
        self.timesteps = timesteps

    def __check_init__(self) -> None:
        if jnp.ndim(self.latents) < 1:
            raise ValueError(
                f"FinalSamples.latents has shape {jnp.shape(self.latents)}, expected [N, *latent]."
            )
        rows = jnp.shape(self.latents)[0]
        for name in ("advantages", "mask"):
            shape = tuple(jnp.shape(getattr(self, name)))
            if shape != (rows,):
                raise ValueError(
                    f"FinalSamples.{name} has shape {shape}, expected [N] = ({rows},)."
                )
        if jnp.result_type(self.mask) != jnp.bool_:
            raise ValueError(
                f"FinalSamples.mask must be a bool array, got dtype {jnp.result_type(self.mask)}."
            )
        check_leading_rows("FinalSamples", "cond", self.cond, rows)
        if self.timesteps is not None and (
            jnp.ndim(self.timesteps) != 2 or jnp.shape(self.timesteps)[0] != rows
        ):
            raise ValueError(
                f"FinalSamples.timesteps has shape {tuple(jnp.shape(self.timesteps))}, "
                f"expected [N, K] with N = {rows}."
            )

    @property
    def num_rows(self) -> int:
        """`N`, the number of rows (samples)."""
        return int(self.latents.shape[0])


def _shape_error(field: str, expected: str, actual: tuple[int, ...]) -> ValueError:
    return ValueError(f"Transitions.{field} has shape {tuple(actual)}, expected {expected}.")


_PER_TRANSITION_FIELDS = ("timesteps", "next_timesteps", "old_log_probs", "transition_mask")


def check_batch_type(batch: Any, kind: type, needed_by: str | None, what: str) -> None:
    """Raise a `ValueError` naming `batch` unless it is a `kind`.

    **Arguments:**

    - `batch`: the batch an objective's `loss` was given.
    - `kind`: the batch class the objective trains on.
    - `needed_by`: the objective, for the message; `None` for none.
    - `what`: what a `kind` holds and where it comes from, for the message.

    **Raises:**

    - `ValueError`: `"`batch` must be <kind> for <needed_by> (<what>), got <type>."`.
    """
    if not isinstance(batch, kind):
        user = "" if needed_by is None else f" for {needed_by}"
        raise ValueError(
            f"`batch` must be {kind.__name__}{user} ({what}), got {type(batch).__name__}."
        )


def check_final_samples(batch: Any, needed_by: str) -> None:
    """Raise a `ValueError` naming `batch` unless it is `FinalSamples`.

    **Arguments:**

    - `batch`: the batch to check.
    - `needed_by`: the objective that needs `FinalSamples`, for the message.

    **Raises:**

    - `ValueError`: naming `batch`, the type it got and the type needed.
    """
    check_batch_type(
        batch,
        FinalSamples,
        needed_by,
        "the final samples of an ODE rollout: `training_batch` makes them",
    )


def check_transitions(batch: Any, needed_by: str | None = None) -> None:
    """Check that `batch` is a `Transitions` whose fields agree with `[N, K, *latent]`, and,
    where its arrays are concrete (not traced), that time decreases along every transition
    the mask keeps.

    `N` and `K` are the shape the `[N, K]` fields (`timesteps`, `next_timesteps`,
    `old_log_probs`, `transition_mask`) agree on, so a field of another shape is the one
    named.

    **Arguments:**

    - `batch`: the batch to check.
    - `needed_by`: the objective that needs `Transitions`, for the message; `None` for none.

    **Raises:**

    - `ValueError`: naming `batch`, the type it got and the type needed, if `batch` is not a
        `Transitions` (say, the `FinalSamples` of an ODE rollout); naming the first field
        whose shape or dtype is wrong; naming `next_timesteps` and `timesteps` if a kept
        transition does not run from `t` down to `t_next < t`.
    """
    check_batch_type(
        batch, Transitions, needed_by, "the recorded transitions of an SDESampler rollout"
    )
    shapes = {name: tuple(jnp.shape(getattr(batch, name))) for name in _PER_TRANSITION_FIELDS}
    # The shape most [N, K] fields agree on (on a tie, that of `timesteps`).
    counts = {shape: list(shapes.values()).count(shape) for shape in shapes.values()}
    want_nk = max(shapes.values(), key=lambda shape: counts[shape])
    for name, shape in shapes.items():
        if len(shape) != 2:
            raise _shape_error(name, "[N, K]", shape)
    for name, shape in shapes.items():
        if shape != want_nk:
            raise _shape_error(name, f"[N, K] = {want_nk}", shape)
    n, k = want_nk
    agreed = ", ".join(name for name, shape in shapes.items() if shape == want_nk)
    latents = batch.latents
    if tuple(jnp.shape(latents))[:2] != want_nk:
        raise _shape_error(
            "latents",
            f"[N, K, *latent] with [N, K] = {want_nk} (the shape of {agreed})",
            jnp.shape(latents),
        )
    if tuple(jnp.shape(batch.next_latents)) != tuple(latents.shape):
        raise _shape_error(
            "next_latents",
            f"[N, K, *latent] = {tuple(latents.shape)}",
            jnp.shape(batch.next_latents),
        )
    if batch.old_means is not None and tuple(jnp.shape(batch.old_means)) != tuple(latents.shape):
        raise _shape_error(
            "old_means", f"[N, K, *latent] = {tuple(latents.shape)}", jnp.shape(batch.old_means)
        )
    if jnp.result_type(batch.transition_mask) != jnp.bool_:
        raise ValueError(
            "Transitions.transition_mask must be a bool array, got dtype "
            f"{jnp.result_type(batch.transition_mask)}."
        )
    for name in ("latents", "next_latents", "timesteps", "next_timesteps", "old_log_probs"):
        if not jnp.issubdtype(jnp.result_type(getattr(batch, name)), jnp.floating):
            raise ValueError(
                f"Transitions.{name} must be floating point, got dtype "
                f"{jnp.result_type(getattr(batch, name))}."
            )
    advantage_shape = tuple(jnp.shape(batch.advantages))
    if advantage_shape not in ((n,), want_nk):
        raise _shape_error("advantages", f"[N] = {(n,)} or [N, K] = {want_nk}", advantage_shape)
    check_leading_rows("Transitions", "cond", batch.cond, n)
    _check_times_decrease(batch)


def _on_host(value: Any) -> bool:
    """Whether `value` can be read on the host here: not traced, not abstract (a
    `jax.ShapeDtypeStruct`, as an ahead-of-time plan builds), and (for a JAX array) every shard
    of it held by this process."""
    if isinstance(value, (jax.core.Tracer, jax.ShapeDtypeStruct)):
        return False
    return not isinstance(value, jax.Array) or value.is_fully_addressable


def _check_times_decrease(batch: Transitions) -> None:
    """Refuse a kept transition whose `next_timesteps` is not below its `timesteps` (one
    NumPy comparison; skipped when the arrays are traced or not all on this process)."""
    fields = (batch.timesteps, batch.next_timesteps, batch.transition_mask)
    if not all(_on_host(value) for value in fields):
        return
    t, t_next, mask = (np.asarray(value) for value in fields)
    wrong = mask & ~(t_next < t)
    if not wrong.any():
        return
    row, step = (int(i) for i in np.argwhere(wrong)[0])
    raise ValueError(
        "Transitions.next_timesteps must be below Transitions.timesteps at every kept "
        "transition (time runs from noise at t = 1 down to data at t = 0), but "
        f"{int(wrong.sum())} kept transitions do not: at row {row}, transition {step}, "
        f"`next_timesteps` is {t_next[row, step]} and `timesteps` {t[row, step]}."
    )


@final
class RolloutInfo(eqx.Module):
    """Host-side diagnostics of one `collect`.

    **Arguments:**

    - `rewards`: `[N]` float64 rewards, exactly as the reward returned them.
    - `reward_mean`: the float32 mean reward (a diagnostic).
    - `zero_std_fraction`: the fraction of groups whose rewards are all equal.
    - `mean_group_std`: the mean over groups of the population reward std.
    - `samples`: `[N, *sample]` the decoded samples (device array).
    - `final`: `[N, *latent]` the final latents at t = 0 that `samples` decode (device
        array): what DiffusionNFT trains on.
    - `seconds`: wall time of `generation` (device work) and `reward` (host transfer,
        reward, float64 statistics, transport between processes).
    - `reward_calls_here`: how many times this process called the reward (1 on process 0,
        0 elsewhere).
    - `window_start`: the window's position, its first stochastic transition (a window
        schedule's `first`; 0 without one; `RandomSteps`' bit mask of its steps).
    - `reward_advantages`: `[R, N]` each reward's own group-normalised advantages, when the
        rollout normalises a `WeightedReward`'s terms one by one
        (`reward_combination="normalize_each"`); `None` otherwise. The batch's advantages are
        their weighted sum; an objective that combines them otherwise (DanceGRPO's
        multi-reward loss) reads them here.
    - `reward_weights`: `[R]` the terms' weights, with `reward_advantages`; else `None`.
    """

    rewards: npt.NDArray[np.float64]
    reward_mean: np.float32
    zero_std_fraction: float
    mean_group_std: float
    samples: Float[Array, " N *sample"]
    final: Float[Array, " N *latent"]
    seconds: dict[str, float]
    reward_calls_here: int
    window_start: int
    reward_advantages: npt.NDArray[np.float32] | None = None
    reward_weights: tuple[float, ...] | None = None


__all__ = [
    "Array",
    "Aux",
    "StepRatios",
    "Condition",
    "FinalSamples",
    "Latent",
    "Latents",
    "Mean",
    "Model",
    "PRNGKeyArray",
    "PyTree",
    "RolloutInfo",
    "RealScalarLike",
    "Scalar",
    "ScalarLike",
    "Step",
    "Times",
    "Transitions",
    "check_transitions",
]
