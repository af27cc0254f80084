"""The main job: pretrain (or load) a base model on the shapes task, measure it, fine-tune it
with Flow-GRPO, and measure again.

Everything random derives from `JobConfig.seed`, the step counters and the epoch index, so
a run resumed from its latest checkpoint ends exactly as an uninterrupted one.
"""

import dataclasses
import json
import pathlib
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jax.sharding import Mesh

from .. import lora
from .._custom_types import Step
from .._distributed import data_mesh, local_copy, owned_rows, process_counts, replicate
from .._flow_base import Variables
from .._inputs import CFG, InputSpec
from .._misc import leading_rows, select_rows
from .._objective import FlowGRPOObjective
from .._process import RectifiedFlow
from .._reward import FlowReward, JpegIncompressibility, load_reward
from .._rollout import FlowRollout
from .._sde import FlowSDE, window_for_indices
from ..models import DiT
from ..train import (
    Checkpointer,
    FlowMatchingObjective,
    MetricsLog,
    SupervisedBatch,
    Trainer,
    TrainState,
    default_optimizer,
    flow_grpo_epoch,
    load_model,
    minibatch_count,
    save_model,
    supervised_steps,
)
from ._progress import Progress
from .config import JobConfig
from .report import plot_curve
from .task import NULL_TOKEN, PROMPT_LENGTH, VOCAB_SIZE, ShapesReward, ShapesTask


def _silent(message: str) -> None:
    del message


SHIPPED_DIR = pathlib.Path(__file__).resolve().parent / "checkpoints"
"""Where the shipped base models live, named `base_<fingerprint>.eqx`."""


class ShapesJob:
    """The pieces of the main job for one config: task, model, objectives, trainers.

    **Arguments:**

    - `config`: the `JobConfig`.
    - `out`: the run directory.
    - `quiet`: no progress bars.
    """

    def __init__(self, config: JobConfig, out: str | pathlib.Path, quiet: bool = False):
        self.config = config
        self.out = pathlib.Path(out)
        self.quiet = quiet
        self.task = ShapesTask()
        self.reward: FlowReward
        if config.custom_reward is not None:
            self.reward = load_reward(config.custom_reward)
        elif config.reward == "jpeg_incompressibility":
            # Dense even for an untrained model: used by the tiny smoke preset.
            self.reward = JpegIncompressibility()
        else:
            self.reward = ShapesReward(self.task, kind=config.reward)
        self.inputs = InputSpec(
            select="tokens",
            null=jnp.full((PROMPT_LENGTH,), NULL_TOKEN, jnp.int32),
            latent_shape=self.task.image_shape,
            caption=lambda rows: [self.task.caption(t) for t in np.asarray(rows["tokens"])],
        )
        self.model = DiT(
            image_size=self.task.image_shape[0],
            channels=self.task.image_shape[2],
            patch=config.patch,
            width=config.width,
            depth=config.depth,
            heads=config.heads,
            vocab_size=VOCAB_SIZE + 1,
            prompt_length=PROMPT_LENGTH,
            key=jax.random.key(config.seed),
        )
        self.guidance = CFG(config.guidance_scale)

    # -- the base model --------------------------------------------------------------

    def pretrain_objective(self) -> FlowMatchingObjective:
        return FlowMatchingObjective(
            self.model,
            RectifiedFlow(),
            self.inputs,
            guidance=self.guidance,
            steps=self.config.eval_steps,
            cond_dropout=self.config.cond_dropout,
        )

    def base_paths(self) -> list[pathlib.Path]:
        name = f"base_{self.config.base_fingerprint()}.eqx"
        return [self.out / name, SHIPPED_DIR / name]

    def pretrain(self, log: Callable[[str], None] = print) -> Any:
        """Flow-matching pretraining on rendered images of every prompt; returns the model."""
        config = self.config
        trainer = Trainer(self.pretrain_objective(), default_optimizer(config.pretrain_lr, 0.0))
        state = trainer.init(jax.random.key(config.seed + 1))
        prompts = self.task.rows("all")["tokens"]

        def make_batch(index: int) -> SupervisedBatch:
            rng = np.random.default_rng([config.seed, index])
            tokens = prompts[rng.integers(0, len(prompts), config.pretrain_batch)]
            images = self.task.render(tokens, rng)
            return SupervisedBatch(data=jnp.asarray(images), cond={"tokens": jnp.asarray(tokens)})

        progress = Progress(config.pretrain_steps, "pretrain", disable=self.quiet)
        metrics_log = MetricsLog(self.out / "pretrain_metrics.jsonl")

        def on_step(index: int, metrics: dict[str, float]) -> None:
            progress.update(1, loss=metrics["loss"])
            if (index + 1) % 100 == 0:
                metrics_log.write({"phase": "pretrain", "step": index + 1, **metrics})

        state, _ = supervised_steps(trainer, state, make_batch, 0, config.pretrain_steps, on_step)
        progress.close()
        return state.variables.policy

    def base_model(self, log: Callable[[str], None] = print) -> tuple[Any, str]:
        """The base model: cached in the run folder, shipped, or pretrained now."""
        for path in self.base_paths():
            if path.exists():
                return load_model(path, self.model), str(path)
        log(f"No base checkpoint for fingerprint {self.config.base_fingerprint()}; pretraining.")
        model = self.pretrain(log)
        save_model(self.base_paths()[0], model)
        return model, "pretrained now"

    def saved_base(self, *folders: pathlib.Path) -> Any:
        """The saved base model `base_<fingerprint>.eqx`, looked for in `folders`, then
        where `base_model` looks; never pretrained.

        **Raises:**

        - `FileNotFoundError`: naming the file, if it is nowhere.
        """
        name = f"base_{self.config.base_fingerprint()}.eqx"
        for path in [folder / name for folder in folders] + self.base_paths():
            if path.exists():
                return load_model(path, self.model)
        raise FileNotFoundError(f"No base model {name} in {[*folders, *self.base_paths()]}.")

    # -- LoRA -------------------------------------------------------------------------

    def policy(self, base: Any) -> Any:
        """The policy Flow-GRPO trains: `base` itself, or with `lora_rank > 0` a
        `lora.LoraModel` with adapters on every linear layer of `base` (only they train)."""
        config = self.config
        if config.lora_rank == 0:
            return base
        return lora.add(
            base,
            config.lora_rank,
            alpha=config.lora_scale_numerator,
            key=jax.random.key(config.seed + 4),
        )

    def checkpoint_metadata(self, base: Any) -> dict[str, Any]:
        """What a checkpoint records besides the state: the base model's `lora.fingerprint`
        when the policy has adapters (the state is stored without the base)."""
        if self.config.lora_rank == 0:
            return {}
        return {"lora_base_fingerprint": lora.fingerprint(base)}

    def from_checkpoint(
        self, stored: Any, like: TrainState, metadata: dict[str, Any], path: pathlib.Path
    ) -> TrainState:
        """The train state from what a checkpoint stored (`lora.without_bases(state)`).

        **Arguments:**

        - `stored`: the restored tree, of the structure of `lora.without_bases(like)`.
        - `like`: a fresh state whose policy holds this run's base model.
        - `metadata`: the checkpoint's metadata.
        - `path`: the checkpoint (or its folder), for the message.

        **Raises:**

        - `ValueError`: naming the checkpoint and both fingerprints, if its adapters belong
            to another base model than this run's.
        """
        if lora.has_adapters(like.variables.policy):
            found = lora.fingerprint(lora.base(like.variables.policy))
            recorded = metadata.get("lora_base_fingerprint")
            if recorded != found:
                raise ValueError(
                    f"Checkpoint {path} holds adapters for the base model with fingerprint "
                    f"{recorded}, but this run's base model has fingerprint {found}."
                )
        restored: TrainState = lora.with_bases(stored, like)
        return restored

    def save_policy(self, policy: Any) -> pathlib.Path:
        """Export the trained policy: `policy.eqx`, or for a policy with adapters only the
        adapters and the base's fingerprint, `policy.lora` (`lora.save_adapters`)."""
        if lora.has_adapters(policy):
            path = self.out / "policy.lora"
            lora.save_adapters(path, policy)
        else:
            path = self.out / "policy.eqx"
            save_model(path, policy)
        return path

    # -- Flow-GRPO --------------------------------------------------------------------

    def sde_window(self) -> tuple[float, float] | None:
        """The SDE window of `sde_steps` (the leading rollout transitions that sample noise;
        the rest are ODE steps, as Flow-GRPO-Fast), or `None` when every transition does."""
        config = self.config
        if config.sde_steps is None:
            return None
        grid = RectifiedFlow().timesteps(config.rollout_steps)
        return window_for_indices(grid, 0, config.sde_steps)

    def objective(self, base: Any) -> FlowGRPOObjective:
        config = self.config
        return FlowGRPOObjective(
            self.model,
            RectifiedFlow(),
            self.inputs,
            sde=FlowSDE(config.noise_level, window=self.sde_window()),
            beta=config.beta,
            clip_range=config.clip_range,
            adv_clip_max=config.adv_clip_max,
            guidance=self.guidance,
            steps=config.eval_steps,
            pretrained=base,
            transition_chunk=config.transition_chunk,
        )

    def rollout(self, objective: FlowGRPOObjective, mesh: Mesh | None = None) -> FlowRollout:
        config = self.config
        return FlowRollout(
            objective,
            self.reward,
            groups=config.groups,
            steps=config.rollout_steps,
            train_steps=config.train_steps,
            mesh=mesh,
        )

    def updates(self) -> int:
        """How many optimizer updates the Flow-GRPO run makes (epochs x inner epochs x
        minibatches per rollout)."""
        config = self.config
        rows = config.rollout_rows
        size = rows if config.minibatch_rows is None else config.minibatch_rows
        return config.epochs * config.inner_epochs * minibatch_count(rows, size)

    def trainer(self, objective: FlowGRPOObjective) -> Trainer:
        config = self.config
        updates = self.updates()
        optimizer = default_optimizer(
            config.learning_rate,
            config.weight_decay,
            config.max_grad_norm,
            decay_steps=updates if config.lr_schedule == "cosine" else None,
        )
        return Trainer(objective, optimizer, ema_decay=config.ema_decay)

    def epoch_rows(self, epoch: int) -> dict[str, npt.NDArray[Any]]:
        """The training prompts of one epoch, drawn without replacement from the train split."""
        rows = self.task.rows("train")
        rng = np.random.default_rng([self.config.seed, 7, epoch])
        count = min(self.config.prompts_per_epoch, leading_rows(rows))
        picked: dict[str, npt.NDArray[Any]] = select_rows(
            rows, rng.permutation(leading_rows(rows))[:count]
        )
        return picked

    # -- measurement ------------------------------------------------------------------

    def measure(self, objective: FlowGRPOObjective, variables: Variables) -> dict[str, Any]:
        """Held-out strict accuracy, reward and diversity, with fixed noise (ODE sampling)."""
        per_prompt = self.config.eval_samples_per_prompt
        rows = self.task.rows("heldout")
        tokens = np.repeat(rows["tokens"], per_prompt, axis=0)
        step = Step(index=0, key=jax.random.key(10_000 + self.config.seed))
        variables = local_copy(variables)
        evaluation = objective.evaluate(variables, {"tokens": jnp.asarray(tokens)}, step)
        samples = np.asarray(evaluation.samples, np.float64)
        check = self.task.check(samples, tokens)
        grouped = samples.reshape(len(rows["tokens"]), per_prompt, -1)
        distances = [
            np.sqrt(np.mean((g[i] - g[j]) ** 2))
            for g in grouped
            for i in range(per_prompt)
            for j in range(i + 1, per_prompt)
        ]
        return {
            "accuracy": float(check.strict.mean()),
            "reward": float(check.partial.mean()),
            "diversity": float(np.mean(distances)) if distances else 0.0,
        }

    def preview(
        self, objective: FlowGRPOObjective, variables: Variables, path: pathlib.Path, title: str
    ) -> None:
        """Samples for the first held-out prompts with fixed noise, captioned with their
        partial scores, written by process 0."""
        if jax.process_index() != 0:
            return
        tokens = self.task.rows("heldout")["tokens"][: self.config.preview_prompts]
        objective.preview(
            local_copy(variables),
            {"tokens": jnp.asarray(tokens)},
            Step(index=0, key=jax.random.key(20_000 + self.config.seed)),
            scored=ShapesReward(self.task, kind="partial"),
            path=str(path),
            title=title,
        )


def run_train(
    config: JobConfig,
    out: str | pathlib.Path,
    *,
    resume: bool = False,
    quiet: bool = False,
    devices: int | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the main job and write the run folder; returns the summary.

    With several devices (or processes), rows are sharded over a data mesh and parameters
    replicated; process 0 alone scores rewards and writes files.

    **Arguments:**

    - `config`: the settings.
    - `out`: the run folder.
    - `resume`: continue from the latest checkpoint in `out/checkpoints`.
    - `quiet`: no progress bars.
    - `devices`: shard rows over this many devices (default: every device of every
        process; 1 turns sharding off).
    - `log`: where messages go (process 0 only).

    **Returns:**

    The summary (also written to `summary.json`).
    """
    started = time.perf_counter()
    out = pathlib.Path(out)
    root = jax.process_index() == 0
    if not root:
        log = _silent
        quiet = True
    out.mkdir(parents=True, exist_ok=True)
    if root:
        (out / "config.json").write_text(json.dumps(dataclasses.asdict(config), indent=2))
    job = ShapesJob(config, out, quiet)
    base, base_source = job.base_model(log)
    device_count = jax.device_count() if devices is None else devices
    mesh = data_mesh(device_count) if device_count > 1 else None
    objective = job.objective(job.policy(base))
    checkpoint_metadata = job.checkpoint_metadata(base)
    rollout = job.rollout(objective, mesh)
    trainer = job.trainer(objective)
    checkpoints = Checkpointer(out / "checkpoints", keep=config.keep_checkpoints)
    # Only process 0 keeps the run's files; the others write to no log at all.
    metrics = MetricsLog(out / "metrics.jsonl" if root else None)
    placement = MetricsLog(out / "distributed.jsonl" if root else None)
    state = trainer.init(jax.random.key(config.seed + 2))
    first_epoch = 0
    if resume and checkpoints.latest() is not None:
        stored, meta = checkpoints.restore(lora.without_bases(state))
        state = job.from_checkpoint(stored, state, meta, checkpoints.directory)
        first_epoch = int(meta["epoch"])
        base_measure = meta["base"]
        metrics.keep_only(lambda r: r.get("epoch", 0) <= first_epoch)
        placement.keep_only(lambda r: r.get("epoch", 0) <= first_epoch)
        log(f"Resumed from {checkpoints.latest()} at epoch {first_epoch}.")
    else:
        metrics.clear()
        placement.clear()
        base_measure = job.measure(objective, state.variables)
        job.preview(
            objective,
            state.variables,
            out / "samples_before.png",
            f"base model: held-out accuracy {base_measure['accuracy']:.2f}",
        )
        metrics.write(
            {
                "epoch": 0,
                "heldout_accuracy": base_measure["accuracy"],
                "heldout_reward": base_measure["reward"],
            }
        )
    if mesh is not None:
        state = replicate(state, mesh)
    log(
        f"Base model ({base_source}): held-out accuracy {base_measure['accuracy']:.3f}, "
        f"reward {base_measure['reward']:.3f}, diversity {base_measure['diversity']:.3f}"
    )
    run_key = jax.random.key(config.seed + 3)
    progress = Progress(config.epochs, "flow-grpo", disable=quiet, initial=first_epoch)
    for epoch in range(first_epoch + 1, config.epochs + 1):
        state, summary, info = flow_grpo_epoch(
            trainer,
            state,
            rollout,
            job.epoch_rows(epoch),
            jax.random.fold_in(run_key, epoch),
            inner_epochs=config.inner_epochs,
            minibatch_rows=config.minibatch_rows,
        )
        placement.write(
            {
                "epoch": epoch,
                "processes": jax.process_count(),
                "devices": 1 if mesh is None else int(mesh.devices.size),
                "reward_calls_per_process": process_counts(info.reward_calls_here),
                "rows_per_process": process_counts(owned_rows(info.samples)),
                "rows_total": int(info.samples.shape[0]),
            }
        )
        record: dict[str, Any] = {"epoch": epoch, **summary}
        if epoch % config.eval_every == 0 or epoch == config.epochs:
            measured = job.measure(objective, state.variables)
            record.update(heldout_accuracy=measured["accuracy"], heldout_reward=measured["reward"])
        metrics.write(record)
        progress.update(
            1,
            reward=summary["reward_mean"],
            loss=summary.get("loss", 0.0),
            acc=record.get("heldout_accuracy"),
        )
        if epoch % config.checkpoint_every == 0 or epoch == config.epochs:
            if root:
                checkpoints.save(
                    epoch,
                    lora.without_bases(local_copy(state)),
                    {"epoch": epoch, "base": base_measure, **checkpoint_metadata},
                )
    progress.close()
    final = job.measure(objective, state.variables)
    if not root:
        return {"process_index": jax.process_index()}
    job.preview(
        objective,
        state.variables,
        out / "samples_after.png",
        f"after Flow-GRPO: held-out accuracy {final['accuracy']:.2f}",
    )
    job.save_policy(local_copy(state.variables.policy))
    records = metrics.read()
    plot_curve(records, out / "reward_curve.png")
    train_rewards = [r["reward_mean"] for r in records if "reward_mean" in r]
    summary_out = {
        "base_accuracy": base_measure["accuracy"],
        "final_accuracy": final["accuracy"],
        "base_reward": base_measure["reward"],
        "final_reward": final["reward"],
        "base_diversity": base_measure["diversity"],
        "final_diversity": final["diversity"],
        "train_reward_first_epoch": train_rewards[0] if train_rewards else None,
        "train_reward_last_epoch": train_rewards[-1] if train_rewards else None,
        "epochs": config.epochs,
        "base_source": base_source,
        "processes": jax.process_count(),
        "devices": 1 if mesh is None else int(mesh.devices.size),
        "wall_seconds": time.perf_counter() - started,
        "resumed": resume,
    }
    (out / "summary.json").write_text(json.dumps(summary_out, indent=2))
    log(
        f"Final: held-out accuracy {final['accuracy']:.3f} (base {base_measure['accuracy']:.3f}), "
        f"diversity {final['diversity']:.3f} (base {base_measure['diversity']:.3f})."
    )
    return summary_out


def run_pretrain(
    config: JobConfig,
    out: str | pathlib.Path,
    *,
    quiet: bool = False,
    log: Callable[[str], None] = print,
) -> pathlib.Path:
    """Pretrain the base model and write it as `out/base_<fingerprint>.eqx`."""
    job = ShapesJob(config, out, quiet)
    pathlib.Path(out).mkdir(parents=True, exist_ok=True)
    model = job.pretrain(log)
    path = job.base_paths()[0]
    save_model(path, model)
    objective = job.objective(model)
    measured = job.measure(objective, objective.init(jax.random.key(0)))
    log(
        f"Wrote {path}: held-out accuracy {measured['accuracy']:.3f}, "
        f"reward {measured['reward']:.3f}, diversity {measured['diversity']:.3f}"
    )
    return path


def run_eval(
    config: JobConfig,
    checkpoint: str | pathlib.Path,
    out: str | pathlib.Path,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Measure a saved policy (`policy.eqx`, `policy.lora` with its run's base model beside
    it, a base `.eqx`, or a checkpoint folder)."""
    job = ShapesJob(config, out, True)
    path = pathlib.Path(checkpoint)
    if path.is_dir():
        start = job.policy(job.saved_base(path.parent.parent)) if config.lora_rank else job.model
        trainer = job.trainer(job.objective(start))
        like: TrainState = trainer.init(jax.random.key(0))
        stored, meta = Checkpointer(path.parent).restore(lora.without_bases(like), path)
        policy = job.from_checkpoint(stored, like, meta, path).variables.policy
    elif path.suffix == ".lora":
        policy = lora.load_adapters(path, job.saved_base(path.parent))
    else:
        policy = load_model(path, job.model)
    objective = job.objective(policy)
    variables = objective.init(jax.random.key(0))
    measured = job.measure(objective, variables)
    pathlib.Path(out).mkdir(parents=True, exist_ok=True)
    job.preview(
        objective,
        variables,
        pathlib.Path(out) / "samples_eval.png",
        f"{path.name}: held-out accuracy {measured['accuracy']:.2f}",
    )
    log(json.dumps(measured))
    return measured
