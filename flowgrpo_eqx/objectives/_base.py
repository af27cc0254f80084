"""What every objective shares: its variables, the trainer's interface (`AbstractFlowObjective`)
and the epoch loop's (`AbstractRLObjective`)."""

import abc
from collections.abc import Callable
from typing import Any, Generic, TypeVar, final

import equinox as eqx
from jaxtyping import Array, Int, PRNGKeyArray, PyTree

from .._custom_types import (
    FinalSamples,
    Mean,
    Model,
    PerTransition,
    RolloutInfo,
    Step,
    TransitionMask,
    Transitions,
)
from .._guided_flow import GuidedFlow
from .._sampling import AbstractSampler
from .._sde import AbstractSDE
from ._trainable import TrainableFilter, held_part, reference_policy, with_part


class AbstractVariables(eqx.Module):
    """What an objective trains and reads: the live policy, and whatever else it needs.

    Each objective's `init` returns its own concrete variables, whose fields say what they
    hold (`FlowGRPOVariables`: the policy and its KL reference; `NFTVariables`: the policy,
    the old policy and the reference; `AWMVariables` and `DGPOVariables`: the policy, an EMA
    and the reference). The trainer's optimizer writes `policy` alone; every other field is
    the objective's, kept or moved by the objective itself (`AbstractReferenceVariables` and
    `AbstractEMAVariables` give the policies those fields stand for).
    """

    policy: eqx.AbstractVar[Model]


@final
class PolicyVariables(AbstractVariables):
    """The variables of an objective that needs nothing but the live policy.

    **Arguments:**

    - `policy`: the live velocity model, trained by the optimizer.
    """

    policy: Model


class AbstractReferenceVariables(AbstractVariables):
    """Variables that may hold a frozen reference for a KL (or a DPO) term: the initial
    policy's `reference_part`, or `None` where no setting needs one.
    """

    reference: eqx.AbstractVar[PyTree[Any] | None]

    def reference_policy(self) -> Model:
        """The frozen reference: the live policy carrying `reference`, its LoRA adapters
        switched off (`reference_policy`): the base model of a LoRA policy whose adapters
        alone train, the frozen initial policy of a fully trained one.

        **Returns:**

        The reference model.

        **Raises:**

        - `ValueError`: naming `variables.reference` if it is `None`.
        """
        needed_by = "the objective's KL or DPO reference needs it"
        return reference_policy(self.policy, held_part(self.reference, "reference", needed_by))


class AbstractEMAVariables(AbstractVariables):
    """Variables that may hold an exponential moving average of the policy's trainable part
    (`trainable_part`), or `None` where no setting needs one.
    """

    ema: eqx.AbstractVar[PyTree[Any] | None]

    def ema_policy(self) -> Model:
        """The EMA policy: the live policy carrying `ema` (`with_part`).

        **Returns:**

        A model like `policy`.

        **Raises:**

        - `ValueError`: naming `variables.ema` if it is `None`.
        """
        needed_by = "the objective's EMA policy needs it"
        return with_part(self.policy, held_part(self.ema, "ema", needed_by))


VariablesT = TypeVar("VariablesT", bound=AbstractVariables)


class AbstractFlowObjective(eqx.Module, Generic[VariablesT]):
    """An objective over a rectified-flow velocity model, in the trainer's interface.

    Concrete objectives hold a `GuidedFlow` (the model, process, inputs, guidance and
    autoencoder) and supply `variables_for` (their own variables, which `init` builds),
    `loss`, and `loss_sums_over_rows` (whether the trainer may split a batch into
    microbatches). Sampling the policy for evaluation and previews is not an objective's
    work: `evaluate_policy` and `preview_policy` take any flow and any policy.
    """

    flow: eqx.AbstractVar[GuidedFlow]
    pretrained: eqx.AbstractVar[Model | None]

    def __check_init__(self) -> None:
        checked_flow(self.flow)

    def init(
        self,
        key: PRNGKeyArray,
        variables: VariablesT | None = None,
        *,
        trainable: TrainableFilter | None = None,
    ) -> VariablesT:
        """The initial variables: the live policy and whatever else the objective reads.

        **Arguments:**

        - `key`: a PRNG key. Equinox models are built with their parameters, so nothing is
            drawn from it; it is part of the interface for lazily built models.
        - `variables`: existing variables to start from (e.g. restored from a checkpoint),
            returned as they are; `None` builds them from `initial_policy()`.
        - `trainable`: the trainer's filter of the policy's trainable part
            (`Trainer.trainable_filter`), which copies of the policy (an old policy, a KL
            reference) hold; `None` for `default_trainable(policy)`.

        **Returns:**

        `variables`, or `variables_for(initial_policy(), trainable)`.
        """
        del key
        if variables is not None:
            return variables
        return self.variables_for(self.initial_policy(), trainable)

    @abc.abstractmethod
    def variables_for(self, policy: Model, trainable: TrainableFilter | None) -> VariablesT:
        """The objective's variables around an initial policy.

        **Arguments:**

        - `policy`: the initial policy.
        - `trainable`: the filter of its trainable part (`None`: `default_trainable`).

        **Returns:**

        The objective's variables.
        """

    @abc.abstractmethod
    def loss(self, variables: VariablesT, batch: Any, step: Step) -> tuple[Mean, Any]:
        """The objective as an exactly reducible `Mean`, with auxiliary `Mean` statistics.

        The trainer differentiates `loss(...)[0].value` with respect to the policy's
        trainable parameters.

        **Arguments:**

        - `variables`: from `init`, with the policy being trained.
        - `batch`: whatever this objective trains on (`Transitions` for Flow-GRPO).
        - `step`: the step index and a PRNG key for whatever the loss samples.

        **Returns:**

        `(Mean(total, count), aux)`: the value as a sum and a count, so that shards reduce
        exactly, and a PyTree whose `Mean`s, scalars and one-axis arrays become metrics
        (arrays of more axes are per-row outputs, not metrics).
        """

    @abc.abstractmethod
    def loss_sums_over_rows(self) -> bool:
        """Whether `loss` is a sum of per-row parts over a count of rows, so that a batch's
        `Mean` is the sum of its parts' `Mean`s; the trainer's `microbatches > 1` needs it.

        **Returns:**

        `False` where the loss of one row depends on other rows of the batch (statistics
        taken over the whole minibatch).
        """

    def initial_policy(self) -> Model:
        """The policy `init` starts from: `pretrained` when given, else the flow's model."""
        return self.flow.model if self.pretrained is None else self.pretrained


def checked_flow(flow: object) -> GuidedFlow:
    """`flow`, checked to be a `GuidedFlow`: an objective's `__check_init__` that reads the
    flow calls this first (Equinox runs a subclass's check before its base's).

    **Raises:**

    - `ValueError`: naming `flow`, if it is not a `GuidedFlow`.
    """
    if not isinstance(flow, GuidedFlow):
        raise ValueError(
            "`flow` must be a GuidedFlow, as GuidedFlow(model, process, inputs, guidance=..., "
            f"autoencoder=..., precision=...) builds one; got {flow!r}."
        )
    return flow


BatchT = TypeVar("BatchT")


@final
class Rescore(eqx.Module, Generic[BatchT]):
    """A training batch that asks the trainer to rescore it before the first update.

    An objective's `training_batch` returns one when the quantities its loss compares with
    (Flow-GRPO's old log densities) must come from the very program that updates, not from
    the rollout's: the epoch loop then runs the trainer's update program, without the
    optimizer, on each minibatch of the first pass at the state that sampled the batch, and
    writes what the loss reported back into the batch with `fill`.

    **Arguments:**

    - `batch`: the training batch, whose leaves have a leading row axis.
    - `fill`: `fill(batch, rows, aux)`: `batch` with the rows `rows` (an index array, one
        minibatch) taken from `aux`, the loss's auxiliary output on that minibatch.
    """

    batch: BatchT
    fill: Callable[[BatchT, Int[Array, " M"], Any], BatchT]


class AbstractRLObjective(AbstractFlowObjective[VariablesT], Generic[VariablesT, BatchT]):
    """An online RL objective: it samples, turns what it sampled into a batch, and trains.

    The rollout and the epoch loop (`flowgrpo_eqx.train.rl_epoch`) ask each objective the
    same five questions besides its `init` and `loss`, and know nothing else about it: which
    sampler its rollout may use (`rollout_sampler`), which policy the rollout samples with
    (`sampling_policy`), how a rollout becomes the training batch
    (`training_batch`, which may ask the trainer to `Rescore` it), what changes in the
    variables once the epoch's updates are done (`end_epoch`), and which statistics of the
    batch the epoch reports (`batch_metrics`). `FlowGRPOObjective` (with or without
    GRPO-Guard, and MixGRPO's window through a `MixSampler`), `DiffusionNFTObjective`,
    `AWMObjective`, `DGPOObjective` and `FlowDPPOObjective` implement it.
    """

    @abc.abstractmethod
    def rollout_sampler(self, requested: AbstractSampler | None) -> AbstractSampler:
        """The sampler a `FlowRollout` of this objective uses.

        **Arguments:**

        - `requested`: the rollout's `sampler` argument, or `None` for the objective's own.

        **Returns:**

        `requested`, or the objective's default sampler when it is `None`.

        **Raises:**

        - `ValueError`: naming `sampler`, if the objective cannot train on what `requested`
            records (for Flow-GRPO, anything but an `SDESampler` of its own `sde`).
        """

    @abc.abstractmethod
    def sampling_policy(self, variables: VariablesT) -> Model:
        """The policy the rollout samples with.

        **Arguments:**

        - `variables`: the objective's variables, from `init` or the trainer's state.

        **Returns:**

        A model like `variables.policy` (the live policy, or an old policy).
        """

    @abc.abstractmethod
    def training_batch(
        self, collected: Transitions | FinalSamples, info: RolloutInfo
    ) -> BatchT | Rescore[BatchT]:
        """The batch the objective's `loss` trains on, from one `FlowRollout.collect`.

        **Arguments:**

        - `collected`: what `collect` returned: `Transitions` from an `SDESampler`,
            `FinalSamples` from an `ODESampler`.
        - `info`: the `RolloutInfo` that came with it.

        **Returns:**

        The training batch, whose leaves have a leading row axis (the loop cuts it into
        minibatches of rows), or a `Rescore` of it for the trainer to rescore first.

        **Raises:**

        - `ValueError`: if the rollout did not record what the objective needs.
        """

    @abc.abstractmethod
    def end_epoch(self, variables: VariablesT, step: int) -> VariablesT:
        """The variables after an epoch's updates (e.g. an old policy that follows the live one).

        **Arguments:**

        - `variables`: the trainer's variables after the epoch's last update.
        - `step`: the optimizer updates done so far (`TrainState.step`).

        **Returns:**

        The variables the next epoch starts from.
        """

    @abc.abstractmethod
    def batch_metrics(self, batch: BatchT) -> dict[str, float]:
        """Statistics of the training batch that the epoch reports beside the losses.

        **Arguments:**

        - `batch`: from `training_batch` (rescored, when it asked to be).

        **Returns:**

        `{name: value}` (may be empty).
        """


class AbstractTransitionObjective(AbstractRLObjective[VariablesT, BatchT]):
    """An RL objective whose loss rescores the transitions its rollout recorded: it says
    which of them count (`kept`) and rescores their log densities (`log_probs`) under its
    `sde`. `FlowGRPOObjective`, `FlowDPPOObjective` and `DanceGRPOObjective` are ones;
    objectives that train on final samples (`DiffusionNFTObjective`, `AWMObjective`,
    `DGPOObjective`) are not, so the porting check's transition lines (`check_consistency`)
    do not apply to them.
    """

    sde: eqx.AbstractVar[AbstractSDE]

    @abc.abstractmethod
    def kept(self, batch: Transitions) -> TransitionMask:
        """The kept set: the transitions the loss averages over.

        **Arguments:**

        - `batch`: the recorded transitions.

        **Returns:**

        `[N, K]` bools.
        """

    @abc.abstractmethod
    def log_probs(self, variables: AbstractVariables, batch: Transitions) -> PerTransition:
        """The recorded transitions' log densities, rescored with the rollout's guidance.

        **Arguments:**

        - `variables`: the objective's variables.
        - `batch`: the recorded transitions.

        **Returns:**

        `[N, K]` log densities, comparable with `batch.old_log_probs`.
        """
