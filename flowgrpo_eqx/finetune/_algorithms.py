"""The algorithms `flowgrpo-eqx finetune` trains with, one settings table each.

A table is a frozen dataclass of the settings its algorithm reads (`[algorithm.<name>]` in a
config file), defaulting to the algorithm's release as this library states it (each
objective's defaults). `AlgorithmSettings.objective` builds the objective and `sampler` the
rollout's sampler from a table and the run's `JobParts`; nothing outside the table and the
shared sections is read, so a setting of another algorithm never reaches one (the config
refuses such a table by name).
"""

import abc
import dataclasses
from typing import Any, ClassVar, Literal, TypeAlias

from .. import (
    AbstractRLObjective,
    AbstractSampler,
    AdvantageStd,
    AWMObjective,
    DanceGRPOObjective,
    DanceSampler,
    DanceSDE,
    DGPOObjective,
    DiffusionNFTObjective,
    DPMSolverPP2M,
    Euler,
    FlowDPPOObjective,
    FlowGRPOObjective,
    FlowSDE,
    GRPOGuard,
    GuidedFlow,
    MixSampler,
    ODESampler,
    ProgressiveWindow,
    RampedDecay,
    SDESampler,
)
from ..settings import section, setting


AlgorithmName: TypeAlias = Literal[
    "flow_grpo",
    "nft",
    "awm",
    "dgpo",
    "mixgrpo",
    "mixgrpo-flash",
    "mixgrpo-flash-star",
    "dppo",
    "dancegrpo",
]
"""The `algorithm.name` setting's values."""


@dataclasses.dataclass(frozen=True)
class JobParts:
    """What an algorithm builds its objective from: the guided flow of the run's model (its
    process, inputs, guidance and autoencoder), the flow without guidance for the losses
    that train unguided, the base policy, and the rollout's grids."""

    flow: GuidedFlow
    unguided_flow: GuidedFlow
    policy: Any
    train_steps: int
    eval_steps: int
    group_size: int
    seed: int


class AlgorithmSettings(abc.ABC):
    """An algorithm's settings table: what it reads, and the objective and sampler it
    builds."""

    name: ClassVar[str]
    """The table's name, `[algorithm.<name>]`."""

    advantage_std: ClassVar[AdvantageStd] = "global"
    """Over which rewards an advantage's std is taken (each release's `global_std`)."""

    @abc.abstractmethod
    def objective(self, parts: JobParts) -> AbstractRLObjective[Any, Any]:
        """The objective, from the run's parts."""

    @abc.abstractmethod
    def sampler(self, parts: JobParts) -> AbstractSampler | None:
        """The rollout's sampler, or `None` for the objective's own."""

    def rollout_advantage_std(self) -> AdvantageStd:
        """The advantages' std: the table's, where it has the setting, else the release's."""
        return self.advantage_std


def _trained_steps(transitions: int, fraction: float) -> int:
    """flow_grpo's `num_train_timesteps = int(num_steps * timestep_fraction)`, at least 1."""
    return max(1, int(transitions * fraction))


@section
class FlowGRPOSettings(AlgorithmSettings):
    """Flow-GRPO (flow_grpo's `scripts/train_sd3.py`): the clipped ratio of SDE transitions,
    a KL to the base model, the first `timestep_fraction` of the transitions trained."""

    name: ClassVar[str] = "flow_grpo"

    clip_range: float = setting(1e-4, "PPO ratio clip", minimum=0, include_minimum=False)
    beta: float = setting(0.04, "KL weight to the base model", minimum=0)
    adv_clip_max: float = setting(5.0, "advantage clip", minimum=0, include_minimum=False)
    noise_level: float = setting(0.7, "SDE noise level a", minimum=0)
    timestep_fraction: float = setting(
        0.99,
        "fraction of the transitions trained (the first ones)",
        minimum=0,
        maximum=1,
        include_minimum=False,
    )
    advantage_std_over: AdvantageStd = setting(
        "global", "advantages' std over the whole rollout (global) or each group (group)"
    )
    grpo_guard: bool = setting(False, "GRPO-Guard's ratio normalisation")
    transition_chunk: int | None = setting(
        None, "transitions the loss evaluates at once (none: all; 1 bounds memory)", minimum=1
    )

    def rollout_advantage_std(self) -> AdvantageStd:
        return self.advantage_std_over

    def objective(self, parts: JobParts) -> FlowGRPOObjective:
        return FlowGRPOObjective(
            parts.flow.model,
            parts.flow.process,
            parts.flow.inputs,
            sde=FlowSDE(self.noise_level),
            beta=self.beta,
            clip_range=self.clip_range,
            adv_clip_max=self.adv_clip_max,
            guard=GRPOGuard() if self.grpo_guard else None,
            transition_chunk=self.transition_chunk,
            guidance=parts.flow.guidance,
            autoencoder=parts.flow.autoencoder,
            precision=parts.flow.precision,
            steps=parts.eval_steps + 1,
            pretrained=parts.policy,
        )

    def sampler(self, parts: JobParts) -> SDESampler:
        return SDESampler(
            FlowSDE(self.noise_level),
            train_steps=_trained_steps(parts.train_steps, self.timestep_fraction),
            record_means=self.grpo_guard,
        )


@section
class NFTSettings(AlgorithmSettings):
    """DiffusionNFT (github NVlabs/DiffusionNFT): negative-aware flow matching on the final
    samples of a deterministic rollout, its old policy an EMA of the live one."""

    name: ClassVar[str] = "nft"

    beta: float = setting(
        1.0, "the implicit policies' step (NFT's beta)", minimum=0, include_minimum=False
    )
    adv_max: float = setting(5.0, "advantage clip A_max", minimum=0, include_minimum=False)
    kl_beta: float = setting(1e-4, "KL weight to the base model", minimum=0)
    old_decay_max: float = setting(
        0.5,
        "largest decay of the old policy's EMA (ramped by 0.001 per step)",
        minimum=0,
        maximum=1,
    )

    def objective(self, parts: JobParts) -> DiffusionNFTObjective:
        return DiffusionNFTObjective(
            parts.unguided_flow,
            beta=self.beta,
            adv_max=self.adv_max,
            kl_beta=self.kl_beta,
            old_decay=RampedDecay(maximum=self.old_decay_max),
            pretrained=parts.policy,
        )

    def sampler(self, parts: JobParts) -> ODESampler:
        return ODESampler(Euler())


@section
class AWMSettings(AlgorithmSettings):
    """Advantage Weighted Matching (github scxue/advantage_weighted_matching): advantage-
    weighted flow matching on the final samples of an SDE rollout."""

    name: ClassVar[str] = "awm"

    clip_range: float = setting(1.0, "ratio clip", minimum=0, include_minimum=False)
    adv_clip_max: float = setting(5.0, "advantage clip", minimum=0, include_minimum=False)
    kl_beta: float = setting(0.001, "KL weight to the base model", minimum=0)
    train_timesteps: int = setting(6, "times trained per sample", minimum=1)
    noise_level: float = setting(0.4, "rollout SDE noise level", minimum=0)

    def objective(self, parts: JobParts) -> AWMObjective:
        return AWMObjective(
            parts.unguided_flow,
            clip_range=self.clip_range,
            adv_clip_max=self.adv_clip_max,
            kl_beta=self.kl_beta,
            train_timesteps=self.train_timesteps,
            sde=FlowSDE(self.noise_level),
            pretrained=parts.policy,
        )

    def sampler(self, parts: JobParts) -> SDESampler:
        return SDESampler(FlowSDE(self.noise_level))


@section
class DGPOSettings(AlgorithmSettings):
    """Direct Group Preference Optimization (github Luo-Yihong/DGPO): a group-level
    preference loss on the final samples of a deterministic DPM-Solver++(2M) rollout."""

    name: ClassVar[str] = "dgpo"

    beta_dpo: float = setting(100.0, "the preference loss's beta", minimum=0, include_minimum=False)
    clip_range: float = setting(0.01, "the DSM clip", minimum=0, include_minimum=False)
    adv_clip_max: float = setting(5.0, "advantage clip", minimum=0, include_minimum=False)
    kl_beta: float = setting(0.02, "KL weight to the base model", minimum=0)
    train_timesteps: int = setting(4, "times trained per sample", minimum=1)
    trunc_steps: int = setting(6, "last grid index the trained times are drawn below", minimum=0)

    def objective(self, parts: JobParts) -> DGPOObjective:
        return DGPOObjective(
            parts.flow,
            group_size=parts.group_size,
            beta_dpo=self.beta_dpo,
            clip_range=self.clip_range,
            adv_clip_max=self.adv_clip_max,
            kl_beta=self.kl_beta,
            train_timesteps=self.train_timesteps,
            trunc_steps=min(self.trunc_steps, parts.train_steps - 1),
            seed=parts.seed,
            pretrained=parts.policy,
        )

    def sampler(self, parts: JobParts) -> ODESampler:
        return ODESampler(DPMSolverPP2M())


MixSolver: TypeAlias = Literal["euler", "dpm_solver_2m"]
"""The ODE solver after MixGRPO's window: Euler, or DPM-Solver++(2M) (MixGRPO-Flash)."""


@section
class MixGRPOSettings(AlgorithmSettings):
    """MixGRPO, MixGRPO-Flash and MixGRPO-Flash* (github Tencent-Hunyuan/MixGRPO,
    `scripts/finetune/finetune_flux_grpo_MixGRPO*.sh`): Flow-GRPO's objective on a window of
    stochastic transitions that moves along the grid (`ProgressiveWindow`), ODE steps around
    it; Flash runs DPM-Solver++(2M) after the window on a compressed grid, Flash* with a
    window that never moves. The three tables differ in their defaults
    (`MIXGRPO_VARIANTS`)."""

    name: ClassVar[str] = "mixgrpo"
    advantage_std: ClassVar[AdvantageStd] = "group"

    clip_range: float = setting(1e-4, "PPO ratio clip", minimum=0, include_minimum=False)
    beta: float = setting(0.0, "KL weight to the base model", minimum=0)
    adv_clip_max: float = setting(5.0, "advantage clip", minimum=0, include_minimum=False)
    noise_level: float = setting(0.7, "SDE noise level a", minimum=0)
    window: int = setting(4, "stochastic, trained transitions in the window", minimum=1)
    shift_every: int = setting(25, "epochs between the window's moves", minimum=1)
    stride: int = setting(1, "transitions the window moves by (0: it never moves)", minimum=0)
    solver: MixSolver = setting("euler", "the ODE solver after the window")
    compress_ratio: float | None = setting(
        None,
        "the grid after the window compressed by this ratio (none: kept)",
        minimum=0,
        maximum=1,
        include_minimum=False,
    )
    transition_chunk: int | None = setting(
        None, "transitions the loss evaluates at once (none: all; 1 bounds memory)", minimum=1
    )

    def objective(self, parts: JobParts) -> FlowGRPOObjective:
        return FlowGRPOObjective(
            parts.flow.model,
            parts.flow.process,
            parts.flow.inputs,
            sde=FlowSDE(self.noise_level),
            beta=self.beta,
            clip_range=self.clip_range,
            adv_clip_max=self.adv_clip_max,
            guidance=parts.flow.guidance,
            autoencoder=parts.flow.autoencoder,
            precision=parts.flow.precision,
            model_time="thousandths",
            transition_chunk=self.transition_chunk,
            steps=parts.eval_steps + 1,
            pretrained=parts.policy,
        )

    def sampler(self, parts: JobParts) -> MixSampler:
        return MixSampler(
            FlowSDE(self.noise_level),
            ProgressiveWindow(self.window, shift_every=self.shift_every, stride=self.stride),
            solver=DPMSolverPP2M() if self.solver == "dpm_solver_2m" else Euler(),
            compress_ratio=self.compress_ratio,
        )


MIXGRPO_VARIANTS: dict[str, dict[str, Any]] = {
    "mixgrpo": {},
    "mixgrpo-flash": {"shift_every": 20, "solver": "dpm_solver_2m", "compress_ratio": 0.4},
    "mixgrpo-flash-star": {
        "shift_every": 20,
        "stride": 0,
        "solver": "dpm_solver_2m",
        "compress_ratio": 0.2,
    },
}
"""The defaults each MixGRPO table changes: the released scripts' window moves and solver."""


@section
class DPPOSettings(AlgorithmSettings):
    """Flow-DPPO (github Tencent-Hunyuan/UniRL, `unirl/algorithms/flowdppo.py`): the
    unclipped ratio of SDE transitions, each step dropped where its KL to the rollout's policy
    reaches `kl_threshold` and its ratio already moved the advantage's way."""

    name: ClassVar[str] = "dppo"

    kl_threshold: float = setting(
        1e-5, "the per-step KL trust region", minimum=0, include_minimum=False
    )
    noise_level: float = setting(0.7, "SDE noise level a", minimum=0)
    timestep_fraction: float = setting(
        0.99,
        "fraction of the transitions trained (the first ones)",
        minimum=0,
        maximum=1,
        include_minimum=False,
    )
    transition_chunk: int | None = setting(
        None, "transitions the loss evaluates at once (none: all; 1 bounds memory)", minimum=1
    )

    def objective(self, parts: JobParts) -> FlowDPPOObjective:
        return FlowDPPOObjective(
            parts.flow,
            kl_threshold=self.kl_threshold,
            sde=FlowSDE(self.noise_level),
            old_means="rollout",
            transition_chunk=self.transition_chunk,
            pretrained=parts.policy,
        )

    def sampler(self, parts: JobParts) -> SDESampler:
        return SDESampler(
            FlowSDE(self.noise_level),
            train_steps=_trained_steps(parts.train_steps, self.timestep_fraction),
            record_means=True,
        )


@section
class DanceGRPOSettings(AlgorithmSettings):
    """DanceGRPO (github XueZeyue/DanceGRPO, `fastvideo/train_grpo_flux.py` and its
    `scripts/finetune/finetune_flux_grpo.sh`): the clipped ratio on the transitions of a
    constant-noise SDE, every step noisy but the last, each sample trained on its own random
    `timestep_fraction` of the steps before the last, the model fed its time in thousandths,
    advantages per group with the unbiased std. The run's rewards give one advantage (their
    weighted sum of advantages), so one surrogate, where the release's multi-reward trainer
    sums one per reward."""

    name: ClassVar[str] = "dancegrpo"
    advantage_std: ClassVar[AdvantageStd] = "group_unbiased"

    clip_range: float = setting(1e-4, "PPO ratio clip", minimum=0, include_minimum=False)
    adv_clip_max: float = setting(5.0, "advantage clip", minimum=0, include_minimum=False)
    noise_level: float = setting(0.3, "SDE noise level eta (constant over the steps)", minimum=0)
    timestep_fraction: float = setting(
        0.6,
        "fraction of the steps before the last each sample trains, drawn at random per sample",
        minimum=0,
        maximum=1,
        include_minimum=False,
    )
    transition_chunk: int | None = setting(
        None, "transitions the loss evaluates at once (none: all; 1 bounds memory)", minimum=1
    )

    def objective(self, parts: JobParts) -> DanceGRPOObjective:
        return DanceGRPOObjective(
            dataclasses.replace(parts.flow, model_time="thousandths"),
            sde=DanceSDE(self.noise_level),
            clip_range=self.clip_range,
            adv_clip_max=self.adv_clip_max,
            timestep_fraction=self.timestep_fraction,
            transition_chunk=self.transition_chunk,
            pretrained=parts.policy,
        )

    def sampler(self, parts: JobParts) -> DanceSampler:
        return DanceSampler(DanceSDE(self.noise_level), self.timestep_fraction)


ALGORITHM_TABLES: dict[str, type[AlgorithmSettings]] = {
    "flow_grpo": FlowGRPOSettings,
    "nft": NFTSettings,
    "awm": AWMSettings,
    "dgpo": DGPOSettings,
    "mixgrpo": MixGRPOSettings,
    "mixgrpo-flash": MixGRPOSettings,
    "mixgrpo-flash-star": MixGRPOSettings,
    "dppo": DPPOSettings,
    "dancegrpo": DanceGRPOSettings,
}
"""Each algorithm's settings table, by its name (the MixGRPO variants share one, with the
defaults of `MIXGRPO_VARIANTS`)."""


def algorithm_settings(name: str, table: dict[str, Any]) -> AlgorithmSettings:
    """The settings table of algorithm `name` with `table`'s values over its defaults.

    **Raises:**

    - `ValueError`: naming the setting, for a bad value (`TypeError` for an unknown one).
    """
    defaults = MIXGRPO_VARIANTS.get(name, {})
    return ALGORITHM_TABLES[name](**{**defaults, **table})
