"""DGPO's loss forms: how a group's preference margin becomes a loss of each (row, time)
(`DGPOSurrogateLoss`, `GroupDPOLoss`), and the group sums they read."""

import abc
from typing import Any, Literal, TypeAlias, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .._custom_types import Model
from .._guided_flow import GuidedFlow
from .._inputs import CFG
from .._misc import stop_gradient_arrays
from ._base import checked_flow
from ._dgpo_data import DGPOVariables, TrainingPoints


DGPOReference: TypeAlias = Literal["base", "ema"]
"""The reference of DGPO's implicit rewards: the frozen base model (`"base"`, the released
default, the same model as the KL's), or the EMA reference (`"ema"`, the release's
`use_ema_ref`)."""


def group_sum(members: Float[Array, " N N"], term: Float[Array, " N T"]) -> Float[Array, " N T"]:
    """Each row's sum of `term` over the rows of its group.

    **Arguments:**

    - `members`: `[N, N]` 1 where row `j` counts and shares row `i`'s group.
    - `term`: `[N, T]` a value of each (row, time).

    **Returns:**

    `[N, T]`: row `i`'s sum of `term` over the rows `j` of its group.
    """
    return jnp.sum(members[:, :, None] * term[None, :, :], axis=1)


@final
class GroupPreferenceTerms(eqx.Module):
    """What DGPO's loss forms read at each (row, time) (`AbstractDGPOLoss`).

    **Arguments:**

    - `error`, `reference_error`: `[N, T]` the live policy's errors (clipped ones detached)
        and the DPO reference's.
    - `advantages`: `[N, 1]` the clipped advantages (0 for rows that do not count).
    - `weight`: `[N, T]` `sigmoid(x_g)` of detached errors.
    - `members`: `[N, N]` 1 where row `j` counts and shares row `i`'s group.
    - `beta_dpo`, `group_size`: the objective's.
    """

    error: Float[Array, " N T"]
    reference_error: Float[Array, " N T"]
    advantages: Float[Array, " N 1"]
    weight: Float[Array, " N T"]
    members: Float[Array, " N N"]
    beta_dpo: float
    group_size: int


class AbstractDGPOLoss(eqx.Module):
    """How DGPO's group preference becomes a loss: the released gradient-equivalent
    surrogate (`DGPOSurrogateLoss`) or the group DPO loss it equals in gradient
    (`GroupDPOLoss`)."""

    @abc.abstractmethod
    def __call__(self, terms: GroupPreferenceTerms) -> Float[Array, " N T"]:
        """The loss of each (row, time).

        **Arguments:**

        - `terms`: the errors, advantages, weights and groups.

        **Returns:**

        `[N, T]` losses.
        """


@final
class DGPOSurrogateLoss(AbstractDGPOLoss):
    """`sg(sigmoid(x_g)) A_i e_i`: the release's `compute_group_dgpo_loss_allreduce`, its
    default."""

    def __call__(self, terms: GroupPreferenceTerms) -> Float[Array, " N T"]:
        return jax.lax.stop_gradient(terms.weight) * terms.advantages * terms.error


@final
class GroupDPOLoss(AbstractDGPOLoss):
    """`softplus(x_g) group_size / (beta_dpo n_g)` per row of a group, `n_g` the group's rows
    in the batch: the paper's `-log sigmoid(R(G+) - R(G-))`, whose gradient is the
    surrogate's."""

    def __call__(self, terms: GroupPreferenceTerms) -> Float[Array, " N T"]:
        scale = terms.beta_dpo / terms.group_size
        reference_error = jax.lax.stop_gradient(terms.reference_error)
        live = group_sum(terms.members, terms.advantages * scale * (terms.error - reference_error))
        count = jnp.maximum(jnp.sum(terms.members, axis=1), 1.0)
        share = (terms.group_size / (terms.beta_dpo * count))[:, None]
        return jax.nn.softplus(live) * share


def same_group(
    group: Int[Array, " N"], keep: Bool[Array, " N"], group_size: int
) -> Bool[Array, "N N"]:
    """Whether row `j` is a counted row of row `i`'s group.

    **Arguments:**

    - `group`: `[N]` each row's group id.
    - `keep`: `[N]` the rows that count.
    - `group_size`: the most counted rows a group may have.

    **Returns:**

    `[N, N]` bools.

    **Raises:**

    - `EquinoxRuntimeError`: if a group has more than `group_size` counted rows.
    """
    same = (group[:, None] == group[None, :]) & keep[None, :]
    checked: Bool[Array, "N N"] = eqx.error_if(
        same,
        jnp.any(keep & (jnp.sum(same, axis=1) > group_size)),
        "A group of the batch has more counted rows than `group_size`: the batch's "
        "`group` ids do not match the objective's `group_size`.",
    )
    return checked


def ratio_clip(
    error: Float[Array, " F"],
    ema_error: Float[Array, " F"],
    advantages: Float[Array, " F"],
    clip_range: float | None,
) -> Bool[Array, " F"]:
    """The release's PPO-style clip of the DSM term: with `r = exp(e_ema - e)`, `r > 1 +
    clip_range` where `A > 0`, else `r < 1 - clip_range`.

    **Arguments:**

    - `error`: `[F]` the live policy's errors `e`.
    - `ema_error`: `[F]` the EMA reference's.
    - `advantages`: `[F]` the clipped advantages.
    - `clip_range`: the ratio clip, or `None` for none.

    **Returns:**

    `[F]` bools (all `False` with `clip_range=None`).
    """
    if clip_range is None:
        return jnp.zeros(error.shape, bool)
    ratio = jnp.exp(ema_error - error)
    return jnp.where(advantages > 0, ratio > 1.0 + clip_range, ratio < 1.0 - clip_range)


def group_preference_loss(
    loss_form: AbstractDGPOLoss,
    error: Float[Array, " N T"],
    reference_error: Float[Array, " N T"],
    advantages: Float[Array, " N"],
    same_group: Bool[Array, " N N"],
    beta_dpo: float,
    group_size: int,
) -> tuple[Float[Array, " N T"], Float[Array, " N T"]]:
    """The group preference loss of each (row, time) and its sigmoid weight.

    `x_g = beta_dpo / group_size * sum_{j in g} A_j (e_j - e_ref,j)`, summed over the
    row's group at each time; `DGPOSurrogateLoss`: `sg(sigmoid(x_g)) A_i e_i` with `x_g`
    from detached errors; `GroupDPOLoss`: `softplus(x_g) group_size / (beta_dpo n_g)`,
    `n_g` the row's group's rows in the batch, so that the gradient is the surrogate's.

    **Arguments:**

    - `loss_form`: the objective's `AbstractDGPOLoss`.
    - `error`: `[N, T]` the live policy's errors (clipped ones detached).
    - `reference_error`: `[N, T]` the DPO reference's.
    - `advantages`: `[N]` the clipped advantages (0 for rows that do not count).
    - `same_group`: `[N, N]`, whether row `j` counts and shares row `i`'s group.
    - `beta_dpo`, `group_size`: the objective's.

    **Returns:**

    `([N, T] losses, [N, T] weights sigmoid(x_g))`, with
    `x_g = beta_dpo / group_size * sum_{j in g} A_j (e_j - e_ref,j)` of detached errors.
    """
    a = advantages[:, None]
    scale = beta_dpo / group_size
    members = same_group.astype(jnp.float32)
    detached = jax.lax.stop_gradient(error)
    margin = group_sum(members, a * scale * (detached - jax.lax.stop_gradient(reference_error)))
    weight = jax.nn.sigmoid(margin)
    terms = GroupPreferenceTerms(error, reference_error, a, weight, members, beta_dpo, group_size)
    losses = loss_form(terms)
    return losses, weight


def base_velocity(
    flow: GuidedFlow, base: Model, points: TrainingPoints, guidance: CFG | None
) -> Array:
    """The base model's velocity at the training points: conditional, or guided.

    **Arguments:**

    - `flow`: the objective's `GuidedFlow`.
    - `base`: the base model.
    - `points`: the loss's `TrainingPoints`.
    - `guidance`: the objective's `reference_guidance`, or `None` for the conditional
        velocity.

    **Returns:**

    The float32 velocity.
    """
    x_t, t, conditioning = points.x_t, points.t, points.cond
    conditional = flow.call_model(base, x_t, t, conditioning).astype(jnp.float32)
    if guidance is None:
        return conditional
    null = flow.null_like(conditioning)
    unconditional = flow.call_model(base, x_t, t, null).astype(jnp.float32)
    return guidance.combine(conditional, unconditional)


def check_loss_form(loss_form: Any) -> None:
    """Check the objective's `loss_form`.

    **Arguments:**

    - `loss_form`: the objective's `loss_form` (any value: this is its check).

    **Raises:**

    - `ValueError`: naming `loss_form` if it is not an `AbstractDGPOLoss`.
    """
    if not isinstance(loss_form, AbstractDGPOLoss):
        raise ValueError(
            "`loss_form` must be an AbstractDGPOLoss (DGPOSurrogateLoss, GroupDPOLoss), "
            f"got {loss_form!r}."
        )


def check_reference_guidance(guidance: Any, flow: Any) -> None:
    """Check the objective's `reference_guidance` against its flow.

    **Arguments:**

    - `guidance`: the objective's `reference_guidance` (any value: this is its check).
    - `flow`: the objective's `flow` (checked by `checked_flow` when it is read).

    **Raises:**

    - `ValueError`: naming `reference_guidance` if it is neither a `CFG` nor `None`, or if
        it is one and the flow's inputs have no null condition; as `checked_flow`.
    """
    if guidance is not None:
        if not isinstance(guidance, CFG):
            raise ValueError(f"`reference_guidance` must be a CFG or None, got {guidance!r}.")
        if not checked_flow(flow).inputs.has_null:
            raise ValueError(
                "`reference_guidance` needs a null condition, but `inputs` has none: pass "
                "InputSpec(null=...) or reference_guidance=None."
            )


def reference_velocities(
    flow: GuidedFlow,
    variables: DGPOVariables,
    points: TrainingPoints,
    guidance: CFG | None,
    base: bool,
    ema: bool,
) -> tuple[Array | None, Array | None]:
    """The detached velocities of the base model and of the EMA reference at the training
    points.

    **Arguments:**

    - `flow`: the objective's `GuidedFlow`.
    - `variables`: the objective's variables.
    - `points`: the loss's `TrainingPoints`.
    - `guidance`: the objective's `reference_guidance` (`base_velocity`).
    - `base`: whether to compute the base model's (the variables keep it).
    - `ema`: whether to compute the EMA reference's (the ratio clip or an `"ema"` DPO
        reference reads it).

    **Returns:**

    `(v_base, v_ema)`, each `None` when not asked for.

    **Raises:**

    - `ValueError`: as `variables.reference_policy()` or `ema_policy`.
    """
    v_base = None
    if base:
        frozen = stop_gradient_arrays(variables.reference_policy())
        v_base = jax.lax.stop_gradient(base_velocity(flow, frozen, points, guidance))
    v_ema = None
    if ema:
        policy = stop_gradient_arrays(variables.ema_policy())
        velocity = flow.call_model(policy, points.x_t, points.t, points.cond).astype(jnp.float32)
        v_ema = jax.lax.stop_gradient(velocity)
    return v_base, v_ema
