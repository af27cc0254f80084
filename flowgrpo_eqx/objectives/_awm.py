"""`AWMObjective`: Advantage Weighted Matching, as its authors' released code computes it."""

from dataclasses import KW_ONLY
from typing import Any, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray, PyTree

from .._custom_types import (
    FinalSamples,
    Mean,
    Model,
    PerExample,
    RolloutInfo,
    Step,
    Transitions,
    check_final_samples,
)
from .._guided_flow import GuidedFlow
from .._misc import (
    check_bool,
    check_int,
    check_number,
    stop_gradient_arrays,
    zero_rows_unless,
)
from .._sampling import AbstractSampler, SDESampler
from .._sde import AbstractSDE, FlowSDE
from ._awm_forms import (
    AbstractAWMKLWeight,
    AbstractAWMRatio,
    AbstractAWMTimes,
    AbstractAWMWeighting,
    DiscreteTimesWithoutInit,
    GHuberWeighting,
    PerTimeRatio,
    UniformKLWeight,
)
from ._base import AbstractEMAVariables, AbstractReferenceVariables, AbstractRLObjective
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


_RELEASED_SDE = FlowSDE(noise_level=0.4, window=(0.9, 0.3))
_RELEASED_EMA_DECAY = RampedDecay(rate=0.001, maximum=0.3)


@final
class AWMVariables(AbstractEMAVariables, AbstractReferenceVariables):
    """AWM's variables: the live policy, the slow EMA of its trainable part, the reference.

    **Arguments:**

    - `policy`: the live velocity model, trained by the optimizer.
    - `ema`: when `ema_beta > 0` or `off_policy`, the EMA of the policy's trainable part
        (`trainable_part`: the adapters of a LoRA policy, every float array of a fully
        trained one); the EMA policy is the live one carrying it (`with_part`). It starts as
        the initial policy's and moves once per epoch (`AWMObjective.end_epoch`). `None`
        otherwise.
    - `reference`: when `kl_beta > 0`, the frozen `reference_part` of the initial policy;
        the KL compares with `reference_policy` (the base model of a LoRA policy). `None`
        otherwise.
    """

    policy: Model
    ema: PyTree[Any] | None
    reference: PyTree[Any] | None


@final
class AWMObjective(AbstractRLObjective[AWMVariables, FinalSamples]):
    """Advantage Weighted Matching (arXiv 2509.25050) as the authors' released
    `scripts/train_sd3_awm.py` computes it (`docs/mathematics/awm.md` §9); the defaults are its
    GenEval recipe (`config/dgx_awm.py`, `geneval_sd3_no_cfg_1node`).

    Trained on final samples `x_0` and one advantage `A` per row. Each minibatch draws
    `T = train_timesteps` grid indices, one per stratum (`times`), shared by its rows; row
    `i` trains at `t = timesteps[i, index]` of the grid that drew it, with fresh noise `eps`
    per (row, time): `x_t = (1 - t) x_0 + t eps`. The flow-matching error
    `e = mean (v_theta(x_t, t) - (eps - x_0))^2` becomes a log-likelihood surrogate
    `log p = weighting(e, t)` (`AbstractAWMWeighting`). The ratio is `exp(log p - old)` per example
    (or per row, `ratio=PerRowRatio()`) with `old = stop_gradient(log p)` (on-policy, the
    released default: the ratio is exactly 1, the loss `-mean(A')` in value and
    `-mean(A' grad log p)` in gradient), or the EMA policy's (`off_policy=True`). With
    `A' = clip(A, -adv_clip_max, adv_clip_max) / adv_clip_max * advantage_max`, the policy
    loss is the mean of `max(-A' r, -A' clip(r, 1 - clip_range, 1 + clip_range))`; the loss
    adds `kl_beta` times the velocity KL to the base model and `ema_beta` times the one to
    the EMA policy (`AbstractAWMKLWeight`). Rows count alike, zero-advantage rows included (the
    release drops none).

    The EMA moves once per epoch, `ema = d ema + (1 - d) live` with `d = ema_decay(step)`
    (`RampedDecay(rate=0.001, maximum=0.3)`: the released linear `min(0.001 step, 0.3)`), so
    it trails the live policy by about an epoch: a trust region, not a long average.

    The rollout may use any sampler (`rollout_sampler`); AWM needs only its final samples
    and its grid. The default is `SDESampler(sde)` with `sde = FlowSDE(0.4, window=(0.9,
    0.3))`, the nearest this library has to the release's SA-Solver (stochasticity 0.4 on
    `0.3 <= t <= 0.9`).

    **Arguments:**

    - `flow`: a `GuidedFlow`: the model, process, inputs, guidance, autoencoder and
        precision.
    - `pretrained`: as for `FlowGRPOObjective`. The release trains without guidance: its
        recipe is a `flow` with `guidance=None`.
    - `weighting`: an `AbstractAWMWeighting` (default `GHuberWeighting(0.25)`, the
        release's `weighting='ghuber'` with `ghuber_power=0.25`).
    - `ratio`: an `AbstractAWMRatio`: `PerTimeRatio()` (default) or `PerRowRatio()`.
    - `clip_range`: the ratio clip, > 0 (default 1.0, the recipe's).
    - `adv_clip_max`: the advantage clip, > 0 (default 5.0, the release's).
    - `advantage_max`: the clipped advantage's new bound, > 0, or `None` to keep the clip's
        scale (default 1.0, the recipe's).
    - `times`: an `AbstractAWMTimes`: `DiscreteTimesWithoutInit()` (default),
        `DiscreteTimes()` or `DiscreteTimesWithInit()`.
    - `train_timesteps`: `T`, the trained times per row, >= 1 (default 6).
    - `time_fraction`: the fraction of the grid the strata cover, in (0, 1] (default 0.9).
    - `kl_beta`: the weight of the KL to the base model, >= 0 (default 0.001).
    - `kl_weight`: its `AbstractAWMKLWeight` (default `UniformKLWeight()`).
    - `ema_beta`: the weight of the KL to the EMA policy, >= 0 (default 1.0).
    - `ema_kl_weight`: its `AbstractAWMKLWeight` (default `UniformKLWeight()`).
    - `ema_decay`: a `RampedDecay` (default, the released linear schedule), a constant in
        [0, 1) (the release's `'constant'`), or `None` to keep the EMA at the initial policy.
    - `off_policy`: whether the EMA policy samples the rollout and gives the old
        log-likelihoods (default `False`, the recipe's).
    - `sde`: the SDE of the default rollout sampler.

    **Raises:**

    - `ValueError`: naming the argument, for a value outside the ranges above, a `ratio`,
        `times`, `kl_weight` or `ema_kl_weight` not of its abstract class, a `flow` that is
        not a `GuidedFlow`, or a `sde` that is not an `AbstractSDE`.
    """

    flow: GuidedFlow
    _: KW_ONLY
    weighting: AbstractAWMWeighting = GHuberWeighting()
    ratio: AbstractAWMRatio = PerTimeRatio()
    clip_range: float = 1.0
    adv_clip_max: float = 5.0
    advantage_max: float | None = 1.0
    times: AbstractAWMTimes = DiscreteTimesWithoutInit()
    train_timesteps: int = eqx.field(default=6, static=True)
    time_fraction: float = eqx.field(default=0.9, static=True)
    kl_beta: float = 0.001
    kl_weight: AbstractAWMKLWeight = UniformKLWeight()
    ema_beta: float = 1.0
    ema_kl_weight: AbstractAWMKLWeight = UniformKLWeight()
    ema_decay: float | RampedDecay | None = _RELEASED_EMA_DECAY
    off_policy: bool = eqx.field(default=False, static=True)
    sde: AbstractSDE = _RELEASED_SDE
    pretrained: Model | None = None

    def __check_init__(self) -> None:
        if not isinstance(self.weighting, AbstractAWMWeighting):
            raise ValueError(
                "`weighting` must be an AbstractAWMWeighting (GHuberWeighting, HuberWeighting, "
                f"TimeWeighting, TimeSquaredWeighting, UniformWeighting), got {self.weighting!r}."
            )
        variants = (
            ("ratio", AbstractAWMRatio, "PerTimeRatio(), PerRowRatio()"),
            (
                "times",
                AbstractAWMTimes,
                "DiscreteTimesWithoutInit(), DiscreteTimes(), DiscreteTimesWithInit()",
            ),
            ("kl_weight", AbstractAWMKLWeight, "UniformKLWeight(), ELBOKLWeight()"),
            ("ema_kl_weight", AbstractAWMKLWeight, "UniformKLWeight(), ELBOKLWeight()"),
        )
        for name, kind, examples in variants:
            value = getattr(self, name)
            if not isinstance(value, kind):
                raise ValueError(
                    f"`{name}` must be an {kind.__name__} ({examples}), got {value!r}."
                )
        for name in ("clip_range", "adv_clip_max", "advantage_max"):
            value = getattr(self, name)
            optional = name == "advantage_max"
            check_number(name, value, minimum=0, include_minimum=False, optional=optional)
        check_int("train_timesteps", self.train_timesteps, 1)
        check_number(
            "time_fraction", self.time_fraction, minimum=0, maximum=1, include_minimum=False
        )
        check_number("kl_beta", self.kl_beta, minimum=0)
        check_number("ema_beta", self.ema_beta, minimum=0)
        check_decay("ema_decay", self.ema_decay)
        check_bool("off_policy", self.off_policy)
        if not isinstance(self.sde, AbstractSDE):
            raise ValueError(f"`sde` must be an AbstractSDE, got {self.sde!r}.")

    # ----------------------------------------------------------------------------------
    # The RL loop's interface

    def variables_for(self, policy: Model, trainable: TrainableFilter | None) -> AWMVariables:
        keeps_ema = self.ema_beta > 0 or self.off_policy
        return AWMVariables(
            policy=policy,
            ema=trainable_part(policy, trainable) if keeps_ema else None,
            reference=reference_part(policy, trainable) if self.kl_beta > 0 else None,
        )

    def rollout_sampler(self, requested: AbstractSampler | None) -> AbstractSampler:
        """`SDESampler(sde)` by default; any requested sampler otherwise: AWM trains on
        final samples, whatever drew them."""
        return SDESampler(self.sde) if requested is None else requested

    def sampling_policy(self, variables: AWMVariables) -> Model:
        """The EMA policy with `off_policy`, else the live policy."""
        return variables.ema_policy() if self.off_policy else variables.policy

    def training_batch(
        self, collected: Transitions | FinalSamples, info: RolloutInfo
    ) -> FinalSamples:
        """The rollout's final samples, rows and advantages; every row counts.

        **Arguments:**

        - `collected`: `FinalSamples` (an ODE rollout), or `Transitions` (an SDE rollout:
            its rows, advantages and grid, with the final latents of `info`).
        - `info`: the rollout's `RolloutInfo`.

        **Returns:**

        The `FinalSamples`.

        **Raises:**

        - `ValueError`: if `collected` holds per-transition (`[N, K]`) advantages.
        """
        return final_samples(collected, info, "AWM")

    def end_epoch(self, variables: AWMVariables, step: int) -> AWMVariables:
        """The EMA moved towards the live policy, `ema = d ema + (1 - d) live`.

        **Arguments:**

        - `variables`: after the epoch's updates.
        - `step`: the optimizer updates done so far (a `RampedDecay` reads it).

        **Returns:**

        `variables` with the moved EMA (`d = ema_decay(step)` for a `RampedDecay`, else
        `ema_decay`); unchanged without an EMA or with `ema_decay=None`.
        """
        if variables.ema is None or self.ema_decay is None:
            return variables
        return _move_ema(variables, decay_at(self.ema_decay, step))

    def batch_metrics(self, batch: FinalSamples) -> dict[str, float]:
        del batch
        return {}

    def loss_sums_over_rows(self) -> bool:
        """`True`: given the step's draws, each row's loss is its own."""
        return True

    # ----------------------------------------------------------------------------------
    # The pieces of the loss

    def log_likelihood(self, error: PerExample, t: PerExample) -> PerExample:
        """The log-likelihood surrogate of each example: `weighting(error, t)`.

        **Arguments:**

        - `error`: `[F]` flow-matching errors `mean (v - (eps - x_0))^2`.
        - `t`: `[F]` their times.

        **Returns:**

        `[F]` surrogates.
        """
        return self.weighting(error, t)

    def scaled_advantages(self, advantages: Float[Array, " N"]) -> Float[Array, " N"]:
        """`A' = clip(A, -adv_clip_max, adv_clip_max)`, times `advantage_max / adv_clip_max`
        when `advantage_max` is set.

        **Arguments:**

        - `advantages`: `[N]` advantages.

        **Returns:**

        `[N]` float32 advantages in `[-advantage_max, advantage_max]`.
        """
        clipped = jnp.clip(advantages.astype(jnp.float32), -self.adv_clip_max, self.adv_clip_max)
        if self.advantage_max is None:
            return clipped
        return clipped / self.adv_clip_max * self.advantage_max

    def trained_indices(self, grid_size: int, key: PRNGKeyArray) -> Int[Array, " T"]:
        """The `T` grid indices a minibatch trains at, one per stratum (`times`).

        **Arguments:**

        - `grid_size`: `K`, the start times of the sampler's grid.
        - `key`: draws the indices (`AbstractAWMTimes.indices`).

        **Returns:**

        `[T]` int32 indices in `[0, K)`.

        **Raises:**

        - `ValueError`: naming `time_fraction`, if `int(K time_fraction)` leaves no index
            after `times.start()`.
        """
        start = self.times.start()
        top = int(grid_size * self.time_fraction)
        if top <= start:
            raise ValueError(
                f"`time_fraction`={self.time_fraction} of a grid of {grid_size} start times "
                f"leaves no trained index for `times`={self.times!r} (needs "
                f"int(K * time_fraction) > {start})."
            )
        return self.times.indices(top, self.train_timesteps, key)

    def kl_of(
        self, v: Array, v_other: Array, t: PerExample, weight: AbstractAWMKLWeight
    ) -> PerExample:
        """The weighted velocity KL of each example: `weight(mean (v - v')^2, t)`.

        **Arguments:**

        - `v`, `v_other`: `[F, *latent]` velocities (`v_other` without gradient).
        - `t`: `[F]` their times.
        - `weight`: an `AbstractAWMKLWeight`.

        **Returns:**

        `[F]` KLs.
        """
        return weight(example_mse(v, jax.lax.stop_gradient(v_other)), t)

    def loss(
        self, variables: AWMVariables, batch: FinalSamples, step: Step
    ) -> tuple[Mean, dict[str, Mean]]:
        """The AWM loss over the batch's counted rows (one `Mean`, summed per row).

        Masked rows are replaced by a zero latent, advantage and conditioning (and time 1)
        before any arithmetic, so NaN or inf in them reach neither the loss nor its gradient.

        **Arguments:**

        - `variables`: gradients flow into `variables.policy` only.
        - `batch`: the `FinalSamples`, with their grid `timesteps` `[N, K]`.
        - `step`: its key draws the times and the noise: `index_key, noise_key =
            jax.random.split(step.key)`; `trained_indices(K, index_key)`, shared by the rows;
            `eps = jax.random.normal(noise_key, [N T, *latent])`, rows repeated time-fastest.

        **Returns:**

        `(Mean(sum of per-row losses, counted rows), aux)`, each row's loss its mean over
        its times (its own with `ratio=PerRowRatio()`), and `aux` the `Mean`s over counted rows
        of `policy_loss`, `error` (`e`), `log_likelihood`, `ratio`, `clipfrac`
        (`|r - 1| > clip_range`), `advantage` (`A'`), and `kl` and `ema_kl` when weighted.

        **Raises:**

        - `ValueError`: naming `batch` if it is not `FinalSamples` (say, `Transitions`);
            naming `batch.timesteps` if it is `None`; as `trained_indices`,
            `variables.reference_policy()`, `ema_policy` or `GuidedFlow.velocity`.
        """
        check_final_samples(batch, type(self).__name__)
        keep = batch.mask
        x_t, target, t_flat, cond, (rows, count) = self._training_points(batch, step.key)

        def velocity(policy: Model) -> Array:
            return self.flow.velocity(policy, x_t, t_flat, cond).astype(jnp.float32)

        v = velocity(variables.policy)
        error = example_mse(v, target)
        log_p = self.log_likelihood(error, t_flat)
        v_ema = None
        old = log_p
        if self.ema_beta > 0 or self.off_policy:
            v_ema = jax.lax.stop_gradient(velocity(stop_gradient_arrays(variables.ema_policy())))
            if self.off_policy:
                old = self.log_likelihood(example_mse(v_ema, target), t_flat)
        advantages = self.scaled_advantages(zero_rows_unless(keep, batch.advantages))
        policy, ratio = self._policy_loss(log_p, jax.lax.stop_gradient(old), advantages, count)
        per_row, aux = policy, {"policy_loss": policy}
        if self.kl_beta > 0:
            v_ref = velocity(stop_gradient_arrays(variables.reference_policy()))
            aux["kl"] = row_mean(self.kl_of(v, v_ref, t_flat, self.kl_weight), count)
            per_row = per_row + self.kl_beta * aux["kl"]
        if v_ema is not None and self.ema_beta > 0:
            aux["ema_kl"] = row_mean(self.kl_of(v, v_ema, t_flat, self.ema_kl_weight), count)
            per_row = per_row + self.ema_beta * aux["ema_kl"]
        aux |= self._diagnostics(error, log_p, ratio, advantages, rows, count)
        stats = {k: mean_over(keep, jax.lax.stop_gradient(a)) for k, a in aux.items()}
        return mean_over(keep, per_row), stats

    def _training_points(
        self, batch: FinalSamples, key: PRNGKeyArray
    ) -> tuple[Array, Array, PerExample, PyTree[Any], tuple[int, int]]:
        """Each row noised at its trained times (`_training_times`): the `[N T, ...]` noised
        latents, velocity targets, times and conditions, and `(N, T)`."""
        index_key, noise_key = jax.random.split(key)
        t = self._training_times(batch, index_key)
        rows, count = t.shape
        t_flat = t.reshape(rows * count)
        x_0, cond = repeated_rows(batch, count)
        noise = jax.random.normal(noise_key, x_0.shape, x_0.dtype)
        x_t, target = noised(self.flow.process, x_0, noise, t_flat)
        return x_t, target, t_flat, cond, (rows, count)

    def _diagnostics(
        self,
        error: PerExample,
        log_p: PerExample,
        ratio: Array,
        advantages: Float[Array, " N"],
        rows: int,
        count: int,
    ) -> dict[str, Array]:
        """The per-row diagnostics besides the loss terms: the error, log-likelihood, ratio,
        clip fraction and advantage of each row."""
        return {
            "error": row_mean(error, count),
            "log_likelihood": row_mean(log_p, count),
            "ratio": row_mean(ratio, ratio.shape[0] // rows),
            "clipfrac": row_mean(
                (jnp.abs(ratio - 1.0) > self.clip_range).astype(jnp.float32),
                ratio.shape[0] // rows,
            ),
            "advantage": advantages,
        }

    def _training_times(self, batch: FinalSamples, key: PRNGKeyArray) -> Float[Array, " N T"]:
        """Each row's trained times, `[N, T]`: its grid at the minibatch's indices."""
        grid = kept_grid(batch, "AWM", "batch.timesteps")
        index = self.trained_indices(grid.shape[1], key)
        return jnp.take(grid, index, axis=1).astype(jnp.float32)

    def _policy_loss(
        self,
        log_p: PerExample,
        old: PerExample,
        advantages: Float[Array, " N"],
        count: int,
    ) -> tuple[Float[Array, " N"], Float[Array, " R"]]:
        """Each row's clipped policy loss and the ratios (per example or per row)."""
        log_p, old, advantages, per = self.ratio.ratios(log_p, old, advantages, count)
        ratio = jnp.exp(log_p - old)
        clipped = jnp.clip(ratio, 1.0 - self.clip_range, 1.0 + self.clip_range)
        loss = jnp.maximum(-advantages * ratio, -advantages * clipped)
        return row_mean(loss, per), ratio


@eqx.filter_jit
def _move_ema(variables: AWMVariables, decay: float) -> AWMVariables:
    ema = blend_part(variables.ema, variables.policy, decay)
    moved: AWMVariables = eqx.tree_at(lambda v: v.ema, variables, ema)
    return moved
