"""What every flow objective shares: variables, the guided velocity, ODE sampling, previews."""

import abc
from typing import Any, final

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jaxtyping import Array, Float, PRNGKeyArray, PyTree

from ._custom_types import Mean, Model, Step, Transitions
from ._inputs import CFG, AbstractAutoEncoder, InputSpec
from ._preview import preview_grid
from ._process import AbstractProcess
from ._reward import FlowReward, score
from ._sde import compute_dtype
from ._solver import AbstractSolver


@final
class Variables(eqx.Module):
    """The objective's variables: the live policy and the held slot.

    **Arguments:**

    - `policy`: the live velocity model, trained by the optimizer.
    - `held`: with `beta > 0`, the frozen reference (a copy of the initial denoiser) that the
        KL term compares with; with `beta == 0`, free for the trainer's EMA of the policy.
    """

    policy: Model
    held: Model


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


def broadcast_rows(tree: PyTree[Any], repeats: int) -> PyTree[Any]:
    """Tile every leaf's leading axis `repeats` times: `[N, ...] -> [repeats * N, ...]`."""
    return jax.tree.map(lambda leaf: jnp.concatenate([leaf] * repeats, axis=0), tree)


def _leading_size(tree: PyTree[Any]) -> int:
    leaves = jax.tree.leaves(tree)
    if not leaves:
        raise ValueError("The rows (conditioning) have no array leaves; cannot count rows.")
    return int(jnp.shape(leaves[0])[0])


class AbstractFlowObjective(eqx.Module):
    """An objective over a rectified-flow velocity model, in the seed's trainer interface.

    Concrete objectives supply `loss` and `held_variables`; the variables, the guided
    velocity, live-policy ODE sampling (`evaluate`) and previews are shared.
    """

    model: eqx.AbstractVar[Model]
    process: eqx.AbstractVar[AbstractProcess]
    inputs: eqx.AbstractVar[InputSpec]
    guidance: eqx.AbstractVar[CFG | None]
    sampler: eqx.AbstractVar[AbstractSolver]
    steps: eqx.AbstractVar[int]
    autoencoder: eqx.AbstractVar[AbstractAutoEncoder]
    pretrained: eqx.AbstractVar[Model | None]

    @abc.abstractmethod
    def held_variables(self) -> Variables:
        """Which variable slots the trainer must leave untouched, as a `Variables` of bools."""

    @abc.abstractmethod
    def loss(self, variables: Variables, batch: Any, step: Step) -> tuple[Mean, Any]:
        """The objective as an exactly reducible `Mean`, with auxiliary `Mean` statistics."""

    def init(self, key: PRNGKeyArray, variables: Variables | None = None) -> Variables:
        """The initial variables: the live policy and the held slot.

        The policy is `variables.policy` when given (e.g. restored from a checkpoint), else
        `pretrained`, else `model`. The held slot starts as a copy of that initial policy: the
        frozen reference when `beta > 0`, the EMA's starting point otherwise.

        **Arguments:**

        - `key`: a PRNG key. Equinox models are built with their parameters, so nothing is
            drawn from it today; it is part of the seed's interface for lazily built models.
        - `variables`: existing variables to start from, or `None`.

        **Returns:**

        The `Variables`.
        """
        del key
        if variables is not None:
            return variables
        policy = self.model if self.pretrained is None else self.pretrained
        return Variables(policy=policy, held=policy)

    def velocity(
        self,
        model: Model,
        x: Float[Array, " B *latent"],
        t: Float[Array, " B"],
        cond: PyTree[Any],
    ) -> Float[Array, " B *latent"]:
        """The guided velocity of `model` on a batch, both guidance branches in one call.

        **Arguments:**

        - `model`: the policy or the reference.
        - `x`: `[B, *latent]` states.
        - `t`: `[B]` times.
        - `cond`: the batch's rows (leading axis `B`), reduced by `inputs`.

        **Returns:**

        `[B, *latent]` velocities in float32 at least.
        """
        conditioning = self.inputs.condition(cond)
        dtype = compute_dtype(x.dtype)
        if self.guidance is None:
            direct: Float[Array, " B *latent"] = jax.vmap(model)(x, t, conditioning)
            return direct.astype(dtype)
        rows = x.shape[0]
        null = self.inputs.null_condition(rows)
        try:
            both = jax.tree.map(
                lambda c, u: jnp.concatenate([c, u.astype(c.dtype)], axis=0), conditioning, null
            )
        except ValueError as error:
            raise ValueError(
                "InputSpec.null must have the structure and per-example shapes of the "
                f"conditioning; got {jax.tree_util.tree_structure(null)} against "
                f"{jax.tree_util.tree_structure(conditioning)}."
            ) from error
        velocities = jax.vmap(model)(
            jnp.concatenate([x, x], axis=0), jnp.concatenate([t, t], axis=0), both
        ).astype(dtype)
        return self.guidance.combine(velocities[:rows], velocities[rows:])

    def sample_latents(
        self,
        model: Model,
        cond: PyTree[Any],
        noise: Float[Array, " N *latent"],
        *,
        sampler: AbstractSolver | None = None,
        steps: int | None = None,
    ) -> Float[Array, " N *latent"]:
        """Integrate the guided probability-flow ODE from `noise` at t = 1 to t = 0.

        **Arguments:**

        - `model`: the model to sample from.
        - `cond`: one row per sample (leading axis `N`).
        - `noise`: `[N, *latent]` starting points.
        - `sampler`, `steps`: override the objective's `sampler` and `steps`.

        **Returns:**

        `[N, *latent]` final latents.
        """
        solver = self.sampler if sampler is None else sampler
        grid = self.process.timesteps(self.steps if steps is None else steps)
        rows = noise.shape[0]

        def velocity(
            x: Float[Array, " N *latent"], t: Float[Array, ""]
        ) -> Float[Array, " N *latent"]:
            return self.velocity(model, x, jnp.full((rows,), t, x.dtype), cond)

        def body(x: Float[Array, " N *latent"], times: Array) -> tuple[Array, None]:
            return solver.step(velocity, x, times[0], times[1]), None

        start = noise.astype(compute_dtype(noise.dtype))
        intervals = jnp.stack([grid[:-1], grid[1:]], axis=1)
        final, _ = jax.lax.scan(body, start, intervals)
        return final

    def decode(self, latents: Float[Array, " N *latent"]) -> Float[Array, " N *sample"]:
        """Decode latents to samples in [-1, 1] with the autoencoder (clipped)."""
        return jnp.clip(jax.vmap(self.autoencoder.decode)(latents), -1.0, 1.0)

    def _rows_and_latent_shape(
        self, batch: Transitions | PyTree[Any]
    ) -> tuple[PyTree[Any], tuple[int, ...]]:
        if isinstance(batch, Transitions):
            return batch.cond, batch.latent_shape
        if self.inputs.latent_shape is None:
            raise ValueError(
                "Sampling from prompt-only rows needs InputSpec(latent_shape=...); the batch "
                "carries no latents to take the shape from."
            )
        return batch, self.inputs.latent_shape

    def evaluate(
        self,
        variables: Variables,
        batch: Transitions | PyTree[Any],
        step: Step,
        *,
        reward: FlowReward | None = None,
    ) -> Evaluation:
        """Generate one live-policy sample per source row, including prompt-only batches.

        Deterministic ODE sampling with `sampler` on the `steps`-point grid from noise drawn
        with `step.key`. Evaluation always uses the live policy, never the held slot.

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
        rows, latent_shape = self._rows_and_latent_shape(batch)
        num_rows = _leading_size(rows)
        noise = jax.random.normal(step.key, (num_rows, *latent_shape), jnp.float32)
        latents = _sample_jit(self, variables.policy, rows, noise)
        samples = self.decode(latents)
        scores = None
        if reward is not None:
            host_rows = jax.tree.map(np.asarray, rows)
            scores = score(reward, np.asarray(samples), host_rows)
        return Evaluation(samples=samples, latents=latents, scores=scores)

    def preview(
        self,
        variables: Variables,
        batch: Transitions | PyTree[Any],
        step: Step,
        *,
        scored: FlowReward | npt.ArrayLike | None = None,
        path: str | None = None,
        captions: list[str] | None = None,
        title: str | None = None,
    ) -> Evaluation:
        """Draw on all ranks; materialise before root-only caption decoding.

        Every process draws its samples (generation is collective); the arrays are made
        ready here, and only process 0 decodes captions and writes the picture grid.

        **Arguments:**

        - `variables`, `batch`, `step`: as for `evaluate`.
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
        evaluation = self.evaluate(variables, batch, step, reward=reward)
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
            rows, _ = self._rows_and_latent_shape(batch)
            host_rows = jax.tree.map(np.asarray, rows)
            if captions is None:
                if self.inputs.caption is not None:
                    captions = list(self.inputs.caption(host_rows))
                else:
                    captions = [f"row {i}" for i in range(num)]
            preview_grid(np.asarray(ready.samples), path, captions, ready.scores, title=title)
        return ready


@eqx.filter_jit
def _sample_jit(
    objective: AbstractFlowObjective,
    policy: Model,
    rows: PyTree[Any],
    noise: Float[Array, " N *latent"],
) -> Float[Array, " N *latent"]:
    return objective.sample_latents(policy, rows, noise)
