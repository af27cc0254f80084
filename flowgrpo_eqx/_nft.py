"""`DiffusionNFTObjective`: online RL on the forward process from final samples and rewards."""

from typing import Any, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PyTree

from . import lora
from ._custom_types import Mean, Model, Step, Transitions
from ._flow_base import AbstractFlowObjective, Variables
from ._guided_flow import GuidedFlow, Precision, flow_from
from ._inputs import CFG, AbstractAutoEncoder, InputSpec
from ._misc import check_int
from ._objective import _stop_gradient
from ._process import AbstractProcess
from ._rollout import RolloutInfo
from ._solver import AbstractSolver, Euler


@final
class NFTBatch(eqx.Module):
    """What DiffusionNFT trains on: final clean latents, their rows and their advantages.

    No trajectory and no likelihood: any sampler may have drawn the latents. `nft_batch`
    builds one from a `FlowRollout.collect`.

    **Arguments:**

    - `latents`: `[N, *latent]` final clean latents `x_0` (at t = 0).
    - `advantages`: `[N]` group-normalised advantages.
    - `cond`: the rows that conditioned them (leaves with a leading axis `N`).
    - `mask`: `[N]` bools, whether each row counts; `None` (the default) counts every row.

    **Raises:**

    - `ValueError`: naming the field whose leading axis is not `N`, or a `mask` that is not
        bool.
    """

    latents: Float[Array, " N *latent"]
    advantages: Float[Array, " N"]
    cond: PyTree[Any]
    mask: Bool[Array, " N"]

    def __init__(
        self,
        latents: Float[Array, " N *latent"],
        advantages: Float[Array, " N"],
        cond: PyTree[Any],
        mask: Bool[Array, " N"] | None = None,
    ):
        self.latents = latents
        self.advantages = advantages
        self.cond = cond
        self.mask = jnp.ones(jnp.shape(latents)[:1], bool) if mask is None else mask

    def __check_init__(self) -> None:
        if jnp.ndim(self.latents) < 1:
            raise ValueError(
                f"NFTBatch.latents has shape {jnp.shape(self.latents)}, expected [N, *latent]."
            )
        rows = jnp.shape(self.latents)[0]
        for name in ("advantages", "mask"):
            shape = tuple(jnp.shape(getattr(self, name)))
            if shape != (rows,):
                raise ValueError(f"NFTBatch.{name} has shape {shape}, expected [N] = ({rows},).")
        if jnp.result_type(self.mask) != jnp.bool_:
            raise ValueError(
                f"NFTBatch.mask must be a bool array, got dtype {jnp.result_type(self.mask)}."
            )
        for path, leaf in jax.tree_util.tree_leaves_with_path(self.cond):
            if jnp.ndim(leaf) == 0 or jnp.shape(leaf)[0] != rows:
                raise ValueError(
                    f"NFTBatch.cond{jax.tree_util.keystr(path)} has shape {jnp.shape(leaf)}, "
                    f"expected a leading axis of size N = {rows}."
                )

    @property
    def num_rows(self) -> int:
        """`N`, the number of rows (samples)."""
        return int(self.latents.shape[0])


def nft_batch(batch: Transitions, info: RolloutInfo) -> NFTBatch:
    """The `NFTBatch` of a `FlowRollout.collect`: its final latents, rows and advantages.

    Every row counts, zero-advantage rows included: their optimality probability is 1/2,
    which pulls the policy towards the old one (see `DiffusionNFTObjective`).

    **Arguments:**

    - `batch`: the `Transitions` that `collect` returned (its `cond` and `advantages`).
    - `info`: the `RolloutInfo` that `collect` returned (its `final` latents).

    **Returns:**

    The `NFTBatch`, placed as the rollout placed its rows.

    **Raises:**

    - `ValueError`: if `batch` holds per-transition (`[N, K]`) advantages.
    """
    if batch.advantages.ndim != 1:
        raise ValueError(
            "DiffusionNFT needs one advantage per row, got Transitions.advantages of shape "
            f"{tuple(batch.advantages.shape)}."
        )
    return NFTBatch(latents=info.final, advantages=batch.advantages, cond=batch.cond)


@final
class DiffusionNFTObjective(AbstractFlowObjective):
    """DiffusionNFT: negative-aware flow matching on final samples, weighted by reward.

    Each row's advantage `A` becomes an optimality probability
    `r = 1/2 + 1/2 clip(A / adv_max, -1, 1)` in [0, 1]. Its clean latent `x_0` is noised
    along the forward process at a uniform time `t`, `x_t = (1 - t) x_0 + t eps`, with the
    target velocity `v = eps - x_0` (t = 1 is noise). With the old policy's guided velocity
    `v_old` (no gradient) and the live policy's `v_theta`, the implicit positive and negative
    policies are `v+ = (1 - beta) v_old + beta v_theta` and
    `v- = (1 + beta) v_old - beta v_theta`, and each counted row contributes
    `r mean||v+ - v||^2 + (1 - r) mean||v- - v||^2` (means over latent coordinates). The
    loss is the mean over counted rows; no count gives 0 and zero gradients.

    The old policy is the held slot: the trainer's EMA of the live policy
    (`Trainer(ema_decay=...)`, the paper's soft update of the sampling policy), or, without
    an EMA, the initial policy. For a policy with LoRA adapters the slot holds the adapters
    alone and the old policy is the live one carrying them. The velocity is the guided one
    (`GuidedFlow.velocity`), the one the sampler integrates, so the policy trained is the
    policy that samples; with `guidance=None` it is the model's conditional velocity.

    **Arguments:**

    - `model`, `process`, `inputs`, `guidance`, `sampler`, `steps`, `autoencoder`,
        `pretrained`, `precision`: as for `FlowGRPOObjective` (`sampler` and `steps` serve
        `evaluate`).
    - `beta`: the mixing strength of the implicit policies, in (0, 1].
    - `adv_max`: the advantage at which the optimality probability saturates (0 or 1).

    **Raises:**

    - `ValueError`: naming the argument, for `beta` outside (0, 1], `adv_max <= 0`,
        `steps < 2`, or guidance without a null condition.
    """

    flow: GuidedFlow
    sampler: AbstractSolver
    steps: int
    pretrained: Model | None
    beta: float
    adv_max: float

    def __init__(
        self,
        model: Model,
        process: AbstractProcess,
        inputs: InputSpec,
        *,
        beta: float = 1.0,
        adv_max: float = 5.0,
        guidance: CFG | None = CFG(3.0),
        sampler: AbstractSolver = Euler(),
        steps: int = 41,
        autoencoder: AbstractAutoEncoder | None = None,
        pretrained: Model | None = None,
        precision: Precision = "float32",
    ):
        self.flow = flow_from(model, process, inputs, guidance, autoencoder, precision)
        self.sampler = sampler
        self.steps = steps
        self.pretrained = pretrained
        self.beta = beta
        self.adv_max = adv_max

    def __check_init__(self) -> None:
        if not (
            isinstance(self.beta, (int, float))
            and not isinstance(self.beta, bool)
            and 0 < self.beta <= 1
        ):
            raise ValueError(f"`beta` must be a number in (0, 1], got {self.beta!r}.")
        if not (
            isinstance(self.adv_max, (int, float))
            and not isinstance(self.adv_max, bool)
            and self.adv_max > 0
        ):
            raise ValueError(f"`adv_max` must be a number > 0, got {self.adv_max!r}.")
        if not isinstance(self.sampler, AbstractSolver):
            raise ValueError(f"`sampler` must be an AbstractSolver, got {self.sampler!r}.")
        check_int("steps", self.steps, 2)

    def held_variables(self) -> Variables:
        """Nothing is held: the held slot is the old policy, written by the trainer's EMA.

        **Returns:**

        `Variables(policy=False, held=False)`.
        """
        return Variables(policy=False, held=False)

    def old_policy(self, variables: Variables) -> Model:
        """The old policy: the held slot (with LoRA, the live policy carrying its adapters).

        **Arguments:**

        - `variables`: the live policy and the held slot.

        **Returns:**

        The old policy, a model like `variables.policy`.

        **Raises:**

        - `ValueError`: if the held slot is `None` (a LoRA policy trained without an EMA).
        """
        if variables.held is None:
            raise ValueError(
                "DiffusionNFT's old policy is the held slot, which is None: train a LoRA "
                "policy with an EMA (Trainer(ema_decay=...))."
            )
        if lora.has_adapters(variables.policy):
            return lora.with_adapters(variables.policy, variables.held)
        return variables.held

    def optimality(self, advantages: Float[Array, " N"]) -> Float[Array, " N"]:
        """The optimality probabilities `r = 1/2 + 1/2 clip(A / adv_max, -1, 1)`.

        **Arguments:**

        - `advantages`: `[N]` advantages.

        **Returns:**

        `[N]` probabilities in [0, 1], float32.
        """
        scaled = jnp.clip(advantages.astype(jnp.float32) / self.adv_max, -1.0, 1.0)
        return 0.5 + 0.5 * scaled

    def loss(
        self, variables: Variables, batch: NFTBatch, step: Step
    ) -> tuple[Mean, dict[str, Mean]]:
        """The DiffusionNFT loss over the batch's counted rows (one `Mean`, summed per row).

        Masked rows are replaced by a zero latent, advantage and conditioning before any
        arithmetic, so NaN or inf in them reach neither the loss nor its gradient.

        **Arguments:**

        - `variables`: gradients flow into `variables.policy` only; the held slot gives
            `v_old`.
        - `batch`: an `NFTBatch`.
        - `step`: its key draws the noise and the times: `noise_key, time_key =
            jax.random.split(step.key)`, `eps ~ N(0, I)` shaped like the latents and
            `t ~ U[1e-4, 1 - 1e-4]` per row.

        **Returns:**

        `(Mean(sum of per-row losses, counted rows), aux)` with `aux` the `Mean`s over
        counted rows of `positive_mse` (`mean||v+ - v||^2`), `negative_mse`, `old_mse`
        (`mean||v_old - v||^2`), `drift` (`mean||v_theta - v_old||^2`) and `optimality`
        (`r`).

        **Raises:**

        - `ValueError`: as `old_policy`, or `GuidedFlow.velocity`.
        """
        old = _stop_gradient(self.old_policy(variables))
        rows = batch.num_rows
        keep = batch.mask

        def clean(leaf: Array) -> Array:
            if not jnp.issubdtype(leaf.dtype, jnp.inexact):
                return leaf
            mask = keep.reshape((rows,) + (1,) * (leaf.ndim - 1))
            return jnp.where(mask, leaf, jnp.zeros((), leaf.dtype))

        data = clean(batch.latents)
        advantages = clean(batch.advantages)
        cond = jax.tree.map(clean, batch.cond)
        noise_key, time_key = jax.random.split(step.key)
        noise = jax.random.normal(noise_key, data.shape, data.dtype)
        t = jax.random.uniform(time_key, (rows,), data.dtype, minval=1e-4, maxval=1.0 - 1e-4)
        process = self.flow.process
        x_t = jax.vmap(process.interpolate)(data, noise, t)
        target = jax.vmap(process.velocity_target)(data, noise).astype(jnp.float32)
        v_theta = self.flow.velocity(variables.policy, x_t, t, cond).astype(jnp.float32)
        v_old = jax.lax.stop_gradient(self.flow.velocity(old, x_t, t, cond).astype(jnp.float32))
        positive = (1.0 - self.beta) * v_old + self.beta * v_theta
        negative = (1.0 + self.beta) * v_old - self.beta * v_theta

        def row_mse(a: Array, b: Array) -> Float[Array, " N"]:
            return jnp.mean(((a - b) ** 2).reshape(rows, -1), axis=1)

        r = self.optimality(advantages)
        positive_mse = row_mse(positive, target)
        negative_mse = row_mse(negative, target)
        per_row = r * positive_mse + (1.0 - r) * negative_mse
        count = jnp.sum(keep, dtype=jnp.float32)

        def mean_of(value: Float[Array, " N"]) -> Mean:
            return Mean(jnp.sum(jnp.where(keep, value, jnp.zeros_like(value))), count)

        aux = {
            "positive_mse": mean_of(positive_mse),
            "negative_mse": mean_of(negative_mse),
            "old_mse": mean_of(row_mse(v_old, target)),
            "drift": mean_of(jax.lax.stop_gradient(row_mse(v_theta, v_old))),
            "optimality": mean_of(r),
        }
        return mean_of(per_row), aux
