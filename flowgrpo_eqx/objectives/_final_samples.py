"""What the objectives trained on final samples share (`DiffusionNFTObjective`,
`AWMObjective`, `DGPOObjective`): the batch of a rollout's final samples, its counted rows
noised at their training times, the per-example flow-matching errors, and the means over
times and over counted rows."""

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PyTree

from .._custom_types import FinalSamples, Mean, PerExample, RolloutInfo, Transitions
from .._misc import zero_rows_unless
from .._process import AbstractProcess


def final_samples(
    collected: Transitions | FinalSamples, info: RolloutInfo, algorithm: str
) -> FinalSamples:
    """The final samples of a rollout: `collected` itself, or the rows, advantages and grid
    of recorded `Transitions` with the final latents of `info` (every row counts).

    **Arguments:**

    - `collected`: what `FlowRollout.collect` returned.
    - `info`: its `RolloutInfo` (the `final` latents).
    - `algorithm`: the objective's name, for the message.

    **Returns:**

    The `FinalSamples`.

    **Raises:**

    - `ValueError`: if `collected` holds per-transition (`[N, K]`) advantages.
    """
    if isinstance(collected, FinalSamples):
        return collected
    if collected.advantages.ndim != 1:
        raise ValueError(
            f"{algorithm} needs one advantage per row, got Transitions.advantages of "
            f"shape {tuple(collected.advantages.shape)}."
        )
    return FinalSamples(
        latents=info.final,
        advantages=collected.advantages,
        cond=collected.cond,
        timesteps=collected.timesteps,
    )


def kept_grid(samples: FinalSamples, algorithm: str, field: str) -> Float[Array, " N K"]:
    """The sampler's grid of each row, time 1 in the rows that do not count (so that NaN or
    inf there reach no arithmetic).

    **Arguments:**

    - `samples`: the batch's `FinalSamples`.
    - `algorithm`: the objective's name, for the message.
    - `field`: where the objective's batch holds the grid, for the message
        (`"batch.timesteps"`).

    **Returns:**

    `[N, K]` start times, in the grid's dtype.

    **Raises:**

    - `ValueError`: naming `field`, if the samples carry no grid.
    """
    if samples.timesteps is None:
        raise ValueError(
            f"{algorithm} trains at the sampler's grid, but `{field}` is None: collect with a "
            "FlowRollout (every sampler records it)."
        )
    keep = samples.mask
    return jnp.where(keep[:, None], samples.timesteps, jnp.ones((), samples.timesteps.dtype))


def repeated_rows(samples: FinalSamples, count: int) -> tuple[Array, PyTree[Any]]:
    """The latents and conditioning of the counted rows (zeros in the others), each row
    repeated `count` times in place: one example per (row, time), time-fastest.

    **Arguments:**

    - `samples`: the batch's `FinalSamples`.
    - `count`: the training times per row.

    **Returns:**

    `([N count, *latent] clean latents x_0, the conditioning with N count rows)`.
    """
    keep = samples.mask
    x_0 = jnp.repeat(zero_rows_unless(keep, samples.latents), count, axis=0)
    cond = jax.tree.map(
        lambda leaf: jnp.repeat(zero_rows_unless(keep, leaf), count, 0), samples.cond
    )
    return x_0, cond


def noised(
    process: AbstractProcess, x_0: Array, noise: Array, t: PerExample
) -> tuple[Array, Array]:
    """Each example noised at its time, and its flow-matching target.

    **Arguments:**

    - `process`: the flow's process.
    - `x_0`: `[F, *latent]` clean latents.
    - `noise`: `[F, *latent]` their noise, in `x_0`'s dtype.
    - `t`: `[F]` their times.

    **Returns:**

    `(x_t, target)`: `[F, *latent]` noised latents in `x_0`'s dtype and velocity targets in
    float32.
    """
    x_t = jax.vmap(process.interpolate)(x_0, noise, t.astype(x_0.dtype))
    target = jax.vmap(process.velocity_target)(x_0, noise).astype(jnp.float32)
    return x_t, target


def example_mean(value: Array) -> PerExample:
    """The mean of each example (leading axis) over its other axes.

    **Arguments:**

    - `value`: `[F, ...]`.

    **Returns:**

    `[F]` means.
    """
    return jnp.mean(value.reshape(value.shape[0], -1), axis=1)


def example_mse(a: Array, b: Array) -> PerExample:
    """The mean squared difference of each example.

    **Arguments:**

    - `a`, `b`: `[F, ...]`, alike in shape.

    **Returns:**

    `[F]` means of `(a - b)^2`.
    """
    return example_mean((a - b) ** 2)


def row_mean(value: PerExample, count: int) -> Float[Array, " N"]:
    """Each row's mean of its `count` consecutive examples.

    **Arguments:**

    - `value`: `[N count]` per-example values, rows time-fastest.
    - `count`: the examples per row.

    **Returns:**

    `[N]` means.
    """
    return jnp.mean(value.reshape(-1, count), axis=1)


def mean_over(keep: Bool[Array, " N"], value: Float[Array, " N"]) -> Mean:
    """The `Mean` of per-row values over the counted rows.

    **Arguments:**

    - `keep`: `[N]` the rows that count.
    - `value`: `[N]` one value per row (anything in the others).

    **Returns:**

    `Mean(sum over counted rows, number of counted rows)`.
    """
    total = jnp.sum(jnp.where(keep, value, jnp.zeros_like(value)))
    return Mean(total, jnp.sum(keep, dtype=jnp.float32))
