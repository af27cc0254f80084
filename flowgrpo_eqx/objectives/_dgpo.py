"""`DGPOObjective`: Direct Group Preference Optimization, as its authors' released code
computes it."""

import abc
from dataclasses import KW_ONLY
from typing import Any, Literal, TypeAlias, final

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray, PyTree

from .._custom_types import (
    ExampleMask,
    FinalSamples,
    Mean,
    Model,
    PerExample,
    RolloutInfo,
    Step,
    Transitions,
    check_batch_type,
)
from .._guided_flow import GuidedFlow
from .._inputs import CFG
from .._misc import (
    check_bool,
    check_int,
    check_mode,
    check_number,
    stop_gradient_arrays,
    zero_rows_unless,
)
from .._sampling import AbstractSampler, ODESampler
from .._solver import AbstractSolver, DPMSolverPP2M
from ._base import (
    AbstractEMAVariables,
    AbstractReferenceVariables,
    AbstractRLObjective,
    checked_flow,
)
from ._decay import RampedDecay, check_decay, decay_at
from ._final_samples import (
    example_mse,
    final_samples,
    kept_grid,
    mean_over,
    noised,
    repeated_rows,
    row_mean,
)
from ._trainable import (
    TrainableFilter,
    blend_part,
    reference_part,
    trainable_part,
)


def _group_sum(members: Float[Array, " N N"], term: Float[Array, " N T"]) -> Float[Array, " N T"]:
    """Each row's sum of `term` over the rows of its group (`members[i, j]`: 1 where row `j`
    counts and shares row `i`'s group)."""
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
        live = _group_sum(terms.members, terms.advantages * scale * (terms.error - reference_error))
        count = jnp.maximum(jnp.sum(terms.members, axis=1), 1.0)
        share = (terms.group_size / (terms.beta_dpo * count))[:, None]
        return jax.nn.softplus(live) * share


DGPOReference: TypeAlias = Literal["base", "ema"]
"""The reference of DGPO's implicit rewards: the frozen base model (`"base"`, the released
default, the same model as the KL's), or the EMA reference (`"ema"`, the release's
`use_ema_ref`)."""

_RELEASED_EMA_DECAY = RampedDecay(rate=0.001, maximum=0.3)
_RELEASED_SOLVER = DPMSolverPP2M()
_QUANTUM_TOLERANCE = 1e-3
"""Added to `quantize * t` before the floor, in units of one training timestep: it absorbs
the float32 rounding of a grid time (below 1e-4 timesteps), so that a time the release
computes as an integer number of timesteps in float64 keeps that integer here."""


@final
class DGPOVariables(AbstractEMAVariables, AbstractReferenceVariables):
    """DGPO's variables: the live policy, its EMA reference, the frozen base, and where the
    epoch trains.

    **Arguments:**

    - `policy`: the live velocity model, trained by the optimizer.
    - `ema`: when `clip_range`, `dpo_reference="ema"` or `switch_ema_ref` needs it, the EMA
        reference's trainable part (`trainable_part`: the adapters of a LoRA policy, every
        float array of a fully trained one; the release's `ema_ref`); the EMA policy is the
        live one carrying it (`with_part`). It starts as the initial policy's and moves
        once per epoch (`DGPOObjective.end_epoch`). `None` otherwise.
    - `reference`: when `dpo_reference="base"` or `kl_beta > 0`, the frozen `reference_part`
        of the initial policy; the base model is `reference_policy` (the adapters switched
        off). `None` otherwise.
    - `indices`: `[T]` int32, the grid indices every update of this epoch trains at
        (`DGPOObjective.epoch_indices`).
    - `step`: int32, the optimizer updates done when the last epoch ended (0 before the
        first): the release's `global_step` when it samples.
    """

    policy: Model
    ema: PyTree[Any] | None
    reference: PyTree[Any] | None
    indices: Int[Array, " T"]
    step: Int[Array, ""]


@final
class GroupedSamples(eqx.Module):
    """Final samples with the group of each row: what `DGPOObjective` trains on.

    The minibatches of an epoch cut rows in any order; the group ids say which rows share a
    prompt's group wherever they land (the release groups a micro-batch's rows by their
    prompt ids).

    **Arguments:**

    - `samples`: the `FinalSamples` (latents, advantages, rows, mask, grid).
    - `group`: `[N]` integer ids, equal for the rows of one group.

    **Raises:**

    - `ValueError`: naming `group` if it is not one integer per row.
    """

    samples: FinalSamples
    group: Int[Array, " N"]

    def __check_init__(self) -> None:
        rows = self.samples.num_rows
        if tuple(jnp.shape(self.group)) != (rows,) or not jnp.issubdtype(
            jnp.result_type(self.group), jnp.integer
        ):
            raise ValueError(
                f"GroupedSamples.group must be [N] = ({rows},) integers, got shape "
                f"{tuple(jnp.shape(self.group))} and dtype {jnp.result_type(self.group)}."
            )

    @property
    def num_rows(self) -> int:
        """`N`, the number of rows."""
        return self.samples.num_rows

    @property
    def advantages(self) -> Any:
        """`[N]` the rows' advantages (`samples.advantages`), which the trainer checks finite
        (annotated `Any`: `eqx.tree_at` reads it on a tree of placeholders)."""
        return self.samples.advantages


@final
class DGPOObjective(AbstractRLObjective[DGPOVariables, GroupedSamples]):
    """Direct Group Preference Optimization (arXiv 2510.08425) as the authors' released
    `scripts/train_sd3_dgpo.py` computes it (`docs/mathematics/dgpo.md` §10); the defaults are
    its default recipe (`config/dgpo.py`, `general_ocr_sd3_4gpu`: rollout with CFG,
    training without).

    Trained on final samples `x_0` of a deterministic (ODE) rollout, one advantage `A` per
    row, clipped to `[-adv_clip_max, adv_clip_max]`, and the groups of `group_size` rows.
    Every update of an epoch trains at the same `T` grid indices, drawn once per epoch
    without replacement from `0..trunc_steps` (`epoch_indices`); row `i` trains at
    `t = floor(quantize * grid_i[index]) / quantize` (the release's integer timesteps over
    1000), at `x_t = (1 - t) x_0 + t eps`, with one `eps` per (group, time) shared by the
    group's rows (`shared_noise`). With the flow-matching errors
    `e = mean (v_theta(x_t, t, c) - (eps - x_0))^2` of the live policy's conditional
    velocity (no guidance in the loss), `e_ref` of the reference's, a group's preference
    margin at each time is

    `x_g = beta_dpo / group_size * sum_{i in g} A_i (e_i - e_ref,i)`,

    and the policy loss of row `i` at that time `sg(sigmoid(x_g)) A_i e_i`
    (`DGPOSurrogateLoss`, released), whose gradient is that of the group DPO loss
    `group_size softplus(x_g) / beta_dpo` per group (`GroupDPOLoss`, which gives each of a
    group's `n_g` counted rows `1 / n_g` of it). With `clip_range`, an example whose ratio
    `r = exp(e_ema - e)` to the EMA reference leaves `1 + clip_range` (for `A > 0`) or
    `1 - clip_range` (otherwise) keeps its value but trains no more (its `e` detached).
    The loss adds `kl_beta mean (v_theta - v_base)^2`; each row's loss is the mean over its
    times, and the batch's the mean over its counted rows.

    The EMA reference moves once per epoch, `ema = d ema + (1 - d) live` with
    `d = ema_decay(step - 1)` (`RampedDecay(rate=0.001, maximum=0.3)`: the released
    `min(0.001 global_step, 0.3)` of the epoch's last update); the rollout samples with it
    once more than `switch_ema_ref` updates are done.

    **Arguments:**

    - `flow`: a `GuidedFlow`; its guidance is the rollout's (the release's `CFG(4.5)`;
        `None` for none). The loss never guides the live policy.
    - `pretrained`: as for `FlowGRPOObjective`.
    - `group_size`: the rows of one group, the rollout's `groups` (the release's
        `num_image_per_prompt`, 16 in its recipe), >= 1: the batch's groups are runs of
        this many consecutive rows, and `x_g` divides by it.
    - `beta_dpo`: `beta_dpo`, > 0 (default 100).
    - `loss_form`: an `AbstractDGPOLoss`: `DGPOSurrogateLoss()` (default, the release's) or
        `GroupDPOLoss()`.
    - `dpo_reference`: `"base"` (default) or `"ema"` (`DGPOReference`).
    - `reference_guidance`: `None` (default) or a `CFG` the base model's velocity is guided
        with, for the KL and a `"base"` DPO reference (the release's `kl_cfg > 1`).
    - `clip_range`: the ratio clip, > 0, or `None` for none (default 0.01; the release's
        `clip_dsm`).
    - `clip_kl`: whether a clipped example's KL trains no more either (default `False`).
    - `adv_clip_max`: the advantage clip, > 0 (default 5.0).
    - `kl_beta`: the weight of the KL to the base model, >= 0 (default 0.02).
    - `train_timesteps`: `T`, the trained indices per epoch, in `1..trunc_steps + 1`
        (default 4).
    - `trunc_steps`: the last grid index trained, >= 0 (default 6).
    - `shared_noise`: whether a group's rows share their noise at each time (default
        `True`); `False` draws one per (row, time).
    - `quantize`: the training timesteps per unit time, >= 1, or `None` to train at the
        grid's own times (default 1000).
    - `ema_decay`: a `RampedDecay` (default, the released ramp), a constant in [0, 1), or
        `None` to keep the EMA reference at the initial policy.
    - `switch_ema_ref`: the updates after which the EMA reference samples the rollout,
        >= 0, or `None` for never (default 200).
    - `seed`: seeds the epochs' trained indices, >= 0 (default 0).
    - `solver`: the ODE solver of the default rollout (`rollout_sampler`; default
        `DPMSolverPP2M()`, the release's DPM-Solver++; the release evaluates with it on 15
        time points: `evaluate_policy(flow, DPMSolverPP2M(), 15, ...)`).

    **Raises:**

    - `ValueError`: naming the argument, for a value outside the ranges above, an unknown
        mode, `clip_kl` without `clip_range`, `reference_guidance` without a null condition,
        a `flow` that is not a `GuidedFlow`, or a `solver` that is not an `AbstractSolver`.
    """

    flow: GuidedFlow
    _: KW_ONLY
    group_size: int = eqx.field(static=True)
    beta_dpo: float = 100.0
    loss_form: AbstractDGPOLoss = DGPOSurrogateLoss()
    dpo_reference: DGPOReference = eqx.field(default="base", static=True)
    reference_guidance: CFG | None = None
    clip_range: float | None = 0.01
    clip_kl: bool = eqx.field(default=False, static=True)
    adv_clip_max: float = 5.0
    kl_beta: float = 0.02
    train_timesteps: int = eqx.field(default=4, static=True)
    trunc_steps: int = eqx.field(default=6, static=True)
    shared_noise: bool = eqx.field(default=True, static=True)
    quantize: int | None = eqx.field(default=1000, static=True)
    ema_decay: float | RampedDecay | None = _RELEASED_EMA_DECAY
    switch_ema_ref: int | None = eqx.field(default=200, static=True)
    seed: int = eqx.field(default=0, static=True)
    solver: AbstractSolver = _RELEASED_SOLVER
    pretrained: Model | None = None

    def __check_init__(self) -> None:
        check_int("group_size", self.group_size, 1)
        check_number("beta_dpo", self.beta_dpo, minimum=0, include_minimum=False)
        if not isinstance(self.loss_form, AbstractDGPOLoss):
            raise ValueError(
                "`loss_form` must be an AbstractDGPOLoss (DGPOSurrogateLoss, GroupDPOLoss), "
                f"got {self.loss_form!r}."
            )
        check_mode("dpo_reference", self.dpo_reference, DGPOReference)
        if self.reference_guidance is not None:
            if not isinstance(self.reference_guidance, CFG):
                raise ValueError(
                    f"`reference_guidance` must be a CFG or None, got {self.reference_guidance!r}."
                )
            if not checked_flow(self.flow).inputs.has_null:
                raise ValueError(
                    "`reference_guidance` needs a null condition, but `inputs` has none: pass "
                    "InputSpec(null=...) or reference_guidance=None."
                )
        check_number("clip_range", self.clip_range, minimum=0, include_minimum=False, optional=True)
        check_bool("clip_kl", self.clip_kl)
        check_bool("shared_noise", self.shared_noise)
        if self.clip_kl and self.clip_range is None:
            raise ValueError(
                "`clip_kl` needs `clip_range`: it detaches the KL of the examples the ratio "
                "clip stops, and with `clip_range=None` none is."
            )
        check_number("adv_clip_max", self.adv_clip_max, minimum=0, include_minimum=False)
        check_number("kl_beta", self.kl_beta, minimum=0)
        check_int("trunc_steps", self.trunc_steps, 0)
        check_int("train_timesteps", self.train_timesteps, 1)
        if self.train_timesteps > self.trunc_steps + 1:
            raise ValueError(
                f"`train_timesteps` must be at most `trunc_steps` + 1 = {self.trunc_steps + 1} "
                f"(distinct indices of 0..{self.trunc_steps}), got {self.train_timesteps}."
            )
        check_int("quantize", self.quantize, 1, optional=True)
        check_decay("ema_decay", self.ema_decay)
        check_int("switch_ema_ref", self.switch_ema_ref, 0, optional=True)
        check_int("seed", self.seed, 0)
        if not isinstance(self.solver, AbstractSolver):
            raise ValueError(f"`solver` must be an AbstractSolver, got {self.solver!r}.")

    # ----------------------------------------------------------------------------------
    # The RL loop's interface

    @property
    def keeps_ema(self) -> bool:
        """Whether the variables keep the EMA reference: the ratio clip, an `"ema"` DPO
        reference or the rollout's switch reads it."""
        return (
            self.clip_range is not None
            or self.dpo_reference == "ema"
            or self.switch_ema_ref is not None
        )

    @property
    def keeps_base(self) -> bool:
        """Whether the variables keep the frozen base model: a `"base"` DPO reference or the
        KL reads it."""
        return self.dpo_reference == "base" or self.kl_beta > 0

    def variables_for(self, policy: Model, trainable: TrainableFilter | None) -> DGPOVariables:
        return DGPOVariables(
            policy=policy,
            ema=trainable_part(policy, trainable) if self.keeps_ema else None,
            reference=reference_part(policy, trainable) if self.keeps_base else None,
            indices=self.epoch_indices(0),
            step=jnp.zeros((), jnp.int32),
        )

    def rollout_sampler(self, requested: AbstractSampler | None) -> AbstractSampler:
        """`ODESampler(solver)` by default (the release's deterministic DPM-Solver++); any
        requested sampler otherwise: DGPO trains on final samples, whatever drew them."""
        return ODESampler(self.solver) if requested is None else requested

    def sampling_policy(self, variables: DGPOVariables) -> Model:
        """The EMA reference once `variables.step > switch_ema_ref` (the release's
        `global_step > switch_ema_ref` when it samples), else the live policy.

        **Arguments:**

        - `variables`: the trainer's variables.

        **Returns:**

        The model the rollout samples with.

        **Raises:**

        - `ValueError`: as `ema_policy`.
        """
        switch = self.switch_ema_ref
        if switch is not None and int(variables.step) > switch:
            return variables.ema_policy()
        return variables.policy

    def training_batch(
        self, collected: Transitions | FinalSamples, info: RolloutInfo
    ) -> GroupedSamples:
        """The rollout's final samples with their groups, runs of `group_size` rows (as a
        `FlowRollout` lays them out); every row counts.

        **Arguments:**

        - `collected`: `FinalSamples` (an ODE rollout), or `Transitions` (an SDE rollout:
            its rows, advantages and grid, with the final latents of `info`).
        - `info`: the rollout's `RolloutInfo`.

        **Returns:**

        The `GroupedSamples`, the group ids placed as the advantages are.

        **Raises:**

        - `ValueError`: if `collected` holds per-transition (`[N, K]`) advantages, or
            naming `group_size` if it does not divide the rows.
        """
        samples = final_samples(collected, info, "DGPO")
        rows = samples.num_rows
        if rows % self.group_size:
            raise ValueError(
                f"`group_size`={self.group_size} must divide the rollout's {rows} rows: it is "
                "the rollout's `groups`, whose runs of consecutive rows are DGPO's groups."
            )
        host = np.arange(rows, dtype=np.int32) // self.group_size
        sharding = samples.advantages.sharding
        group = jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
        return GroupedSamples(samples, group)

    def end_epoch(self, variables: DGPOVariables, step: int) -> DGPOVariables:
        """The EMA reference moved towards the live policy, the next epoch's indices drawn,
        and `step` recorded.

        **Arguments:**

        - `variables`: after the epoch's updates.
        - `step`: the optimizer updates done so far (`TrainState.step`).

        **Returns:**

        `variables` with `ema = d ema + (1 - d) live` (`d = ema_decay(step - 1)` for a
        `RampedDecay`: the decay of the epoch's last update, which `step - 1` updates
        preceded; else `ema_decay`; unmoved without an EMA or with `ema_decay=None`),
        `indices = epoch_indices(step)` and `step`.
        """
        decay = None
        if variables.ema is not None and self.ema_decay is not None:
            decay = jnp.asarray(decay_at(self.ema_decay, max(step - 1, 0)), jnp.float32)
        return _advance(
            variables,
            decay,
            jnp.asarray(step, jnp.int32),
            self.seed,
            self.trunc_steps + 1,
            self.train_timesteps,
        )

    def batch_metrics(self, batch: GroupedSamples) -> dict[str, float]:
        del batch
        return {}

    def loss_sums_over_rows(self) -> bool:
        """`False`: a row's weight is its group's, so rows of one group must share a batch."""
        return False

    # ----------------------------------------------------------------------------------
    # The pieces of the loss

    def epoch_indices(self, step: int | Int[Array, ""]) -> Int[Array, " T"]:
        """The grid indices an epoch trains at: `train_timesteps` distinct indices of
        `0..trunc_steps` (the release's `random.sample(range(trunc_steps + 1), M)`, once per
        epoch), `jax.random.permutation(key, trunc_steps + 1)[:T]` with
        `key = jax.random.fold_in(jax.random.key(seed), step)`.

        **Arguments:**

        - `step`: the optimizer updates done when the epoch starts (0 for the first).

        **Returns:**

        `[T]` int32 indices.
        """
        return _draw_indices(self.seed, step, self.trunc_steps + 1, self.train_timesteps)

    def clipped_advantages(self, advantages: Float[Array, " N"]) -> Float[Array, " N"]:
        """`clip(A, -adv_clip_max, adv_clip_max)` (the release's `adv_clip_max`).

        **Arguments:**

        - `advantages`: `[N]` advantages.

        **Returns:**

        `[N]` float32 advantages.
        """
        a = advantages.astype(jnp.float32)
        return jnp.clip(a, -self.adv_clip_max, self.adv_clip_max)

    def training_times(
        self, timesteps: Float[Array, " N K"], indices: Int[Array, " T"]
    ) -> Float[Array, " N T"]:
        """Each row's trained times: its grid at `indices`, quantised.

        With `quantize = Q`, `t = floor(Q t_grid + 1e-3) / Q`: the release trains at its
        scheduler's integer timesteps (`int64(1000 sigma)`) over 1000, and the `1e-3`
        absorbs the float32 rounding of the grid (a grid time `0.7` is `0.7` here as the
        release's float64 `700` is).

        **Arguments:**

        - `timesteps`: `[N, K]` the grid of each row.
        - `indices`: `[T]` the epoch's indices.

        **Returns:**

        `[N, T]` float32 times.

        **Raises:**

        - `ValueError`: naming `trunc_steps` if the grid has no index `trunc_steps`.
        - `EquinoxRuntimeError`: if an index lies outside the grid.
        """
        size = timesteps.shape[1]
        if self.trunc_steps >= size:
            raise ValueError(
                f"`trunc_steps`={self.trunc_steps} needs a grid of more than {self.trunc_steps} "
                f"start times, got {size}: sample with more steps or lower `trunc_steps`."
            )
        indices = eqx.error_if(
            indices,
            jnp.any((indices < 0) | (indices >= size)),
            "DGPOVariables.indices holds an index outside the grid of the batch.",
        )
        t = jnp.take(timesteps, indices, axis=1).astype(jnp.float32)
        if self.quantize is None:
            return t
        q = float(self.quantize)
        return jnp.floor(t * q + _QUANTUM_TOLERANCE) / q

    def training_noise(
        self, group: Int[Array, " N"], count: int, shape: tuple[int, ...], key: PRNGKeyArray
    ) -> Float[Array, " F *latent"]:
        """The noise of each (row, time), rows repeated time-fastest (`F = N T`).

        With `shared_noise`, row `i`'s noise at its `j`-th time is
        `jax.random.normal(jax.random.fold_in(key, group[i]), [T, *latent])[j]`: one draw per
        (group, time), as the release's `generate_shared_noise_for_groups`; otherwise
        `jax.random.normal(key, [N T, *latent])`.

        **Arguments:**

        - `group`: `[N]` the rows' groups.
        - `count`: `T`, the times per row.
        - `shape`: the shape of one latent.
        - `key`: the update's key (`step.key`).

        **Returns:**

        `[N T, *latent]` float32 noise.
        """
        rows = group.shape[0]
        if not self.shared_noise:
            return jax.random.normal(key, (rows * count, *shape), jnp.float32)

        def draw(member: Int[Array, ""]) -> Float[Array, " T *latent"]:
            return jax.random.normal(jax.random.fold_in(key, member), (count, *shape), jnp.float32)

        per_row: Float[Array, " N T *latent"] = jax.vmap(draw)(group)
        return per_row.reshape(rows * count, *shape)

    def should_clip(
        self,
        error: PerExample,
        ema_error: PerExample,
        advantages: PerExample,
    ) -> ExampleMask:
        """The release's PPO-style clip of the DSM term: with `r = exp(e_ema - e)`, `r > 1 +
        clip_range` where `A > 0`, else `r < 1 - clip_range`.

        **Arguments:**

        - `error`: `[F]` the live policy's errors `e`.
        - `ema_error`: `[F]` the EMA reference's.
        - `advantages`: `[F]` the clipped advantages.

        **Returns:**

        `[F]` bools (all `False` with `clip_range=None`).
        """
        if self.clip_range is None:
            return jnp.zeros(error.shape, bool)
        ratio = jnp.exp(ema_error - error)
        return jnp.where(
            advantages > 0, ratio > 1.0 + self.clip_range, ratio < 1.0 - self.clip_range
        )

    def preference_loss(
        self,
        error: Float[Array, " N T"],
        reference_error: Float[Array, " N T"],
        advantages: Float[Array, " N"],
        same_group: Bool[Array, " N N"],
    ) -> tuple[Float[Array, " N T"], Float[Array, " N T"]]:
        """The group preference loss of each (row, time) and its sigmoid weight.

        `x_g = beta_dpo / group_size * sum_{j in g} A_j (e_j - e_ref,j)`, summed over the
        row's group at each time; `DGPOSurrogateLoss`: `sg(sigmoid(x_g)) A_i e_i` with `x_g`
        from detached errors; `GroupDPOLoss`: `softplus(x_g) group_size / (beta_dpo n_g)`,
        `n_g` the row's group's rows in the batch, so that the gradient is the surrogate's.

        **Arguments:**

        - `error`: `[N, T]` the live policy's errors (clipped ones detached).
        - `reference_error`: `[N, T]` the DPO reference's.
        - `advantages`: `[N]` the clipped advantages (0 for rows that do not count).
        - `same_group`: `[N, N]`, whether row `j` counts and shares row `i`'s group.

        **Returns:**

        `([N, T] losses, [N, T] weights sigmoid(x_g))`.
        """
        a = advantages[:, None]
        scale = self.beta_dpo / self.group_size
        members = same_group.astype(jnp.float32)
        detached = jax.lax.stop_gradient(error)
        margin = _group_sum(
            members, a * scale * (detached - jax.lax.stop_gradient(reference_error))
        )
        weight = jax.nn.sigmoid(margin)
        terms = GroupPreferenceTerms(
            error, reference_error, a, weight, members, self.beta_dpo, self.group_size
        )
        losses = self.loss_form(terms)
        return losses, weight

    def loss(
        self, variables: DGPOVariables, batch: GroupedSamples, step: Step
    ) -> tuple[Mean, dict[str, Mean]]:
        """The DGPO loss over the batch's counted rows (one `Mean`, summed per row).

        Masked rows are replaced by a zero latent, advantage and conditioning (and time 1)
        before any arithmetic, and count in no group, so NaN or inf in them reach neither
        the loss nor its gradient.

        **Arguments:**

        - `variables`: gradients flow into `variables.policy` only; the times are at
            `variables.indices`.
        - `batch`: the `GroupedSamples`, with their grid `timesteps` `[N, K]`.
        - `step`: its key draws the noise (`training_noise(group, T, latent, step.key)`).

        **Returns:**

        `(Mean(sum of per-row losses, counted rows), aux)`, each row's loss its mean over its
        times of the preference loss plus `kl_beta` times the KL; `aux` the `Mean`s over
        counted rows of `policy_loss`, `error` (`e`), `reference_error`, `weight`
        (`sigmoid(x_g)`), `advantage`, `clipfrac` (with `clip_range`) and `kl` (with
        `kl_beta > 0`).

        **Raises:**

        - `ValueError`: naming `batch` if it is not `GroupedSamples` (say, `FinalSamples`);
            naming `batch.timesteps` if it is `None`; as `training_times`,
            `variables.reference_policy()`, `ema_policy` or `GuidedFlow.call_model`.
        - `EquinoxRuntimeError`: if a group has more than `group_size` counted rows.
        """
        check_batch_type(
            batch,
            GroupedSamples,
            type(self).__name__,
            "final samples with their groups: `training_batch` makes them",
        )
        keep = batch.samples.mask
        points = self.training_points(variables, batch.samples, batch.group, step.key)
        x_t, target, t_flat, conditioning = points.x_t, points.target, points.t, points.cond
        rows, count = batch.samples.latents.shape[0], points.count
        samples = batch.samples

        def velocity(policy: Model) -> Array:
            return self.flow.call_model(policy, x_t, t_flat, conditioning).astype(jnp.float32)

        v = velocity(variables.policy)
        error = example_mse(v, target)
        advantages = self.clipped_advantages(zero_rows_unless(keep, samples.advantages))
        flat_advantages = jnp.repeat(advantages, count)
        v_base = None
        if self.keeps_base:
            base = stop_gradient_arrays(variables.reference_policy())
            v_base = jax.lax.stop_gradient(self._base_velocity(base, x_t, t_flat, conditioning))
        v_ema = None
        if self.clip_range is not None or self.dpo_reference == "ema":
            v_ema = jax.lax.stop_gradient(velocity(stop_gradient_arrays(variables.ema_policy())))
        clip = jnp.zeros(error.shape, bool)
        if v_ema is not None and self.clip_range is not None:
            clip = self.should_clip(error, example_mse(v_ema, target), flat_advantages)
        clipped = jnp.where(clip, jax.lax.stop_gradient(error), error)
        v_dpo = v_ema if self.dpo_reference == "ema" else v_base
        assert v_dpo is not None
        reference_error = example_mse(v_dpo, target)
        same = self._same_group(batch.group, keep)
        policy, weight = self.preference_loss(
            clipped.reshape(rows, count), reference_error.reshape(rows, count), advantages, same
        )
        per_row = jnp.mean(policy, axis=1)
        aux = {
            "policy_loss": per_row,
            "error": row_mean(error, count),
            "reference_error": row_mean(reference_error, count),
            "weight": jnp.mean(weight, axis=1),
            "advantage": advantages,
        }
        if self.clip_range is not None:
            aux["clipfrac"] = row_mean(clip.astype(jnp.float32), count)
        if self.kl_beta > 0:
            assert v_base is not None
            kl = example_mse(v, v_base)
            if self.clip_kl:
                kl = jnp.where(clip, jax.lax.stop_gradient(kl), kl)
            aux["kl"] = row_mean(kl, count)
            per_row = per_row + self.kl_beta * aux["kl"]
        stats = {k: mean_over(keep, jax.lax.stop_gradient(a)) for k, a in aux.items()}
        return mean_over(keep, per_row), stats

    def training_points(
        self,
        variables: DGPOVariables,
        samples: FinalSamples,
        group: Int[Array, " N"],
        key: PRNGKeyArray,
    ) -> "_TrainingPoints":
        """Each counted row noised at its epoch's trained times (`training_times` of its grid
        at `variables.indices`) with its group's noise; masked rows as zeros at time 1.

        **Arguments:**

        - `variables`: its `indices` are the epoch's trained grid indices.
        - `samples`: the batch's `FinalSamples`, with their grid `timesteps`.
        - `group`: `[N]` each row's group id.
        - `key`: draws the noise (`training_noise`).

        **Returns:**

        The `[N T, ...]` noised latents, velocity targets, times and conditioning.

        **Raises:**

        - `ValueError`: naming `batch.samples.timesteps` if it is `None`; as
            `training_times`.
        """
        grid = kept_grid(samples, "DGPO", "batch.samples.timesteps")
        t = self.training_times(grid, variables.indices)
        rows, count = t.shape
        t_flat = t.reshape(rows * count)
        x_0, cond = repeated_rows(samples, count)
        noise = self.training_noise(group, count, x_0.shape[1:], key).astype(x_0.dtype)
        x_t, target = noised(self.flow.process, x_0, noise, t_flat)
        return _TrainingPoints(
            x_t=x_t,
            target=target,
            t=t_flat,
            cond=self.flow.inputs.condition(cond),
            count=count,
        )

    def _same_group(self, group: Int[Array, " N"], keep: Bool[Array, " N"]) -> Bool[Array, "N N"]:
        """`[N, N]`: whether row `j` is a counted row of row `i`'s group.

        **Raises:**

        - `EquinoxRuntimeError`: if a group has more than `group_size` counted rows.
        """
        same = (group[:, None] == group[None, :]) & keep[None, :]
        checked: Bool[Array, "N N"] = eqx.error_if(
            same,
            jnp.any(keep & (jnp.sum(same, axis=1) > self.group_size)),
            "A group of the batch has more counted rows than `group_size`: the batch's "
            "`group` ids do not match the objective's `group_size`.",
        )
        return checked

    def _base_velocity(
        self, base: Model, x_t: Array, t: PerExample, conditioning: PyTree[Any]
    ) -> Array:
        """The base model's velocity: conditional, or guided by `reference_guidance`."""
        conditional = self.flow.call_model(base, x_t, t, conditioning).astype(jnp.float32)
        if self.reference_guidance is None:
            return conditional
        null = self.flow.null_like(conditioning)
        unconditional = self.flow.call_model(base, x_t, t, null).astype(jnp.float32)
        return self.reference_guidance.combine(conditional, unconditional)


class _TrainingPoints(eqx.Module):
    """The flattened `[N T, ...]` inputs of one DGPO loss: noised latents, velocity targets,
    times and conditioning, for `count` times per row."""

    x_t: Array
    target: Array
    t: PerExample
    cond: PyTree[Any]
    count: int = eqx.field(static=True)


def _draw_indices(
    seed: int, step: int | Int[Array, ""], choices: int, count: int
) -> Int[Array, " T"]:
    """`count` distinct indices of `0..choices - 1`, drawn from `seed` and `step`."""
    key = jax.random.fold_in(jax.random.key(seed), step)
    return jax.random.permutation(key, choices)[:count].astype(jnp.int32)


@eqx.filter_jit
def _advance(
    variables: DGPOVariables,
    decay: Float[Array, ""] | None,
    step: Int[Array, ""],
    seed: int,
    choices: int,
    count: int,
) -> DGPOVariables:
    ema = variables.ema
    if decay is not None:
        ema = blend_part(ema, variables.policy, decay)
    recorded = jnp.zeros_like(variables.step) + step
    indices = jnp.zeros_like(variables.indices) + _draw_indices(seed, recorded, choices, count)
    return DGPOVariables(variables.policy, ema, variables.reference, indices, recorded)
