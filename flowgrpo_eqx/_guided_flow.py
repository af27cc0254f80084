"""`GuidedFlow`: the model and what surrounds it, shared by every objective and the rollout.

The process, the conditioning inputs, classifier-free guidance and the autoencoder, with the
guided velocity on a batch, probability-flow ODE sampling and decoding.
"""

import contextlib
from typing import Any, Literal, TypeAlias, final, get_args

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PyTree

from ._custom_types import Latents, Model, Scalar, Times
from ._distributed import DATA_AXIS
from ._inputs import (
    CFG,
    AbstractAutoEncoder,
    AbstractGuidance,
    IdentityAutoEncoder,
    InputSpec,
)
from ._process import AbstractProcess
from ._sde import AbstractSDE, compute_dtype
from ._solver import AbstractSolver


Precision: TypeAlias = Literal["float32", "bfloat16"]
"""The dtype the model computes in. With `"bfloat16"` the model's floating-point weights, its
inputs and its activations are bfloat16 while the weights the optimizer keeps (the master
weights) stay as they are (float32); the velocity leaves the model as float32, so the SDE,
log densities, ratios, KL and advantages are float32 (or wider) either way."""

PRECISIONS: tuple[Precision, ...] = get_args(Precision)

MatmulPrecision: TypeAlias = Literal["highest", "high", "default"] | None
"""The precision of the model's float32 matrix products wherever the library calls the model
(rollout, rescoring, loss, reference, evaluation), as `jax.default_matmul_precision` sets it
for the call: `"highest"` (full float32: six bfloat16 passes on a TPU, no TensorFloat-32 on a
GPU), `"high"` (three bfloat16 passes on a TPU), `"default"` (the backend's fastest: one
bfloat16 pass on a TPU), or `None` (whatever JAX's own setting is around the call).
Products of bfloat16 operands are exact in one pass whatever the setting. The velocity feeds
the SDE's mean, so this is the precision of the log densities, ratios and KL built on it
(docs/accelerators.md: the precision policy)."""

MATMUL_PRECISIONS: tuple[MatmulPrecision, ...] = ("highest", "high", "default", None)

ModelTime: TypeAlias = Literal["exact", "thousandths"]
"""The time the model receives for a time `t` of the process: `"exact"`, `t` itself; or
`"thousandths"`, `floor(1000 t) / 1000` computed in `t`'s dtype, as MixGRPO's release feeds
FLUX.1 in its rollout and its update alike (github `Tencent-Hunyuan/MixGRPO`,
`fastvideo/utils/sampling_utils.py` lines 64-71 and `fastvideo/train_grpo_flux.py` lines 387
and 132: `timestep = int(sigma * 1000)`, then `timestep / 1000`). Only the model's input
changes: the process, the SDE and the solvers keep `t`."""

MODEL_TIMES: tuple[ModelTime, ...] = get_args(ModelTime)


def check_matmul_precision(value: Any) -> None:
    """Raise a `ValueError` naming `matmul_precision` unless `value` is a `MatmulPrecision`."""
    if value not in MATMUL_PRECISIONS:
        raise ValueError(f"`matmul_precision` must be one of {MATMUL_PRECISIONS}, got {value!r}.")


def matmul_precision(value: MatmulPrecision) -> contextlib.AbstractContextManager[Any]:
    """The scope in which the library traces the model: `jax.default_matmul_precision(value)`,
    or no change for `None`.

    **Arguments:**

    - `value`: a `MatmulPrecision`.

    **Returns:**

    A context manager.
    """
    if value is None:
        return contextlib.nullcontext()
    scope: contextlib.AbstractContextManager[Any] = jax.default_matmul_precision(value)
    return scope


def _on_data_mesh() -> bool:
    """Whether the program is traced for a mesh with the data axis (`jax.set_mesh`)."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and DATA_AXIS in mesh.axis_names


def _to_bfloat16(tree: PyTree[Any]) -> PyTree[Any]:
    """`tree` with every float32/float64 array cast to bfloat16 (other leaves as they are)."""

    def cast(leaf: Any) -> Any:
        if eqx.is_inexact_array(leaf) and jnp.dtype(leaf.dtype).itemsize >= 4:
            return leaf.astype(jnp.bfloat16)
        return leaf

    return jax.tree.map(cast, tree)


def _per_example_shapes(tree: PyTree[Any]) -> PyTree[Any]:
    return jax.tree.map(lambda leaf: tuple(jnp.shape(leaf)[1:]), tree)


@final
class GuidedFlow(eqx.Module):
    """A velocity model with its process, conditioning, guidance and autoencoder.

    Objectives hold one; the model itself is passed to each method, so the same code serves
    the live policy, the frozen reference and an EMA.

    **Arguments:**

    - `model`: the velocity model, `model(x, t, cond) -> v` on one unbatched example; its
        structure (and, unless an objective is given other weights, its initial weights).
    - `process`: the generative process (`RectifiedFlow`), which supplies the time grid.
    - `inputs`: an `InputSpec`: which row fields condition the model, and the null condition.
    - `guidance`: classifier-free guidance (`CFG`), a guidance-distilled model's guidance
        input (`EmbeddedGuidance`), or `None`.
    - `autoencoder`: decodes latents to samples in [-1, 1] (identity by default).
    - `precision`: `"float32"` (default) or `"bfloat16"`: the dtype the model computes in
        (`Precision`). The cast happens inside each call, so gradients reach the float32
        weights and the optimizer updates those.
    - `matmul_precision`: the precision of the model's float32 matrix products in every call
        (`MatmulPrecision`): `"highest"` by default, on every backend, so that log densities
        and ratios agree with their float64 statement to float32's digits on a TPU as on a
        CPU; `"default"` for the backend's fastest.
    - `model_time`: the time the model receives in every call (`ModelTime`): `"exact"`
        (default), or `"thousandths"`, `floor(1000 t) / 1000`, as MixGRPO's release.

    **Raises:**

    - `ValueError`: naming the argument, for a model that is not callable, a wrong type,
        guidance without a null condition, or an unknown `precision`, `matmul_precision` or
        `model_time`.
    """

    model: Model
    process: AbstractProcess
    inputs: InputSpec
    guidance: AbstractGuidance | None = CFG(3.0)
    autoencoder: AbstractAutoEncoder = IdentityAutoEncoder()
    precision: Precision = "float32"
    matmul_precision: MatmulPrecision = "highest"
    model_time: ModelTime = "exact"

    def __check_init__(self) -> None:
        if not callable(self.model):
            raise ValueError(f"`model` must be callable as model(x, t, cond), got {self.model!r}.")
        if not isinstance(self.process, AbstractProcess):
            raise ValueError(f"`process` must be an AbstractProcess, got {self.process!r}.")
        if not isinstance(self.inputs, InputSpec):
            raise ValueError(f"`inputs` must be an InputSpec, got {self.inputs!r}.")
        if self.guidance is not None and not isinstance(self.guidance, AbstractGuidance):
            raise ValueError(
                f"`guidance` must be an AbstractGuidance (a CFG, an EmbeddedGuidance) or None, "
                f"got {self.guidance!r}."
            )
        if self.guidance is not None and self.guidance.needs_null and not self.inputs.has_null:
            raise ValueError(
                "`guidance` needs a null condition, but `inputs` has none: pass "
                "InputSpec(null=...) or guidance=None."
            )
        if not isinstance(self.autoencoder, AbstractAutoEncoder):
            raise ValueError(
                f"`autoencoder` must be an AbstractAutoEncoder, got {self.autoencoder!r}."
            )
        if self.precision not in PRECISIONS:
            raise ValueError(f"`precision` must be one of {PRECISIONS}, got {self.precision!r}.")
        check_matmul_precision(self.matmul_precision)
        if self.model_time not in MODEL_TIMES:
            raise ValueError(f"`model_time` must be one of {MODEL_TIMES}, got {self.model_time!r}.")

    def null_like(self, conditioning: PyTree[Any]) -> PyTree[Any]:
        """The null condition repeated for every row of `conditioning`, checked against it.

        **Arguments:**

        - `conditioning`: the rows' conditioning, already selected and encoded (leading
            axis `B`).

        **Returns:**

        The encoded null condition with the same leading axis `B`.

        **Raises:**

        - `ValueError`: when the rows' conditioning and the null condition differ in
            structure or in per-example shapes, naming both.
        """
        rows = jax.tree.leaves(conditioning)[0].shape[0]
        null = self.inputs.null_condition(rows)
        got = _per_example_shapes(conditioning)
        want = _per_example_shapes(null)
        if got != want:
            raise ValueError(
                "The rows' conditioning does not match the null condition: per example the "
                f"rows give shapes {got}, the null condition (InputSpec.null) {want}."
            )
        return null

    def call_model(
        self,
        model: Model,
        x: Float[Array, " B *latent"],
        t: Float[Array, " B"],
        conditioning: PyTree[Any],
    ) -> Float[Array, " B *latent"]:
        """The model's velocity on a batch, without guidance, checked for its output's shape.

        The model, which takes one unbatched example, is `vmap`ped over the batch axis.

        **Arguments:**

        - `model`: the model.
        - `x`: `[N, *latent]` states.
        - `t`: `[N]` times (the model receives them as `model_time` says).
        - `conditioning`: the model's conditioning (already selected and encoded).

        **Returns:**

        `[N, *latent]` velocities in float32 at least.

        **Raises:**

        - `ValueError`: when the model returns a velocity not shaped like `x`.
        """
        if self.model_time == "thousandths":
            t = jnp.floor(t * 1000) / 1000
        inputs = (model, x, t, conditioning)
        if self.precision == "bfloat16":
            inputs = _to_bfloat16(inputs)
        model, x_in, t_in, conditioning = inputs
        with matmul_precision(self.matmul_precision):
            velocities: Array = jax.vmap(model)(x_in, t_in, conditioning)
        if velocities.shape != x.shape:
            raise ValueError(
                f"The model returned a velocity of shape {tuple(velocities.shape[1:])} for a "
                f"latent of shape {tuple(x.shape[1:])}; model(x, t, cond) must return one "
                "velocity shaped like its x."
            )
        return velocities.astype(compute_dtype(x.dtype))

    def velocity(
        self, model: Model, x: Float[Array, " B *latent"], t: Float[Array, " B"], cond: PyTree[Any]
    ) -> Float[Array, " B *latent"]:
        """The guided velocity of `model` on a batch, both guidance branches in one call.

        **Arguments:**

        - `model`: the policy or the reference.
        - `x`: `[N, *latent]` states.
        - `t`: `[N]` times.
        - `cond`: the batch's rows (leading axis `N`), reduced by `inputs`.

        **Returns:**

        `[N, *latent]` velocities in float32 at least.

        **Raises:**

        - `ValueError`: when the model returns a velocity not shaped like `x`, or the rows'
            conditioning does not match the null condition.
        """
        conditioning = self.inputs.condition(cond)
        if self.guidance is None:
            return self.call_model(model, x, t, conditioning)
        return self.guidance.guided_velocity(
            lambda conditioning: self.call_model(model, x, t, conditioning),
            lambda conditioning: self._with_null(model, x, t, conditioning),
            conditioning,
            x.shape[0],
        )

    def _with_null(
        self,
        model: Model,
        x: Float[Array, " B *latent"],
        t: Float[Array, " B"],
        conditioning: PyTree[Any],
    ) -> tuple[Float[Array, " B *latent"], Float[Array, " B *latent"]]:
        """The model's velocities given the rows' conditioning and given the null condition,
        in one batched call: `(conditional, unconditional)`."""
        null = self.null_like(conditioning)
        rows = x.shape[0]
        if not _on_data_mesh():
            both = jax.tree.map(
                lambda c, u: jnp.concatenate([c, u.astype(c.dtype)], axis=0), conditioning, null
            )
            velocities = self.call_model(
                model, jnp.concatenate([x, x], axis=0), jnp.concatenate([t, t], axis=0), both
            )
            return velocities[:rows], velocities[rows:]

        def pair(c: Array, u: Array) -> Array:
            # On a data mesh, row r's two branches side by side (rows 2r and 2r + 1) rather
            # than the two halves one after the other: each device keeps both branches of its
            # own rows, so the partitioner never gathers the batch to build them. Off a mesh
            # the two halves are one contiguous batch per branch, and the shipped results
            # (the main job's, the fixtures') are computed in that order.
            both = jnp.stack([c, u.astype(c.dtype)], axis=1)
            return both.reshape(-1, *c.shape[1:])

        both = jax.tree.map(pair, conditioning, null)
        velocities = self.call_model(model, pair(x, x), pair(t, t), both)
        velocities = velocities.reshape(rows, 2, *velocities.shape[1:])
        return velocities[:, 0], velocities[:, 1]

    def transition(
        self,
        sde: AbstractSDE,
        model: Model,
        x: Latents,
        t: Times,
        t_next: Times,
        cond: PyTree[Any],
        allowed: Bool[Array, " N"] | None = None,
    ) -> tuple[Latents, Times]:
        """The batch's Gaussian transitions `(mean, std)` under `sde` and the guided velocity.

        The one place where a policy becomes a transition: the rollout samples with it and
        `FlowGRPOObjective` rescores with it, so an unchanged policy rescores exactly what
        it sampled.

        **Arguments:**

        - `sde`: the SDE (`FlowSDE`, `CoefficientsPreservingSDE`).
        - `model`: the policy or the reference.
        - `x`: `[N, *latent]` states at `t`.
        - `t`, `t_next`: `[N]` start and end times.
        - `cond`: the batch's rows (leading axis `N`).
        - `allowed`: `[N]`, `False` where the transition must be deterministic whatever the
            SDE says (`AbstractSDE.transition`); `None` allows noise everywhere.

        **Returns:**

        `(mean, std)`: `[N, *latent]` means and `[N]` stds (0 on deterministic transitions).

        **Raises:**

        - `ValueError`: as `velocity`.
        """
        v = self.velocity(model, x, t, cond)
        if allowed is None:
            return jax.vmap(sde.transition)(x, v, t, t_next)
        return jax.vmap(sde.transition)(x, v, t, t_next, allowed)

    def sample_latents(
        self, model: Model, cond: PyTree[Any], noise: Latents, sampler: AbstractSolver, steps: int
    ) -> Latents:
        """Integrate the guided probability-flow ODE from `noise` at t = 1 to t = 0.

        **Arguments:**

        - `model`: the model to sample from.
        - `cond`: one row per sample (leading axis `N`).
        - `noise`: `[N, *latent]` starting points.
        - `sampler`: the ODE solver; its state (`init` at t = 1) is carried through the steps.
        - `steps`: the number of time points of the grid.

        **Returns:**

        `[N, *latent]` final latents.
        """
        grid = self.process.timesteps(steps)
        rows = noise.shape[0]

        def velocity(x: Latents, t: Scalar) -> Latents:
            return self.velocity(model, x, jnp.full((rows,), t, x.dtype), cond)

        def body(carry: tuple[Array, Any], times: Array) -> tuple[tuple[Array, Any], None]:
            x, state = carry
            return sampler.step(velocity, x, times[0], times[1], state), None

        start = noise.astype(compute_dtype(noise.dtype))
        intervals = jnp.stack([grid[:-1], grid[1:]], axis=1)
        (final, _), _ = jax.lax.scan(body, (start, sampler.init(start, grid[0])), intervals)
        return final

    def decode(self, latents: Latents) -> Float[Array, " N *sample"]:
        """Decode latents to samples in [-1, 1] with the autoencoder (clipped).

        **Arguments:**

        - `latents`: `[N, *latent]` final latents.

        **Returns:**

        `[N, *sample]` samples, clipped to [-1, 1].
        """
        return jnp.clip(jax.vmap(self.autoencoder.decode)(latents), -1.0, 1.0)


def flow_from(
    model: Model,
    process: AbstractProcess,
    inputs: InputSpec,
    guidance: AbstractGuidance | None,
    autoencoder: AbstractAutoEncoder | None,
    precision: Precision = "float32",
    matmul_precision: MatmulPrecision = "highest",
    model_time: ModelTime = "exact",
) -> GuidedFlow:
    """A `GuidedFlow` from an objective's constructor arguments (`None`: identity decoder)."""
    return GuidedFlow(
        model,
        process,
        inputs,
        guidance=guidance,
        autoencoder=IdentityAutoEncoder() if autoencoder is None else autoencoder,
        precision=precision,
        matmul_precision=matmul_precision,
        model_time=model_time,
    )


__all__ = [
    "MATMUL_PRECISIONS",
    "MODEL_TIMES",
    "PRECISIONS",
    "GuidedFlow",
    "MatmulPrecision",
    "ModelTime",
    "Precision",
    "flow_from",
    "matmul_precision",
]
