"""DanceGRPO as released: its SDE, its rollout of randomly chosen trained steps, and its
clipped policy objective with one surrogate per reward (`docs/mathematics/dancegrpo.md`
§13)."""

from dataclasses import KW_ONLY
from typing import Any, final

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray, PyTree

from .._custom_types import (
    FinalSamples,
    Latent,
    Mean,
    Model,
    PerRow,
    PerTransition,
    RolloutInfo,
    Scalar,
    Step,
    TransitionMask,
    Transitions,
    check_transitions,
)
from .._guided_flow import GuidedFlow
from .._misc import check_int, check_number, zero_rows_unless
from .._sampling import AbstractSampler, Draw, Generated, SDEPath, recorded_batch, step_noise
from .._sde import AbstractSDE, KLWeighting, PaperKLWeighting
from ._base import (
    AbstractTransitionObjective,
    AbstractVariables,
    PolicyVariables,
    Rescore,
)
from ._policy_loss import (
    OldLogProbs,
    kept_inputs,
    kept_transitions,
    map_transitions,
    recorded_transitions,
    transition_log_probs,
    with_rescored,
)
from ._trainable import TrainableFilter


@final
class DanceSDE(AbstractSDE):
    """DanceGRPO's SDE (github `XueZeyue/DanceGRPO`, `fastvideo/train_grpo_flux.py`
    `flux_step` with `sde_solver=True`, lines 131-170; the same in `train_grpo_wan_2_1.py`
    and `train_grpo_hunyuan.py`): Flow-GRPO's SDE with a constant noise level.

    For a transition `t -> t_next`, `dt = t_next - t < 0`, velocity `v` and noise level
    `eta`, computed in the release's order: `x0 = x - t v`, the score
    `-(x - (1 - t) x0) / t^2`, `mean = x + dt v - eta^2 / 2 score dt` and
    `std = eta sqrt(-dt)`; that is Flow-GRPO's mean (`FlowSDE`) with `sigma = eta` at every
    step. The last step, to the data at `t_next = 0`, is deterministic (`can_be_stochastic`
    is `t_next > 0`): the release samples it with noise but decodes its data prediction
    `x - t v`, the Euler step, and never trains it.

    **Arguments:**

    - `noise_level`: `eta`, 0.3 by default (the release's FLUX and Wan scripts; 0.25 for
        HunyuanVideo).
    - `window`, `kl_weighting`: as for `FlowSDE` (the release has no window and no KL).

    **Raises:**

    - `ValueError`: naming the argument, as `AbstractSDE`.
    """

    noise_level: float = 0.3
    window: tuple[float, float] | None = None
    kl_weighting: KLWeighting = PaperKLWeighting()

    def gaussian(
        self, x: Latent, v: Latent, t: Scalar, t_next: Scalar, level: Scalar
    ) -> tuple[Latent, Scalar]:
        dt = t_next - t
        mean = x + dt * v
        data = x - t * v
        score = -(x - data * (1 - t)) / t**2
        mean = mean + (-0.5 * level**2 * score) * dt
        return mean, level * jnp.sqrt(t - t_next)

    def can_be_stochastic(self, t_next: Float[Array, " *batch"]) -> Bool[Array, " *batch"]:
        return t_next > 0


@final
class DanceSampler(AbstractSampler):
    """DanceGRPO's rollout and its trained steps (`train_grpo_flux.py` `train_one_step`,
    lines 505-570): the SDE on every transition, and for each row a random
    `int((T - 1) timestep_fraction)` of the first `T - 1` transitions recorded and trained
    (the release shuffles each row's `T - 1` steps, `torch.randperm`, and trains the first
    `train_timesteps` of them; the last step it never trains). The subset is drawn per row
    from the rollout's key; it is recorded in increasing order (the order of a row's steps
    does not change the gradient the release accumulates over them).

    **Arguments:**

    - `sde`: the SDE (the objective's, a `DanceSDE`).
    - `timestep_fraction`: in (0, 1]: 0.6 in the release's scripts.

    **Raises:**

    - `ValueError`: naming the argument, for an `sde` that is not an `AbstractSDE` or a
        `timestep_fraction` outside (0, 1]; and, when a rollout checks it, a grid with fewer
        than one trained step or one of whose first `T - 1` transitions the `sde` does not
        make stochastic.
    """

    sde: AbstractSDE
    timestep_fraction: float = eqx.field(default=0.6, static=True)

    def __check_init__(self) -> None:
        if not isinstance(self.sde, AbstractSDE):
            raise ValueError(f"`sde` must be an AbstractSDE, got {self.sde!r}.")
        check_number(
            "timestep_fraction", self.timestep_fraction, minimum=0, maximum=1, include_minimum=False
        )

    def check_rollout(self, flow: GuidedFlow, steps: int, groups: int, shared_noise: bool) -> None:
        del groups, shared_noise
        if self.recorded_transitions(steps) < 1:
            raise ValueError(
                f"`timestep_fraction`={self.timestep_fraction} trains int({steps - 2} x "
                f"{self.timestep_fraction}) = 0 of the {steps - 2} steps before the last "
                f"(steps={steps}): use more steps or a larger fraction."
            )
        grid = flow.process.timesteps(steps)
        if not bool(jnp.all(self.sde.is_stochastic(grid[:-2], grid[1:-1]))):
            raise ValueError(
                f"`sde` ({self.sde!r}) must make every transition but the last stochastic: "
                "DanceGRPO trains steps drawn among all of them."
            )

    def records_transitions_of(self, sde: AbstractSDE) -> bool:
        return bool(eqx.tree_equal(self.sde, sde))

    def records_means(self) -> bool:
        return False

    def recorded_transitions(self, steps: int) -> int:
        """`int((steps - 2) timestep_fraction)`: the release's `train_timesteps` of the
        `T - 1 = steps - 2` steps before the last."""
        return int((steps - 2) * self.timestep_fraction)

    def window_start(self, epoch: int, steps: int, key: PRNGKeyArray) -> int:
        del epoch, steps, key
        return 0

    def trained_steps(self, key: PRNGKeyArray, rows: int, steps: int) -> Int[Array, " N K"]:
        """Each row's trained transitions: the first `K` of a uniform permutation of
        `0 .. steps - 3`, sorted.

        **Arguments:**

        - `key`: the rollout's step key.
        - `rows`: `N`.
        - `steps`: the grid's points.

        **Returns:**

        `[N, K]` int32 transition indices, `K = recorded_transitions(steps)`.
        """
        count = self.recorded_transitions(steps)
        keys = jax.random.split(jax.random.fold_in(key, 0xDA7CE), rows)
        chosen = jax.vmap(lambda k: jax.random.permutation(k, steps - 2)[:count])(keys)
        return jnp.sort(chosen, axis=1).astype(jnp.int32)

    def trajectory(
        self, draw: Draw, start: Float[Array, " N *latent"], key: PRNGKeyArray
    ) -> Generated:
        """One `lax.scan` over the grid, every transition with the SDE, each row's trained
        transitions (`trained_steps`) taken out of the recorded trajectory."""
        steps, rows = draw.steps, start.shape[0]
        noise = step_noise(key, steps, rows, start.shape[1:], draw.sharding)
        path = SDEPath(draw.flow, self.sde, draw.policy, draw.rows, False)
        grid = draw.grid()
        head = (grid[:-1], grid[1:], noise)
        x, (latents, next_latents, log_probs) = jax.lax.scan(
            lambda x, xs: path.recording(x, xs), start, head
        )
        chosen = self.trained_steps(key, rows, steps)

        def per_row(leaf: Array) -> Array:
            by_row = jnp.swapaxes(leaf, 0, 1)
            index = chosen.reshape(chosen.shape + (1,) * (by_row.ndim - 2))
            return jnp.take_along_axis(by_row, index, axis=1)

        return Generated(
            latents=per_row(latents),
            next_latents=per_row(next_latents),
            log_probs=per_row(log_probs),
            final=x,
            samples=draw.flow.decode(x),
            steps=chosen,
        )

    def batch(
        self, draw: Draw, generated: Generated, advantages: npt.NDArray[np.float32]
    ) -> Transitions:
        """The `Transitions` of each row's trained steps; rows with a zero advantage masked.

        **Raises:**

        - `ValueError`: if `generated` holds no per-row steps (it came from another
            sampler).
        """
        if (
            generated.latents is None
            or generated.next_latents is None
            or generated.log_probs is None
            or generated.steps is None
        ):
            raise ValueError("`generated` holds no per-row steps: it came from another sampler.")
        grid = np.asarray(draw.grid())
        chosen = np.asarray(generated.steps)
        timesteps, next_timesteps = grid[chosen], grid[chosen + 1]
        stochastic = np.asarray(self.sde.is_stochastic(timesteps, next_timesteps))
        return recorded_batch(draw, generated, timesteps, next_timesteps, stochastic, advantages)


@final
class RewardTransitions(eqx.Module):
    """Recorded transitions with each reward's own advantages: what DanceGRPO's loss trains
    on.

    **Arguments:**

    - `transitions`: the rollout's `Transitions` (their `advantages` the rewards' weighted
        sum, which decides the mask of a row).
    - `advantages`: `[N, R]` each reward's group-normalised advantages.
    - `weights`: the `R` rewards' weights.
    """

    transitions: Transitions
    advantages: Float[Array, " N R"]
    weights: tuple[float, ...] = eqx.field(static=True)

    def __check_init__(self) -> None:
        rows = self.transitions.num_rows
        if self.advantages.ndim != 2 or self.advantages.shape != (rows, len(self.weights)):
            raise ValueError(
                f"`advantages` must have shape [N, R] = ({rows}, {len(self.weights)}), got "
                f"{self.advantages.shape}."
            )

    @property
    def num_rows(self) -> int:
        """`N`, the number of rows."""
        return self.transitions.num_rows


@final
class DanceGRPOAux(eqx.Module):
    """Diagnostics of one DanceGRPO loss evaluation, each a `Mean` over the kept transitions.

    **Arguments:**

    - `policy_loss`: the summed clipped surrogates.
    - `clipfrac`, `clipfrac_gt_one`, `clipfrac_lt_one`: the fractions with `|r - 1|`,
        `r - 1`, `1 - r` above `clip_range`.
    - `approx_kl`: `0.5 (log p_theta - old_log_prob)^2`.
    - `ratio`: the policy ratio `r`.
    - `counted`: the number of kept transitions `D`.
    - `log_probs`: `[N, K]` the kept transitions' log densities as this evaluation computed
        them, marked `PerRow`, with `old_log_probs="update"`; else `None`.
    """

    policy_loss: Mean
    clipfrac: Mean
    clipfrac_gt_one: Mean
    clipfrac_lt_one: Mean
    approx_kl: Mean
    ratio: Mean
    counted: Float[Array, ""]
    log_probs: PerRow | None = None


@final
class DanceGRPOObjective(AbstractTransitionObjective[PolicyVariables, RewardTransitions]):
    """DanceGRPO (arXiv:2505.07818) as released (github `XueZeyue/DanceGRPO`,
    `fastvideo/train_grpo_flux.py`, `train_grpo_wan_2_1.py`, `train_grpo_hunyuan.py`;
    `docs/mathematics/dancegrpo.md` §13): Flow-GRPO's clipped ratio on the transitions of
    `DanceSDE`, each row trained on its own random `timestep_fraction` of the steps
    (`DanceSampler`), one clipped surrogate per reward.

    With `r = exp(log p_theta - old_log_prob)` (the mean-coordinate log density of §3),
    `A_k = clip(advantage_k, -adv_clip_max, adv_clip_max)` each reward's advantage and `w_k`
    its weight, each kept transition's term is
    `sum_k w_k max(-A_k r, -A_k clip(r, 1 - clip_range, 1 + clip_range))` (the release's
    multi-reward loss, `train_grpo_hunyuan.py` lines 455-477; one reward: its single
    surrogate, `train_grpo_flux.py` lines 589-603); `loss = sum_kept / D`. The rewards'
    advantages come from the rollout (`RolloutInfo.reward_advantages`, a `WeightedReward` with
    `reward_combination="normalize_each"`), else the batch's one advantage. No KL to a
    reference model (the release has none).

    **Arguments:**

    - `flow`: a `GuidedFlow` (the release feeds the model `int(1000 t) / 1000`:
        `model_time="thousandths"`).
    - `sde`: the SDE, `DanceSDE(0.3)` by default.
    - `clip_range`: the ratio clip, 1e-4 as released.
    - `adv_clip_max`: the advantage clip, 5.0 as released.
    - `timestep_fraction`: the fraction of the steps each row trains in the default rollout
        (`DanceSampler`), 0.6 as released.
    - `old_log_probs`: `"rollout"` (default, as released) or `"update"` (rescored by the
        update program before the first update: an exact ratio 1 in any precision).
    - `transition_chunk`, `remat`, `pretrained`: as for `FlowGRPOObjective`.

    **Raises:**

    - `ValueError`: naming the argument, for a `clip_range`, `adv_clip_max` or
        `timestep_fraction` out of range, an `sde` that is not an `AbstractSDE`, an unknown
        `old_log_probs`, `transition_chunk < 1`, or a `flow` that is not a `GuidedFlow`.
    """

    flow: GuidedFlow
    _: KW_ONLY
    sde: AbstractSDE = DanceSDE()
    clip_range: float = 1e-4
    adv_clip_max: float = 5.0
    timestep_fraction: float = 0.6
    old_log_probs: OldLogProbs = eqx.field(default="rollout", static=True)
    transition_chunk: int | None = None
    remat: bool | None = None
    pretrained: Model | None = None

    def __check_init__(self) -> None:
        if not isinstance(self.sde, AbstractSDE):
            raise ValueError(f"`sde` must be an AbstractSDE, got {self.sde!r}.")
        check_number("clip_range", self.clip_range, minimum=0, include_minimum=False)
        check_number("adv_clip_max", self.adv_clip_max, minimum=0, include_minimum=False)
        check_number(
            "timestep_fraction", self.timestep_fraction, minimum=0, maximum=1, include_minimum=False
        )
        if self.old_log_probs not in ("rollout", "update"):
            raise ValueError(
                f"`old_log_probs` must be 'rollout' or 'update', got {self.old_log_probs!r}."
            )
        check_int("transition_chunk", self.transition_chunk, 1, optional=True)
        if self.remat is not None and not isinstance(self.remat, bool):
            raise ValueError(f"`remat` must be a bool or None, got {self.remat!r}.")

    # ----------------------------------------------------------------------------------
    # The RL loop's interface

    def variables_for(self, policy: Model, trainable: TrainableFilter | None) -> PolicyVariables:
        del trainable
        return PolicyVariables(policy=policy)

    def rollout_sampler(self, requested: AbstractSampler | None) -> AbstractSampler:
        """`DanceSampler(sde, timestep_fraction)` by default; a requested sampler only if it
        records transitions of this `sde`.

        **Raises:**

        - `ValueError`: naming `sampler`, for one that records no transitions of the `sde`.
        """
        if requested is None:
            return DanceSampler(self.sde, self.timestep_fraction)
        if not requested.records_transitions_of(self.sde):
            raise ValueError(
                "`sampler` must record transitions of the DanceGRPO objective's own `sde` "
                f"({self.sde!r}): a DanceSampler or an SDESampler of it, got {requested!r}."
            )
        return requested

    def sampling_policy(self, variables: PolicyVariables) -> Model:
        return variables.policy

    def training_batch(
        self, collected: Transitions | FinalSamples, info: RolloutInfo
    ) -> RewardTransitions | Rescore[RewardTransitions]:
        """The rollout's transitions with each reward's advantages
        (`info.reward_advantages`, or the batch's one advantage), as a `Rescore` with
        `old_log_probs="update"`.

        **Arguments:**

        - `collected`: the rollout's `Transitions`.
        - `info`: its `RolloutInfo`.

        **Returns:**

        The `RewardTransitions`, or a `Rescore` of them.

        **Raises:**

        - `ValueError`: if the rollout recorded no transitions, or its advantages are per
            transition (`[N, K]`).
        """
        transitions = recorded_transitions(collected, "DanceGRPO")
        if transitions.advantages.ndim != 1:
            raise ValueError(
                f"DanceGRPO's advantages are one per row ([N]), got {transitions.advantages.shape}."
            )
        if info.reward_advantages is None or info.reward_weights is None:
            advantages = transitions.advantages[:, None]
            weights: tuple[float, ...] = (1.0,)
        else:
            host = np.ascontiguousarray(np.asarray(info.reward_advantages, np.float32).T)
            sharding = transitions.advantages.sharding
            if isinstance(sharding, NamedSharding):
                spec = PartitionSpec(*sharding.spec, None)  # type: ignore[no-untyped-call]
                sharding = NamedSharding(sharding.mesh, spec)
            advantages = jax.make_array_from_callback(
                host.shape, sharding, lambda index: host[index]
            )
            weights = info.reward_weights
        batch = RewardTransitions(transitions, advantages, weights)
        if self.old_log_probs == "update":
            return Rescore(batch, fill=self.with_rescored_rows)
        return batch

    def with_rescored_rows(
        self, batch: RewardTransitions, rows: Int[Array, " M"], aux: DanceGRPOAux
    ) -> RewardTransitions:
        """`batch` whose kept transitions in `rows` take their old log densities from `aux`.

        **Raises:**

        - `ValueError`: naming `aux` if it holds no log densities.
        """
        if aux.log_probs is None:
            raise ValueError("`aux.log_probs` is None: `old_log_probs='update'` needs them.")
        transitions = batch.transitions
        kept = self.kept(jax.tree.map(lambda leaf: leaf[rows], transitions))
        rescored = with_rescored(transitions, rows, kept, "old_log_probs", aux.log_probs.value)
        return RewardTransitions(rescored, batch.advantages, batch.weights)

    def end_epoch(self, variables: PolicyVariables, step: int) -> PolicyVariables:
        del step
        return variables

    def batch_metrics(self, batch: RewardTransitions) -> dict[str, float]:
        """The fraction of recorded transitions the mask keeps, as `kept_fraction`."""
        return {"kept_fraction": float(jnp.mean(batch.transitions.transition_mask))}

    def loss_sums_over_rows(self) -> bool:
        """`True`: each transition's term is its own."""
        return True

    # ----------------------------------------------------------------------------------
    # The objective

    def kept(self, batch: Transitions) -> TransitionMask:
        """The kept set: masked-in transitions that are stochastic under `sde`.

        **Arguments:**

        - `batch`: the recorded transitions.

        **Returns:**

        `[N, K]` bools.
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

        - `ValueError`: naming `batch` for a malformed batch (`check_transitions`).
        """
        check_transitions(batch, type(self).__name__)
        return transition_log_probs(
            self.flow, self.sde, variables.policy, batch, self.transition_chunk, self.remat
        )

    def surrogate(
        self, log_ratio: PerTransition, advantages: Float[Array, " N R"], weights: tuple[float, ...]
    ) -> PerTransition:
        """Each transition's summed clipped surrogates.

        **Arguments:**

        - `log_ratio`: `[N, K]` `log p_theta - old_log_prob`.
        - `advantages`: `[N, R]` each reward's advantage.
        - `weights`: the rewards' weights.

        **Returns:**

        `[N, K]`: `sum_k w_k max(-A_k r, -A_k clip(r, 1 - eps, 1 + eps))` with
        `A_k = clip(advantages[:, k], -adv_clip_max, adv_clip_max)`.
        """
        ratio = jnp.exp(log_ratio)
        clipped_ratio = jnp.clip(ratio, 1.0 - self.clip_range, 1.0 + self.clip_range)
        total = jnp.zeros_like(log_ratio)
        for k, weight in enumerate(weights):
            advantage = jnp.clip(advantages[:, k], -self.adv_clip_max, self.adv_clip_max)[:, None]
            total = total + weight * jnp.maximum(-advantage * ratio, -advantage * clipped_ratio)
        return total

    def loss(
        self, variables: PolicyVariables, batch: RewardTransitions, step: Step
    ) -> tuple[Mean, DanceGRPOAux]:
        """DanceGRPO's clipped policy loss over the recorded transitions.

        A `lax.scan` over the transitions (in chunks of `transition_chunk`) that carries
        nothing between them. Masked transitions are replaced by a safe dummy before any
        arithmetic, so NaN or inf in them reach neither the loss nor its gradient.

        **Arguments:**

        - `variables`: from `init`; gradients flow into `variables.policy`.
        - `batch`: the `RewardTransitions`.
        - `step`: unused by this objective's arithmetic.

        **Returns:**

        `(Mean(total, count), DanceGRPOAux)`: `total` the sum of the kept transitions'
        terms, `count` the kept count `D`.

        **Raises:**

        - `ValueError`: naming `batch` if it is not `RewardTransitions`, or the field, for
            malformed transitions (`check_transitions`).
        """
        del step
        if not isinstance(batch, RewardTransitions):
            raise ValueError(
                "`batch` must be RewardTransitions (the objective's `training_batch`), got "
                f"{type(batch).__name__}."
            )
        transitions = batch.transitions
        check_transitions(transitions, type(self).__name__)
        kept = self.kept(transitions)
        inputs = kept_inputs(transitions, kept, needs_means=False)
        log_ratio, log_probs = self._score_kept(variables.policy, inputs, transitions.cond)
        advantages = jnp.where(
            jnp.any(kept, axis=1, keepdims=True), batch.advantages.astype(jnp.float32), 0.0
        )
        surrogate = jnp.where(kept, self.surrogate(log_ratio, advantages, batch.weights), 0.0)
        ratio = jax.lax.stop_gradient(jnp.exp(log_ratio))
        count = jax.lax.stop_gradient(jnp.sum(kept, dtype=jnp.float32))

        def mean_of(value: Array) -> Mean:
            value = jnp.where(kept, value.astype(jnp.float32), 0.0)
            return Mean(total=jnp.sum(value), count=count)

        aux = DanceGRPOAux(
            policy_loss=mean_of(surrogate),
            clipfrac=mean_of(jnp.abs(ratio - 1.0) > self.clip_range),
            clipfrac_gt_one=mean_of(ratio - 1.0 > self.clip_range),
            clipfrac_lt_one=mean_of(1.0 - ratio > self.clip_range),
            approx_kl=mean_of(0.5 * log_ratio**2),
            ratio=mean_of(ratio),
            counted=count,
            log_probs=None if log_probs is None else PerRow(log_probs),
        )
        return Mean(total=jnp.sum(surrogate), count=count), jax.lax.stop_gradient(aux)

    def _score_kept(
        self, policy: Model, inputs: dict[str, Array], batch_cond: PyTree[Any]
    ) -> tuple[PerTransition, PerTransition | None]:
        """Each kept transition's log-ratio (and log density with `old_log_probs="update"`),
        0 elsewhere."""
        report = self.old_log_probs == "update"

        def per_transition(chunk: dict[str, Array], cond: PyTree[Any]) -> dict[str, Array]:
            mean, std = self.flow.transition(
                self.sde, policy, chunk["x"], chunk["t"], chunk["t_next"], cond
            )
            log_prob = jax.vmap(self.sde.log_prob)(chunk["x_next"], mean, std)
            per = {"log_ratio": log_prob - chunk["old"]}
            if report:
                per["log_prob"] = log_prob
            zero = jnp.zeros_like(log_prob)
            return {name: jnp.where(chunk["kept"], value, zero) for name, value in per.items()}

        row_kept = jnp.any(inputs["kept"], axis=1)
        cond = jax.tree.map(lambda leaf: zero_rows_unless(row_kept, leaf), batch_cond)
        scored: dict[str, PerTransition] = map_transitions(
            per_transition, inputs, cond, self.transition_chunk, self.remat
        )
        return scored["log_ratio"], scored.get("log_prob")
