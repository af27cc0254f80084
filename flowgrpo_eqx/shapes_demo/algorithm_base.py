"""What every RL algorithm of the main job is built on: the settings it reads (`Settings`),
what it builds from (`JobPieces`), its interface (`AbstractAlgorithm`), the settings only
some algorithms read (`ALGORITHM_SETTINGS`, in groups), and the flow, SDE, window and
Flow-GRPO objective the algorithms of `algorithms` build with.
"""

import abc
import dataclasses
from typing import Any, ClassVar, Protocol, final, runtime_checkable

import equinox as eqx
from jax.sharding import Mesh

from .. import (
    CFG,
    AbstractKLStd,
    AbstractRLObjective,
    AbstractSampler,
    AbstractWindowSchedule,
    AdvantageStd,
    AtEnd,
    FlowGRPOObjective,
    FlowReward,
    FlowRollout,
    FlowSDE,
    GRPOGuard,
    GuidedFlow,
    InputSpec,
    ModelTime,
    OldLogProbs,
    ProgressiveWindow,
    RandomSteps,
    RandomWindow,
    RectifiedFlow,
    ReleasedKLStd,
    SDESampler,
    SlidingWindow,
    TransitionKLStd,
    UnitKLStd,
    window_for_indices,
)
from .settings import (
    AlgorithmName,
    DPPOKLStdName,
    EvaluationSettings,
    ModelSettings,
    ObjectiveSettings,
    RewardSettings,
    RolloutSettings,
)


@runtime_checkable
class Settings(Protocol):
    """The sections of the job's settings an algorithm reads (`config.JobConfig` has them)."""

    @property
    def model(self) -> ModelSettings: ...
    @property
    def rollout(self) -> RolloutSettings: ...
    @property
    def rewards(self) -> RewardSettings: ...
    @property
    def objective(self) -> ObjectiveSettings: ...
    @property
    def evaluation(self) -> EvaluationSettings: ...


@final
@dataclasses.dataclass(frozen=True)
class JobPieces:
    """What an algorithm builds from (`parts.ShapesJob.pieces()`): the settings, the model,
    its inputs, the guidance and the train reward."""

    config: Settings
    model: Any
    inputs: InputSpec
    guidance: CFG
    reward: FlowReward


ALGORITHM_SETTINGS: frozenset[str] = frozenset(
    {
        "nft_beta",
        "nft_old_decay",
        "dppo_kl_threshold",
        "dppo_kl_std",
        "beta",
        "clip_range",
        "grpo_guard",
        "adv_clip_max",
        "transition_chunk",
        "old_log_probs",
        "noise_level",
        "sde_steps",
        "train_steps",
        "window_schedule",
        "window_shift_every",
        "window_stride",
    }
)
"""The settings that some algorithms read and others do not (each algorithm's `reads` says
which of these it reads; every other setting is read by all). A setting the chosen algorithm
does not read is refused when named (`config.make_config`), and at a value other than its
default wherever it comes from (`config.JobConfig`)."""


SDE_ROLLOUT = frozenset({"noise_level", "sde_steps"})
"""The settings of an SDE rollout's noise."""

RECORDED_WINDOW = frozenset(
    {"train_steps", "window_schedule", "window_shift_every", "window_stride"}
)
"""The settings of the recorded (trained) window of an SDE rollout."""

RATIO = frozenset({"transition_chunk", "old_log_probs"})
"""The settings of a ratio over recorded transitions."""

CLIPS = frozenset({"beta", "clip_range", "adv_clip_max"})
"""The settings of a clipped objective and its KL term."""


class AbstractAlgorithm(eqx.Module):
    """An RL algorithm of the main job: its settings checks, its objective and its rollout,
    and which of `ALGORITHM_SETTINGS` it reads (`reads`)."""

    reads: eqx.AbstractClassVar[frozenset[str]]
    """The settings of `ALGORITHM_SETTINGS` its objective, rollout or checks read."""

    @abc.abstractmethod
    def check(self, config: Settings) -> None:
        """Refuse settings that do not fit this algorithm.

        **Raises:**

        - `ValueError`: naming the setting and the algorithm.
        """

    @abc.abstractmethod
    def default_settings(self) -> dict[str, Any]:
        """Settings, by name, whose defaults this algorithm changes (`config.make_config`
        applies them unless named)."""

    @abc.abstractmethod
    def objective(self, job: JobPieces, base: Any) -> AbstractRLObjective[Any, Any]:
        """The objective the trainer trains, starting from the policy `base`."""

    @abc.abstractmethod
    def sampler(self, job: JobPieces) -> AbstractSampler:
        """The sampler of the rollout that collects each epoch's batch."""

    advantage_std: eqx.AbstractClassVar[AdvantageStd]
    """Over which rewards an advantage's std is taken: its group's or the whole rollout's."""

    trains_on_ratios: eqx.AbstractClassVar[bool]
    """Whether the objective trains on the policy ratio of recorded transitions (whose
    histogram a run with metrics writers logs)."""

    model_time: ClassVar[ModelTime] = "exact"
    """The time the model receives in the Flow-GRPO objective the algorithm trains and the
    job rescores ratios with (`GuidedFlow.model_time`): `"exact"`, or MixGRPO's released
    `"thousandths"`."""

    def old_log_probs(self, config: Settings) -> OldLogProbs:
        """Where the Flow-GRPO objective's ratio takes its old log densities from (the job
        measures with that objective whatever the algorithm): the `old_log_probs` setting,
        or when it is none the update program's densities in bfloat16 (an exact ratio 1) for
        an algorithm that trains on ratios, else the rollout's."""
        explicit = config.objective.old_log_probs
        if explicit is not None:
            return explicit
        bfloat16 = config.model.precision == "bfloat16"
        return "update" if self.trains_on_ratios and bfloat16 else "rollout"

    def flow_grpo_objective(self, job: JobPieces, base: Any) -> FlowGRPOObjective:
        """Flow-GRPO's objective from `base` with this algorithm's `old_log_probs` and
        `model_time` (`flow_grpo_objective`): what `flow_grpo` and the MixGRPO algorithms
        train, what the policy-ratio histograms of an algorithm that trains on ratios
        rescore with, and what `flowgrpo-eqx check` checks, whatever the algorithm."""
        return flow_grpo_objective(job, base, self.old_log_probs(job.config), self.model_time)

    def rollout(
        self, job: JobPieces, objective: AbstractRLObjective[Any, Any], mesh: Mesh | None
    ) -> FlowRollout:
        """The rollout of `objective`'s guided flow with this algorithm's `sampler` and
        `advantage_std`, and the job's groups, time grid, initial noise and reward
        combination, its rows on `mesh`."""
        rollout = job.config.rollout
        return FlowRollout(
            objective,
            job.reward,
            sampler=self.sampler(job),
            advantage_std=self.advantage_std,
            groups=rollout.groups,
            steps=rollout.rollout_steps,
            shared_noise=rollout.shared_noise,
            reward_combination=job.config.rewards.reward_combination,
            mesh=mesh,
        )


DPPO_KL_STDS: dict[DPPOKLStdName, AbstractKLStd] = {
    "released": ReleasedKLStd(),
    "transition": TransitionKLStd(),
    "unit": UnitKLStd(),
}
"""The `dppo_kl_std` setting's variants."""


def dppo_steps(rollout: RolloutSettings) -> RandomSteps | None:
    """Flow-DPPO's SDE steps on the job's grid: `sde_steps` drawn per rollout among the first
    half of the transitions (the release's `timestep_fraction` [0, 0.5]), the half widened to
    `sde_steps` where it holds fewer; every transition with `sde_steps` none; `None` with a
    moving `window_schedule` (its window places the noise)."""
    if rollout.window_schedule != "fixed":
        return None
    transitions = rollout.rollout_steps - 1
    if rollout.sde_steps is None:
        return RandomSteps(transitions)
    count = rollout.sde_steps
    if count <= int(transitions * 0.5):
        return RandomSteps(count, fraction=(0.0, 0.5))
    return RandomSteps(count, fraction=(0.0, min(1.0, (count + 0.5) / transitions)))


def refuse_shared_noise(config: Settings, algorithm: AlgorithmName) -> None:
    """Refuse shared initial noise for an algorithm whose rollout is deterministic.

    **Raises:**

    - `ValueError`: naming `shared_noise` and `algorithm`, if the setting is on.
    """
    if config.rollout.shared_noise:
        raise ValueError(
            f"Setting `shared_noise` must be false with algorithm '{algorithm}': its rollout "
            "is a deterministic ODE, so a group sharing one initial noise would be one "
            "sample repeated, and every advantage 0."
        )


def flow_grpo_objective(
    job: JobPieces, base: Any, old_log_probs: OldLogProbs, model_time: ModelTime = "exact"
) -> FlowGRPOObjective:
    """Flow-GRPO's objective from `base` with the job's SDE, `old_log_probs` and
    `model_time` (`AbstractAlgorithm.flow_grpo_objective` gives the algorithm's)."""
    config = job.config
    algorithm = config.objective
    return FlowGRPOObjective(
        job.model,
        RectifiedFlow(),
        job.inputs,
        sde=rollout_sde(config.rollout),
        beta=algorithm.beta,
        clip_range=algorithm.clip_range,
        adv_clip_max=algorithm.adv_clip_max,
        transition_chunk=algorithm.transition_chunk,
        guard=GRPOGuard() if algorithm.grpo_guard else None,
        old_log_probs=old_log_probs,
        guidance=job.guidance,
        precision=config.model.precision,
        model_time=model_time,
        steps=config.evaluation.eval_steps,
        pretrained=base,
    )


def job_flow(job: JobPieces, guidance: CFG | None) -> GuidedFlow:
    """The job's model, process and inputs with `guidance`, in the job's precision."""
    precision = job.config.model.precision
    return GuidedFlow(job.model, RectifiedFlow(), job.inputs, guidance, precision=precision)


def sde_window(rollout: RolloutSettings) -> tuple[float, float] | None:
    """The SDE window of `sde_steps` (the leading rollout transitions that sample noise; the
    rest are ODE steps, as Flow-GRPO-Fast), or `None` when every transition does or a
    schedule moves the window."""
    if rollout.sde_steps is None or rollout.window_schedule != "fixed":
        return None
    grid = RectifiedFlow().timesteps(rollout.rollout_steps)
    return window_for_indices(grid, 0, rollout.sde_steps)


def rollout_sde(rollout: RolloutSettings) -> FlowSDE:
    """The rollout's SDE: `noise_level`, stochastic on `sde_window`."""
    return FlowSDE(rollout.noise_level, window=sde_window(rollout))


def window_sampler(rollout: RolloutSettings, record_means: bool) -> SDESampler:
    """The rollout's SDE (`rollout_sde`), recording the trained window: the leading
    `train_steps` transitions with the fixed window, else the `window_schedule`'s."""
    return SDESampler(
        rollout_sde(rollout),
        train_steps=rollout.train_steps if rollout.window_schedule == "fixed" else None,
        window_schedule=window_schedule(rollout),
        record_means=record_means,
    )


def window_schedule(
    rollout: RolloutSettings, at_end: AtEnd = "clip"
) -> AbstractWindowSchedule | None:
    """`None` for the fixed leading window (the SDE's `window`), else a schedule of
    `sde_steps` stochastic, trained transitions; a sliding one stays at the grid's end or
    starts again (`at_end`); a progressive one is MixGRPO's released window (cut short of
    the grid's last two transitions, empty at its last position, then from the first
    again)."""
    count = rollout.sde_steps if rollout.sde_steps is not None else rollout.rollout_steps - 1
    if rollout.window_schedule == "random":
        return RandomWindow(count)
    if rollout.window_schedule == "progressive":
        return ProgressiveWindow(
            count, shift_every=rollout.window_shift_every, stride=rollout.window_stride
        )
    if rollout.window_schedule == "sliding":
        return SlidingWindow(
            count,
            shift_every=rollout.window_shift_every,
            stride=rollout.window_stride,
            at_end=at_end,
        )
    return None
