"""`FlowGRPOObjective`: the clipped Flow-GRPO policy objective over recorded transitions."""

from typing import Any, final

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy.typing as npt
from jaxtyping import Array, Float, Int, PyTree

from .._custom_types import (
    Aux,
    FinalSamples,
    Mean,
    Model,
    PerRow,
    PerTransition,
    RolloutInfo,
    Step,
    TransitionMask,
    Transitions,
    check_transitions,
)
from .._evaluation import Evaluation, evaluate_policy, preview_policy
from .._guided_flow import GuidedFlow, MatmulPrecision, ModelTime, Precision, flow_from
from .._inputs import CFG, AbstractAutoEncoder, AbstractGuidance, InputSpec
from .._misc import check_bool, check_int, check_number, stop_gradient_arrays, zero_rows_unless
from .._process import AbstractProcess
from .._sampling import AbstractSampler
from .._sde import AbstractSDE, FlowSDE
from .._solver import AbstractSolver, Euler
from ..rewards import FlowReward
from ._base import AbstractTransitionObjective, AbstractVariables, Rescore
from ._grpo_guard import AbstractGRPOGuard, guard_step_ratios, guarded, needs_old_means
from ._policy_loss import (
    OldLogProbs,
    kept_inputs,
    kept_transitions,
    map_transitions,
    recorded_transitions,
    transition_log_probs,
    transition_sampler,
    with_rescored,
)
from ._trainable import TrainableFilter, held_part, reference_part, reference_policy


@final
class FlowGRPOVariables(AbstractVariables):
    """Flow-GRPO's variables: the live policy and the frozen KL reference.

    **Arguments:**

    - `policy`: the live velocity model, trained by the optimizer.
    - `reference`: when `beta > 0`, a frozen copy of the initial policy's trainable arrays
        that are not LoRA adapters (`reference_part`: every float array of a fully trained
        policy, none when a LoRA policy's adapters alone train); the KL term compares with
        the policy carrying it with its adapters switched off (`reference_policy`). `None`
        without a KL term.
    """

    policy: Model
    reference: PyTree[Any] | None


@final
class FlowGRPOObjective(AbstractTransitionObjective[FlowGRPOVariables, Transitions]):
    """Train a rectified-flow policy on clipped, coordinate-normalised gradients.

    The policy is the SDE's Gaussian transition built from the model's guided velocity.
    Its ratio uses the mean-coordinate log likelihood of the released implementation (not the
    product of all coordinate likelihood ratios). With `beta > 0` a conditional transition KL,
    coordinate-averaged and with a variance that includes elapsed time, regularises it towards
    the reference: a frozen copy of the initial denoiser (`FlowGRPOVariables.reference`), or,
    for a policy with LoRA adapters (`lora.add`), the same policy with its adapters switched
    off (`lora.without_adapters`), which costs no copy.

    For each recorded transition, with `A = clip(advantage, -adv_clip_max, adv_clip_max)` and
    `r = exp(log p_theta - old_log_prob)`:
    `surrogate = max(-A r, -A clip(r, 1 - clip_range, 1 + clip_range))`, and
    `loss = sum_kept (surrogate + beta KL) / D`, where the kept set is the transitions whose
    `transition_mask` is set AND that are stochastic under `sde`, and `D` its size.
    Deterministic intervals contribute no policy loss; `D = 0` gives loss 0 and zero gradients.

    **Arguments:**

    - `model`: the velocity model, `model(x, t, cond) -> v` on one unbatched example.
    - `process`: the generative process (`RectifiedFlow`), which supplies the time grid.
    - `inputs`: an `InputSpec`: which row fields condition the model, and the null condition.
    - `sde`: the SDE (`FlowSDE`, `CoefficientsPreservingSDE`) used both by the rollout and
        for rescoring.
    - `beta`: the KL weight; `beta > 0` freezes a copy of the initial policy's trainable
        part as the reference (`FlowGRPOVariables.reference`).
    - `clip_range`: the ratio clip `epsilon` (1e-4 by default, as Flow-GRPO).
    - `adv_clip_max`: advantages are clipped to `[-adv_clip_max, adv_clip_max]`.
    - `autoencoder`: decodes latents to samples in [-1, 1]; identity (with clipping) if `None`.
    - `guidance`: the guidance used in rollout, rescoring and evaluation: classifier-free
        (`CFG`), a guidance-distilled model's input (`EmbeddedGuidance`), or `None`.
    - `sampler`: the ODE solver of `evaluate` and `preview`.
    - `steps`: the number of time points of their grid. (`sampler`, `steps`, `evaluate` and
        `preview` keep the interface of the README's `dew.objectives.rl.flow` table; they
        hand over to `evaluate_policy` and `preview_policy`, which sample any policy of any
        flow. The other objectives hold no evaluation settings.)
    - `pretrained`: initial policy weights (a model of the same structure), or `None` to
        start from `model` itself.
    - `transition_chunk`: how many transitions `loss` and `log_probs` evaluate together per
        `lax.scan` step (vmapped). `None` (the default) evaluates all `K` at once, the fastest;
        `1` with rematerialisation keeps memory flat in `K`. `K` need not be a multiple: the
        last chunk is padded with copies whose results are discarded.
    - `remat`: whether each scan step is rematerialised (`jax.checkpoint`); `None` (default)
        means "when there is more than one chunk".
    - `guard`: a GRPO-Guard form (`GRPOGuard()`, the authors' fixed release, whose batch
        needs `Transitions.old_means`; `GRPOGuard(drift="batch")`, the release as published;
        `EmpiricalGuard()`) for its normalised ratio and step weights (the ratio and the
        surrogate above are then the guarded ones, and `Aux.step_ratios` reports the ratio
        per step before and after normalisation); `None` (default) for plain Flow-GRPO.
    - `precision`: `"float32"` (default) or `"bfloat16"`, the dtype the model computes in
        (`GuidedFlow`); the SDE, densities, ratio and KL stay float32.
    - `matmul_precision`: the precision of the model's float32 matrix products
        (`MatmulPrecision`, `GuidedFlow`): `"highest"` by default on every backend;
        `"default"` for the backend's fastest (one bfloat16 pass on a TPU).
    - `model_time`: the time the model receives (`ModelTime`, `GuidedFlow`): `"exact"`
        (default), or `"thousandths"`, `floor(1000 t) / 1000`, as MixGRPO's release feeds
        it in its rollout and its update.
    - `old_log_probs`: `"rollout"` (the default) keeps the old log densities the rollout
        recorded; `"update"` has `training_batch` ask the trainer to `Rescore` the batch with
        its own update program before the first update of each rollout, and `loss` then
        reports each transition's log density (`Aux.log_probs`). The rollout and the update
        are different compiled programs; in float32 they agree to about 1e-7, but in
        bfloat16 they round differently and the first update's ratio is off 1 by about 4e-4
        on the demo. With `"update"` the ratio of every transition of the first update is
        exactly 1, at the cost of one more run of the update program per minibatch of the
        first pass.

    **Raises:**

    - `ValueError`: naming the argument, for `clip_range <= 0`, `adv_clip_max <= 0`,
        `beta < 0`, `steps < 2`, `transition_chunk < 1`, a `remat` that is not a bool or
        `None`, an `sde` that is not an `AbstractSDE`, a `sampler` that is not an
        `AbstractSolver`, a `guard` that is not an `AbstractGRPOGuard`, an unknown
        `old_log_probs`, `precision`, `matmul_precision` or `model_time` (`GuidedFlow`), or
        guidance without a null condition.
    """

    flow: GuidedFlow
    sde: AbstractSDE
    beta: float
    clip_range: float
    adv_clip_max: float
    sampler: AbstractSolver
    steps: int
    pretrained: Model | None
    transition_chunk: int | None
    remat: bool | None
    guard: AbstractGRPOGuard | None
    old_log_probs: OldLogProbs = eqx.field(static=True)

    def __init__(
        self,
        model: Model,
        process: AbstractProcess,
        inputs: InputSpec,
        *,
        sde: AbstractSDE = FlowSDE(),
        beta: float = 0.0,
        clip_range: float = 1e-4,
        adv_clip_max: float = 5.0,
        autoencoder: AbstractAutoEncoder | None = None,
        guidance: AbstractGuidance | None = CFG(3.0),
        sampler: AbstractSolver = Euler(),
        steps: int = 41,
        pretrained: Model | None = None,
        transition_chunk: int | None = None,
        remat: bool | None = None,
        guard: AbstractGRPOGuard | None = None,
        precision: Precision = "float32",
        old_log_probs: OldLogProbs = "rollout",
        matmul_precision: MatmulPrecision = "highest",
        model_time: ModelTime = "exact",
    ):
        self.flow = flow_from(
            model, process, inputs, guidance, autoencoder, precision, matmul_precision, model_time
        )
        self.sde = sde
        self.beta = beta
        self.clip_range = clip_range
        self.adv_clip_max = adv_clip_max
        self.sampler = sampler
        self.steps = steps
        self.pretrained = pretrained
        self.transition_chunk = transition_chunk
        self.remat = remat
        self.guard = guard
        self.old_log_probs = old_log_probs

    def __check_init__(self) -> None:
        if not isinstance(self.sde, AbstractSDE):
            raise ValueError(f"`sde` must be an AbstractSDE, got {self.sde!r}.")
        if not isinstance(self.sampler, AbstractSolver):
            raise ValueError(f"`sampler` must be an AbstractSolver, got {self.sampler!r}.")
        check_int("steps", self.steps, 2)
        check_number("beta", self.beta, minimum=0)
        check_number("clip_range", self.clip_range, minimum=0, include_minimum=False)
        check_number("adv_clip_max", self.adv_clip_max, minimum=0, include_minimum=False)
        check_int("transition_chunk", self.transition_chunk, 1, optional=True)
        check_bool("remat", self.remat, optional=True)
        if self.guard is not None and not isinstance(self.guard, AbstractGRPOGuard):
            raise ValueError(
                f"`guard` must be an AbstractGRPOGuard (GRPOGuard, EmpiricalGuard) or None, "
                f"got {self.guard!r}."
            )
        if self.old_log_probs not in ("rollout", "update"):
            raise ValueError(
                f"`old_log_probs` must be 'rollout' or 'update', got {self.old_log_probs!r}."
            )

    # ----------------------------------------------------------------------------------
    # The RL loop's interface

    def variables_for(self, policy: Model, trainable: TrainableFilter | None) -> FlowGRPOVariables:
        reference = reference_part(policy, trainable) if self.beta > 0 else None
        return FlowGRPOVariables(policy=policy, reference=reference)

    def rollout_sampler(self, requested: AbstractSampler | None) -> AbstractSampler:
        """`SDESampler(sde)` by default; a requested sampler only if it records transitions
        of this `sde` (`AbstractSampler.records_transitions_of`).

        Flow-GRPO rescores recorded transitions with its own `sde`: a rollout that sampled
        another one (or an ODE) would give log densities the loss cannot reproduce. A
        `MixSampler` (MixGRPO's rollout) records its window with the same `sde`, so it is
        accepted too.

        **Raises:**

        - `ValueError`: naming `sampler`, for a sampler that records no transitions of the
            objective's `sde` (anything but an `SDESampler` or `MixSampler` of it).
        """
        return transition_sampler(self.sde, requested, "Flow-GRPO")

    def sampling_policy(self, variables: FlowGRPOVariables) -> Model:
        return variables.policy

    def training_batch(
        self, collected: Transitions | FinalSamples, info: RolloutInfo
    ) -> Transitions | Rescore[Transitions]:
        """The rollout's transitions; with `old_log_probs="update"`, a `Rescore` of them.

        **Arguments:**

        - `collected`: the rollout's `Transitions`.
        - `info`: unused.

        **Returns:**

        `collected`, or `Rescore(collected, fill=self.with_rescored_rows)`, so that the
        trainer recomputes the old log densities with its own update program and the first
        pass of updates starts from a ratio of exactly 1 whatever the precision.

        **Raises:**

        - `ValueError`: if the rollout recorded no transitions (an ODE sampler).
        """
        del info
        transitions = recorded_transitions(collected, "Flow-GRPO")
        if self.old_log_probs == "update":
            return Rescore(transitions, fill=self.with_rescored_rows)
        return transitions

    def with_rescored_rows(
        self, batch: Transitions, rows: Int[Array, " M"], aux: Aux
    ) -> Transitions:
        """`batch` whose kept transitions in `rows` take their old log densities from `aux`.

        **Arguments:**

        - `batch`: the whole batch.
        - `rows`: the rows of one minibatch.
        - `aux`: what `loss` reported on that minibatch (`Aux.log_probs`, `old_log_probs=
            "update"`).

        **Returns:**

        `batch` with new `old_log_probs` in those rows where a transition is kept.

        **Raises:**

        - `ValueError`: if `aux` holds no log densities (`old_log_probs` is not `"update"`).
        """
        if aux.log_probs is None:
            raise ValueError(
                "`aux.log_probs` is None: the loss reports log densities only with "
                "`old_log_probs='update'`."
            )
        kept = self.kept(jax.tree.map(lambda leaf: leaf[rows], batch))
        return with_rescored(batch, rows, kept, "old_log_probs", aux.log_probs.value)

    def end_epoch(self, variables: FlowGRPOVariables, step: int) -> FlowGRPOVariables:
        del step
        return variables

    def batch_metrics(self, batch: Transitions) -> dict[str, float]:
        """The fraction of recorded transitions the mask keeps, as `kept_fraction`."""
        return {"kept_fraction": float(jnp.mean(batch.transition_mask))}

    # ----------------------------------------------------------------------------------
    # Public objective methods

    def kept(self, batch: Transitions) -> TransitionMask:
        """The kept set: masked-in transitions that are stochastic under `sde`.

        **Arguments:**

        - `batch`: the recorded transitions.

        **Returns:**

        `[N, K]` bools: `transition_mask` and stochastic; the loss averages over these.
        """
        return kept_transitions(self.sde, batch)

    def log_probs(self, variables: AbstractVariables, batch: Transitions) -> PerTransition:
        """Rescore joint transition log densities with the rollout's guidance.

        Uses the live policy and the same `FlowSDE` as the rollout, so rescoring an unchanged
        policy reproduces `old_log_probs`. Deterministic transitions score 0.

        **Arguments:**

        - `variables`: from `init`.
        - `batch`: the recorded transitions.

        **Returns:**

        `[N, K]` mean-coordinate log densities.

        **Raises:**

        - `ValueError`: naming `batch` if it is not `Transitions` (say, `FinalSamples`), or
            the field, for a malformed batch (`check_transitions`).
        """
        check_transitions(batch, type(self).__name__)
        return transition_log_probs(
            self.flow, self.sde, variables.policy, batch, self.transition_chunk, self.remat
        )

    def loss_sums_over_rows(self) -> bool:
        """`True` without a `guard`; a guard's ratio normalisation and step weights use
        whole-minibatch statistics."""
        return self.guard is None

    def loss(
        self, variables: FlowGRPOVariables, batch: Transitions, step: Step
    ) -> tuple[Mean, Aux]:
        """Score the clipped policy gradient over the recorded transitions.

        A `lax.scan` over the transitions (in chunks of `transition_chunk`) that carries
        nothing between them; each transition contributes its surrogate, its KL to the frozen
        reference (`variables.reference`; for a policy with LoRA adapters, the policy with its
        adapters switched off), whether it counted, and whether its ratio was clipped. Masked
        transitions are replaced by a safe dummy before any arithmetic, so NaN or inf in them
        reach neither the loss nor its gradient.

        **Arguments:**

        - `variables`: from `init`; gradients flow into `variables.policy` only.
        - `batch`: the recorded transitions.
        - `step`: the training step: its index and key are unused by this objective's
            arithmetic.

        **Returns:**

        `(Mean(total, count), Aux)`: `total` is the sum over kept transitions of
        `surrogate + beta KL` and `count` the kept count `D`, so that shards reduce exactly.
        With `old_log_probs="update"`, `Aux.log_probs` holds each transition's log density.

        **Raises:**

        - `ValueError`: naming `batch` if it is not `Transitions` (say, the `FinalSamples`
            of an ODE rollout), or the field, for a malformed batch (`check_transitions`);
            or naming `variables` when `beta > 0` and a policy without adapters comes
            without its reference; or naming `guard` and `batch.old_means` when the guard
            adds back the drift from the rollout's means and the batch has none.
        """
        check_transitions(batch, type(self).__name__)
        reference = self.kl_reference(variables)
        needs_means = needs_old_means(self.guard, batch.old_means)
        kept = self.kept(batch)
        inputs = kept_inputs(batch, kept, needs_means)
        scored = self._score_kept(variables.policy, reference, inputs, batch.cond)
        log_ratio, weight = guarded(self.guard, scored, inputs, kept)
        stats = self._surrogate_statistics(log_ratio, weight, inputs["advantage"], scored)
        stats = {
            name: jnp.where(kept, value, jnp.zeros_like(value)) for name, value in stats.items()
        }
        count = jax.lax.stop_gradient(jnp.sum(kept, dtype=jnp.float32))
        return self._objective_and_aux(stats, count, scored, kept)

    def _objective_and_aux(
        self,
        stats: dict[str, PerTransition],
        count: Float[Array, ""],
        scored: dict[str, PerTransition],
        kept: TransitionMask,
    ) -> tuple[Mean, Aux]:
        """The loss's `(Mean, Aux)` from the kept transitions' statistics: each a `Mean` over
        the kept count, with the guard's per-step ratio statistics when there is a guard."""

        def mean_of(name: str) -> Mean:
            return Mean(total=jnp.sum(stats[name]), count=count)

        step_ratios = None
        if self.guard is not None:
            step_ratios = guard_step_ratios(scored["log_ratio"], stats["ratio"], kept)
        log_probs = scored.get("log_prob")
        aux = Aux(
            policy_loss=mean_of("policy_loss"),
            kl=mean_of("kl"),
            clipfrac=mean_of("clipfrac"),
            clipfrac_gt_one=mean_of("clipfrac_gt_one"),
            clipfrac_lt_one=mean_of("clipfrac_lt_one"),
            approx_kl=mean_of("approx_kl"),
            ratio=mean_of("ratio"),
            counted=count,
            step_ratios=jax.lax.stop_gradient(step_ratios),
            log_probs=None if log_probs is None else PerRow(jax.lax.stop_gradient(log_probs)),
        )
        return mean_of("objective"), aux

    def evaluate(
        self,
        variables: AbstractVariables,
        batch: Transitions | PyTree[Any],
        step: Step,
        *,
        reward: FlowReward | None = None,
    ) -> Evaluation:
        """One live-policy sample per source row, including prompt-only batches:
        `evaluate_policy(flow, sampler, steps, variables.policy, batch, step.key)`.

        Evaluation is not an objective's work and its code lives in `evaluate_policy`; this
        method (like `preview`, `sampler` and `steps`) stays because the documented API, the
        README's `dew.objectives.rl.flow` table, lists `FlowGRPOObjective.evaluate(params,
        batch, step)`.

        **Arguments:**

        - `variables`: from `init`.
        - `batch`: a `Transitions` batch (its `cond` rows are used) or the rows themselves.
        - `step`: its `key` draws the starting noise.
        - `reward`: if given, the samples are scored with it on the host (float64).

        **Returns:**

        An `Evaluation` with the decoded `samples`, the final `latents`, and `scores`.

        **Raises:**

        - `ValueError`: if the rows are prompt-only and `InputSpec.latent_shape` is unset.
        - `RewardError`: if the reward fails.
        """
        return evaluate_policy(
            self.flow, self.sampler, self.steps, variables.policy, batch, step.key, reward=reward
        )

    def preview(
        self,
        variables: AbstractVariables,
        batch: Transitions | PyTree[Any],
        step: Step,
        *,
        scored: FlowReward | npt.ArrayLike | None = None,
        path: str | None = None,
        captions: list[str] | None = None,
        title: str | None = None,
    ) -> Evaluation:
        """Draw, score and picture one live-policy sample per row: `preview_policy` with
        the objective's flow, `sampler` and `steps`.

        A thin hand-over kept for the documented API (the README's `dew.objectives.rl.flow`
        table lists `FlowGRPOObjective.preview(params, batch, step, *, scored=None)`); the
        drawing and the picture are `preview_policy`'s.

        **Arguments:**

        - `variables`, `batch`, `step`: as for `evaluate`.
        - `scored`, `path`, `captions`, `title`: as for `preview_policy`.

        **Returns:**

        The `Evaluation` (with `scores` when `scored` was given).

        **Raises:**

        - `ValueError`: if `scored` scores or `captions` do not have one entry per row.
        """
        return preview_policy(
            self.flow,
            self.sampler,
            self.steps,
            variables.policy,
            batch,
            step.key,
            scored=scored,
            path=path,
            captions=captions,
            title=title,
        )

    def kl_reference(self, variables: FlowGRPOVariables) -> Model | None:
        """The frozen model the KL term compares with, without gradient; `None` when
        `beta == 0`.

        **Arguments:**

        - `variables`: from `init`.

        **Returns:**

        `reference_policy(variables.policy, variables.reference)`: the initial policy with
        its LoRA adapters switched off.

        **Raises:**

        - `ValueError`: naming `variables` when `beta > 0` and it holds no reference.
        """
        if self.beta == 0:
            return None
        part = held_part(variables.reference, "reference", "`beta` > 0 needs the frozen reference")
        reference: Model = stop_gradient_arrays(reference_policy(variables.policy, part))
        return reference

    def _score_kept(
        self,
        policy: Model,
        reference: Model | None,
        inputs: dict[str, Array],
        batch_cond: PyTree[Any],
    ) -> dict[str, PerTransition]:
        """Each kept transition's log-ratio, KL and std (and drift, log density when asked),
        0 elsewhere."""
        needs_means = "old_mean" in inputs
        report_log_probs = self.old_log_probs == "update"

        def per_transition(chunk: dict[str, Array], cond: PyTree[Any]) -> dict[str, Array]:
            mean, std = self.flow.transition(
                self.sde, policy, chunk["x"], chunk["t"], chunk["t_next"], cond
            )
            log_prob = jax.vmap(self.sde.log_prob)(chunk["x_next"], mean, std)
            if reference is not None:
                mean_ref, _ = self.flow.transition(
                    self.sde, reference, chunk["x"], chunk["t"], chunk["t_next"], cond
                )
                kl = jax.vmap(self.sde.kl)(mean, mean_ref, std, chunk["t_next"] - chunk["t"])
            else:
                kl = jnp.zeros_like(log_prob)
            per = {"log_ratio": log_prob - chunk["old"], "kl": kl, "std": std}
            if needs_means:
                difference = (mean - chunk["old_mean"]).reshape(mean.shape[0], -1)
                per["drift"] = jnp.mean(difference**2, axis=1)
            if report_log_probs:
                per["log_prob"] = log_prob
            zero = jnp.zeros_like(log_prob)
            return {name: jnp.where(chunk["kept"], value, zero) for name, value in per.items()}

        # A row with no kept transition may carry anything in its conditioning too.
        row_kept = jnp.any(inputs["kept"], axis=1)
        cond = jax.tree.map(lambda leaf: zero_rows_unless(row_kept, leaf), batch_cond)
        scored: dict[str, PerTransition] = map_transitions(
            per_transition, inputs, cond, self.transition_chunk, self.remat
        )
        return scored

    def _surrogate_statistics(
        self,
        log_ratio: PerTransition,
        weight: PerTransition | None,
        advantage: PerTransition,
        scored: dict[str, PerTransition],
    ) -> dict[str, PerTransition]:
        """The clipped surrogate, the objective and the per-transition diagnostics."""
        ratio = jnp.exp(log_ratio)
        advantage = jnp.clip(advantage, -self.adv_clip_max, self.adv_clip_max)
        clipped_ratio = jnp.clip(ratio, 1.0 - self.clip_range, 1.0 + self.clip_range)
        surrogate = jnp.maximum(-advantage * ratio, -advantage * clipped_ratio)
        if weight is not None:
            surrogate = weight * surrogate
        kl = scored["kl"]
        return {
            "objective": surrogate + self.beta * kl,
            "policy_loss": surrogate,
            "kl": kl,
            "clipfrac": (jnp.abs(ratio - 1.0) > self.clip_range).astype(surrogate.dtype),
            "clipfrac_gt_one": (ratio - 1.0 > self.clip_range).astype(surrogate.dtype),
            "clipfrac_lt_one": (1.0 - ratio > self.clip_range).astype(surrogate.dtype),
            "approx_kl": 0.5 * scored["log_ratio"] ** 2,
            "ratio": jax.lax.stop_gradient(ratio),
        }
