"""Training loops: Flow-GRPO and DiffusionNFT epochs over rollouts, and pretraining steps."""

from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, PRNGKeyArray, PyTree

from .._custom_types import Transitions
from .._flow_base import Variables
from .._nft import DiffusionNFTObjective, nft_batch
from .._objective import FlowGRPOObjective
from .._rollout import FlowRollout, RolloutInfo
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


def minibatches(
    batch: Transitions, minibatch_rows: int, key: PRNGKeyArray
) -> Iterator[Transitions]:
    """The batch's rows, shuffled by `key`, in minibatches of `minibatch_rows` rows.

    **Arguments:**

    - `batch`: the rollout's `Transitions`.
    - `minibatch_rows`: rows per minibatch; must divide `batch.num_rows`.
    - `key`: the PRNG key of the shuffle.

    **Returns:**

    An iterator over `Transitions` minibatches that together hold every row once.

    **Raises:**

    - `ValueError`: as `minibatch_count`.
    """
    for index in _minibatch_rows(batch.num_rows, minibatch_rows, key):
        yield jax.tree.map(lambda leaf, index=index: leaf[index], batch)


def _minibatch_rows(rows: int, minibatch_rows: int, key: PRNGKeyArray) -> Iterator[Array]:
    minibatch_count(rows, minibatch_rows)
    order = jax.random.permutation(key, rows)
    for start in range(0, rows, minibatch_rows):
        yield order[start : start + minibatch_rows]


def update_program_log_probs(
    trainer: Trainer, state: TrainState, batch: Transitions, minibatch_rows: int, key: PRNGKeyArray
) -> Transitions:
    """`batch` with its old log densities recomputed by the trainer's own update program.

    The rows are cut into the minibatches `minibatches(batch, minibatch_rows, key)` gives, and
    each is scored by `trainer.update_log_probs` at `state`, so that the first pass of updates
    over those minibatches starts from a ratio of exactly 1.

    **Arguments:**

    - `trainer`: a trainer of a `FlowGRPOObjective` with `old_log_probs="update"`.
    - `state`: the state that sampled the batch (not consumed).
    - `batch`: the rollout's `Transitions`.
    - `minibatch_rows`: rows per update; must divide `batch.num_rows`.
    - `key`: the key of the first pass's shuffle.

    **Returns:**

    `batch` with new `old_log_probs` (unchanged where a transition is not kept).

    **Raises:**

    - `ValueError`: naming `trainer` if its objective is not a `FlowGRPOObjective`; as
        `minibatch_count` and `Trainer.update_log_probs`.
    """
    objective = trainer.objective
    if not isinstance(objective, FlowGRPOObjective):
        raise ValueError(
            f"`trainer`'s objective must be a FlowGRPOObjective, got {type(objective).__name__}."
        )
    old_log_probs = batch.old_log_probs
    for index in _minibatch_rows(batch.num_rows, minibatch_rows, key):
        minibatch = jax.tree.map(lambda leaf, index=index: leaf[index], batch)
        scores = trainer.update_log_probs(state, minibatch)
        kept = objective.kept(minibatch)
        old_log_probs = old_log_probs.at[index].set(
            jnp.where(kept, scores, minibatch.old_log_probs)
        )
    rescored: Transitions = eqx.tree_at(lambda b: b.old_log_probs, batch, old_log_probs)
    return rescored


def _mean_metrics(history: list[dict[str, Array]]) -> dict[str, float]:
    if not history:
        return {}
    stacked = jax.device_get(history)
    return {name: float(np.mean([h[name] for h in stacked])) for name in stacked[0]}


def flow_grpo_epoch(
    trainer: Trainer,
    state: TrainState,
    rollout: FlowRollout,
    rows: PyTree[Any],
    key: PRNGKeyArray,
    *,
    epoch: int = 1,
    inner_epochs: int = 1,
    minibatch_rows: int | None = None,
    after_updates: Callable[[TrainState, Transitions, RolloutInfo], None] | None = None,
) -> tuple[TrainState, dict[str, float], RolloutInfo]:
    """One Flow-GRPO epoch: collect a rollout, then `inner_epochs` passes of updates over it.

    **Arguments:**

    - `trainer`: the trainer of a `FlowGRPOObjective`.
    - `state`: the current state (donated).
    - `rollout`: the `FlowRollout`.
    - `rows`: this epoch's source rows.
    - `key`: this epoch's key (rollout noise and shuffling).
    - `epoch`: the epoch, from 1: where the rollout's `window_schedule` puts the window.
    - `inner_epochs`: passes over the rollout.
    - `minibatch_rows`: rows per update (must divide the rollout's rows); all at once if
        `None`.
    - `after_updates`: called with the new state, the rollout's batch and its info once the
        epoch's updates are done (e.g. to log the policy ratio's distribution).

    With `Trainer(old_log_probs="update")`, the batch's old log densities are first
    recomputed by the update program (`update_program_log_probs`).

    **Returns:**

    The new state, the epoch's mean metrics (losses, clip fractions, reward statistics),
    and the rollout's `RolloutInfo`.
    """
    rollout_key, shuffle_key = jax.random.split(key)
    batch, info = rollout.collect(state.variables, rows, rollout_key, epoch)
    size = batch.num_rows if minibatch_rows is None else minibatch_rows
    if trainer.old_log_probs == "update":
        batch = update_program_log_probs(
            trainer, state, batch, size, jax.random.fold_in(shuffle_key, 0)
        )
    history = []
    for inner in range(inner_epochs):
        for minibatch in minibatches(batch, size, jax.random.fold_in(shuffle_key, inner)):
            state, metrics = trainer.update(state, minibatch)
            history.append(metrics)
    if after_updates is not None:
        after_updates(state, batch, info)
    summary = _mean_metrics(history)
    summary.update(
        reward_mean=float(info.reward_mean),
        reward_zero_std_fraction=info.zero_std_fraction,
        reward_group_std=info.mean_group_std,
        kept_fraction=float(jnp.mean(batch.transition_mask)),
        window_start=float(info.window_start),
    )
    return state, summary, info


def nft_epoch(
    trainer: Trainer,
    state: TrainState,
    rollout: FlowRollout,
    rows: PyTree[Any],
    key: PRNGKeyArray,
    *,
    epoch: int = 1,
    inner_epochs: int = 1,
    minibatch_rows: int | None = None,
) -> tuple[TrainState, dict[str, float], RolloutInfo]:
    """One DiffusionNFT epoch: the old policy samples, then `inner_epochs` passes of updates.

    The rollout samples with the objective's old policy (`DiffusionNFTObjective.old_policy`,
    the held slot), whose final latents, rows and advantages form the `NFTBatch`
    (`nft_batch`); the rollout's own objective supplies only the sampler (its SDE and
    guidance), and the trajectory it records is not used.

    **Arguments:**

    - `trainer`: the trainer of a `DiffusionNFTObjective` (with `ema_decay`, its old policy
        follows the live one; without, it stays the initial policy).
    - `state`, `rollout`, `rows`, `key`, `epoch`, `inner_epochs`, `minibatch_rows`: as for
        `flow_grpo_epoch`.

    **Returns:**

    The new state, the epoch's mean metrics (losses and reward statistics), and the
    rollout's `RolloutInfo`.

    **Raises:**

    - `ValueError`: naming `trainer` if its objective is not a `DiffusionNFTObjective`.
    """
    objective = trainer.objective
    if not isinstance(objective, DiffusionNFTObjective):
        raise ValueError(
            f"`trainer` must train a DiffusionNFTObjective, got {type(objective).__name__}."
        )
    rollout_key, shuffle_key = jax.random.split(key)
    sampling = Variables(policy=objective.old_policy(state.variables), held=None)
    transitions, info = rollout.collect(sampling, rows, rollout_key, epoch)
    batch = nft_batch(transitions, info)
    size = batch.num_rows if minibatch_rows is None else minibatch_rows
    minibatch_count(batch.num_rows, size)
    history = []
    for inner in range(inner_epochs):
        for index in _minibatch_rows(batch.num_rows, size, jax.random.fold_in(shuffle_key, inner)):
            minibatch = jax.tree.map(lambda leaf, index=index: leaf[index], batch)
            state, metrics = trainer.update(state, minibatch)
            history.append(metrics)
    summary = _mean_metrics(history)
    summary.update(
        reward_mean=float(info.reward_mean),
        reward_zero_std_fraction=info.zero_std_fraction,
        reward_group_std=info.mean_group_std,
    )
    return state, summary, info


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
