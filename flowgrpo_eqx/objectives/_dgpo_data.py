"""DGPO's data: its variables, the grouped final samples it trains on, the noised points of
one loss, and how an epoch's end moves the variables."""

from typing import Any, final

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray, PyTree

from .._custom_types import FinalSamples, Model, PerExample
from .._guided_flow import GuidedFlow
from ._base import AbstractEMAVariables, AbstractReferenceVariables
from ._final_samples import noised, repeated_rows
from ._trainable import blend_part


_QUANTUM_TOLERANCE = 1e-3
"""Added to `quantize * t` before the floor, in units of one training timestep: it absorbs
the float32 rounding of a grid time (below 1e-4 timesteps), so that a time the release
computes as an integer number of timesteps in float64 keeps that integer here."""


@final
class DGPOVariables(AbstractEMAVariables, AbstractReferenceVariables):
    """DGPO's variables: the live policy, its EMA reference, the frozen base, and where the
    epoch trains.

    **Arguments:**

    - `policy`: the live velocity model, trained by the optimizer.
    - `ema`: when `clip_range`, `dpo_reference="ema"` or `switch_ema_ref` needs it, the EMA
        reference's trainable part (`trainable_part`: the adapters of a LoRA policy, every
        float array of a fully trained one; the release's `ema_ref`); the EMA policy is the
        live one carrying it (`with_part`). It starts as the initial policy's and moves
        once per epoch (`DGPOObjective.end_epoch`). `None` otherwise.
    - `reference`: when `dpo_reference="base"` or `kl_beta > 0`, the frozen `reference_part`
        of the initial policy; the base model is `reference_policy` (the adapters switched
        off). `None` otherwise.
    - `indices`: `[T]` int32, the grid indices every update of this epoch trains at
        (`DGPOObjective.epoch_indices`).
    - `step`: int32, the optimizer updates done when the last epoch ended (0 before the
        first): the release's `global_step` when it samples.
    """

    policy: Model
    ema: PyTree[Any] | None
    reference: PyTree[Any] | None
    indices: Int[Array, " T"]
    step: Int[Array, ""]


@final
class GroupedSamples(eqx.Module):
    """Final samples with the group of each row: what `DGPOObjective` trains on.

    The minibatches of an epoch cut rows in any order; the group ids say which rows share a
    prompt's group wherever they land (the release groups a micro-batch's rows by their
    prompt ids).

    **Arguments:**

    - `samples`: the `FinalSamples` (latents, advantages, rows, mask, grid).
    - `group`: `[N]` integer ids, equal for the rows of one group.

    **Raises:**

    - `ValueError`: naming `group` if it is not one integer per row.
    """

    samples: FinalSamples
    group: Int[Array, " N"]

    def __check_init__(self) -> None:
        rows = self.samples.num_rows
        if tuple(jnp.shape(self.group)) != (rows,) or not jnp.issubdtype(
            jnp.result_type(self.group), jnp.integer
        ):
            raise ValueError(
                f"GroupedSamples.group must be [N] = ({rows},) integers, got shape "
                f"{tuple(jnp.shape(self.group))} and dtype {jnp.result_type(self.group)}."
            )

    @property
    def num_rows(self) -> int:
        """`N`, the number of rows."""
        return self.samples.num_rows

    @property
    def advantages(self) -> Any:
        """`[N]` the rows' advantages (`samples.advantages`), which the trainer checks finite
        (annotated `Any`: `eqx.tree_at` reads it on a tree of placeholders)."""
        return self.samples.advantages


class TrainingPoints(eqx.Module):
    """The flattened `[N T, ...]` inputs of one DGPO loss: noised latents, velocity targets,
    times and conditioning, for `count` times per row."""

    x_t: Array
    target: Array
    t: PerExample
    cond: PyTree[Any]
    count: int = eqx.field(static=True)


def draw_indices(
    seed: int, step: int | Int[Array, ""], choices: int, count: int
) -> Int[Array, " T"]:
    """`count` distinct indices of `0..choices - 1`, drawn from `seed` and `step`.

    **Arguments:**

    - `seed`: the objective's seed.
    - `step`: the optimizer updates done when the epoch starts.
    - `choices`: how many indices to draw from.
    - `count`: how many to draw.

    **Returns:**

    `[count]` int32 indices: `jax.random.permutation(fold_in(key(seed), step), choices)`'s
    first `count`.
    """
    key = jax.random.fold_in(jax.random.key(seed), step)
    return jax.random.permutation(key, choices)[:count].astype(jnp.int32)


@eqx.filter_jit
def advance_variables(
    variables: DGPOVariables,
    decay: Float[Array, ""] | None,
    step: Int[Array, ""],
    seed: int,
    choices: int,
    count: int,
) -> DGPOVariables:
    """`variables` at the end of an epoch (jitted): the EMA part blended towards the live
    policy, `step` recorded and the next epoch's indices drawn.

    **Arguments:**

    - `variables`: after the epoch's updates.
    - `decay`: the EMA decay `d` (`ema = d ema + (1 - d) live`), or `None` to leave it.
    - `step`: the optimizer updates done so far.
    - `seed`, `choices`, `count`: as `draw_indices`.

    **Returns:**

    The next epoch's `DGPOVariables`.
    """
    ema = variables.ema
    if decay is not None:
        ema = blend_part(ema, variables.policy, decay)
    recorded = jnp.zeros_like(variables.step) + step
    indices = jnp.zeros_like(variables.indices) + draw_indices(seed, recorded, choices, count)
    return DGPOVariables(variables.policy, ema, variables.reference, indices, recorded)


def quantised_times(
    timesteps: Float[Array, " N K"],
    indices: Int[Array, " T"],
    trunc_steps: int,
    quantize: int | None,
) -> Float[Array, " N T"]:
    """Each row's grid at `indices`, quantised: `floor(quantize t + 1e-3) / quantize`.

    **Arguments:**

    - `timesteps`: `[N, K]` the grid of each row.
    - `indices`: `[T]` the epoch's indices.
    - `trunc_steps`: the last grid index trained.
    - `quantize`: the training timesteps per unit time, or `None` for the grid's own times.

    **Returns:**

    `[N, T]` float32 times.

    **Raises:**

    - `ValueError`: naming `trunc_steps` if the grid has no index `trunc_steps`.
    - `EquinoxRuntimeError`: if an index lies outside the grid.
    """
    size = timesteps.shape[1]
    if trunc_steps >= size:
        raise ValueError(
            f"`trunc_steps`={trunc_steps} needs a grid of more than {trunc_steps} "
            f"start times, got {size}: sample with more steps or lower `trunc_steps`."
        )
    indices = eqx.error_if(
        indices,
        jnp.any((indices < 0) | (indices >= size)),
        "DGPOVariables.indices holds an index outside the grid of the batch.",
    )
    t = jnp.take(timesteps, indices, axis=1).astype(jnp.float32)
    if quantize is None:
        return t
    q = float(quantize)
    return jnp.floor(t * q + _QUANTUM_TOLERANCE) / q


def group_noise(
    group: Int[Array, " N"],
    count: int,
    shape: tuple[int, ...],
    key: PRNGKeyArray,
    shared: bool,
) -> Float[Array, " F *latent"]:
    """The noise of each (row, time), rows repeated time-fastest (`F = N T`).

    With `shared`, row `i`'s noise at its `j`-th time is
    `jax.random.normal(jax.random.fold_in(key, group[i]), [T, *latent])[j]`: one draw per
    (group, time), as the release's `generate_shared_noise_for_groups`; otherwise
    `jax.random.normal(key, [N T, *latent])`.

    **Arguments:**

    - `group`: `[N]` the rows' groups.
    - `count`: `T`, the times per row.
    - `shape`: the shape of one latent.
    - `key`: the update's key.
    - `shared`: whether a group's rows share their noise at each time (one draw per
        (group, time) from `fold_in(key, group)`), else one `[N T, *latent]` draw.

    **Returns:**

    `[N T, *latent]` float32 noise.
    """
    rows = group.shape[0]
    if not shared:
        return jax.random.normal(key, (rows * count, *shape), jnp.float32)

    def draw(member: Int[Array, ""]) -> Float[Array, " T *latent"]:
        return jax.random.normal(jax.random.fold_in(key, member), (count, *shape), jnp.float32)

    per_row: Float[Array, " N T *latent"] = jax.vmap(draw)(group)
    return per_row.reshape(rows * count, *shape)


def noised_points(
    flow: GuidedFlow,
    samples: FinalSamples,
    t: Float[Array, " N T"],
    group: Int[Array, " N"],
    key: PRNGKeyArray,
    shared_noise: bool,
) -> TrainingPoints:
    """Each row noised at its trained times with its group's noise (`group_noise`).

    **Arguments:**

    - `flow`: the objective's `GuidedFlow` (its process noises, its inputs condition).
    - `samples`: the batch's `FinalSamples`.
    - `t`: `[N, T]` each row's trained times.
    - `group`: `[N]` each row's group id.
    - `key`: draws the noise.
    - `shared_noise`: as `group_noise`'s `shared`.

    **Returns:**

    The `[N T, ...]` noised latents, velocity targets, times and conditioning.
    """
    rows, count = t.shape
    t_flat = t.reshape(rows * count)
    x_0, cond = repeated_rows(samples, count)
    noise = group_noise(group, count, x_0.shape[1:], key, shared_noise).astype(x_0.dtype)
    x_t, target = noised(flow.process, x_0, noise, t_flat)
    return TrainingPoints(
        x_t=x_t,
        target=target,
        t=t_flat,
        cond=flow.inputs.condition(cond),
        count=count,
    )


def grouped_runs(samples: FinalSamples, group_size: int) -> GroupedSamples:
    """The samples with their groups: runs of `group_size` consecutive rows (as a
    `FlowRollout` lays them out), the ids placed as the advantages are.

    **Arguments:**

    - `samples`: the rollout's `FinalSamples`.
    - `group_size`: the rows of one group.

    **Returns:**

    The `GroupedSamples`.

    **Raises:**

    - `ValueError`: naming `group_size` if it does not divide the rows.
    """
    rows = samples.num_rows
    if rows % group_size:
        raise ValueError(
            f"`group_size`={group_size} must divide the rollout's {rows} rows: it is "
            "the rollout's `groups`, whose runs of consecutive rows are DGPO's groups."
        )
    host = np.arange(rows, dtype=np.int32) // group_size
    sharding = samples.advantages.sharding
    group = jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
    return GroupedSamples(samples, group)
