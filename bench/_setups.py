"""The two benchmarked configurations, built only from the library's public API.

- `mlp_setup`: `MLPVelocity(latent_dim=64, cond_dim=16, hidden=512, depth=4)`, N = 32 samples
  (8 source rows x 4 groups), K = 10 transitions (rollout steps = 11), CFG 4.5, beta 0.04,
  AdamW (`default_optimizer`), and a cheap float64 numpy reward on the host.
- `dit_setup`: the demo task's `DiT` at the settings of `flowgrpo_eqx.shapes_demo.make_config()`
  (read at run time), scored by `ShapesReward`, with fewer source rows (smaller N) for time.
"""

import dataclasses
import tempfile
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt

import flowgrpo_eqx as fg
from flowgrpo_eqx.models import MLPVelocity
from flowgrpo_eqx.shapes_demo import PROMPT_LENGTH, ShapesJob, make_config
from flowgrpo_eqx.train import Trainer, default_optimizer


@dataclasses.dataclass
class Setup:
    """One benchmarked configuration.

    - `make_objective(chunk)`: the objective with `transition_chunk=chunk` (else identical).
    - `make_trainer(objective)`: the trainer (same optimizer and settings) for an objective.
    - `rows(epoch)`: the source rows of one epoch (same shapes every epoch).
    - `analytic_flops(inputs)`: matmul FLOPs of one training step whose guided model batch
      has `inputs` rows, or `None` where not counted analytically.
    - `layer_dims`: `(in, out)` of the model's dense layers (MLP), for the matmul-at-the-
      model's-shapes diagnostic; `None` where the model is not a plain stack of layers.
    """

    name: str
    objective: fg.FlowGRPOObjective
    rollout: fg.FlowRollout
    trainer: Trainer
    make_objective: Callable[[int | None], fg.FlowGRPOObjective]
    make_trainer: Callable[[fg.FlowGRPOObjective], Trainer]
    rows: Callable[[int], Any]
    config: dict[str, Any]
    analytic_flops: Callable[[int], float] | None = None
    layer_dims: list[tuple[int, int]] | None = None


class TargetReward:
    """A cheap host reward: minus the float64 mean squared distance of the first
    `cond_dim` sample coordinates from `tanh(cond)`."""

    name = "target_distance"

    def __call__(self, samples: npt.NDArray[Any], rows: Any) -> npt.NDArray[np.float64]:
        cond = np.asarray(rows, dtype=np.float64)
        head = np.asarray(samples, dtype=np.float64)[:, : cond.shape[1]]
        scores: npt.NDArray[np.float64] = -np.mean((head - np.tanh(cond)) ** 2, axis=1)
        return scores


def mlp_setup(quick: bool) -> Setup:
    del quick  # the default config is the acceptance config in both modes
    latent_dim, cond_dim, hidden, depth = 64, 16, 512, 4
    prompts, groups, steps, beta, scale = 8, 4, 11, 0.04, 4.5
    model = MLPVelocity(
        latent_dim=latent_dim, cond_dim=cond_dim, hidden=hidden, depth=depth, key=jax.random.key(0)
    )
    inputs = fg.InputSpec(null=jnp.zeros(cond_dim), latent_shape=(latent_dim,))

    def make_objective(chunk: int | None) -> fg.FlowGRPOObjective:
        return fg.FlowGRPOObjective(
            model,
            fg.RectifiedFlow(),
            inputs,
            beta=beta,
            guidance=fg.CFG(scale),
            transition_chunk=chunk,
        )

    optimizer = default_optimizer(1e-4)

    def make_trainer(objective: fg.FlowGRPOObjective) -> Trainer:
        return Trainer(objective, optimizer)

    objective = make_objective(None)
    rollout = fg.FlowRollout(objective, TargetReward(), groups=groups, steps=steps)

    def rows(epoch: int) -> npt.NDArray[np.float32]:
        rng = np.random.default_rng([0, epoch])
        return rng.normal(size=(prompts, cond_dim)).astype(np.float32)

    in_size = latent_dim + model.time_features + cond_dim
    dims = [(in_size, hidden)] + [(hidden, hidden)] * (depth - 1) + [(hidden, latent_dim)]
    weights = sum(i * o for i, o in dims)

    def analytic_flops(inputs_: int) -> float:
        # 2 FLOPs per weight per example per forward; the policy's forward and backward are
        # 3 forwards, the reference (beta > 0) one more.
        passes = 3 + (1 if beta > 0 else 0)
        return float(2 * weights * inputs_ * passes)

    config = {
        "model": f"MLPVelocity(latent_dim={latent_dim}, cond_dim={cond_dim}, hidden={hidden}, "
        f"depth={depth})",
        "parameters": int(sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))),
        "N": prompts * groups,
        "source_rows": prompts,
        "groups": groups,
        "K": steps - 1,
        "rollout_steps": steps,
        "guidance": scale,
        "beta": beta,
        "optimizer": "default_optimizer(1e-4): AdamW, clip_by_global_norm(1.0)",
        "reward": "host numpy float64: -mean((x[:, :16] - tanh(cond))^2)",
        "transition_chunk": None,
    }
    return Setup(
        name="mlp",
        objective=objective,
        rollout=rollout,
        trainer=make_trainer(objective),
        make_objective=make_objective,
        make_trainer=make_trainer,
        rows=rows,
        config=config,
        analytic_flops=analytic_flops,
        layer_dims=dims,
    )


def _perturb_zero_leaves(model: Any, scale: float, key: Any) -> Any:
    """Give the zero-initialised (adaLN-Zero) layers small values, as a trained model has.

    A fresh DiT's velocity is exactly 0, which would make every reward equal and every
    transition masked; the work is the same either way, but a trained-like model keeps the
    benchmark representative of a real run (and away from zero-only arithmetic).
    """
    leaves, treedef = jax.tree.flatten(model)
    out = []
    for index, leaf in enumerate(leaves):
        if eqx.is_inexact_array(leaf) and not bool(jnp.any(leaf != 0)):
            noise = np.random.default_rng([int(key), index]).normal(size=leaf.shape)
            leaf = jnp.asarray(scale * noise, leaf.dtype)
        out.append(leaf)
    return jax.tree.unflatten(treedef, out)


def dit_setup(quick: bool) -> Setup:
    job_config = make_config()
    prompts = 1 if quick else 2
    # The main job's own pieces (model, inputs, objective, rollout, trainer), on fewer prompts.
    # One update over the whole rollout, as measured here (the job's minibatches need more rows).
    config = job_config.replace(prompts_per_epoch=prompts, minibatch_rows=None)
    scratch = tempfile.mkdtemp(prefix="flowgrpo-bench-")
    job = ShapesJob(config, scratch, quiet=True)
    task = job.task
    model = _perturb_zero_leaves(job.model, 0.02, config.training.seed)

    def make_objective(chunk: int | None) -> fg.FlowGRPOObjective:
        chunked = config.replace(transition_chunk=chunk)
        return ShapesJob(chunked, scratch, quiet=True).flow_grpo_objective(model)

    def make_trainer(objective: fg.FlowGRPOObjective) -> Trainer:
        return job.trainer(objective)

    objective = make_objective(config.objective.transition_chunk)
    rollout = job.rollout(objective)
    rows = job.epoch_rows

    rollout_settings, model_settings = config.rollout, config.model
    training, objective_settings = config.training, config.objective
    train_steps = rollout_settings.train_steps
    recorded = rollout_settings.rollout_steps - 1 if train_steps is None else train_steps
    info = {
        "model": f"DiT(width={model_settings.width}, depth={model_settings.depth}, "
        f"heads={model_settings.heads}, patch={model_settings.patch}) on {task.image_shape} "
        f"images, prompt length {PROMPT_LENGTH}",
        "settings_from": "flowgrpo_eqx.shapes_demo.make_config() (JobConfig defaults)",
        "weights": "fresh init (seed from JobConfig) with the zero-initialised adaLN layers "
        "given N(0, 0.02^2) values; no pretraining",
        "parameters": int(sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))),
        "N": prompts * rollout_settings.groups,
        "source_rows": prompts,
        "groups": rollout_settings.groups,
        "job_N": job_config.rollout.prompts_per_epoch * rollout_settings.groups,
        "K": recorded,
        "rollout_steps": rollout_settings.rollout_steps,
        "guidance": rollout_settings.guidance_scale,
        "beta": objective_settings.beta,
        "noise_level": rollout_settings.noise_level,
        "optimizer": f"default_optimizer({training.learning_rate}, {training.weight_decay}, "
        f"{training.max_grad_norm})",
        "reward": f"ShapesReward(kind={config.rewards.reward!r})",
        "transition_chunk": objective_settings.transition_chunk,
    }
    return Setup(
        name="dit",
        objective=objective,
        rollout=rollout,
        trainer=make_trainer(objective),
        make_objective=make_objective,
        make_trainer=make_trainer,
        rows=rows,
        config=info,
    )
