"""Sampling a policy for evaluation and previews: the trainer's and the app's side, not an
objective's (an objective says what to train; any policy of any flow can be sampled)."""

from typing import Any, final

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jaxtyping import Array, Float, PRNGKeyArray, PyTree

from ._custom_types import Model, Transitions
from ._guided_flow import GuidedFlow
from ._misc import check_int, leading_rows
from ._preview import preview_grid
from ._solver import AbstractSolver
from .rewards import FlowReward, score


@final
class Evaluation(eqx.Module):
    """Samples drawn by `evaluate_policy`.

    **Arguments:**

    - `samples`: `[N, *sample]`, decoded to [-1, 1].
    - `latents`: `[N, *latent]`, the final latents before decoding.
    - `scores`: `[N]` float64 scores from the reward, when one was given.
    """

    samples: Float[Array, " N *sample"]
    latents: Float[Array, " N *latent"]
    scores: npt.NDArray[np.float64] | None = None


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
    `sampler` on the `steps`-point grid, from noise drawn with `key`: the live policy of a
    training run (`state.variables.policy`), its EMA or a reference alike, on any flow (an
    objective's `flow`, or another guidance or autoencoder).

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

    - `ValueError`: if `scored` scores or `captions` do not have one entry per row (before
        anything is sampled), or as `evaluate_policy`.
    """
    rows, _ = _rows_and_latent_shape(flow, batch)
    num = leading_rows(rows)
    if captions is not None and len(captions) != num:
        raise ValueError(f"`captions` must have one entry per row ({num}), got {len(captions)}.")
    values = None
    if scored is not None and not callable(scored):
        values = np.asarray(scored, dtype=np.float64)
        if values.shape != (num,):
            raise ValueError(f"`scored` must have shape [N] = ({num},), got {values.shape}.")
    reward = scored if callable(scored) else None
    evaluation = evaluate_policy(flow, sampler, steps, policy, batch, key, reward=reward)
    if values is not None:
        evaluation = eqx.tree_at(
            lambda e: e.scores, evaluation, values, is_leaf=lambda x: x is None
        )
    ready: Evaluation = jax.block_until_ready(evaluation)  # type: ignore[no-untyped-call]
    if path is not None and jax.process_index() == 0:
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
