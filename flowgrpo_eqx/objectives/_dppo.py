"""`FlowDPPOObjective`: Flow-DPPO's divergence-masked policy objective, as released."""

from dataclasses import KW_ONLY
from typing import Any, Literal, TypeAlias, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int, PyTree

from .._custom_types import (
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
from .._guided_flow import GuidedFlow
from .._misc import check_bool, check_int, check_number, zero_rows_unless
from .._sampling import AbstractSampler, SDESampler
from .._sde import AbstractSDE, FlowSDE
from .._window import AbstractWindowSchedule, RandomSteps
from ._base import (
    AbstractTransitionObjective,
    AbstractVariables,
    PolicyVariables,
    Rescore,
)
from ._dppo_divergence import AbstractKLStd, ReleasedKLStd, divergence_mask
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
from ._trainable import TrainableFilter


OldMeans: TypeAlias = Literal["rollout", "update"]
"""Where Flow-DPPO takes the old policy's transition means, the anchor of its KL, from: as the
rollout recorded them (`SDESampler(record_means=True)`), or recomputed by the trainer's own
update program before the first update (`"update"`, the release's replay at the pre-update
weights)."""


@final
class DPPOAux(eqx.Module):
    """Diagnostics of one Flow-DPPO loss evaluation, each a `Mean` over the kept transitions
    (the released metrics of `_flowdppo_kl_adv_loss`).

    **Arguments:**

    - `policy_loss`: the masked surrogate `-A r`, 0 where dropped.
    - `ratio`: the policy ratio `r = exp(log p_theta - old_log_prob)`.
    - `approx_kl`: `0.5 (log p_theta - old_log_prob)^2`.
    - `kl`: the per-transition KL to the old policy (the release's `kl_new_old_mean`).
    - `high_kl_fraction`: the fraction with `kl >= kl_threshold` (`kl_mask_fraction`).
    - `masked_fraction`: the fraction dropped by the mask (`masked_fraction`).
    - `masked_positive_fraction`: dropped with `A > 0` and `r > 1` (`pos_rm_fraction`).
    - `masked_negative_fraction`: dropped with `A < 0` and `r < 1` (`neg_rm_fraction`).
    - `counted`: the number of kept stochastic transitions `D`.
    - `log_probs`: `[N, K]` each kept transition's log density as this evaluation computed
        it (0 where not kept; no gradient), marked `PerRow`, with `old_log_probs="update"`;
        else `None`. Not a metric: `with_rescored_rows` records it.
    - `means`: `[N, K, *latent]` each kept transition's Gaussian mean as this evaluation
        computed it (0 where not kept; no gradient), marked `PerRow`, with
        `old_means="update"`; else `None`. Not a metric: `with_rescored_rows` records it.
    """

    policy_loss: Mean
    ratio: Mean
    approx_kl: Mean
    kl: Mean
    high_kl_fraction: Mean
    masked_fraction: Mean
    masked_positive_fraction: Mean
    masked_negative_fraction: Mean
    counted: Float[Array, ""]
    log_probs: PerRow | None = None
    means: PerRow | None = None


RELEASED_SDE_STEPS = RandomSteps(3, fraction=(0.0, 0.5))
"""The release's SDE steps: 3 drawn per rollout among the first half of the transitions
(`examples/diffusion/sd3_flowdppo.yaml`, `num_sde_steps: 3`, `timestep_fraction: [0.0, 0.5]`)."""


@final
class FlowDPPOObjective(AbstractTransitionObjective[PolicyVariables, Transitions]):
    """Flow-DPPO (arXiv:2606.11025) as its authors released it: Flow-GRPO's ratio surrogate
    without the clip, each term dropped by an exact per-step KL trust region on the side the
    advantage pushes (`docs/mathematics/dppo.md` §12).

    Each recorded transition is the SDE's Gaussian `N(mu, s^2 I)`, and the old policy's is
    `N(mu_old, s^2 I)` with the same std, so their KL is cheap:
    `kl = mean_coords (mu_theta - mu_old)^2 / (2 sigma^2)` (the released mean over the latent
    coordinates, not the sum), `sigma` the `kl_std`: the release's recomputed Flow-SDE std,
    clamped at `t = 1` (`ReleasedKLStd`, the default), the transition's own `s` (the exact KL,
    `TransitionKLStd`, the release's open fix) or 1 (`UnitKLStd`). With
    `r = exp(log p_theta - old_log_prob)` and `A` the advantage (not clipped, as released),
    a term is dropped (`divergence_mask`) when `kl >= kl_threshold` and `r > 1, A > 0` or
    `r < 1, A < 0`; `loss = sum_kept (-A r, 0 where dropped) / D` over the kept set (masked-in
    and stochastic) of size `D`: dropped terms count in the denominator, as released. No KL
    to a reference model (the release has none), no ratio clip, no advantage clip; the KL
    carries no gradient (it only masks).

    The default rollout (`rollout_sampler(None)`) samples the release's steps: `sde_steps`,
    3 transitions drawn per rollout among the first half (`RandomSteps`), the ODE elsewhere.
    Its advantages are the rollout's: the release normalises over the batch with each group's
    mean, `FlowRollout(advantage_std="global_unbiased")`.

    The old means come, as released, from the policy that sampled the batch, rescored by the
    trainer's own update program before the first update (`old_means="update"`: the batch
    comes as a `Rescore`), or from the rollout (`"rollout"`: `SDESampler(record_means=True)`,
    the default sampler then, one program fewer; in float32 the two agree to about 1e-7).

    **Arguments:**

    - `flow`: a `GuidedFlow`: the model, process, inputs, guidance, autoencoder and
        precision; the rollout samples with its guidance and the loss rescores with it.
    - `kl_threshold`: the KL threshold `delta`, > 0 (default 1e-5, the release's
        `kl_mask_threshold`, calibrated for the coordinate mean).
    - `kl_std`: an `AbstractKLStd`, the std the KL divides by: `ReleasedKLStd()` (default,
        the release's `add_kl_coefficient=True`), `TransitionKLStd()` (the release's open
        fix) or `UnitKLStd()` (`add_kl_coefficient=False`).
    - `sde`: the SDE of the rollout and the rescoring (`FlowSDE()` by default, noise 0.7 as
        the release's `eta`).
    - `sde_steps`: the window schedule of the default rollout (`rollout_sampler(None)`):
        `RandomSteps(3, fraction=(0.0, 0.5))` by default, as released; `None` for the
        `sde`'s own stochastic transitions (all of them, or its `window`). Must be `None`
        with an `sde` that has a `window`.
    - `old_log_probs`: `"rollout"` (default, the release's `old_logp_source="rollout"`) or
        `"update"` (its `"replay"`: recomputed by the update program, an exact ratio 1 at
        the first update in any precision).
    - `old_means`: `"update"` (default, as released) or `"rollout"`.
    - `transition_chunk`, `remat`: as for `FlowGRPOObjective`.
    - `pretrained`: as for `FlowGRPOObjective`.

    **Raises:**

    - `ValueError`: naming the argument, for a `kl_threshold` that is not a finite number
        > 0, a `kl_std` that is not an `AbstractKLStd`, a `remat` that is not a bool,
        `transition_chunk < 1`, an unknown `old_log_probs` or `old_means`, a `flow` that is
        not a `GuidedFlow`, a `sde` that is not an `AbstractSDE`, or a `sde_steps` that is not
        a window schedule or sits beside the `sde`'s `window`.
    """

    flow: GuidedFlow
    _: KW_ONLY
    kl_threshold: float = 1e-5
    kl_std: AbstractKLStd = ReleasedKLStd()
    sde: AbstractSDE = FlowSDE()
    sde_steps: AbstractWindowSchedule | None = RELEASED_SDE_STEPS
    old_log_probs: OldLogProbs = eqx.field(default="rollout", static=True)
    old_means: OldMeans = eqx.field(default="update", static=True)
    transition_chunk: int | None = None
    remat: bool | None = None
    pretrained: Model | None = None

    def __check_init__(self) -> None:
        check_number("kl_threshold", self.kl_threshold, minimum=0, include_minimum=False)
        if not isinstance(self.kl_std, AbstractKLStd):
            raise ValueError(
                "`kl_std` must be an AbstractKLStd (ReleasedKLStd, TransitionKLStd, "
                f"UnitKLStd), got {self.kl_std!r}."
            )
        if not isinstance(self.sde, AbstractSDE):
            raise ValueError(f"`sde` must be an AbstractSDE, got {self.sde!r}.")
        if self.sde_steps is not None:
            if not isinstance(self.sde_steps, AbstractWindowSchedule):
                raise ValueError(
                    "`sde_steps` must be None or an AbstractWindowSchedule (RandomSteps, "
                    f"FixedWindow, ...), got {self.sde_steps!r}."
                )
            if self.sde.window is not None:
                raise ValueError(
                    "`sde_steps` must be None with an `sde` that has a `window` (the window "
                    f"places the noise), got {self.sde_steps!r} beside window="
                    f"{self.sde.window!r}."
                )
        for name in ("old_log_probs", "old_means"):
            value = getattr(self, name)
            if value not in ("rollout", "update"):
                raise ValueError(f"`{name}` must be 'rollout' or 'update', got {value!r}.")
        check_int("transition_chunk", self.transition_chunk, 1, optional=True)
        check_bool("remat", self.remat, optional=True)

    # ----------------------------------------------------------------------------------
    # The RL loop's interface

    def variables_for(self, policy: Model, trainable: TrainableFilter | None) -> PolicyVariables:
        del trainable
        return PolicyVariables(policy=policy)

    def rollout_sampler(self, requested: AbstractSampler | None) -> AbstractSampler:
        """`SDESampler(sde, window_schedule=sde_steps)`, recording the means with
        `old_means="rollout"`, by default; a requested sampler only if it records transitions
        of this `sde` (and, with `old_means="rollout"`, their means):
        `AbstractSampler.records_transitions_of` and `records_means`.

        **Raises:**

        - `ValueError`: naming `sampler`, for a sampler that records no transitions of the
            objective's `sde` (anything but an `SDESampler` or `MixSampler` of it), or one
            that records no means when `old_means="rollout"` needs them.
        """
        needs_means = self.old_means == "rollout"
        if requested is None:
            return SDESampler(self.sde, window_schedule=self.sde_steps, record_means=needs_means)
        sampler = transition_sampler(self.sde, requested, "Flow-DPPO")
        if needs_means and not sampler.records_means():
            raise ValueError(
                "`sampler` must record the rollout's means (`record_means=True`): with "
                f"`old_means='rollout'` they are the KL's anchor, got {requested!r}."
            )
        return sampler

    def sampling_policy(self, variables: PolicyVariables) -> Model:
        return variables.policy

    def training_batch(
        self, collected: Transitions | FinalSamples, info: RolloutInfo
    ) -> Transitions | Rescore[Transitions]:
        """The rollout's transitions, or a `Rescore` of them when an anchor comes from the
        update program (`old_means="update"` or `old_log_probs="update"`).

        **Arguments:**

        - `collected`: the rollout's `Transitions`.
        - `info`: unused.

        **Returns:**

        `collected`, or `Rescore(batch, fill=self.with_rescored_rows)`, where `batch` is
        `collected` with zeros for means the rollout did not record (the update program
        then writes them).

        **Raises:**

        - `ValueError`: if the rollout recorded no transitions (an ODE sampler), or, with
            `old_means="rollout"`, no means.
        """
        del info
        transitions = recorded_transitions(collected, "Flow-DPPO")
        if self.old_means == "rollout":
            if transitions.old_means is None:
                raise ValueError(
                    "The rollout recorded no means, and `old_means='rollout'` takes the KL's "
                    "anchor from them: sample with `SDESampler(record_means=True)` (the "
                    "objective's `rollout_sampler`)."
                )
            if self.old_log_probs == "rollout":
                return transitions
        batch = transitions
        if batch.old_means is None:
            batch = eqx.tree_at(
                lambda b: b.old_means,
                batch,
                jnp.zeros_like(batch.latents),
                is_leaf=lambda x: x is None,
            )
        return Rescore(batch, fill=self.with_rescored_rows)

    def with_rescored_rows(
        self, batch: Transitions, rows: Int[Array, " M"], aux: DPPOAux
    ) -> Transitions:
        """`batch` whose kept transitions in `rows` take their old log densities
        (`old_log_probs="update"`) and old means (`old_means="update"`) from `aux`.

        **Arguments:**

        - `batch`: the whole batch.
        - `rows`: the rows of one minibatch.
        - `aux`: what `loss` reported on that minibatch.

        **Returns:**

        `batch` with those rows' anchors replaced where a transition is kept.

        **Raises:**

        - `ValueError`: naming `aux` if it lacks what an `"update"` anchor needs, or
            `batch.old_means` if it is `None` when the means are to be written.
        """
        kept = self.kept(jax.tree.map(lambda leaf: leaf[rows], batch))
        if self.old_log_probs == "update":
            if aux.log_probs is None:
                raise ValueError("`aux.log_probs` is None: `old_log_probs='update'` needs them.")
            batch = with_rescored(batch, rows, kept, "old_log_probs", aux.log_probs.value)
        if self.old_means == "update":
            if aux.means is None:
                raise ValueError("`aux.means` is None: `old_means='update'` needs them.")
            if batch.old_means is None:
                raise ValueError(
                    "`batch.old_means` is None: `training_batch` gives the batch a place "
                    "for the means before they are rescored."
                )
            batch = with_rescored(batch, rows, kept, "old_means", aux.means.value)
        return batch

    def end_epoch(self, variables: PolicyVariables, step: int) -> PolicyVariables:
        del step
        return variables

    def batch_metrics(self, batch: Transitions) -> dict[str, float]:
        """The fraction of recorded transitions the mask keeps, as `kept_fraction`."""
        return {"kept_fraction": float(jnp.mean(batch.transition_mask))}

    def loss_sums_over_rows(self) -> bool:
        """`True`: each transition's term is its own (the KL compares it with its own
        anchor, not with the minibatch)."""
        return True

    # ----------------------------------------------------------------------------------
    # The objective

    def kept(self, batch: Transitions) -> TransitionMask:
        """The kept set: masked-in transitions that are stochastic under `sde`.

        **Arguments:**

        - `batch`: the recorded transitions.

        **Returns:**

        `[N, K]` bools; the loss averages over these.
        """
        return kept_transitions(self.sde, batch)

    def log_probs(self, variables: AbstractVariables, batch: Transitions) -> PerTransition:
        """Rescore joint transition log densities with the rollout's guidance.

        **Arguments:**

        - `variables`: from `init`.
        - `batch`: the recorded transitions.

        **Returns:**

        `[N, K]` mean-coordinate log densities (0 on deterministic transitions).

        **Raises:**

        - `ValueError`: naming `batch` if it is not `Transitions`, or the field, for a
            malformed batch (`check_transitions`).
        """
        check_transitions(batch, type(self).__name__)
        return transition_log_probs(
            self.flow, self.sde, variables.policy, batch, self.transition_chunk, self.remat
        )

    def divergence(
        self,
        mean: Float[Array, " *latent"],
        old_mean: Float[Array, " *latent"],
        std: Float[ArrayLike, ""],
    ) -> Float[Array, ""]:
        """The KL between one transition's Gaussian and the old policy's, given the KL's std.

        **Arguments:**

        - `mean`: the policy's transition mean.
        - `old_mean`: the old policy's.
        - `std`: the KL's std `sigma` (`kl_std`'s value for the transition).

        **Returns:**

        `mean_coords (mean - old_mean)^2 / (2 sigma^2)`; 0 when `sigma == 0` (a
        deterministic transition).
        """
        difference = mean - old_mean.astype(mean.dtype)
        squared = jnp.mean(difference**2)
        std = jnp.asarray(std, mean.dtype)
        positive = std > 0
        safe_std = jnp.where(positive, std, 1.0)
        return jnp.where(positive, squared / (2 * safe_std**2), 0.0)

    def kl_stds(
        self,
        t: Float[Array, " B"],
        t_next: Float[Array, " B"],
        transition_std: Float[Array, " B"],
    ) -> Float[Array, " B"]:
        """`kl_std` of a batch of transitions.

        **Arguments:**

        - `t`, `t_next`: `[B]` the transitions' times.
        - `transition_std`: `[B]` the SDE's std of each.

        **Returns:**

        `[B]` the KL's stds.
        """
        stds: Float[Array, " B"] = jax.vmap(lambda a, b, s: self.kl_std(self.sde, a, b, s))(
            t, t_next, transition_std
        )
        return stds

    def loss(
        self, variables: PolicyVariables, batch: Transitions, step: Step
    ) -> tuple[Mean, DPPOAux]:
        """Flow-DPPO's divergence-masked policy loss over the recorded transitions.

        A `lax.scan` over the transitions (in chunks of `transition_chunk`) that carries
        nothing between them; each kept transition contributes `-A r`, or 0 where
        `divergence_mask` drops it. Masked transitions are replaced by a safe dummy before any
        arithmetic, so NaN or inf in them reach neither the loss nor its gradient; a dropped
        term's ratio is never evaluated, so an overflowing ratio there cannot either.

        **Arguments:**

        - `variables`: from `init`; gradients flow into `variables.policy`.
        - `batch`: the recorded transitions, with the old policy's means
            (`Transitions.old_means`).
        - `step`: unused by this objective's arithmetic.

        **Returns:**

        `(Mean(total, count), DPPOAux)`: `total` is the sum of the kept transitions'
        masked surrogates and `count` the kept count `D`, so that shards reduce exactly.

        **Raises:**

        - `ValueError`: naming `batch` if it is not `Transitions`, or the field, for a
            malformed batch (`check_transitions`); naming `batch.old_means` if it is `None`.
        """
        del step
        check_transitions(batch, type(self).__name__)
        if batch.old_means is None:
            raise ValueError(
                "`batch.old_means` is None: Flow-DPPO's KL compares each transition's mean "
                "with the old policy's; sample with `SDESampler(record_means=True)` or let "
                "`training_batch` have the update program rescore them."
            )
        kept = self.kept(batch)
        inputs = kept_inputs(batch, kept, needs_means=True)
        scored = self._score_kept(variables.policy, inputs, batch.cond)
        log_ratio = scored["log_ratio"]
        kl = jax.lax.stop_gradient(scored["kl"])
        advantage = inputs["advantage"]
        ratio = jnp.exp(jax.lax.stop_gradient(log_ratio))
        dropped = divergence_mask(kl, ratio, advantage, self.kl_threshold) & kept
        # Double `where`: a dropped term's ratio is never computed from its log-ratio.
        surrogate = -advantage * jnp.exp(jnp.where(dropped, 0.0, log_ratio))
        surrogate = jnp.where(kept & ~dropped, surrogate, 0.0)
        count = jax.lax.stop_gradient(jnp.sum(kept, dtype=jnp.float32))

        aux = self._aux(scored, surrogate, ratio, kl, advantage, dropped, kept, count)
        return Mean(total=jnp.sum(surrogate), count=count), jax.lax.stop_gradient(aux)

    def _aux(
        self,
        scored: dict[str, PerTransition],
        surrogate: PerTransition,
        ratio: PerTransition,
        kl: PerTransition,
        advantage: PerTransition,
        dropped: TransitionMask,
        kept: TransitionMask,
        count: Float[Array, ""],
    ) -> DPPOAux:
        """The loss's `DPPOAux`: each diagnostic a `Mean` over the kept transitions, and the
        rescored log densities and means when the batch asks for them."""
        log_ratio = scored["log_ratio"]

        def mean_of(value: Array) -> Mean:
            value = jnp.where(kept, value.astype(jnp.float32), 0.0)
            return Mean(total=jnp.sum(value), count=count)

        log_probs = scored.get("log_prob")
        means = scored.get("mean")
        aux = DPPOAux(
            policy_loss=mean_of(surrogate),
            ratio=mean_of(ratio),
            approx_kl=mean_of(0.5 * log_ratio**2),
            kl=mean_of(kl),
            high_kl_fraction=mean_of(kl >= self.kl_threshold),
            masked_fraction=mean_of(dropped),
            masked_positive_fraction=mean_of(dropped & (advantage > 0)),
            masked_negative_fraction=mean_of(dropped & (advantage < 0)),
            counted=count,
            log_probs=None if log_probs is None else PerRow(log_probs),
            means=None if means is None else PerRow(means),
        )
        return aux

    def _score_kept(
        self, policy: Model, inputs: dict[str, Array], batch_cond: PyTree[Any]
    ) -> dict[str, Array]:
        """Each kept transition's log-ratio and KL (and log density, mean when an `"update"`
        anchor asks), 0 elsewhere."""
        report_log_probs = self.old_log_probs == "update"
        report_means = self.old_means == "update"

        def per_transition(chunk: dict[str, Array], cond: PyTree[Any]) -> dict[str, Array]:
            mean, std = self.flow.transition(
                self.sde, policy, chunk["x"], chunk["t"], chunk["t_next"], cond
            )
            log_prob = jax.vmap(self.sde.log_prob)(chunk["x_next"], mean, std)
            anchor = jax.lax.stop_gradient(mean)
            sigma = self.kl_stds(chunk["t"], chunk["t_next"], std)
            kl = jax.vmap(self.divergence)(anchor, chunk["old_mean"], sigma)
            per = {"log_ratio": log_prob - chunk["old"], "kl": kl}
            if report_log_probs:
                per["log_prob"] = log_prob
            if report_means:
                per["mean"] = mean
            kept = chunk["kept"]

            def where_kept(value: Array) -> Array:
                wide = kept.reshape(kept.shape + (1,) * (value.ndim - 1))
                return jnp.where(wide, value, jnp.zeros_like(value))

            return {name: where_kept(value) for name, value in per.items()}

        # A row with no kept transition may carry anything in its conditioning too.
        row_kept = jnp.any(inputs["kept"], axis=1)
        cond = jax.tree.map(lambda leaf: zero_rows_unless(row_kept, leaf), batch_cond)
        scored: dict[str, Array] = map_transitions(
            per_transition, inputs, cond, self.transition_chunk, self.remat
        )
        return scored
