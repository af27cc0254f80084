"""What a fine-tuning run trains: the policy (LoRA or every weight), the objective, the
rollout, the trainer, and the programs that sample, score and evaluate on the device."""

import dataclasses
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jaxtyping import Array, Float, PRNGKeyArray

from .. import (
    AbstractRLObjective,
    AdvantageStd,
    Euler,
    FlowRollout,
    Generated,
    GuidedFlow,
    InputSpec,
    RewardCombination,
    device_group_advantages,
    lora,
    with_part,
)
from ..models import diffusers_layers
from ..train import Trainer
from ._algorithms import JobParts
from ._config import FinetuneConfig, TrainingSettings
from ._pipeline import Pipeline
from ._plan import MeshPlan
from ._rewards import CombinedReward, DeviceTerm, HostTerm, score_terms


def make_policy(transformer: Any, config: FinetuneConfig) -> Any:
    """The trained policy: the transformer with float32 LoRA adapters (whatever the base's
    dtype) on the configured targets (`lora.rank` > 0), or the transformer itself (every
    weight trained).

    **Raises:**

    - `ValueError`: naming `targets`, for a target that picks no layer.
    """
    settings = config.lora
    if settings.rank == 0:
        return transformer
    assert settings.targets is not None
    where = diffusers_layers(transformer, settings.targets)
    key = jax.random.key(config.seed + 1)
    policy = lora.add(
        transformer, settings.rank, alpha=settings.alpha, key=key, where=where, dtype=jnp.float32
    )
    adapters = lora.adapters(policy)
    if settings.init == "kaiming":
        # PEFT's default: A ~ kaiming-uniform with a = sqrt(5), bound 1 / sqrt(fan_in).
        keys = iter(jax.random.split(key, len(jax.tree.leaves(adapters))))

        def draw(leaf: Any) -> Any:
            bound = 1.0 / np.sqrt(leaf.shape[-1])
            return jax.random.uniform(next(keys), leaf.shape, jnp.float32, -bound, bound)

        adapters = jax.tree.map(
            lambda adapter: (
                dataclasses.replace(adapter, a=draw(adapter.a))
                if isinstance(adapter, lora.LoraAdapter)
                else adapter
            ),
            adapters,
            is_leaf=lambda node: isinstance(node, lora.LoraAdapter),
        )
    return lora.with_adapters(policy, adapters)


def make_optimizer(training: TrainingSettings, total_updates: int) -> optax.GradientTransformation:
    """AdamW (flow_grpo's: betas 0.9 and 0.999, epsilon 1e-8) with the configured step size
    schedule, warm-up and gradient clip."""
    decay_steps = max(1, total_updates - training.warmup_steps)
    peak = training.learning_rate
    main: optax.Schedule = (
        optax.cosine_decay_schedule(peak, decay_steps)
        if training.schedule == "cosine"
        else optax.constant_schedule(peak)
    )
    schedule = (
        optax.join_schedules(
            [optax.linear_schedule(0.0, peak, training.warmup_steps), main],
            [training.warmup_steps],
        )
        if training.warmup_steps
        else main
    )
    adamw = optax.adamw(schedule, b1=0.9, b2=0.999, eps=1e-8, weight_decay=training.weight_decay)
    if training.max_grad_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(training.max_grad_norm), adamw)


@dataclasses.dataclass
class Job:
    """The run's trained parts and its device programs."""

    config: FinetuneConfig
    plan: MeshPlan
    flow: GuidedFlow
    objective: AbstractRLObjective[Any, Any]
    rollout: FlowRollout
    trainer: Trainer
    device_terms: list[DeviceTerm]
    host_terms: list[HostTerm]
    mesh: Mesh | None

    @classmethod
    def build(
        cls,
        config: FinetuneConfig,
        plan: MeshPlan,
        pipeline: Pipeline,
        null: dict[str, np.ndarray] | None,
        device_terms: list[DeviceTerm],
        host_terms: list[HostTerm],
        mesh: Mesh | None,
    ) -> "Job":
        """The job of a resolved configuration on a loaded pipeline; `null` is the negative
        prompt's condition (one row), for classifier-free guidance."""
        policy = make_policy(pipeline.transformer, config)
        null_row: Any = None
        if null is not None and pipeline.needs_null:
            fields = {name: jnp.asarray(value[0]) for name, value in null.items()}
            null_row = fields[pipeline.select] if isinstance(pipeline.select, str) else fields
        inputs = InputSpec(
            select=pipeline.select, null=null_row, latent_shape=pipeline.latent_shape
        )
        flow = GuidedFlow(
            pipeline.transformer,
            pipeline.process,
            inputs,
            pipeline.guidance,
            autoencoder=pipeline.vae,
            precision=config.precision.compute,
        )
        unguided = GuidedFlow(
            pipeline.transformer,
            pipeline.process,
            InputSpec(select=pipeline.select, latent_shape=pipeline.latent_shape),
            None,
            autoencoder=pipeline.vae,
            precision=config.precision.compute,
        )
        sampling = config.sampling
        assert sampling.train_steps is not None and sampling.eval_steps is not None
        parts = JobParts(
            flow=flow,
            unguided_flow=unguided,
            policy=policy,
            train_steps=sampling.train_steps,
            eval_steps=sampling.eval_steps,
            group_size=sampling.group_size,
            seed=config.seed,
        )
        table = config.algorithm_table
        objective = table.objective(parts)
        rollout = FlowRollout(
            objective,
            CombinedReward(device_terms, host_terms),
            groups=sampling.group_size,
            steps=sampling.train_steps + 1,
            sampler=table.sampler(parts),
            advantage_std=table.rollout_advantage_std(),
            shared_noise=sampling.shared_noise,
            mesh=mesh,
        )
        training = config.training
        total_updates = training.epochs * training.updates_per_epoch * training.inner_epochs
        microbatches = plan.microbatches if objective.loss_sums_over_rows() else 1
        trainer = Trainer(
            objective,
            make_optimizer(training, total_updates),
            ema_decay=training.ema_decay if training.ema else None,
            ema_every=training.ema_every,
            ema_warmup=True,
            microbatches=microbatches,
        )
        return cls(config, plan, flow, objective, rollout, trainer, device_terms, host_terms, mesh)

    def without_model_arrays(self) -> "Job":
        """The job with the model's arrays left out of its objective, rollout, trainer and
        flow (each array replaced by its shape and dtype), once the trainer's state holds its
        own copy of them: the programs read the policy from the state, so the model would
        otherwise sit twice in the device's memory (4.5 GB more for SD3.5 Medium).

        **Returns:**

        The job; a program that read the left-out arrays would fail to trace.
        """
        objective = _shapes_only(self.objective)
        return dataclasses.replace(
            self,
            flow=_shapes_only_flow(self.flow),
            objective=objective,
            rollout=eqx.tree_at(lambda r: r.objective, self.rollout, objective),
            trainer=eqx.tree_at(lambda t: t.objective, self.trainer, objective),
        )

    def evaluation_policy(self, state: Any) -> Any:
        """The policy evaluated and exported: the EMA of the trained part when kept, else the
        live policy."""
        policy = state.variables.policy
        return policy if state.ema is None else with_part(policy, state.ema)


@eqx.filter_jit
def rollout_program(
    rollout: FlowRollout,
    policy: Any,
    rows: dict[str, Any],
    key: PRNGKeyArray,
    first: Array,
    terms: Sequence[DeviceTerm],
) -> tuple[Generated, dict[str, Float[Array, " N"]]]:
    """One rollout call: sample the rows' groups, decode, and score with every device term, in
    one compiled program (nothing comes back to the host)."""
    generated = rollout.generate(policy, rows, key, first)
    return generated, score_terms(terms, generated.samples, rows)


@eqx.filter_jit
def advantages_program(
    scores: dict[str, Float[Array, " N"]],
    weights: dict[str, float],
    groups: int,
    std: AdvantageStd,
    combination: RewardCombination,
) -> tuple[Float[Array, " N"], Float[Array, " N"]]:
    """The weighted total of the device terms' scores and its group advantages, on the
    device: of the total (`"sum"`), or each term normalised in its group then weighted
    (`"normalize_each"`, as `per_reward_advantages`)."""
    names = sorted(scores)
    total = sum(weights[name] * scores[name] for name in names)
    assert isinstance(total, jax.Array)
    if combination == "sum":
        return total, device_group_advantages(total, groups, std=std)
    advantages = sum(
        weights[name] * device_group_advantages(scores[name], groups, std=std) for name in names
    )
    assert isinstance(advantages, jax.Array)
    return total, advantages


@eqx.filter_jit
def evaluation_program(
    flow: GuidedFlow,
    steps: int,
    policy: Any,
    rows: dict[str, Any],
    noise: Float[Array, "N ..."],
    terms: Sequence[DeviceTerm],
) -> tuple[Float[Array, "N ..."], dict[str, Float[Array, " N"]]]:
    """One evaluation call: the ODE (Euler) from fixed noise, decoded and scored with every
    device term."""
    latents = flow.sample_latents(policy, rows, noise, Euler(), steps)
    samples = flow.decode(latents)
    return samples, score_terms(terms, samples, rows)


def _shapes(tree: Any) -> Any:
    """`tree` with every array replaced by its `jax.ShapeDtypeStruct`."""
    return jax.tree.map(
        lambda leaf: (
            jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)  # type: ignore[no-untyped-call]
            if eqx.is_array(leaf)
            else leaf
        ),
        tree,
    )


def _shapes_only_flow(flow: GuidedFlow) -> GuidedFlow:
    """The flow with its model's arrays as shapes (its inputs' null row stays)."""
    stripped: GuidedFlow = eqx.tree_at(lambda f: f.model, flow, _shapes(flow.model))
    return stripped


def _shapes_only(objective: AbstractRLObjective[Any, Any]) -> AbstractRLObjective[Any, Any]:
    """The objective with its flow's model and its `pretrained` policy as shapes."""
    stripped = eqx.tree_at(lambda o: o.flow, objective, _shapes_only_flow(objective.flow))
    if objective.pretrained is not None:
        stripped = eqx.tree_at(
            lambda o: o.pretrained,
            stripped,
            _shapes(objective.pretrained),
            is_leaf=lambda x: x is None,
        )
    result: AbstractRLObjective[Any, Any] = stripped
    return result
