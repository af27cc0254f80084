"""`DiffusionNFTObjective`: online RL on the forward process from final samples and rewards."""

import abc
from dataclasses import KW_ONLY
from typing import Any, Literal, TypeAlias, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray, PyTree

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
from .._misc import check_number, stop_gradient_arrays, zero_rows_unless
from .._sampling import AbstractSampler, ODESampler
from .._solver import AbstractSolver, Euler
from ._base import AbstractReferenceVariables, AbstractRLObjective
from ._decay import RampedDecay, check_decay, decay_at
from ._final_samples import (
    example_mean,
    example_mse,
    final_samples,
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
    with_part,
)


@final
class ImplicitPolicyErrors(eqx.Module):
    """What DiffusionNFT's loss forms read of a flat batch of examples (`AbstractNFTLoss`).

    **Arguments:**

    - `x_0`, `x_t`: `[F, *latent]` the examples' data and noised points.
    - `t`: `[F]` their times.
    - `positive`, `negative`: `[F, *latent]` float32 velocities of the implicit policies
        `(1 - beta) v_old + beta v` and `(1 + beta) v_old - beta v`.
    - `target`: `[F, *latent]` the flow-matching target `eps - x_0`.
    - `scale`: `adv_max / beta`, the released form's factor.
    """

    x_0: Array
    x_t: Array
    t: PerExample
    positive: Array
    negative: Array
    target: Array
    scale: float


class AbstractNFTLoss(eqx.Module):
    """DiffusionNFT's per-example errors of its implicit positive and negative policies:
    `AdaptiveX0Loss` (the released code's) or `VelocityLoss` (the paper's statement)."""

    @abc.abstractmethod
    def __call__(self, inputs: ImplicitPolicyErrors) -> tuple[PerExample, PerExample, float]:
        """The positive and negative policies' errors per example, and the factor of their
        weighted sum.

        **Arguments:**

        - `inputs`: the examples and the implicit policies' velocities.

        **Returns:**

        `(positive [F], negative [F], factor)`.
        """


@final
class AdaptiveX0Loss(AbstractNFTLoss):
    """The released code's loss: the implicit policies' x0 predictions `x_t - t v+-`, each
    error squared over its own detached mean absolute error (at least 1e-5), the weighted
    sum scaled by `adv_max / beta`."""

    def __call__(self, inputs: ImplicitPolicyErrors) -> tuple[PerExample, PerExample, float]:
        x_0 = inputs.x_0
        flat = x_0.shape[0]
        x_0_f32 = x_0.astype(jnp.float32)
        t_column = inputs.t.astype(jnp.float32).reshape((flat,) + (1,) * (x_0.ndim - 1))
        x_t_f32 = inputs.x_t.astype(jnp.float32)
        positive_error = (x_t_f32 - t_column * inputs.positive) - x_0_f32
        negative_error = (x_t_f32 - t_column * inputs.negative) - x_0_f32
        positive_weight = jax.lax.stop_gradient(
            jnp.maximum(example_mean(jnp.abs(positive_error)), 1e-5)
        )
        negative_weight = jax.lax.stop_gradient(
            jnp.maximum(example_mean(jnp.abs(negative_error)), 1e-5)
        )
        positive_mse = example_mean(positive_error**2) / positive_weight
        negative_mse = example_mean(negative_error**2) / negative_weight
        return positive_mse, negative_mse, inputs.scale


@final
class VelocityLoss(AbstractNFTLoss):
    """The paper's statement: `mean (v+- - (eps - x_0))^2`, unscaled."""

    def __call__(self, inputs: ImplicitPolicyErrors) -> tuple[PerExample, PerExample, float]:
        positive = example_mse(inputs.positive, inputs.target)
        return positive, example_mse(inputs.negative, inputs.target), 1.0


NFTTimes: TypeAlias = Literal["grid", "uniform"]
"""Where DiffusionNFT's training times come from: a random subset of the sampler's grid per
row (the released code), or one uniform time per row."""


_RELEASED_DECAY = RampedDecay()


@final
class NFTVariables(AbstractReferenceVariables):
    """DiffusionNFT's variables: the live policy, the old (sampling) policy and the reference.

    **Arguments:**

    - `policy`: the live velocity model, trained by the optimizer.
    - `old_policy`: the old policy's trainable part (`trainable_part`: every float array
        of a fully trained policy, the adapters of a LoRA policy, whatever the trainer's
        filter selects); the old policy, which the rollout samples with and the implicit
        policies mix with, is the live one carrying it (`with_part`). Moved towards the live
        policy once per epoch by `DiffusionNFTObjective.end_epoch` when `old_decay` is set.
    - `reference`: when `kl_beta > 0`, a frozen copy of the initial policy's trainable
        arrays that are not LoRA adapters (`reference_part`); the KL term compares with the
        policy carrying it, adapters off (`reference_policy`). `None` without a KL term.
    """

    policy: Model
    old_policy: PyTree[Any]
    reference: PyTree[Any] | None


@final
class DiffusionNFTObjective(AbstractRLObjective[NFTVariables, FinalSamples]):
    """DiffusionNFT: negative-aware flow matching on final samples, weighted by reward; by
    default as the authors' released code computes it (`docs/mathematics/nft.md` §8).

    Each row's advantage `A` becomes an optimality probability
    `r = 1/2 + 1/2 clip(A / adv_max, -1, 1)` in [0, 1]. Its clean latent `x_0` is noised at
    time `t`, `x_t = (1 - t) x_0 + t eps` (t = 1 is noise). With the old policy's velocity
    `v_old` (no gradient) and the live policy's `v_theta`, the implicit positive and negative
    policies are `v+ = (1 - beta) v_old + beta v_theta` and `v- = (1 + beta) v_old - beta
    v_theta`. With `AdaptiveX0Loss()` (default), the x0-space errors `e+- = (x_t - t v+-) -
    x_0` and their adaptive weights `w+- = max(mean|e+-|, 1e-5)` (no gradient) give
    `(adv_max / beta) [r mean(e+^2) / w+ + (1 - r) mean(e-^2) / w-]`; with `VelocityLoss()`
    (the paper's statement, kept as a scale-free baseline that needs no weights) it is
    `r mean(v+ - v)^2 + (1 - r) mean(v- - v)^2` with `v = eps - x_0`. Both add
    `kl_beta mean(v_theta - v_ref)^2` to the reference.

    With `times="grid"` (default) each row trains on a random `int(time_fraction * K)` of the
    `K` start times of the sampler's grid that drew it (`FinalSamples.timesteps`), each with
    its own noise, all in one update (the release accumulates their gradients into one
    optimizer step); `"uniform"` (the paper's `t ~ U`, kept for batches without a grid) draws
    one `t ~ U[1e-4, 1 - 1e-4]` per row. A row's loss is the mean over its times; the loss is
    the mean over counted rows; no count gives 0 and zero gradients.

    The old policy (`NFTVariables.old_policy`) samples the rollout (the release samples with
    a deterministic second-order solver: give the `FlowRollout`
    `sampler=ODESampler(Heun())`, or this objective `solver=Heun()`) and anchors the
    implicit policies. It starts as the initial policy and follows the live one once per
    epoch (`end_epoch`) by `old_decay`; it holds the policy's trainable part alone. The
    velocity is the guided one (`GuidedFlow.velocity`); the release is guidance-free, the
    recipe a `flow` with `guidance=None`.

    **Arguments:**

    - `flow`: a `GuidedFlow`: the model, process, inputs, guidance, autoencoder and
        precision.
    - `solver`: the ODE solver of the default rollout (`rollout_sampler`; default `Euler()`).
    - `pretrained`: as for `FlowGRPOObjective`.
    - `beta`: the mixing strength of the implicit policies, in (0, 1].
    - `adv_max`: the advantage clip at which the optimality probability saturates (the
        release's `adv_clip_max`).
    - `kl_beta`: the weight of the velocity KL to the reference (>= 0; default 1e-4, the
        release's): the initial policy with its LoRA adapters switched off (for a LoRA
        policy whose adapters alone train, its base model; none is kept at 0).
    - `old_decay`: `RampedDecay()` (default, the release's ramp); a number in [0, 1) for a
        constant decay; or `None` to keep the old policy at the initial one.
    - `loss_form`: an `AbstractNFTLoss`: `AdaptiveX0Loss()` (default, the release's) or
        `VelocityLoss()` (the paper's).
    - `times`: `"grid"` (default) or `"uniform"`.
    - `time_fraction`: the fraction of the grid's times each row trains on, in (0, 1]
        (default 0.99, the release's `timestep_fraction`; at least one time).

    **Raises:**

    - `ValueError`: naming the argument, for `beta` outside (0, 1], `adv_max <= 0`,
        `kl_beta < 0`, a numeric `old_decay` outside [0, 1), a `time_fraction` outside (0, 1],
        a `loss_form` that is not an `AbstractNFTLoss`, an unknown `times`, a `flow` that is
        not a `GuidedFlow`, or a `solver` that is not an `AbstractSolver`.
    """

    flow: GuidedFlow
    _: KW_ONLY
    beta: float = 1.0
    adv_max: float = 5.0
    kl_beta: float = 1e-4
    old_decay: float | RampedDecay | None = _RELEASED_DECAY
    loss_form: AbstractNFTLoss = AdaptiveX0Loss()
    times: NFTTimes = eqx.field(default="grid", static=True)
    time_fraction: float = 0.99
    solver: AbstractSolver = Euler()
    pretrained: Model | None = None

    def __check_init__(self) -> None:
        check_number("beta", self.beta, minimum=0, maximum=1, include_minimum=False)
        check_number("adv_max", self.adv_max, minimum=0, include_minimum=False)
        check_number("kl_beta", self.kl_beta, minimum=0)
        check_decay("old_decay", self.old_decay)
        if not isinstance(self.loss_form, AbstractNFTLoss):
            raise ValueError(
                "`loss_form` must be an AbstractNFTLoss (AdaptiveX0Loss, VelocityLoss), got "
                f"{self.loss_form!r}."
            )
        if self.times not in ("grid", "uniform"):
            raise ValueError(f"`times` must be 'grid' or 'uniform', got {self.times!r}.")
        check_number(
            "time_fraction", self.time_fraction, minimum=0, maximum=1, include_minimum=False
        )
        if not isinstance(self.solver, AbstractSolver):
            raise ValueError(f"`solver` must be an AbstractSolver, got {self.solver!r}.")

    # ----------------------------------------------------------------------------------
    # The RL loop's interface

    def variables_for(self, policy: Model, trainable: TrainableFilter | None) -> NFTVariables:
        reference = reference_part(policy, trainable) if self.kl_beta > 0 else None
        return NFTVariables(
            policy=policy, old_policy=trainable_part(policy, trainable), reference=reference
        )

    def rollout_sampler(self, requested: AbstractSampler | None) -> AbstractSampler:
        """`ODESampler(solver)` by default (the objective's solver); any requested sampler
        otherwise: DiffusionNFT trains on final samples, whatever drew them."""
        return ODESampler(self.solver) if requested is None else requested

    def sampling_policy(self, variables: NFTVariables) -> Model:
        return self.old_policy(variables)

    def training_batch(
        self, collected: Transitions | FinalSamples, info: RolloutInfo
    ) -> FinalSamples:
        """The final samples of a rollout, with their rows and advantages.

        Every row counts, zero-advantage rows included: their optimality probability is 1/2,
        which pulls the policy towards the old one.

        **Arguments:**

        - `collected`: `FinalSamples` (an ODE rollout), or `Transitions` (an SDE rollout:
            its rows and advantages, with the final latents of `info`).
        - `info`: the rollout's `RolloutInfo` (its `final` latents).

        **Returns:**

        The `FinalSamples`, placed as the rollout placed its rows.

        **Raises:**

        - `ValueError`: if `collected` holds per-transition (`[N, K]`) advantages.
        """
        return final_samples(collected, info, "DiffusionNFT")

    def end_epoch(self, variables: NFTVariables, step: int) -> NFTVariables:
        """With `old_decay`, the old policy moved towards the live one; else unchanged.

        **Arguments:**

        - `variables`: after the epoch's updates.
        - `step`: the optimizer updates done so far (a `RampedDecay` reads it).

        **Returns:**

        `variables` with `old_policy = eta * old + (1 - eta) * live` on the trainable part,
        `eta = old_decay(step)` for a `RampedDecay`, else `old_decay`.
        """
        if self.old_decay is None:
            return variables
        return _soft_update(variables, decay_at(self.old_decay, step))

    def batch_metrics(self, batch: FinalSamples) -> dict[str, float]:
        del batch
        return {}

    def old_policy(self, variables: NFTVariables) -> Model:
        """The old policy: the live policy carrying `variables.old_policy`.

        **Arguments:**

        - `variables`: from `init`.

        **Returns:**

        The old policy, a model like `variables.policy`.
        """
        return with_part(variables.policy, variables.old_policy)

    def optimality(self, advantages: Float[Array, " N"]) -> Float[Array, " N"]:
        """The optimality probabilities `r = 1/2 + 1/2 clip(A / adv_max, -1, 1)`.

        **Arguments:**

        - `advantages`: `[N]` advantages.

        **Returns:**

        `[N]` probabilities in [0, 1], float32.
        """
        scaled = jnp.clip(advantages.astype(jnp.float32) / self.adv_max, -1.0, 1.0)
        return 0.5 + 0.5 * scaled

    def loss_sums_over_rows(self) -> bool:
        """`True`: each row's loss, adaptive weights and KL are its own."""
        return True

    def loss(
        self, variables: NFTVariables, batch: FinalSamples, step: Step
    ) -> tuple[Mean, dict[str, Mean]]:
        """The DiffusionNFT loss over the batch's counted rows (one `Mean`, summed per row).

        Masked rows are replaced by a zero latent, advantage and conditioning before any
        arithmetic, so NaN or inf in them reach neither the loss nor its gradient.

        **Arguments:**

        - `variables`: gradients flow into `variables.policy` only; the old policy gives
            `v_old`, the reference `v_ref`.
        - `batch`: the `FinalSamples`.
        - `step`: its key draws the noise and the times: `noise_key, time_key =
            jax.random.split(step.key)`; with `times="grid"` each row's subset is the first
            `int(time_fraction * K)` of `argsort(uniform(time_key, [N, K]))` of its grid,
            with `"uniform"` `t ~ U[1e-4, 1 - 1e-4]` of shape `[N, 1]`; `eps ~ N(0, I)` for
            each (row, time), rows repeated time-fastest.

        **Returns:**

        `(Mean(sum of per-row losses, counted rows), aux)` with `aux` the `Mean`s over
        counted rows (each row's mean over its times) of `positive_mse` and `negative_mse`
        (the weighted x0-space errors `mean(e+-^2) / w+-` with `AdaptiveX0Loss`, else
        `mean(v+- - v)^2`), `old_mse` (`mean(v_old - v)^2`), `drift`
        (`mean(v_theta - v_old)^2`), `optimality` (`r`), and with `kl_beta > 0` `kl`
        (`mean(v_theta - v_ref)^2`).

        **Raises:**

        - `ValueError`: naming `batch` if it is not `FinalSamples` (say, `Transitions`); as
            `variables.reference_policy()`, or `GuidedFlow.velocity`; naming `batch.timesteps` when
            `times="grid"` and the batch has none.
        """
        check_final_samples(batch, type(self).__name__)
        old = stop_gradient_arrays(self.old_policy(variables))
        keep = batch.mask
        advantages = zero_rows_unless(keep, batch.advantages)
        noise_key, time_key = jax.random.split(step.key)
        t, count_per_row = self._training_times(batch, keep, batch.latents.dtype, time_key)
        # Every (row, time) pair is one example of a flat batch of rows * count_per_row.
        x_0, flat_cond = repeated_rows(batch, count_per_row)
        noise = jax.random.normal(noise_key, x_0.shape, x_0.dtype)
        x_t, target = noised(self.flow.process, x_0, noise, t)
        v_theta = self.flow.velocity(variables.policy, x_t, t, flat_cond).astype(jnp.float32)
        v_old = jax.lax.stop_gradient(
            self.flow.velocity(old, x_t, t, flat_cond).astype(jnp.float32)
        )
        positive_mse, negative_mse, scale = self._implicit_errors(
            x_0, x_t, t, v_theta, v_old, target
        )
        r = jnp.repeat(self.optimality(advantages), count_per_row)
        per_example = scale * (r * positive_mse + (1.0 - r) * negative_mse)
        kl = None
        if self.kl_beta > 0:
            reference = stop_gradient_arrays(variables.reference_policy())
            v_ref = self.flow.velocity(reference, x_t, t, flat_cond).astype(jnp.float32)
            kl = example_mse(v_theta, jax.lax.stop_gradient(v_ref))
            per_example = per_example + self.kl_beta * kl

        def row_stat(value: PerExample) -> Mean:
            return mean_over(keep, row_mean(jax.lax.stop_gradient(value), count_per_row))

        aux = {
            "positive_mse": row_stat(positive_mse),
            "negative_mse": row_stat(negative_mse),
            "old_mse": row_stat(example_mse(v_old, target)),
            "drift": row_stat(example_mse(v_theta, v_old)),
            "optimality": row_stat(r),
        }
        if kl is not None:
            aux["kl"] = row_stat(kl)
        return mean_over(keep, row_mean(per_example, count_per_row)), aux

    def _training_times(
        self, batch: FinalSamples, keep: Array, dtype: Any, time_key: PRNGKeyArray
    ) -> tuple[PerExample, int]:
        """Each row's training times, flat and row-major, and how many each row has."""
        rows = batch.num_rows
        if self.times == "uniform":
            t = jax.random.uniform(time_key, (rows, 1), dtype, minval=1e-4, maxval=1.0 - 1e-4)
            return t.reshape(rows), 1
        if batch.timesteps is None:
            raise ValueError(
                "`times`='grid' trains on the sampler's grid, but `batch.timesteps` is "
                "None: collect with a FlowRollout (an ODE sampler records it), or use "
                "`times`='uniform'."
            )
        grid = zero_rows_unless(keep, batch.timesteps).astype(dtype)
        size = grid.shape[1]
        count_per_row = max(1, int(self.time_fraction * size))
        order = jnp.argsort(jax.random.uniform(time_key, (rows, size)), axis=1)
        t = jnp.take_along_axis(grid, order[:, :count_per_row], axis=1)
        return t.reshape(rows * count_per_row), count_per_row

    def _implicit_errors(
        self,
        x_0: Array,
        x_t: Array,
        t: PerExample,
        v_theta: Array,
        v_old: Array,
        target: Array,
    ) -> tuple[PerExample, PerExample, float]:
        """The implicit positive and negative policies' errors per example, and the factor
        of their weighted sum (`loss_form`)."""
        positive = (1.0 - self.beta) * v_old + self.beta * v_theta
        negative = (1.0 + self.beta) * v_old - self.beta * v_theta
        scale = self.adv_max / self.beta
        return self.loss_form(ImplicitPolicyErrors(x_0, x_t, t, positive, negative, target, scale))


@eqx.filter_jit
def _soft_update(variables: NFTVariables, decay: float) -> NFTVariables:
    old_policy = blend_part(variables.old_policy, variables.policy, decay)
    moved: NFTVariables = eqx.tree_at(lambda v: v.old_policy, variables, old_policy)
    return moved
