"""Training loops: one epoch of any RL objective over a rollout, and pretraining steps."""

import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from jaxtyping import Array, PRNGKeyArray, PyTree

from .._custom_types import RolloutInfo
from .._misc import check_int
from .._rollout import FlowRollout
from ..objectives import AbstractRLObjective, Rescore
from ._diverged import check_finite
from ._metrics_log import MetricsLog as MetricsLog
from ._trainer import Trainer, TrainState


def minibatch_count(rows: int, minibatch_rows: int) -> int:
    """How many minibatches of `minibatch_rows` rows a rollout of `rows` rows makes.

    **Arguments:**

    - `rows`: the rollout's rows `N`.
    - `minibatch_rows`: rows per update.

    **Returns:**

    `rows // minibatch_rows`.

    **Raises:**

    - `ValueError`: naming `minibatch_rows` if `rows` is not a multiple of it (nothing is
        silently dropped).
    """
    if minibatch_rows < 1 or rows % minibatch_rows != 0:
        raise ValueError(
            f"`minibatch_rows`={minibatch_rows} must divide the rollout's {rows} rows."
        )
    return rows // minibatch_rows


def minibatches(batch: Any, minibatch_rows: int, key: PRNGKeyArray) -> Iterator[Any]:
    """The batch's rows, shuffled by `key`, in minibatches of `minibatch_rows` rows.

    **Arguments:**

    - `batch`: a training batch whose leaves all have a leading row axis (`Transitions`,
        `FinalSamples`), with a `num_rows` property.
    - `minibatch_rows`: rows per minibatch; must divide `batch.num_rows`.
    - `key`: the PRNG key of the shuffle.

    **Returns:**

    An iterator over minibatches of the batch's type that together hold every row once.

    **Raises:**

    - `ValueError`: as `minibatch_count`.
    """
    for index in minibatch_indices(batch.num_rows, minibatch_rows, key):
        yield jax.tree.map(lambda leaf, index=index: leaf[index], batch)


def minibatch_indices(rows: int, minibatch_rows: int, key: PRNGKeyArray) -> list[Array]:
    """The rows of each minibatch of one pass: a permutation by `key`, cut in order.

    **Arguments:**

    - `rows`: the batch's rows `N`.
    - `minibatch_rows`: rows per minibatch; must divide `rows`.
    - `key`: the PRNG key of the shuffle.

    **Returns:**

    `N / minibatch_rows` index arrays of `minibatch_rows` rows each.

    **Raises:**

    - `ValueError`: as `minibatch_count`.
    """
    minibatch_count(rows, minibatch_rows)
    order = jax.random.permutation(key, rows)
    return [order[start : start + minibatch_rows] for start in range(0, rows, minibatch_rows)]


def _mean_metrics(history: list[dict[str, Array]]) -> dict[str, float]:
    if not history:
        return {}
    stacked = jax.device_get(history)
    return {name: float(np.mean([h[name] for h in stacked])) for name in stacked[0]}


def rl_epoch(
    trainer: Trainer,
    state: TrainState,
    rollout: FlowRollout,
    rows: PyTree[Any],
    key: PRNGKeyArray,
    *,
    epoch: int = 1,
    inner_epochs: int = 1,
    minibatch_rows: int | None = None,
    after_updates: Callable[[TrainState, Any, RolloutInfo], None] | None = None,
) -> tuple[TrainState, dict[str, float], RolloutInfo]:
    """One epoch of an RL objective: collect, prepare, `inner_epochs` passes of updates.

    The trainer's objective (an `AbstractRLObjective`) names the policy that samples
    (`sampling_policy`); the rollout collects with it; the objective turns the rollout into
    its training batch (`training_batch`), which the trainer rescores first when it comes as
    a `Rescore` (`Trainer.rescore`, over the first pass's minibatches); the rows are
    shuffled and cut into minibatches, one optimizer update each, `inner_epochs` times; then
    the objective ends the epoch at the optimizer step reached (`end_epoch`).

    **Arguments:**

    - `trainer`: the trainer of an `AbstractRLObjective` (`FlowGRPOObjective`,
        `DiffusionNFTObjective`).
    - `state`: the current state (donated).
    - `rollout`: the `FlowRollout`.
    - `rows`: this epoch's source rows.
    - `key`: this epoch's key (rollout noise and shuffling).
    - `epoch`: the epoch, from 1: where the rollout's `window_schedule` puts the window.
    - `inner_epochs`: passes over the rollout, >= 1.
    - `minibatch_rows`: rows per update (must divide the rollout's rows); all at once if
        `None`.
    - `after_updates`: called with the new state, the training batch and the rollout's info
        once the epoch's updates are done (e.g. to log the policy ratio's distribution).

    **Returns:**

    The new state, the epoch's mean metrics (the loss's, the reward's statistics, the
    window's position, the objective's `batch_metrics`, and the wall seconds of the phases:
    `seconds_sampling` (the rollout's device work), `seconds_reward` (the transfer to the
    host, the reward and the advantages) and `seconds_update` (rescoring the batch and every
    update)), and the rollout's `RolloutInfo`.

    **Raises:**

    - `ValueError`: naming `trainer` if its objective is not an `AbstractRLObjective`, or
        `inner_epochs` if it is not an int >= 1 (both before the rollout); as
        `minibatch_count`; as `FlowRollout.collect`.
    - `TrainingDiverged`: with the epoch and its metrics, if the loss, the gradient norm or
        the policy's parameters are not finite after the epoch's updates.
    """
    objective = _rl_objective(trainer)
    check_int("inner_epochs", inner_epochs, 1)
    rollout_key, shuffle_key = jax.random.split(key)
    collected, info = rollout.collect(
        objective.sampling_policy(state.variables), rows, rollout_key, epoch
    )
    state, summary = rl_updates(
        trainer,
        state,
        collected,
        info,
        shuffle_key,
        epoch=epoch,
        inner_epochs=inner_epochs,
        minibatch_rows=minibatch_rows,
        after_updates=after_updates,
    )
    return state, summary, info


def _rl_objective(trainer: Trainer) -> AbstractRLObjective[Any, Any]:
    objective = trainer.objective
    if not isinstance(objective, AbstractRLObjective):
        raise ValueError(
            f"`trainer` must train an AbstractRLObjective, got {type(objective).__name__}."
        )
    return objective


def rl_updates(
    trainer: Trainer,
    state: TrainState,
    collected: Any,
    info: RolloutInfo,
    key: PRNGKeyArray,
    *,
    epoch: int = 1,
    inner_epochs: int = 1,
    minibatch_rows: int | None = None,
    after_updates: Callable[[TrainState, Any, RolloutInfo], None] | None = None,
) -> tuple[TrainState, dict[str, float]]:
    """The updates of one epoch on what a rollout collected: `rl_epoch` after its rollout,
    for a loop that collects its own way (say, scoring on the device in the program that
    samples).

    The objective turns the collected batch into its training batch (`training_batch`),
    which the trainer rescores first when it comes as a `Rescore`; the rows are shuffled by
    `key` and cut into minibatches, one optimizer update each, `inner_epochs` times; then
    the objective ends the epoch at the optimizer step reached (`end_epoch`).

    **Arguments:**

    - `trainer`, `state`, `epoch`, `inner_epochs`, `minibatch_rows`, `after_updates`: as
        for `rl_epoch`.
    - `collected`: the rollout's batch (`Transitions` or `FinalSamples`, as
        `FlowRollout.collect` gives it).
    - `info`: the rollout's `RolloutInfo`.
    - `key`: the shuffle's key.

    **Returns:**

    The new state and the epoch's mean metrics, as `rl_epoch`'s.

    **Raises:**

    - `ValueError`: naming `trainer` or `inner_epochs`, as `rl_epoch`; as `minibatch_count`.
    - `TrainingDiverged`: as `rl_epoch`.
    """
    objective = _rl_objective(trainer)
    check_int("inner_epochs", inner_epochs, 1)
    shuffle_key = key
    collected_at = time.perf_counter()
    requested = objective.training_batch(collected, info)
    batch = requested.batch if isinstance(requested, Rescore) else requested
    size = batch.num_rows if minibatch_rows is None else minibatch_rows
    passes = [
        minibatch_indices(batch.num_rows, size, jax.random.fold_in(shuffle_key, inner))
        for inner in range(inner_epochs)
    ]
    if passes and isinstance(requested, Rescore):
        batch = trainer.rescore(state, requested, passes[0])
    history = []
    order = [index for indices in passes for index in indices]

    def rows_of(index: Array) -> Any:
        return jax.tree.map(lambda leaf: leaf[index], batch)

    # Each minibatch is cut one update ahead: `Trainer.update` reads its advantages on the
    # host before it donates the state, and a minibatch cut before the previous update was
    # dispatched is ready without waiting for that update (a device runs its work in order).
    upcoming = rows_of(order[0]) if order else None
    for position in range(len(order)):
        minibatch = upcoming
        upcoming = rows_of(order[position + 1]) if position + 1 < len(order) else None
        state, metrics = trainer.update(state, minibatch)
        history.append(metrics)
    summary = _mean_metrics(history)
    jax.block_until_ready(state)  # type: ignore[no-untyped-call]
    updated_at = time.perf_counter()
    check_finite(epoch, summary, state.variables.policy)
    variables = objective.end_epoch(state.variables, int(state.step))
    state = dataclasses.replace(state, variables=variables)
    if after_updates is not None:
        after_updates(state, batch, info)
    summary.update(
        reward_mean=float(info.reward_mean),
        reward_zero_std_fraction=info.zero_std_fraction,
        reward_group_std=info.mean_group_std,
        window_start=float(info.window_start),
        seconds_sampling=info.seconds["generation"],
        seconds_reward=info.seconds["reward"],
        seconds_update=updated_at - collected_at,
        **objective.batch_metrics(batch),
    )
    return state, summary


def supervised_steps(
    trainer: Trainer,
    state: TrainState,
    make_batch: Callable[[int], Any],
    first: int,
    count: int,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> tuple[TrainState, dict[str, float]]:
    """`count` updates on batches `make_batch(i)` for `i = first, ..., first + count - 1`.

    **Arguments:**

    - `trainer`: the trainer (e.g. of a `FlowMatchingObjective`).
    - `state`: the current state (donated).
    - `make_batch`: the batch of step `i`, e.g. a `SupervisedBatch`.
    - `first`: the index of the first step (so that a resumed run continues the sequence).
    - `count`: how many updates.
    - `on_step`: called after each update with its index and its metrics as floats.

    **Returns:**

    The new state and the mean metrics over the steps.
    """
    history = []
    for index in range(first, first + count):
        state, metrics = trainer.update(state, make_batch(index))
        history.append(metrics)
        if on_step is not None:
            on_step(index, {k: float(v) for k, v in jax.device_get(metrics).items()})
    return state, _mean_metrics(history)
