"""The objectives: what the trainer minimises, one module per algorithm.

`AbstractFlowObjective` is what the trainer asks of any objective, `AbstractRLObjective` what
the rollout and the epoch loop ask of an online RL one. Each algorithm lives in its own
module and reaches another's pieces only through the shared ones (`_base`, `_policy_loss`
for objectives over recorded transitions, `_final_samples` for objectives over final
samples, `_decay`, `_trainable`): Flow-GRPO (`FlowGRPOObjective`, with GRPO-Guard's forms in
`_grpo_guard`; MixGRPO is Flow-GRPO with a `MixSampler`), DiffusionNFT
(`DiffusionNFTObjective`), AWM (`AWMObjective`), DGPO (`DGPOObjective`), Flow-DPPO
(`FlowDPPOObjective`) and DanceGRPO (`DanceGRPOObjective`).
"""

from ._awm import (
    AWMObjective as AWMObjective,
    AWMVariables as AWMVariables,
)
from ._awm_forms import (
    AbstractAWMKLWeight as AbstractAWMKLWeight,
    AbstractAWMRatio as AbstractAWMRatio,
    AbstractAWMTimes as AbstractAWMTimes,
    AbstractAWMWeighting as AbstractAWMWeighting,
    DiscreteTimes as DiscreteTimes,
    DiscreteTimesWithInit as DiscreteTimesWithInit,
    DiscreteTimesWithoutInit as DiscreteTimesWithoutInit,
    ELBOKLWeight as ELBOKLWeight,
    GHuberWeighting as GHuberWeighting,
    HuberWeighting as HuberWeighting,
    PerRowRatio as PerRowRatio,
    PerTimeRatio as PerTimeRatio,
    TimeSquaredWeighting as TimeSquaredWeighting,
    TimeWeighting as TimeWeighting,
    UniformKLWeight as UniformKLWeight,
    UniformWeighting as UniformWeighting,
)
from ._base import (
    AbstractEMAVariables as AbstractEMAVariables,
    AbstractFlowObjective as AbstractFlowObjective,
    AbstractReferenceVariables as AbstractReferenceVariables,
    AbstractRLObjective as AbstractRLObjective,
    AbstractTransitionObjective as AbstractTransitionObjective,
    AbstractVariables as AbstractVariables,
    PolicyVariables as PolicyVariables,
    Rescore as Rescore,
)
from ._dancegrpo import (
    DanceGRPOAux as DanceGRPOAux,
    DanceGRPOObjective as DanceGRPOObjective,
    DanceSampler as DanceSampler,
    DanceSDE as DanceSDE,
    RewardTransitions as RewardTransitions,
)
from ._decay import (
    RampedDecay as RampedDecay,
)
from ._dgpo import (
    DGPOObjective as DGPOObjective,
)
from ._dgpo_data import (
    DGPOVariables as DGPOVariables,
    GroupedSamples as GroupedSamples,
)
from ._dgpo_loss import (
    AbstractDGPOLoss as AbstractDGPOLoss,
    DGPOReference as DGPOReference,
    DGPOSurrogateLoss as DGPOSurrogateLoss,
    GroupDPOLoss as GroupDPOLoss,
    GroupPreferenceTerms as GroupPreferenceTerms,
)
from ._dppo import (
    DPPOAux as DPPOAux,
    FlowDPPOObjective as FlowDPPOObjective,
    OldMeans as OldMeans,
)
from ._dppo_divergence import (
    AbstractKLStd as AbstractKLStd,
    ReleasedKLStd as ReleasedKLStd,
    TransitionKLStd as TransitionKLStd,
    UnitKLStd as UnitKLStd,
    divergence_mask as divergence_mask,
)
from ._flow_grpo import (
    FlowGRPOObjective as FlowGRPOObjective,
    FlowGRPOVariables as FlowGRPOVariables,
)
from ._grpo_guard import (
    AbstractGRPOGuard as AbstractGRPOGuard,
    EmpiricalGuard as EmpiricalGuard,
    GRPOGuard as GRPOGuard,
    GuardDrift as GuardDrift,
    GuardParts as GuardParts,
    GuardScale as GuardScale,
    ratio_norm as ratio_norm,
    step_weights as step_weights,
)
from ._nft import (
    AbstractNFTLoss as AbstractNFTLoss,
    AdaptiveX0Loss as AdaptiveX0Loss,
    DiffusionNFTObjective as DiffusionNFTObjective,
    ImplicitPolicyErrors as ImplicitPolicyErrors,
    NFTTimes as NFTTimes,
    NFTVariables as NFTVariables,
    VelocityLoss as VelocityLoss,
)
from ._policy_loss import (
    OldLogProbs as OldLogProbs,
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
