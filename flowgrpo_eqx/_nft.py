"""`DiffusionNFTObjective`: online RL on the forward process from final samples and rewards."""

from typing import Any, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from . import lora
from ._custom_types import FinalSamples, Mean, Model, Step, Transitions
from ._flow_base import AbstractVariables
from ._guided_flow import GuidedFlow, Precision, flow_from
from ._inputs import CFG, AbstractAutoEncoder, InputSpec
from ._misc import check_int, check_number
from ._objective import _stop_gradient
from ._process import AbstractProcess
from ._rl import AbstractRLObjective, FirstPass, RunUpdate
from ._rollout import RolloutInfo
from ._solver import AbstractSolver, Euler


@final
class NFTVariables(AbstractVariables):
    """DiffusionNFT's variables: the live policy, the old (sampling) policy and the reference.

    **Arguments:**

    - `policy`: the live velocity model, trained by the optimizer.
    - `old_policy`: the policy the rollout samples with and the implicit policies mix
        with; for a policy with LoRA adapters, the old adapters alone (the old policy is the
        live one carrying them). Moved towards the live policy once per epoch by
        `DiffusionNFTObjective.end_epoch` when `old_decay` is set.
    - `reference`: the frozen copy of the initial policy that the KL term compares with,
        when `kl_beta > 0` and the policy has no LoRA adapters; `None` otherwise (for a
        policy with adapters the reference is the policy with its adapters switched off).
    """

    policy: Model
    old_policy: Model
    reference: Model | None


@final
class DiffusionNFTObjective(AbstractRLObjective[NFTVariables, FinalSamples]):
    """DiffusionNFT: negative-aware flow matching on final samples, weighted by reward.

    Each row's advantage `A` becomes an optimality probability
    `r = 1/2 + 1/2 clip(A / adv_max, -1, 1)` in [0, 1]. Its clean latent `x_0` is noised
    along the forward process at a uniform time `t`, `x_t = (1 - t) x_0 + t eps`, with the
    target velocity `v = eps - x_0` (t = 1 is noise). With the old policy's guided velocity
    `v_old` (no gradient) and the live policy's `v_theta`, the implicit positive and negative
    policies are `v+ = (1 - beta) v_old + beta v_theta` and
    `v- = (1 + beta) v_old - beta v_theta`, and each counted row contributes
    `r mean||v+ - v||^2 + (1 - r) mean||v- - v||^2` (means over latent coordinates), plus
    `kl_beta mean||v_theta - v_ref||^2` to the reference when `kl_beta > 0`. The loss is the
    mean over counted rows; no count gives 0 and zero gradients.

    The old policy (`NFTVariables.old_policy`) samples the rollout and anchors the implicit
    policies. It starts as the initial policy and, with `old_decay`, follows the live one
    once per epoch (`end_epoch`, the paper's soft update of the sampling policy); without,
    it stays the initial policy. For a policy with LoRA adapters it holds the adapters
    alone and the old policy is the live one carrying them. The velocity is the guided one
    (`GuidedFlow.velocity`), the one the sampler integrates, so the policy trained is the
    policy that samples; with `guidance=None` it is the model's conditional velocity.

    **Arguments:**

    - `model`, `process`, `inputs`, `guidance`, `sampler`, `steps`, `autoencoder`,
        `pretrained`, `precision`: as for `FlowGRPOObjective` (`sampler` and `steps` serve
        `evaluate`).
    - `beta`: the mixing strength of the implicit policies, in (0, 1].
    - `adv_max`: the advantage at which the optimality probability saturates (0 or 1).
    - `kl_beta`: the weight of the velocity KL to the reference (>= 0; 0, the default,
        keeps no reference). With a LoRA policy the reference is the policy with its adapters
        switched off; otherwise a frozen copy of the initial policy.
    - `old_decay`: `None` (default) keeps the old policy at the initial policy; a number
        in [0, 1) moves it once per epoch to `old_decay * old + (1 - old_decay) * live`.

    **Raises:**

    - `ValueError`: naming the argument, for `beta` outside (0, 1], `adv_max <= 0`,
        `kl_beta < 0`, `old_decay` outside [0, 1), `steps < 2`, or guidance without a null
        condition.
    """

    flow: GuidedFlow
    sampler: AbstractSolver
    steps: int
    pretrained: Model | None
    beta: float
    adv_max: float
    kl_beta: float
    old_decay: float | None

    def __init__(
        self,
        model: Model,
        process: AbstractProcess,
        inputs: InputSpec,
        *,
        beta: float = 1.0,
        adv_max: float = 5.0,
        kl_beta: float = 0.0,
        old_decay: float | None = None,
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
        self.kl_beta = kl_beta
        self.old_decay = old_decay

    def __check_init__(self) -> None:
        check_number("beta", self.beta, minimum=0, maximum=1, include_minimum=False)
        check_number("adv_max", self.adv_max, minimum=0, include_minimum=False)
        check_number("kl_beta", self.kl_beta, minimum=0)
        check_number(
            "old_decay", self.old_decay, minimum=0, maximum=1, include_maximum=False, optional=True
        )
        if not isinstance(self.sampler, AbstractSolver):
            raise ValueError(f"`sampler` must be an AbstractSolver, got {self.sampler!r}.")
        check_int("steps", self.steps, 2)

    # ----------------------------------------------------------------------------------
    # The RL loop's interface

    def init(self, key: PRNGKeyArray, variables: NFTVariables | None = None) -> NFTVariables:
        del key
        if variables is not None:
            return variables
        policy = self.initial_policy()
        adapted = lora.has_adapters(policy)
        return NFTVariables(
            policy=policy,
            old_policy=lora.adapters(policy) if adapted else policy,
            reference=policy if self.kl_beta > 0 and not adapted else None,
        )

    def sampling_policy(self, variables: NFTVariables) -> Model:
        return self.old_policy(variables)

    def training_batch(
        self, collected: Transitions | FinalSamples, info: RolloutInfo
    ) -> FinalSamples:
        """The final samples of a rollout, with their rows and advantages.

        Every row counts, zero-advantage rows included: their optimality probability is 1/2,
        which pulls the policy towards the old one.

        **Arguments:**

        - `collected`: `FinalSamples` (an ODE rollout), or `Transitions` (an SDE rollout:
            its rows and advantages, with the final latents of `info`).
        - `info`: the rollout's `RolloutInfo` (its `final` latents).

        **Returns:**

        The `FinalSamples`, placed as the rollout placed its rows.

        **Raises:**

        - `ValueError`: if `collected` holds per-transition (`[N, K]`) advantages.
        """
        if isinstance(collected, FinalSamples):
            return collected
        if collected.advantages.ndim != 1:
            raise ValueError(
                "DiffusionNFT needs one advantage per row, got Transitions.advantages of "
                f"shape {tuple(collected.advantages.shape)}."
            )
        return FinalSamples(
            latents=info.final, advantages=collected.advantages, cond=collected.cond
        )

    def prepare_batch(
        self, batch: FinalSamples, run_update: RunUpdate, first_pass: FirstPass
    ) -> FinalSamples:
        del run_update, first_pass
        return batch

    def end_epoch(self, variables: NFTVariables, epoch: int) -> NFTVariables:
        """With `old_decay`, the old policy moved towards the live one; else unchanged.

        **Arguments:**

        - `variables`: after the epoch's updates.
        - `epoch`: the epoch that ended.

        **Returns:**

        `variables` with `old_policy = old_decay * old + (1 - old_decay) * live` (the
        adapters alone for a LoRA policy).
        """
        del epoch
        if self.old_decay is None:
            return variables
        return _soft_update(variables, self.old_decay)

    def batch_metrics(self, batch: FinalSamples) -> dict[str, float]:
        del batch
        return {}

    def old_policy(self, variables: NFTVariables) -> Model:
        """The old policy: `variables.old_policy`, or for a LoRA policy the live policy
        carrying the old adapters.

        **Arguments:**

        - `variables`: from `init`.

        **Returns:**

        The old policy, a model like `variables.policy`.
        """
        if lora.has_adapters(variables.policy):
            return lora.with_adapters(variables.policy, variables.old_policy)
        return variables.old_policy

    def reference(self, variables: NFTVariables) -> Model:
        """The KL reference: the LoRA policy with its adapters off, else `variables.reference`.

        **Arguments:**

        - `variables`: from `init`.

        **Returns:**

        The reference model.

        **Raises:**

        - `ValueError`: naming `variables` if a policy without adapters comes without its
            reference.
        """
        if lora.has_adapters(variables.policy):
            return lora.without_adapters(variables.policy)
        if variables.reference is None:
            raise ValueError(
                "`variables.reference` is None, but `kl_beta` > 0 needs the frozen reference "
                "of a policy without LoRA adapters: build the variables with `init`."
            )
        return variables.reference

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
        self, variables: NFTVariables, batch: FinalSamples, step: Step
    ) -> tuple[Mean, dict[str, Mean]]:
        """The DiffusionNFT loss over the batch's counted rows (one `Mean`, summed per row).

        Masked rows are replaced by a zero latent, advantage and conditioning before any
        arithmetic, so NaN or inf in them reach neither the loss nor its gradient.

        **Arguments:**

        - `variables`: gradients flow into `variables.policy` only; the old policy gives
            `v_old`, the reference `v_ref`.
        - `batch`: the `FinalSamples`.
        - `step`: its key draws the noise and the times: `noise_key, time_key =
            jax.random.split(step.key)`, `eps ~ N(0, I)` shaped like the latents and
            `t ~ U[1e-4, 1 - 1e-4]` per row.

        **Returns:**

        `(Mean(sum of per-row losses, counted rows), aux)` with `aux` the `Mean`s over
        counted rows of `positive_mse` (`mean||v+ - v||^2`), `negative_mse`, `old_mse`
        (`mean||v_old - v||^2`), `drift` (`mean||v_theta - v_old||^2`), `optimality`
        (`r`), and with `kl_beta > 0` `kl` (`mean||v_theta - v_ref||^2`).

        **Raises:**

        - `ValueError`: as `reference`, or `GuidedFlow.velocity`.
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
        kl = None
        if self.kl_beta > 0:
            reference = _stop_gradient(self.reference(variables))
            v_ref = self.flow.velocity(reference, x_t, t, cond).astype(jnp.float32)
            kl = row_mse(v_theta, jax.lax.stop_gradient(v_ref))
            per_row = per_row + self.kl_beta * kl
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
        if kl is not None:
            aux["kl"] = mean_of(jax.lax.stop_gradient(kl))
        return mean_of(per_row), aux


@eqx.filter_jit
def _soft_update(variables: NFTVariables, decay: float) -> NFTVariables:
    policy = variables.policy
    live = lora.adapters(policy) if lora.has_adapters(policy) else policy

    def blend(old: Any, current: Any) -> Any:
        if eqx.is_inexact_array(old):
            return decay * old + (1.0 - decay) * current
        return old

    old_policy = jax.tree.map(blend, variables.old_policy, live)
    moved: NFTVariables = eqx.tree_at(lambda v: v.old_policy, variables, old_policy)
    return moved
