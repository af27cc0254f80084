"""Flow-matching pretraining of the base velocity model, in the same trainer interface."""

from dataclasses import KW_ONLY
from typing import Any, Literal, TypeAlias, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PyTree

from .._custom_types import Mean, Model, Step
from .._guided_flow import GuidedFlow
from .._misc import check_leading_rows, check_number
from ..objectives import AbstractFlowObjective, PolicyVariables, TrainableFilter
from ..objectives._base import checked_flow


TimeSampling: TypeAlias = Literal["logit_normal", "uniform"]
"""How flow matching draws its training times: SD3's logit-normal, or uniform."""


@final
class SupervisedBatch(eqx.Module):
    """Data for flow matching.

    **Arguments:**

    - `data`: `[B, *latent]` clean latents `x_0`.
    - `cond`: the rows that condition them (leading axis `B`).

    **Raises:**

    - `ValueError`: naming the `cond` leaf whose leading axis is not `B`.
    """

    data: Float[Array, " B *latent"]
    cond: PyTree[Any]

    def __check_init__(self) -> None:
        check_leading_rows("SupervisedBatch", "cond", self.cond, self.data.shape[0], rows_name="B")


@final
class FlowMatchingObjective(AbstractFlowObjective[PolicyVariables]):
    """Rectified-flow (flow-matching) regression: `E || v(x_t, t, c) - (eps - x_0) ||^2`.

    Times are drawn uniformly or from a logit-normal (SD3's choice), and the condition is
    replaced by the null condition with probability `cond_dropout`, so that the trained
    model supports classifier-free guidance.

    **Arguments:**

    - `flow`: a `GuidedFlow` (its precision is the loss's).
    - `pretrained`: as for `FlowGRPOObjective`.
    - `cond_dropout`: probability of training a row on the null condition.
    - `time_sampling`: `"logit_normal"` (default) or `"uniform"`.

    **Raises:**

    - `ValueError`: naming the argument, for `cond_dropout` outside [0, 1), an unknown
        `time_sampling`, a `flow` that is not a `GuidedFlow`, or dropout
        without a null condition.

    Training a model that returns a velocity of the wrong shape, or on rows whose
    conditioning does not match the null condition, raises a `ValueError` saying so.
    """

    flow: GuidedFlow
    _: KW_ONLY
    pretrained: Model | None = None
    cond_dropout: float = 0.1
    time_sampling: TimeSampling = "logit_normal"

    def __check_init__(self) -> None:
        check_number("cond_dropout", self.cond_dropout, minimum=0, maximum=1, include_maximum=False)
        if self.time_sampling not in ("logit_normal", "uniform"):
            raise ValueError(
                f"`time_sampling` must be 'logit_normal' or 'uniform', got {self.time_sampling!r}."
            )
        if self.cond_dropout > 0 and not checked_flow(self.flow).inputs.has_null:
            raise ValueError("`cond_dropout` > 0 needs a null condition: pass InputSpec(null=...).")

    def variables_for(self, policy: Model, trainable: TrainableFilter | None) -> PolicyVariables:
        del trainable
        return PolicyVariables(policy=policy)

    def sample_times(self, key: Array, count: int) -> Float[Array, " B"]:
        """Training times in (0, 1), drawn as `time_sampling` says.

        **Arguments:**

        - `key`: a PRNG key.
        - `count`: how many times to draw.

        **Returns:**

        `[count]` float32 times: `sigmoid` of a standard normal (`"logit_normal"`), or
        uniform on `[1e-4, 1 - 1e-4]` (`"uniform"`).
        """
        if self.time_sampling == "uniform":
            return jax.random.uniform(key, (count,), minval=1e-4, maxval=1.0 - 1e-4)
        return jax.nn.sigmoid(jax.random.normal(key, (count,)))

    def loss_sums_over_rows(self) -> bool:
        """`True`: each row's flow-matching error is its own."""
        return True

    def loss(
        self, variables: PolicyVariables, batch: SupervisedBatch, step: Step
    ) -> tuple[Mean, dict[str, Mean]]:
        """The mean squared velocity error over the batch (one `Mean`, summed per row).

        **Arguments:**

        - `variables`: gradients flow into `variables.policy`.
        - `batch`: a `SupervisedBatch`.
        - `step`: its key draws the noise, the times and the condition dropout.

        **Returns:**

        `(Mean(sum of per-row MSE, rows), {"mse": ..., "dropped": ...})`.
        """
        rows = batch.data.shape[0]
        noise_key, time_key, drop_key = jax.random.split(step.key, 3)
        noise = jax.random.normal(noise_key, batch.data.shape, batch.data.dtype)
        t = self.sample_times(time_key, rows).astype(batch.data.dtype)
        process = self.flow.process
        x_t = jax.vmap(process.interpolate)(batch.data, noise, t)
        target = jax.vmap(process.velocity_target)(batch.data, noise)
        conditioning = self.flow.inputs.condition(batch.cond)
        dropped = jnp.zeros((rows,), bool)
        if self.cond_dropout > 0:
            dropped = jax.random.bernoulli(drop_key, self.cond_dropout, (rows,))
            null = self.flow.null_like(conditioning)

            def choose(c: Array, u: Array) -> Array:
                mask = dropped.reshape((rows,) + (1,) * (c.ndim - 1))
                return jnp.where(mask, u.astype(c.dtype), c)

            conditioning = jax.tree.map(choose, conditioning, null)
        prediction = self.flow.call_model(variables.policy, x_t, t, conditioning)
        error = (prediction.astype(jnp.float32) - target.astype(jnp.float32)) ** 2
        per_row = jnp.mean(error.reshape(rows, -1), axis=1)
        count = jnp.asarray(rows, jnp.float32)
        mse = Mean(jnp.sum(per_row), count)
        return mse, {"mse": mse, "dropped": Mean(jnp.sum(dropped, dtype=jnp.float32), count)}
