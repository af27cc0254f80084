"""What the policy objectives on recorded SDE transitions share (`FlowGRPOObjective`,
`FlowDPPOObjective`): the kept set, the batch's inputs made safe, the scan over chunks of
transitions, the samplers and batches they accept, the anchors the update program rescores,
and the rescored log densities."""

from collections.abc import Callable
from typing import Any, Literal, TypeAlias

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PyTree

from .._custom_types import FinalSamples, Model, PerTransition, TransitionMask, Transitions
from .._guided_flow import GuidedFlow
from .._misc import tile_rows
from .._sampling import AbstractSampler, SDESampler
from .._sde import AbstractSDE


OldLogProbs: TypeAlias = Literal["rollout", "update"]
"""Where a policy objective (Flow-GRPO, Flow-DPPO) takes the old log densities of its ratio
from: as the rollout recorded them, or recomputed by the trainer's own update program before
the first update."""


# The transition a masked entry is replaced by before any arithmetic, so that NaN or inf in
# masked inputs can reach neither the values nor the gradients (the double-`where` pattern).
SAFE_T = 1.0
SAFE_T_NEXT = 0.5


def kept_transitions(sde: AbstractSDE, batch: Transitions) -> TransitionMask:
    """The kept set: the transitions whose `transition_mask` is set and that are stochastic
    under `sde`; a policy loss averages over these.

    **Arguments:**

    - `sde`: the SDE the objective rescores with.
    - `batch`: the recorded transitions.

    **Returns:**

    `[N, K]` bools.
    """
    return batch.transition_mask & sde.is_stochastic(batch.timesteps, batch.next_timesteps)


def kept_inputs(batch: Transitions, kept: TransitionMask, needs_means: bool) -> dict[str, Array]:
    """The batch's per-transition inputs, each entry outside the kept set replaced by a safe
    value before any arithmetic (the double-`where` pattern).

    **Arguments:**

    - `batch`: the recorded transitions.
    - `kept`: `[N, K]` the kept set (`kept_transitions`).
    - `needs_means`: whether to include the rollout's means (`"old_mean"`), when the batch
        has them.

    **Returns:**

    `{"x", "x_next", "t", "t_next", "old", "advantage", "kept"}` (and `"old_mean"`), each
    `[N, K, ...]`; the advantages broadcast to `[N, K]` in float32.
    """
    n, k = batch.timesteps.shape
    advantages = batch.advantages
    if advantages.ndim == 1:
        advantages = jnp.broadcast_to(advantages[:, None], (n, k))

    def keep(value: Array, safe: float) -> Array:
        mask = kept.reshape(kept.shape + (1,) * (value.ndim - 2))
        return jnp.where(mask, value, jnp.asarray(safe, value.dtype))

    inputs = {
        "x": keep(batch.latents, 0.0),
        "x_next": keep(batch.next_latents, 0.0),
        "t": keep(batch.timesteps, SAFE_T),
        "t_next": keep(batch.next_timesteps, SAFE_T_NEXT),
        "old": keep(batch.old_log_probs, 0.0),
        "advantage": keep(advantages.astype(jnp.float32), 0.0),
        "kept": kept,
    }
    if needs_means and batch.old_means is not None:
        inputs["old_mean"] = keep(batch.old_means, 0.0)
    return inputs


def map_transitions(
    fn: Callable[..., PyTree[Float[Array, " B ..."]]],
    per_transition: PyTree[Array],
    cond: PyTree[Any],
    transition_chunk: int | None,
    remat: bool | None,
) -> PyTree[Float[Array, " N K ..."]]:
    """Apply `fn(flat_inputs, flat_cond)` to all `[N, K, ...]` inputs, chunk by chunk.

    A `lax.scan` over chunks of `transition_chunk` transitions that carries nothing between
    them; within a chunk the `chunk * N` transitions are one batch. `K` need not be a
    multiple of the chunk: the last chunk is padded with copies of the last transition whose
    outputs are discarded.

    **Arguments:**

    - `fn`: `fn(inputs, cond)` on one chunk: `inputs` the leaves of `per_transition` as
        `[chunk * N, ...]` (transition-major), `cond` the rows tiled `chunk` times; returns
        a PyTree of `[chunk * N, ...]` arrays.
    - `per_transition`: a PyTree of `[N, K, ...]` arrays.
    - `cond`: the batch's rows (leading axis `N`).
    - `transition_chunk`: transitions per chunk; `None` for all `K` at once.
    - `remat`: whether each scan step is rematerialised (`jax.checkpoint`); `None` for "when
        there is more than one chunk".

    **Returns:**

    `fn`'s outputs as `[N, K, ...]`.
    """
    leaves = jax.tree.leaves(per_transition)
    n, k = leaves[0].shape[:2]
    chunk = max(k, 1) if transition_chunk is None else min(transition_chunk, max(k, 1))
    num_chunks = -(-k // chunk)
    padded = num_chunks * chunk

    def to_chunks(leaf: Array) -> Array:
        leaf = jnp.swapaxes(leaf, 0, 1)
        if padded > k:
            # Pad with copies of the last (already sanitised) transition: finite values
            # whose outputs are sliced off below, so they count nowhere.
            pad = jnp.broadcast_to(leaf[-1:], (padded - k, *leaf.shape[1:]))
            leaf = jnp.concatenate([leaf, pad], axis=0)
        return leaf.reshape(num_chunks, chunk * n, *leaf.shape[2:])

    xs = jax.tree.map(to_chunks, per_transition)
    chunk_cond = tile_rows(cond, chunk)

    def body(carry: None, inputs: PyTree[Array]) -> tuple[None, PyTree[Array]]:
        return carry, fn(inputs, chunk_cond)

    if remat is None:
        remat = num_chunks > 1
    if remat:
        body = jax.checkpoint(body)
    _, outputs = jax.lax.scan(body, None, xs)

    def from_chunks(leaf: Array) -> Array:
        leaf = leaf.reshape(padded, n, *leaf.shape[2:])[:k]
        return jnp.swapaxes(leaf, 0, 1)

    return jax.tree.map(from_chunks, outputs)


def transition_sampler(
    sde: AbstractSDE, requested: AbstractSampler | None, objective: str
) -> AbstractSampler:
    """`SDESampler(sde)` by default; a requested sampler only if it records transitions of
    this `sde`.

    An objective that rescores its recorded transitions with its own `sde` cannot train on a
    rollout that sampled another one (or an ODE): the log densities would not be the ones its
    loss reproduces. Each sampler says whether its transitions are `sde`'s
    (`AbstractSampler.records_transitions_of`): an `SDESampler` or a `MixSampler` (MixGRPO's
    rollout, which records its window) of the same `sde` does.

    **Arguments:**

    - `sde`: the objective's SDE.
    - `requested`: the rollout's `sampler` argument, or `None`.
    - `objective`: the objective's name, for the message (`"Flow-GRPO"`).

    **Returns:**

    `requested`, or `SDESampler(sde)` when it is `None`.

    **Raises:**

    - `ValueError`: naming `sampler`, for a sampler that records no transitions of `sde`.
    """
    if requested is None:
        return SDESampler(sde)
    if not requested.records_transitions_of(sde):
        raise ValueError(
            f"`sampler` must be an SDESampler of the {objective} objective's own `sde` "
            f"({sde!r}), or another sampler that records transitions of it (a MixSampler of "
            f"it): the objective rescores what it recorded, got {requested!r}."
        )
    return requested


def recorded_transitions(collected: Transitions | FinalSamples, objective: str) -> Transitions:
    """A rollout's batch, if it recorded transitions.

    **Arguments:**

    - `collected`: what the rollout collected.
    - `objective`: the objective's name, for the message (`"Flow-GRPO"`).

    **Returns:**

    `collected`.

    **Raises:**

    - `ValueError`: if the rollout recorded no transitions (an ODE sampler's `FinalSamples`).
    """
    if not isinstance(collected, Transitions):
        raise ValueError(
            f"{objective} trains on recorded transitions: collect with an SDESampler of the "
            f"objective's `sde` (it collected {type(collected).__name__})."
        )
    return collected


def with_rescored(
    batch: Transitions,
    rows: Int[Array, " M"],
    kept: TransitionMask,
    field: Literal["old_log_probs", "old_means"],
    rescored: Array,
) -> Transitions:
    """`batch` whose anchor `field` takes the update program's values in the kept
    transitions of one minibatch's rows (the `fill` of a `Rescore`).

    **Arguments:**

    - `batch`: the whole batch, with `field` set.
    - `rows`: `[M]` the rows of the minibatch.
    - `kept`: `[M, K]` their kept set (`kept_transitions`).
    - `field`: `"old_log_probs"` (`[N, K]`) or `"old_means"` (`[N, K, *latent]`).
    - `rescored`: `[M, K, ...]` the minibatch's values as the loss computed them.

    **Returns:**

    `batch` with `field` replaced in those rows where a transition is kept.
    """
    current = getattr(batch, field)
    wide = kept.reshape(kept.shape + (1,) * (rescored.ndim - 2))
    written = jnp.where(wide, rescored, current[rows])
    replaced: Transitions = eqx.tree_at(
        lambda b: getattr(b, field), batch, current.at[rows].set(written)
    )
    return replaced


def transition_log_probs(
    flow: GuidedFlow,
    sde: AbstractSDE,
    policy: Model,
    batch: Transitions,
    transition_chunk: int | None,
    remat: bool | None,
) -> PerTransition:
    """The policy's joint (mean-coordinate) log density of every recorded transition.

    With the flow's guidance and `sde`, so rescoring the policy that sampled the batch
    reproduces its `old_log_probs`. Deterministic transitions score 0.

    **Arguments:**

    - `flow`: the guided flow (the rollout's guidance).
    - `sde`: the SDE the rollout sampled.
    - `policy`: the velocity model.
    - `batch`: the recorded transitions.
    - `transition_chunk`, `remat`: as `map_transitions`.

    **Returns:**

    `[N, K]` mean-coordinate log densities.
    """

    def score(inputs: dict[str, Array], cond: PyTree[Any]) -> Float[Array, " B"]:
        mean, std = flow.transition(sde, policy, inputs["x"], inputs["t"], inputs["t_next"], cond)
        return jax.vmap(sde.log_prob)(inputs["x_next"], mean, std)

    inputs = {
        "x": batch.latents,
        "x_next": batch.next_latents,
        "t": batch.timesteps,
        "t_next": batch.next_timesteps,
    }
    result: PerTransition = map_transitions(score, inputs, batch.cond, transition_chunk, remat)
    return result
