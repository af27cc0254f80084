"""`AbstractRLObjective`: what an online RL objective gives the epoch loop."""

import abc
from collections.abc import Callable
from typing import Any, Generic, TypeVar, final

import equinox as eqx
from jaxtyping import Array, Int

from ._custom_types import FinalSamples, Model, RolloutInfo, Transitions
from ._flow_base import AbstractFlowObjective, VariablesT
from ._sampling import AbstractSampler


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
