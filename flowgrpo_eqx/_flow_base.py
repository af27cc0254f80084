"""What every flow objective shares: variables, the guided velocity, ODE sampling, previews."""

import abc
from typing import Any, Generic, TypeVar, final

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jaxtyping import Array, Float, PRNGKeyArray, PyTree

from ._custom_types import Mean, Model, Step, Transitions
from ._guided_flow import GuidedFlow
from ._misc import check_int, leading_rows
from ._preview import preview_grid
from ._reward import FlowReward, score
from ._solver import AbstractSolver
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


@final
class Evaluation(eqx.Module):
    """Samples drawn by `FlowGRPOObjective.evaluate`.

    **Arguments:**

    - `samples`: `[N, *sample]`, decoded to [-1, 1].
    - `latents`: `[N, *latent]`, the final latents before decoding.
    - `scores`: `[N]` float64 scores from the reward, when one was given.
    """

    samples: Float[Array, " N *sample"]
    latents: Float[Array, " N *latent"]
    scores: npt.NDArray[np.float64] | None = None


class AbstractFlowObjective(eqx.Module, Generic[VariablesT]):
    """An objective over a rectified-flow velocity model, in the trainer's interface.

    Concrete objectives hold a `GuidedFlow` (the model, process, inputs, guidance and
    autoencoder) and supply `variables_for` (their own variables, which `init` builds),
    `loss`, and `loss_sums_over_rows`
    (whether the trainer may split a batch into microbatches); live-policy ODE sampling
    (`evaluate`) and previews are shared here.
    """

    flow: eqx.AbstractVar[GuidedFlow]
    sampler: eqx.AbstractVar[AbstractSolver]
    steps: eqx.AbstractVar[int]
    pretrained: eqx.AbstractVar[Model | None]

    def __check_init__(self) -> None:
        if not isinstance(self.flow, GuidedFlow):
            raise ValueError(
                "`flow` must be a GuidedFlow, as GuidedFlow(model, process, inputs, guidance=..., "
                f"autoencoder=..., precision=...) builds one; got {self.flow!r}."
            )
        if not isinstance(self.sampler, AbstractSolver):
            raise ValueError(f"`sampler` must be an AbstractSolver, got {self.sampler!r}.")
        check_int("steps", self.steps, 2)

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

    def evaluate(
        self,
        variables: AbstractVariables,
        batch: Transitions | PyTree[Any],
        step: Step,
        *,
        reward: FlowReward | None = None,
    ) -> Evaluation:
        """Generate one live-policy sample per source row, including prompt-only batches:
        `evaluate_policy` with the objective's flow, `sampler` and `steps`.

        Deterministic ODE sampling with `sampler` on the `steps`-point grid from noise drawn
        with `step.key`. Evaluation always uses the live policy.

        **Arguments:**

        - `variables`: from `init`.
        - `batch`: a `Transitions` batch (its `cond` rows are used) or the rows themselves.
        - `step`: its `key` draws the starting noise.
        - `reward`: if given, the samples are scored with it on the host (float64).

        **Returns:**

        An `Evaluation` with the decoded `samples`, the final `latents`, and `scores`.

        **Raises:**

        - `ValueError`: if the rows are prompt-only and `InputSpec.latent_shape` is unset.
        - `RewardError`: if the reward fails.
        """
        return evaluate_policy(
            self.flow, self.sampler, self.steps, variables.policy, batch, step.key, reward=reward
        )

    def preview(
        self,
        variables: AbstractVariables,
        batch: Transitions | PyTree[Any],
        step: Step,
        *,
        scored: FlowReward | npt.ArrayLike | None = None,
        path: str | None = None,
        captions: list[str] | None = None,
        title: str | None = None,
    ) -> Evaluation:
        """Draw, score and picture one live-policy sample per row: `preview_policy` with the
        objective's flow, `sampler` and `steps`.

        **Arguments:**

        - `variables`, `batch`, `step`: as for `evaluate`.
        - `scored`, `path`, `captions`, `title`: as for `preview_policy`.

        **Returns:**

        The `Evaluation` (with `scores` when `scored` was given).

        **Raises:**

        - `ValueError`: if `scored` scores or `captions` do not have one entry per row.
        """
        return preview_policy(
            self.flow,
            self.sampler,
            self.steps,
            variables.policy,
            batch,
            step.key,
            scored=scored,
            path=path,
            captions=captions,
            title=title,
        )


def _rows_and_latent_shape(
    flow: GuidedFlow, batch: Transitions | PyTree[Any]
) -> tuple[PyTree[Any], tuple[int, ...]]:
    if isinstance(batch, Transitions):
        return batch.cond, batch.latent_shape
    if flow.inputs.latent_shape is None:
        raise ValueError(
            "Sampling from prompt-only rows needs InputSpec(latent_shape=...); the batch "
            "carries no latents to take the shape from."
        )
    return batch, flow.inputs.latent_shape


def evaluate_policy(
    flow: GuidedFlow,
    sampler: AbstractSolver,
    steps: int,
    policy: Model,
    batch: Transitions | PyTree[Any],
    key: PRNGKeyArray,
    *,
    reward: FlowReward | None = None,
) -> Evaluation:
    """Generate one sample of `policy` per source row, including prompt-only batches.

    Deterministic ODE sampling of `flow` (its guidance, precision and autoencoder) with
    `sampler` on the `steps`-point grid, from noise drawn with `key`; what every objective's
    `evaluate` does with its own flow and live policy, for any policy and any flow.

    **Arguments:**

    - `flow`: the guided flow to sample (its `model` gives nothing but the structure).
    - `sampler`: the ODE solver.
    - `steps`: the number of grid points (>= 2).
    - `policy`: the velocity model to sample with.
    - `batch`: a `Transitions` batch (its `cond` rows are used) or the rows themselves.
    - `key`: draws the starting noise.
    - `reward`: if given, the samples are scored with it on the host (float64).

    **Returns:**

    An `Evaluation` with the decoded `samples`, the final `latents`, and `scores`.

    **Raises:**

    - `ValueError`: if the rows are prompt-only and `InputSpec.latent_shape` is unset, or
        `steps` is not an int >= 2.
    - `RewardError`: if the reward fails.
    """
    check_int("steps", steps, 2)
    rows, latent_shape = _rows_and_latent_shape(flow, batch)
    num_rows = leading_rows(rows)
    noise = jax.random.normal(key, (num_rows, *latent_shape), jnp.float32)
    latents = _sample_jit(flow, sampler, steps, policy, rows, noise)
    samples = flow.decode(latents)
    scores = None
    if reward is not None:
        host_rows = jax.tree.map(np.asarray, rows)
        scores = score(reward, np.asarray(samples), host_rows)
    return Evaluation(samples=samples, latents=latents, scores=scores)


def preview_policy(
    flow: GuidedFlow,
    sampler: AbstractSolver,
    steps: int,
    policy: Model,
    batch: Transitions | PyTree[Any],
    key: PRNGKeyArray,
    *,
    scored: FlowReward | npt.ArrayLike | None = None,
    path: str | None = None,
    captions: list[str] | None = None,
    title: str | None = None,
) -> Evaluation:
    """Draw, score and picture one sample of `policy` per row (`evaluate_policy`).

    Every process draws its samples (generation is collective); they are materialised
    before process 0 alone decodes captions and writes the picture grid.

    **Arguments:**

    - `flow`, `sampler`, `steps`, `policy`, `batch`, `key`: as for `evaluate_policy`.
    - `scored`: a reward to score the samples with, or `[N]` scores to show, or `None`.
    - `path`: where to write the PNG grid; nothing is written when `None`.
    - `captions`: one caption per row; default `InputSpec.caption(rows)` when the spec
        has one, else the row index.
    - `title`: an optional title line for the picture.

    **Returns:**

    The `Evaluation` (with `scores` when `scored` was given).

    **Raises:**

    - `ValueError`: if `scored` scores or `captions` do not have one entry per row.
    """
    reward = scored if callable(scored) else None
    evaluation = evaluate_policy(flow, sampler, steps, policy, batch, key, reward=reward)
    num = int(evaluation.samples.shape[0])
    if scored is not None and not callable(scored):
        values = np.asarray(scored, dtype=np.float64)
        if values.shape != (num,):
            raise ValueError(f"`scored` must have shape [N] = ({num},), got {values.shape}.")
        evaluation = eqx.tree_at(
            lambda e: e.scores, evaluation, values, is_leaf=lambda x: x is None
        )
    ready: Evaluation = jax.block_until_ready(evaluation)  # type: ignore[no-untyped-call]
    if path is not None and jax.process_index() == 0:
        rows, _ = _rows_and_latent_shape(flow, batch)
        host_rows = jax.tree.map(np.asarray, rows)
        if captions is None:
            if flow.inputs.caption is not None:
                captions = list(flow.inputs.caption(host_rows))
            else:
                captions = [f"row {i}" for i in range(num)]
        preview_grid(np.asarray(ready.samples), path, captions, ready.scores, title=title)
    return ready


@eqx.filter_jit
def _sample_jit(
    flow: GuidedFlow,
    sampler: AbstractSolver,
    steps: int,
    policy: Model,
    rows: PyTree[Any],
    noise: Float[Array, " N *latent"],
) -> Float[Array, " N *latent"]:
    return flow.sample_latents(policy, rows, noise, sampler, steps)
