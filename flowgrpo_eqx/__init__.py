"""Flow-GRPO for rectified-flow generators, as a strictly typed functional Equinox library."""

from . import lora as lora
from ._advantages import (
    AdvantageStd as AdvantageStd,
    RewardCombination as RewardCombination,
    group_advantages as group_advantages,
    per_reward_advantages as per_reward_advantages,
    reward_advantages as reward_advantages,
)
from ._awm import (
    AbstractAWMWeighting as AbstractAWMWeighting,
    AWMKLWeight as AWMKLWeight,
    AWMObjective as AWMObjective,
    AWMRatio as AWMRatio,
    AWMTimes as AWMTimes,
    AWMVariables as AWMVariables,
    GHuberWeighting as GHuberWeighting,
    HuberWeighting as HuberWeighting,
    TimeSquaredWeighting as TimeSquaredWeighting,
    TimeWeighting as TimeWeighting,
    UniformWeighting as UniformWeighting,
)
from ._buffer import Buffer as Buffer
from ._consistency import (
    CheckLine as CheckLine,
    ConsistencyReport as ConsistencyReport,
    ConsistencyThresholds as ConsistencyThresholds,
    check_consistency as check_consistency,
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
from ._dancegrpo import (
    DanceGRPOAux as DanceGRPOAux,
    DanceGRPOObjective as DanceGRPOObjective,
    DanceSampler as DanceSampler,
    DanceSDE as DanceSDE,
    RewardTransitions as RewardTransitions,
)
from ._decay import RampedDecay as RampedDecay
from ._device_advantages import device_group_advantages as device_group_advantages
from ._dgpo import (
    AbstractDGPOLoss as AbstractDGPOLoss,
    DGPOObjective as DGPOObjective,
    DGPOReference as DGPOReference,
    DGPOSurrogateLoss as DGPOSurrogateLoss,
    DGPOVariables as DGPOVariables,
    GroupDPOLoss as GroupDPOLoss,
    GroupedSamples as GroupedSamples,
    GroupPreferenceTerms as GroupPreferenceTerms,
)
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
    score_on_root as score_on_root,
    shard_batch as shard_batch,
    shard_parameters as shard_parameters,
    sync_processes as sync_processes,
)
from ._dppo import (
    AbstractKLStd as AbstractKLStd,
    DPPOAux as DPPOAux,
    FlowDPPOObjective as FlowDPPOObjective,
    OldMeans as OldMeans,
    ReleasedKLStd as ReleasedKLStd,
    TransitionKLStd as TransitionKLStd,
    UnitKLStd as UnitKLStd,
    divergence_mask as divergence_mask,
)
from ._evaluation import (
    Evaluation as Evaluation,
    evaluate_policy as evaluate_policy,
    preview_policy as preview_policy,
)
from ._flow_base import (
    AbstractEMAVariables as AbstractEMAVariables,
    AbstractFlowObjective as AbstractFlowObjective,
    AbstractReferenceVariables as AbstractReferenceVariables,
    AbstractVariables as AbstractVariables,
    PolicyVariables as PolicyVariables,
)
from ._flow_grpo import (
    AbstractGRPOGuard as AbstractGRPOGuard,
    EmpiricalGuard as EmpiricalGuard,
    FlowGRPOObjective as FlowGRPOObjective,
    FlowGRPOVariables as FlowGRPOVariables,
    GRPOGuard as GRPOGuard,
    GuardDrift as GuardDrift,
    GuardParts as GuardParts,
    GuardScale as GuardScale,
    ratio_norm as ratio_norm,
    step_weights as step_weights,
)
from ._guided_flow import (
    GuidedFlow as GuidedFlow,
    MatmulPrecision as MatmulPrecision,
    ModelTime as ModelTime,
    Precision as Precision,
)
from ._http_reward import HttpReward as HttpReward
from ._inputs import (
    CFG as CFG,
    AbstractAutoEncoder as AbstractAutoEncoder,
    AbstractGuidance as AbstractGuidance,
    EmbeddedGuidance as EmbeddedGuidance,
    IdentityAutoEncoder as IdentityAutoEncoder,
    InputSpec as InputSpec,
)
from ._misc import check_int as check_int, check_number as check_number, is_int as is_int
from ._nft import (
    AbstractNFTLoss as AbstractNFTLoss,
    AdaptiveX0Loss as AdaptiveX0Loss,
    DiffusionNFTObjective as DiffusionNFTObjective,
    ImplicitPolicyErrors as ImplicitPolicyErrors,
    NFTTimes as NFTTimes,
    NFTVariables as NFTVariables,
    VelocityLoss as VelocityLoss,
)
from ._policy_loss import OldLogProbs as OldLogProbs
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
from ._reward import (
    FlowReward as FlowReward,
    JpegCompressibility as JpegCompressibility,
    JpegIncompressibility as JpegIncompressibility,
    RewardError as RewardError,
    WeightedReward as WeightedReward,
    check_finite_samples as check_finite_samples,
    load_reward as load_reward,
)
from ._rl import AbstractRLObjective as AbstractRLObjective, Rescore as Rescore
from ._rollout import FlowRollout as FlowRollout
from ._sampling import (
    AbstractSampler as AbstractSampler,
    Draw as Draw,
    Generated as Generated,
    MixSampler as MixSampler,
    ODESampler as ODESampler,
    SDESampler as SDESampler,
)
from ._sde import (
    AbstractSDE as AbstractSDE,
    CoefficientsPreservingSDE as CoefficientsPreservingSDE,
    FlowSDE as FlowSDE,
    KLWeighting as KLWeighting,
    window_for_indices as window_for_indices,
)
from ._solver import (
    AbstractSolver as AbstractSolver,
    DPMSolverPP2M as DPMSolverPP2M,
    Euler as Euler,
    Heun as Heun,
    MultistepState as MultistepState,
)
from ._trainable import (
    TrainableFilter as TrainableFilter,
    default_trainable as default_trainable,
    reference_part as reference_part,
    reference_policy as reference_policy,
    split_trainable as split_trainable,
    trainable_part as trainable_part,
    with_part as with_part,
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


__version__ = "0.1.0"
