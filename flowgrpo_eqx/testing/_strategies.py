"""Hypothesis strategies for flow objectives: time grids, transition batches, rewards.

Every jit-compiled evaluation compiles once per (objective configuration, batch shape), and a
compilation of a loss and its gradient costs about a second on a small CPU: so batch shapes
come from a small fixed set and Hypothesis varies the data (seeds, masks, grid indices,
advantages, ratios) within them.
"""

import os
import random
from collections.abc import Callable, Sequence
from typing import Any, final

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from hypothesis import HealthCheck, settings, strategies as st
from jaxtyping import Array, PyTree

from .._custom_types import FinalSamples, Model, RolloutInfo, Transitions
from .._misc import leading_rows
from .._process import AbstractProcess, RectifiedFlow
from .._rollout import FlowRollout
from ..objectives import (
    AbstractRLObjective,
    AbstractTransitionObjective,
    AbstractVariables,
    Rescore,
)
from ..train import Trainer


_Draw = Callable[[st.SearchStrategy[Any]], Any]
"""Hypothesis' `draw` (its own `DrawFn` protocol cannot be checked at run time)."""

SHAPES: tuple[tuple[int, int], ...] = ((2, 5), (3, 2), (1, 1))
"""The default `(N, K)` batch shapes: few, so that compilations are few."""

MASK_PROBABILITIES: tuple[float, ...] = (0.0, 0.4, 0.8, 1.0)
"""The default probabilities of a transition being masked in (all out, some, all in)."""


def property_settings(max_examples: int) -> Any:
    """Hypothesis settings sized for a small CPU: no deadline (the first example of a shape
    compiles), no too-slow health checks.

    The environment variable `PROPERTY_TESTS_SCALE=k` runs `k` times more examples.

    **Arguments:**

    - `max_examples`: the number of examples at scale 1.

    **Returns:**

    A `hypothesis.settings`, usable as a decorator (annotated `Any`: the runtime type
    checker cannot check against `hypothesis.settings`).
    """
    scale = float(os.environ.get("PROPERTY_TESTS_SCALE", "1"))
    return settings(
        max_examples=max(1, round(max_examples * scale)),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        print_blob=True,
    )


def seeds() -> st.SearchStrategy[int]:
    """Seeds for `numpy.random.default_rng`."""
    return st.integers(0, 2**32 - 1)


def time_grids(
    steps: st.SearchStrategy[int] | None = None,
    shifts: st.SearchStrategy[float] | None = None,
    process: Callable[[float], AbstractProcess] = RectifiedFlow,
) -> st.SearchStrategy[npt.NDArray[np.float32]]:
    """Time grids as the library makes them: `process(shift).timesteps(steps)`.

    **Arguments:**

    - `steps`: the number of grid points (default 2..60).
    - `shifts`: the time shift (default 0.05..10).
    - `process`: makes the process from a shift (default `RectifiedFlow`).

    **Returns:**

    A strategy of float32 NumPy grids, from 1 down to 0.
    """
    steps = st.integers(2, 60) if steps is None else steps
    shifts = st.floats(0.05, 10.0) if shifts is None else shifts
    return st.builds(
        lambda shift, count: np.asarray(process(shift).timesteps(count)), shifts, steps
    )


def transition_masks(
    rows: int, transitions: int, probabilities: Sequence[float] = MASK_PROBABILITIES
) -> st.SearchStrategy[npt.NDArray[np.bool_]]:
    """`[N, K]` boolean masks, each entry in with one probability drawn from `probabilities`."""

    @st.composite
    def draw_mask(draw: _Draw) -> npt.NDArray[np.bool_]:
        probability = draw(st.sampled_from(tuple(probabilities)))
        rng = np.random.default_rng(draw(seeds()))
        mask: npt.NDArray[np.bool_] = rng.random((rows, transitions)) < probability
        return mask

    return draw_mask()


def advantages(
    rows: int, transitions: int, per_transition: st.SearchStrategy[bool] | None = None
) -> st.SearchStrategy[npt.NDArray[np.float32]]:
    """Advantages of both shapes: `[N]` (one per row) or `[N, K]` (one per transition),
    standard normal with some beyond the usual clip of 5.

    **Arguments:**

    - `rows`, `transitions`: `N` and `K`.
    - `per_transition`: whether the shape is `[N, K]` (default: both are drawn).
    """
    per_transition = st.booleans() if per_transition is None else per_transition

    @st.composite
    def draw_advantages(draw: _Draw) -> npt.NDArray[np.float32]:
        shape = (rows, transitions) if draw(per_transition) else (rows,)
        rng = np.random.default_rng(draw(seeds()))
        scale = draw(st.sampled_from((1.0, 4.0)))
        values: npt.NDArray[np.float32] = (scale * rng.standard_normal(shape)).astype(np.float32)
        return values

    return draw_advantages()


def reward_groups(
    prompts: st.SearchStrategy[int] | None = None,
    group_sizes: st.SearchStrategy[int] | None = None,
    values: st.SearchStrategy[float] | None = None,
) -> st.SearchStrategy[tuple[npt.NDArray[np.float64], int]]:
    """Rollout rewards `[P * G]` in float64 with their group size `G`: groups of free values,
    groups with ties (values drawn from a pool of three), and constant groups.

    **Arguments:**

    - `prompts`: `P`, the number of groups (default 1..5).
    - `group_sizes`: `G` (default 2..6; `group_advantages` refuses a group of one).
    - `values`: one reward (default finite floats in [-100, 100]).

    **Returns:**

    A strategy of `(rewards, groups)`.
    """
    prompts = st.integers(1, 5) if prompts is None else prompts
    group_sizes = st.integers(2, 6) if group_sizes is None else group_sizes
    values = (
        st.floats(-100.0, 100.0, allow_nan=False, allow_infinity=False)
        if values is None
        else values
    )

    @st.composite
    def draw_groups(draw: _Draw) -> tuple[npt.NDArray[np.float64], int]:
        count = draw(prompts)
        size = draw(group_sizes)
        pool = [draw(values) for _ in range(3)]
        rewards: list[float] = []
        for _ in range(count):
            kind = draw(st.sampled_from(("free", "ties", "constant")))
            if kind == "free":
                rewards += [draw(values) for _ in range(size)]
            elif kind == "ties":
                rewards += [pool[draw(st.integers(0, 2))] for _ in range(size)]
            else:
                rewards += [draw(values)] * size
        return np.asarray(rewards, np.float64), size

    return draw_groups()


@eqx.filter_jit
def _transition(
    objective: AbstractTransitionObjective[Any, Any],
    policy: Model,
    x: Array,
    t: Array,
    t_next: Array,
    cond: PyTree[Any],
    noise: Array,
) -> tuple[Array, Array]:
    mean, std = objective.flow.transition(objective.sde, policy, x, t, t_next, cond)
    x_next = jax.vmap(objective.sde.sample)(mean, std, noise)
    return x_next, jax.vmap(objective.sde.log_prob)(x_next, mean, std)


def default_rows(
    objective: AbstractTransitionObjective[Any, Any], rng: np.random.Generator, rows: int
) -> PyTree[Any]:
    """Conditioning rows shaped like the objective's null condition: standard normal floats,
    zeros for integer fields.

    **Raises:**

    - `ValueError`: if the objective's `InputSpec` has no null condition to copy.
    """
    null = objective.flow.inputs.null
    if null is None:
        raise ValueError("Pass `rows=`: the objective's InputSpec has no `null` to copy.")

    def like(leaf: Any) -> npt.NDArray[Any]:
        shape = (rows, *np.shape(leaf))
        dtype = np.asarray(leaf).dtype
        if np.issubdtype(dtype, np.floating):
            return rng.standard_normal(shape).astype(dtype)
        return np.zeros(shape, dtype)

    return jax.tree.map(like, null)


def rollout_like_transitions(
    objective: AbstractTransitionObjective[Any, Any],
    variables: AbstractVariables,
    seed: int,
    rows: int,
    transitions: int,
    *,
    steps: int = 5,
    mask_probability: float = 0.7,
    per_transition_advantages: bool = False,
    off_policy: float = 0.1,
    make_rows: Callable[[np.random.Generator, int], PyTree[Any]] | None = None,
) -> Transitions:
    """A batch of `N x K` transitions sampled with the objective's own SDE and policy.

    Each entry starts from a standard normal latent at a random interval of the
    `steps`-point grid (so deterministic intervals — outside an SDE window, or the last
    step of a CPS grid — occur), and its next latent is drawn from the policy's transition.
    `old_log_probs` are the drawn latent's own log density plus `N(0, off_policy^2)` noise.

    **Arguments:**

    - `objective`, `variables`: the objective and the policy to sample with.
    - `seed`: seeds everything drawn.
    - `rows`, `transitions`: `N` and `K`.
    - `steps`: the grid's number of points.
    - `mask_probability`: the probability of each entry being masked in.
    - `per_transition_advantages`: `[N, K]` advantages instead of `[N]`.
    - `off_policy`: the scale of the noise on the recorded log densities (0: on-policy).
    - `make_rows`: `(rng, N) -> cond`; default `default_rows`.

    **Returns:**

    The `Transitions`.
    """
    rng = np.random.default_rng(seed)
    n, k = rows, transitions
    latent_shape = objective.flow.inputs.latent_shape
    if latent_shape is None:
        raise ValueError("The objective's InputSpec needs a `latent_shape`.")
    grid = np.asarray(objective.flow.process.timesteps(steps))
    indices = rng.integers(0, steps - 1, size=(n, k))
    t, t_next = grid[indices], grid[indices + 1]
    cond = default_rows(objective, rng, n) if make_rows is None else make_rows(rng, n)
    x = rng.standard_normal((n, k, *latent_shape)).astype(np.float32)
    noise = rng.standard_normal((n * k, *latent_shape)).astype(np.float32)
    flat_cond = jax.tree.map(lambda leaf: jnp.asarray(np.repeat(leaf, k, axis=0)), cond)
    x_next, own = _transition(
        objective,
        variables.policy,
        jnp.asarray(x.reshape(n * k, *latent_shape)),
        jnp.asarray(t.reshape(-1)),
        jnp.asarray(t_next.reshape(-1)),
        flat_cond,
        jnp.asarray(noise),
    )
    recorded = np.asarray(own).reshape(n, k) + off_policy * rng.standard_normal((n, k))
    advantage_shape = (n, k) if per_transition_advantages else (n,)
    return Transitions(
        latents=jnp.asarray(x),
        next_latents=jnp.asarray(x_next).reshape(n, k, *latent_shape),
        timesteps=jnp.asarray(t, jnp.float32),
        next_timesteps=jnp.asarray(t_next, jnp.float32),
        old_log_probs=jnp.asarray(recorded, jnp.float32),
        transition_mask=jnp.asarray(rng.random((n, k)) < mask_probability),
        advantages=jnp.asarray(rng.standard_normal(advantage_shape), jnp.float32),
        cond=jax.tree.map(jnp.asarray, cond),
    )


def transitions(
    objective: AbstractTransitionObjective[Any, Any],
    variables: AbstractVariables,
    *,
    shapes: Sequence[tuple[int, int]] = SHAPES,
    steps: int = 5,
    mask_probabilities: Sequence[float] = MASK_PROBABILITIES,
    per_transition_advantages: st.SearchStrategy[bool] | None = None,
    off_policy: float = 0.1,
    make_rows: Callable[[np.random.Generator, int], PyTree[Any]] | None = None,
) -> st.SearchStrategy[Transitions]:
    """`Transitions` batches sampled from the objective's own transitions
    (`rollout_like_transitions`), with masks, deterministic intervals and advantages of
    both shapes.

    **Arguments:**

    - `objective`, `variables`: the objective and the policy to sample with.
    - `shapes`: the `(N, K)` shapes to draw from.
    - `steps`: the grid's number of points.
    - `mask_probabilities`: the probabilities of an entry being masked in to draw from.
    - `per_transition_advantages`: whether advantages are `[N, K]` (default: both).
    - `off_policy`: the noise scale on recorded log densities (0: on-policy).
    - `make_rows`: `(rng, N) -> cond`; default `default_rows`.

    **Returns:**

    A strategy of `Transitions`.
    """
    per_transition = (
        st.booleans() if per_transition_advantages is None else per_transition_advantages
    )

    @st.composite
    def draw_batch(draw: _Draw) -> Transitions:
        rows, count = draw(st.sampled_from(tuple(shapes)))
        return rollout_like_transitions(
            objective,
            variables,
            draw(seeds()),
            rows,
            count,
            steps=steps,
            mask_probability=draw(st.sampled_from(tuple(mask_probabilities))),
            per_transition_advantages=draw(per_transition),
            off_policy=off_policy,
            make_rows=make_rows,
        )

    return draw_batch()


@final
class CollectedBatch(eqx.Module):
    """One rollout of an objective and the batch its loss trains on, as the epoch loop
    builds it (`objective.training_batch`, rescored by a `Trainer` when it asks to be).

    **Arguments:**

    - `batch`: the training batch (`Transitions`, `FinalSamples`, or the objective's own).
    - `collected`: what `FlowRollout.collect` returned.
    - `info`: the `RolloutInfo` (rewards, in groups of `groups` consecutive rows).
    - `groups`: the rollout's group size.
    """

    batch: Any
    collected: Transitions | FinalSamples
    info: RolloutInfo
    groups: int = eqx.field(static=True)


def collected_batch(
    objective: AbstractRLObjective[Any, Any],
    variables: AbstractVariables,
    rollout: FlowRollout,
    rows: PyTree[Any],
    seed: int,
    *,
    trainer: Trainer | None = None,
) -> CollectedBatch:
    """Collect with `objective.sampling_policy(variables)` and build the training batch,
    the way the epoch loop does: works for any `AbstractRLObjective`.

    **Arguments:**

    - `objective`, `variables`: the objective and its variables.
    - `rollout`: a `FlowRollout` over the objective.
    - `rows`: the source rows, `[P, ...]` host leaves.
    - `seed`: seeds the collect.
    - `trainer`: rescores a batch that asks for it (`Rescore`); `Trainer(objective)` when
        `None`.

    **Returns:**

    The `CollectedBatch`.
    """
    key = jax.random.key(seed)
    collected, info = rollout.collect(objective.sampling_policy(variables), rows, key)
    requested = objective.training_batch(collected, info)
    if isinstance(requested, Rescore):
        trainer = Trainer(objective) if trainer is None else trainer
        state = trainer.init(key, variables)
        every_row = jnp.arange(leading_rows(requested.batch))
        requested = trainer.rescore(state, requested, [every_row])
    return CollectedBatch(requested, collected, info, rollout.groups)


def training_batches(
    objective: AbstractRLObjective[Any, Any],
    variables: AbstractVariables,
    rollout: FlowRollout,
    rows: PyTree[Any],
    *,
    trainer: Trainer | None = None,
) -> st.SearchStrategy[CollectedBatch]:
    """Training batches of any objective, from its own rollout (`collected_batch`) under
    drawn seeds: the strategy that the invariants of every objective
    (`check_objective_invariants`) take their batches from.

    **Arguments:**

    - `objective`, `variables`, `rollout`, `rows`, `trainer`: as `collected_batch`.

    **Returns:**

    A strategy of `CollectedBatch`.
    """

    def build(seed: int) -> CollectedBatch:
        # Hypothesis refuses a strategy that moves the global `random` state, which the
        # collect (a user's reward, the library's imports) may do.
        state = random.getstate()
        try:
            return collected_batch(objective, variables, rollout, rows, seed, trainer=trainer)
        finally:
            random.setstate(state)

    return st.builds(build, seeds())
