"""`DGPOObjective`: Direct Group Preference Optimization, as its authors' released code
computes it."""

from dataclasses import KW_ONLY
from typing import final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

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
    zero_rows_unless,
)
from .._sampling import AbstractSampler, ODESampler
from .._solver import AbstractSolver, DPMSolverPP2M
from ._base import (
    AbstractRLObjective,
)
from ._decay import RampedDecay, check_decay, decay_at
from ._dgpo_data import (
    DGPOVariables,
    GroupedSamples,
    TrainingPoints,
    advance_variables,
    draw_indices,
    group_noise,
    grouped_runs,
    noised_points,
    quantised_times,
)
from ._dgpo_loss import (
    AbstractDGPOLoss,
    DGPOReference,
    DGPOSurrogateLoss,
    check_loss_form,
    check_reference_guidance,
    group_preference_loss,
    ratio_clip,
    reference_velocities,
    same_group,
)
from ._final_samples import (
    example_mse,
    final_samples,
    kept_grid,
    mean_over,
    row_mean,
)
from ._trainable import (
    TrainableFilter,
    reference_part,
    trainable_part,
)


_RELEASED_EMA_DECAY = RampedDecay(rate=0.001, maximum=0.3)
_RELEASED_SOLVER = DPMSolverPP2M()


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
        check_loss_form(self.loss_form)
        check_mode("dpo_reference", self.dpo_reference, DGPOReference)
        check_reference_guidance(self.reference_guidance, self.flow)
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
        return grouped_runs(final_samples(collected, info, "DGPO"), self.group_size)

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
        return advance_variables(
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
        return draw_indices(self.seed, step, self.trunc_steps + 1, self.train_timesteps)

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
        return quantised_times(timesteps, indices, self.trunc_steps, self.quantize)

    def training_noise(
        self, group: Int[Array, " N"], count: int, shape: tuple[int, ...], key: PRNGKeyArray
    ) -> Float[Array, " F *latent"]:
        """The noise of each (row, time), rows repeated time-fastest (`F = N T`): one draw
        per (group, time) with `shared_noise`, else per (row, time) (`group_noise`).

        **Arguments:**

        - `group`: `[N]` the rows' groups.
        - `count`: `T`, the times per row.
        - `shape`: the shape of one latent.
        - `key`: the update's key (`step.key`).

        **Returns:**

        `[N T, *latent]` float32 noise.
        """
        return group_noise(group, count, shape, key, self.shared_noise)

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
        return ratio_clip(error, ema_error, advantages, self.clip_range)

    def preference_loss(
        self,
        error: Float[Array, " N T"],
        reference_error: Float[Array, " N T"],
        advantages: Float[Array, " N"],
        same_group: Bool[Array, " N N"],
    ) -> tuple[Float[Array, " N T"], Float[Array, " N T"]]:
        """The group preference loss of each (row, time) and its sigmoid weight, in this
        objective's `loss_form` (the formulas: `group_preference_loss`).

        **Arguments:**

        - `error`: `[N, T]` the live policy's errors (clipped ones detached).
        - `reference_error`: `[N, T]` the DPO reference's.
        - `advantages`: `[N]` the clipped advantages (0 for rows that do not count).
        - `same_group`: `[N, N]`, whether row `j` counts and shares row `i`'s group.

        **Returns:**

        `([N, T] losses, [N, T] weights sigmoid(x_g))`.
        """
        return group_preference_loss(
            self.loss_form,
            error,
            reference_error,
            advantages,
            same_group,
            self.beta_dpo,
            self.group_size,
        )

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
        rows, count = batch.samples.latents.shape[0], points.count
        v = self._velocity(variables.policy, points)
        error = example_mse(v, points.target)
        advantages = self.clipped_advantages(zero_rows_unless(keep, batch.samples.advantages))
        flat_advantages = jnp.repeat(advantages, count)
        reads_ema = self.clip_range is not None or self.dpo_reference == "ema"
        v_base, v_ema = reference_velocities(
            self.flow, variables, points, self.reference_guidance, self.keeps_base, reads_ema
        )
        clip, clipped, reference_error = self._clip_and_reference_error(
            error, v_base, v_ema, points.target, flat_advantages
        )
        same = same_group(batch.group, keep, self.group_size)
        policy, weight = self.preference_loss(
            clipped.reshape(rows, count), reference_error.reshape(rows, count), advantages, same
        )
        per_row, aux = self._row_losses(
            policy, weight, error, reference_error, advantages, clip, v, v_base
        )
        stats = {k: mean_over(keep, jax.lax.stop_gradient(a)) for k, a in aux.items()}
        return mean_over(keep, per_row), stats

    def _velocity(self, policy: Model, points: TrainingPoints) -> Array:
        """`policy`'s conditional velocity at the training points, in float32."""
        return self.flow.call_model(policy, points.x_t, points.t, points.cond).astype(jnp.float32)

    def _clip_and_reference_error(
        self,
        error: PerExample,
        v_base: Array | None,
        v_ema: Array | None,
        target: Array,
        flat_advantages: PerExample,
    ) -> tuple[ExampleMask, PerExample, PerExample]:
        """The examples the ratio clip stops, the errors with theirs detached, and the DPO
        reference's errors."""
        clip = jnp.zeros(error.shape, bool)
        if v_ema is not None and self.clip_range is not None:
            clip = self.should_clip(error, example_mse(v_ema, target), flat_advantages)
        clipped = jnp.where(clip, jax.lax.stop_gradient(error), error)
        v_dpo = v_ema if self.dpo_reference == "ema" else v_base
        assert v_dpo is not None
        reference_error = example_mse(v_dpo, target)
        return clip, clipped, reference_error

    def _row_losses(
        self,
        policy: Float[Array, " N T"],
        weight: Float[Array, " N T"],
        error: PerExample,
        reference_error: PerExample,
        advantages: Float[Array, " N"],
        clip: ExampleMask,
        v: Array,
        v_base: Array | None,
    ) -> tuple[Float[Array, " N"], dict[str, Array]]:
        """Each row's loss (its mean policy loss over its times, plus `kl_beta` times its
        KL to the base model) and its per-row diagnostics."""
        count = policy.shape[1]
        aux = {
            "policy_loss": jnp.mean(policy, axis=1),
            "error": row_mean(error, count),
            "reference_error": row_mean(reference_error, count),
            "weight": jnp.mean(weight, axis=1),
            "advantage": advantages,
        }
        per_row = aux["policy_loss"]
        if self.clip_range is not None:
            aux["clipfrac"] = row_mean(clip.astype(jnp.float32), count)
        if self.kl_beta > 0:
            assert v_base is not None
            kl = example_mse(v, v_base)
            if self.clip_kl:
                kl = jnp.where(clip, jax.lax.stop_gradient(kl), kl)
            aux["kl"] = row_mean(kl, count)
            per_row = per_row + self.kl_beta * aux["kl"]
        return per_row, aux

    def training_points(
        self,
        variables: DGPOVariables,
        samples: FinalSamples,
        group: Int[Array, " N"],
        key: PRNGKeyArray,
    ) -> TrainingPoints:
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
        return noised_points(self.flow, samples, t, group, key, self.shared_noise)
