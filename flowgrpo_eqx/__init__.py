"""Flow-GRPO for rectified-flow generators, as a strictly typed functional Equinox library.

The user's API, one import block per wing as diffrax's is: the objectives
(`flowgrpo_eqx.objectives`), the rewards (`flowgrpo_eqx.rewards`), and the modules the
algorithms share (processes and time grids, inputs and guidance, SDEs, samplers, solvers and
window schedules, the rollout and its advantages, evaluation and previews, many devices, the
porting check). Models, LoRA, training, fine-tuning a published pipeline and the testing
tools are subpackages: `flowgrpo_eqx.models`, `.lora`, `.train`, `.finetune`, `.testing`.
"""

from . import lora as lora
from ._advantages import (
    AdvantageStd as AdvantageStd,
    RewardCombination as RewardCombination,
    group_advantages as group_advantages,
    per_reward_advantages as per_reward_advantages,
    reward_advantages as reward_advantages,
)
from ._buffer import Buffer as Buffer
from ._consistency import check_consistency as check_consistency
from ._consistency_report import (
    CheckLine as CheckLine,
    ConsistencyReport as ConsistencyReport,
    ConsistencyThresholds as ConsistencyThresholds,
)
from ._custom_types import (
    Aux as Aux,
    FinalSamples as FinalSamples,
    Mean as Mean,
    PerRow as PerRow,
    RolloutInfo as RolloutInfo,
    Step as Step,
    StepRatios as StepRatios,
    Transitions as Transitions,
)
from ._device_advantages import device_group_advantages as device_group_advantages
from ._distributed import (
    ParamSharding as ParamSharding,
    data_mesh as data_mesh,
    device_fraction as device_fraction,
    gather_weights as gather_weights,
    host_samples as host_samples,
    initialize as initialize,
    local_copy as local_copy,
    owned_rows as owned_rows,
    process_counts as process_counts,
    replicate as replicate,
    shard_batch as shard_batch,
    shard_parameters as shard_parameters,
    sync_processes as sync_processes,
)
from ._evaluation import (
    Evaluation as Evaluation,
    evaluate_policy as evaluate_policy,
    preview_policy as preview_policy,
)
from ._guided_flow import (
    GuidedFlow as GuidedFlow,
    MatmulPrecision as MatmulPrecision,
    ModelTime as ModelTime,
    Precision as Precision,
)
from ._inputs import (
    CFG as CFG,
    AbstractAutoEncoder as AbstractAutoEncoder,
    AbstractGuidance as AbstractGuidance,
    EmbeddedGuidance as EmbeddedGuidance,
    IdentityAutoEncoder as IdentityAutoEncoder,
    InputSpec as InputSpec,
)
from ._mix_sampler import MixSampler as MixSampler
from ._preview import preview_grid as preview_grid
from ._process import (
    AbstractProcess as AbstractProcess,
    AbstractTimeGrid as AbstractTimeGrid,
    DiffusersGrid as DiffusersGrid,
    FluxGrid as FluxGrid,
    RectifiedFlow as RectifiedFlow,
    UniformGrid as UniformGrid,
    flux_shift as flux_shift,
)
from ._rollout import FlowRollout as FlowRollout
from ._sampling import (
    AbstractSampler as AbstractSampler,
    Draw as Draw,
    Generated as Generated,
    ODESampler as ODESampler,
    SDESampler as SDESampler,
)
from ._sde import (
    AbstractKLWeighting as AbstractKLWeighting,
    AbstractSDE as AbstractSDE,
    CoefficientsPreservingSDE as CoefficientsPreservingSDE,
    FlowSDE as FlowSDE,
    KLWeighting as KLWeighting,
    PaperKLWeighting as PaperKLWeighting,
    ReleasedKLWeighting as ReleasedKLWeighting,
    window_for_indices as window_for_indices,
)
from ._solver import (
    AbstractSolver as AbstractSolver,
    DPMSolverPP2M as DPMSolverPP2M,
    Euler as Euler,
    Heun as Heun,
    MultistepState as MultistepState,
)
from ._window import (
    AbstractWindowSchedule as AbstractWindowSchedule,
    AtEnd as AtEnd,
    FixedWindow as FixedWindow,
    ProgressiveWindow as ProgressiveWindow,
    RandomSteps as RandomSteps,
    RandomWindow as RandomWindow,
    SlidingWindow as SlidingWindow,
)
from .objectives import (
    AbstractAWMKLWeight as AbstractAWMKLWeight,
    AbstractAWMRatio as AbstractAWMRatio,
    AbstractAWMTimes as AbstractAWMTimes,
    AbstractAWMWeighting as AbstractAWMWeighting,
    AbstractDGPOLoss as AbstractDGPOLoss,
    AbstractEMAVariables as AbstractEMAVariables,
    AbstractFlowObjective as AbstractFlowObjective,
    AbstractGRPOGuard as AbstractGRPOGuard,
    AbstractKLStd as AbstractKLStd,
    AbstractNFTLoss as AbstractNFTLoss,
    AbstractReferenceVariables as AbstractReferenceVariables,
    AbstractRLObjective as AbstractRLObjective,
    AbstractTransitionObjective as AbstractTransitionObjective,
    AbstractVariables as AbstractVariables,
    AdaptiveX0Loss as AdaptiveX0Loss,
    AWMObjective as AWMObjective,
    AWMVariables as AWMVariables,
    DanceGRPOAux as DanceGRPOAux,
    DanceGRPOObjective as DanceGRPOObjective,
    DanceSampler as DanceSampler,
    DanceSDE as DanceSDE,
    DGPOObjective as DGPOObjective,
    DGPOReference as DGPOReference,
    DGPOSurrogateLoss as DGPOSurrogateLoss,
    DGPOVariables as DGPOVariables,
    DiffusionNFTObjective as DiffusionNFTObjective,
    DiscreteTimes as DiscreteTimes,
    DiscreteTimesWithInit as DiscreteTimesWithInit,
    DiscreteTimesWithoutInit as DiscreteTimesWithoutInit,
    DPPOAux as DPPOAux,
    ELBOKLWeight as ELBOKLWeight,
    EmpiricalGuard as EmpiricalGuard,
    FlowDPPOObjective as FlowDPPOObjective,
    FlowGRPOObjective as FlowGRPOObjective,
    FlowGRPOVariables as FlowGRPOVariables,
    GHuberWeighting as GHuberWeighting,
    GroupDPOLoss as GroupDPOLoss,
    GroupedSamples as GroupedSamples,
    GroupPreferenceTerms as GroupPreferenceTerms,
    GRPOGuard as GRPOGuard,
    GuardDrift as GuardDrift,
    GuardParts as GuardParts,
    GuardScale as GuardScale,
    HuberWeighting as HuberWeighting,
    ImplicitPolicyErrors as ImplicitPolicyErrors,
    NFTTimes as NFTTimes,
    NFTVariables as NFTVariables,
    OldLogProbs as OldLogProbs,
    OldMeans as OldMeans,
    PerRowRatio as PerRowRatio,
    PerTimeRatio as PerTimeRatio,
    PolicyVariables as PolicyVariables,
    RampedDecay as RampedDecay,
    ReleasedKLStd as ReleasedKLStd,
    Rescore as Rescore,
    RewardTransitions as RewardTransitions,
    TimeSquaredWeighting as TimeSquaredWeighting,
    TimeWeighting as TimeWeighting,
    TrainableFilter as TrainableFilter,
    TransitionKLStd as TransitionKLStd,
    UniformKLWeight as UniformKLWeight,
    UniformWeighting as UniformWeighting,
    UnitKLStd as UnitKLStd,
    VelocityLoss as VelocityLoss,
    default_trainable as default_trainable,
    divergence_mask as divergence_mask,
    ratio_norm as ratio_norm,
    reference_part as reference_part,
    reference_policy as reference_policy,
    split_trainable as split_trainable,
    step_weights as step_weights,
    trainable_part as trainable_part,
    with_part as with_part,
)
from .rewards import (
    FlowReward as FlowReward,
    HttpReward as HttpReward,
    JpegCompressibility as JpegCompressibility,
    JpegIncompressibility as JpegIncompressibility,
    RewardError as RewardError,
    WeightedReward as WeightedReward,
    check_finite_samples as check_finite_samples,
    load_reward as load_reward,
    score_on_root as score_on_root,
)


__version__ = "0.1.0"
