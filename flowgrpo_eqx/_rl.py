"""`AbstractRLObjective`: what an online RL objective gives the epoch loop."""

import abc
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeAlias, TypeVar

from jaxtyping import Array, Int

from ._custom_types import FinalSamples, Model, Transitions
from ._flow_base import AbstractFlowObjective, VariablesT
from ._rollout import RolloutInfo


BatchT = TypeVar("BatchT")
RunUpdate: TypeAlias = Callable[[Any], Any]
"""The trainer's update program run on a minibatch without changing the state: the loss's
auxiliary output."""
FirstPass: TypeAlias = Sequence[Int[Array, " M"]]
"""The rows of each minibatch of the first pass of updates, in order."""


class AbstractRLObjective(AbstractFlowObjective[VariablesT], Generic[VariablesT, BatchT]):
    """An online RL objective: it samples, turns what it sampled into a batch, and trains.

    The epoch loop (`flowgrpo_eqx.train.rl_epoch`) asks each objective the same five
    questions and knows nothing else about it: which policy the rollout samples with
    (`sampling_policy`), how a rollout becomes the training batch (`training_batch`), how
    the batch is prepared with the trainer's own update program before the first update
    (`prepare_batch`), what changes in the variables once the epoch's updates are done
    (`end_epoch`), and which statistics of the batch the epoch reports (`batch_metrics`).
    `FlowGRPOObjective` (with or without GRPO-Guard) and `DiffusionNFTObjective` implement
    it.
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
    def training_batch(self, collected: Transitions | FinalSamples, info: RolloutInfo) -> BatchT:
        """The batch the objective's `loss` trains on, from one `FlowRollout.collect`.

        **Arguments:**

        - `collected`: what `collect` returned: `Transitions` when the rollout's sampler is
            an SDE, `FinalSamples` when it is an ODE solver.
        - `info`: the `RolloutInfo` that came with it.

        **Returns:**

        The training batch, whose leaves have a leading row axis (the loop cuts it into
        minibatches of rows).

        **Raises:**

        - `ValueError`: if the rollout did not record what the objective needs.
        """

    @abc.abstractmethod
    def prepare_batch(self, batch: BatchT, run_update: RunUpdate, first_pass: FirstPass) -> BatchT:
        """The batch as the epoch's updates will see it, before the first update.

        **Arguments:**

        - `batch`: from `training_batch`.
        - `run_update`: the trainer's update program, run at the state that sampled the batch
            on a minibatch without changing the state; returns the `loss`'s auxiliary output.
        - `first_pass`: the rows of each minibatch of the first pass of updates, in order.

        **Returns:**

        The batch to train on.
        """

    @abc.abstractmethod
    def end_epoch(self, variables: VariablesT, epoch: int) -> VariablesT:
        """The variables after an epoch's updates (e.g. an old policy that follows the live one).

        **Arguments:**

        - `variables`: the trainer's variables after the epoch's last update.
        - `epoch`: the epoch that ended, from 1.

        **Returns:**

        The variables the next epoch starts from.
        """

    @abc.abstractmethod
    def batch_metrics(self, batch: BatchT) -> dict[str, float]:
        """Statistics of the training batch that the epoch reports beside the losses.

        **Arguments:**

        - `batch`: from `training_batch`.

        **Returns:**

        `{name: value}` (may be empty).
        """
