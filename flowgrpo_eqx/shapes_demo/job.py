"""The main job: pretrain (or load) a base model on the shapes task, measure it, fine-tune it
with Flow-GRPO, and measure again.

The base model derives from `JobConfig.pretrain_seed`, the Flow-GRPO run from `seed` (with
the step counters and the epoch index), and the held-out evaluation's noise from `eval_seed`;
a run resumed from its latest checkpoint ends exactly as an uninterrupted one.
"""

import dataclasses
import json
import pathlib
import shutil
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jax.sharding import Mesh
from jaxtyping import Array

from .. import lora
from .._custom_types import Step, Transitions
from .._distributed import (
    data_mesh,
    device_fraction,
    host_samples,
    local_copy,
    owned_rows,
    process_counts,
    shard_parameters,
)
from .._flow_base import AbstractVariables
from .._http_reward import HttpReward
from .._inputs import CFG, InputSpec
from .._misc import leading_rows, select_rows
from .._nft import DiffusionNFTObjective
from .._objective import FlowGRPOObjective, GRPOGuard
from .._process import RectifiedFlow
from .._reward import (
    FlowReward,
    JpegCompressibility,
    JpegIncompressibility,
    WeightedReward,
    load_reward,
)
from .._rl import AbstractRLObjective
from .._rollout import FlowRollout, RolloutInfo
from .._sde import FlowSDE, window_for_indices
from .._window import AbstractWindowSchedule, RandomWindow, SlidingWindow
from ..models import DiT
from ..train import (
    Checkpointer,
    FlowMatchingObjective,
    MetricsLog,
    SupervisedBatch,
    Trainer,
    TrainState,
    default_optimizer,
    load_model,
    minibatch_count,
    rl_epoch,
    save_model,
    supervised_steps,
)
from ..train._preemption import GracefulStop
from ..train._writers import MetricsWriter, make_writers
from ._progress import Progress
from .config import JobConfig, config_to_toml, parse_reward_weights
from .report import plot_curve, plot_seed_curves
from .task import NULL_TOKEN, PROMPT_LENGTH, VOCAB_SIZE, ShapesReward, ShapesTask


def _silent(message: str) -> None:
    del message


BUILTIN_REWARDS: dict[str, Callable[[], FlowReward]] = {
    "partial": lambda: ShapesReward(ShapesTask(), kind="partial"),
    "strict": lambda: ShapesReward(ShapesTask(), kind="strict"),
    # Dense even for an untrained model: used by the tiny smoke preset.
    "jpeg_incompressibility": JpegIncompressibility,
    "jpeg_compressibility": JpegCompressibility,
}
"""The rewards `--reward` and `flowgrpo-eqx serve-reward` know by name."""

SHIPPED_DIR = pathlib.Path(__file__).resolve().parent / "checkpoints"
"""Where the shipped base models live, named `base_<fingerprint>.eqx`."""


class ShapesJob:
    """The pieces of the main job for one config: task, model, objectives, trainers.

    **Arguments:**

    - `config`: the `JobConfig`.
    - `out`: the run directory.
    - `quiet`: no progress bars.
    """

    def __init__(
        self,
        config: JobConfig,
        out: str | pathlib.Path,
        quiet: bool = False,
        *,
        reward_token: str | None = None,
    ):
        self.config = config
        self.out = pathlib.Path(out)
        self.quiet = quiet
        self.task = ShapesTask()
        self.reward: FlowReward
        if config.custom_reward is not None:
            self.reward = load_reward(config.custom_reward)
        elif config.reward_url is not None:
            self.reward = HttpReward(
                config.reward_url,
                timeout=config.reward_timeout,
                retries=config.reward_retries,
                token=reward_token,
            )
        elif config.reward_weights is not None:
            weights = parse_reward_weights(config.reward_weights)
            self.reward = WeightedReward(
                [(BUILTIN_REWARDS[name](), weight) for name, weight in weights.items()]
            )
        else:
            self.reward = BUILTIN_REWARDS[config.reward]()
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
            key=jax.random.key(config.pretrain_seed),
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
        state = trainer.init(jax.random.key(config.pretrain_seed + 1))
        prompts = self.task.rows("all")["tokens"]

        def make_batch(index: int) -> SupervisedBatch:
            rng = np.random.default_rng([config.pretrain_seed, index])
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
        if config.sde_steps is None or config.window_schedule != "fixed":
            return None
        grid = RectifiedFlow().timesteps(config.rollout_steps)
        return window_for_indices(grid, 0, config.sde_steps)

    def sde(self) -> FlowSDE:
        """The rollout's SDE: `noise_level`, stochastic on `sde_window()`."""
        return FlowSDE(self.config.noise_level, window=self.sde_window())

    def objective(self, base: Any) -> FlowGRPOObjective:
        config = self.config
        old_log_probs = config.old_log_probs
        if old_log_probs is None:
            old_log_probs = "update" if config.precision == "bfloat16" else "rollout"
        return FlowGRPOObjective(
            self.model,
            RectifiedFlow(),
            self.inputs,
            sde=self.sde(),
            beta=config.beta,
            clip_range=config.clip_range,
            adv_clip_max=config.adv_clip_max,
            guidance=self.guidance,
            steps=config.eval_steps,
            pretrained=base,
            transition_chunk=config.transition_chunk,
            guard=GRPOGuard() if config.grpo_guard else None,
            precision=config.precision,
            old_log_probs=old_log_probs,
        )

    def nft_objective(self, base: Any) -> DiffusionNFTObjective:
        """DiffusionNFT's objective for `--algorithm nft`: `adv_clip_max` is its `A_max`, and
        its old policy follows the live one once per epoch with `nft_old_decay`."""
        config = self.config
        return DiffusionNFTObjective(
            self.model,
            RectifiedFlow(),
            self.inputs,
            beta=config.nft_beta,
            adv_max=config.adv_clip_max,
            old_decay=config.nft_old_decay,
            guidance=self.guidance,
            steps=config.eval_steps,
            pretrained=base,
            precision=config.precision,
        )

    def train_objective(self, base: Any) -> AbstractRLObjective[Any, Any]:
        """The objective the trainer trains: `objective(base)`, or with `--algorithm nft`
        `nft_objective(base)` (the rollout samples with the same SDE either way)."""
        if self.config.algorithm == "nft":
            return self.nft_objective(base)
        return self.objective(base)

    def rollout(
        self, objective: AbstractRLObjective[Any, Any], mesh: Mesh | None = None
    ) -> FlowRollout:
        """The rollout of `objective`'s guided flow with the job's SDE (`sde()`)."""
        config = self.config
        return FlowRollout(
            objective.flow,
            self.sde(),
            self.reward,
            groups=config.groups,
            steps=config.rollout_steps,
            train_steps=config.train_steps if config.window_schedule == "fixed" else None,
            shared_noise=config.shared_noise,
            reward_combination=config.reward_combination,
            window_schedule=self.window_schedule(),
            mesh=mesh,
        )

    def window_schedule(self) -> AbstractWindowSchedule | None:
        """`None` for the fixed leading window (the SDE's `window`), else a schedule of
        `sde_steps` stochastic, trained transitions."""
        config = self.config
        count = config.sde_steps if config.sde_steps is not None else config.rollout_steps - 1
        if config.window_schedule == "random":
            return RandomWindow(count)
        if config.window_schedule == "sliding":
            return SlidingWindow(
                count, shift_every=config.window_shift_every, stride=config.window_stride
            )
        return None

    def updates(self) -> int:
        """How many optimizer updates the Flow-GRPO run makes (epochs x inner epochs x
        minibatches per rollout)."""
        config = self.config
        rows = config.rollout_rows
        size = rows if config.minibatch_rows is None else config.minibatch_rows
        return config.epochs * config.inner_epochs * minibatch_count(rows, size)

    def trainer(self, objective: AbstractRLObjective[Any, Any]) -> Trainer:
        """The trainer of `objective`, with the job's optimizer and `ema_decay`."""
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

    def measure(self, objective: FlowGRPOObjective, variables: AbstractVariables) -> dict[str, Any]:
        """Held-out strict accuracy, reward and diversity, with fixed noise (ODE sampling)."""
        per_prompt = self.config.eval_samples_per_prompt
        rows = self.task.rows("heldout")
        tokens = np.repeat(rows["tokens"], per_prompt, axis=0)
        step = Step(index=0, key=jax.random.key(10_000 + self.config.eval_seed))
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
        self,
        objective: FlowGRPOObjective,
        variables: AbstractVariables,
        path: pathlib.Path,
        title: str,
    ) -> None:
        """Samples for the first held-out prompts with fixed noise, captioned with their
        partial scores, written by process 0 (every process takes part in gathering sharded
        parameters)."""
        variables = local_copy(variables)
        if jax.process_index() != 0:
            return
        tokens = self.task.rows("heldout")["tokens"][: self.config.preview_prompts]
        objective.preview(
            variables,
            {"tokens": jnp.asarray(tokens)},
            Step(index=0, key=jax.random.key(20_000 + self.config.eval_seed)),
            scored=ShapesReward(self.task, kind="partial"),
            path=str(path),
            title=title,
        )


@eqx.filter_jit
def _kept_ratios(
    objective: FlowGRPOObjective, variables: AbstractVariables, batch: Transitions
) -> tuple[Array, Array]:
    ratios = jnp.exp(objective.log_probs(variables, batch) - batch.old_log_probs)
    return ratios, objective.kept(batch)


def _log_distributions(
    writers: MetricsWriter | None, objective: FlowGRPOObjective, epoch: int
) -> Callable[[TrainState, Transitions, RolloutInfo], None]:
    """After an epoch's updates: histograms of the advantages and of the policy ratio of the
    kept transitions (run on every process, since gathering rows is collective)."""

    def record(state: TrainState, batch: Transitions, info: RolloutInfo) -> None:
        del info
        ratios, kept = _kept_ratios(objective, state.variables, batch)
        advantages = host_samples(batch.advantages)
        ratio_values = host_samples(ratios)[host_samples(kept)]
        if writers is not None:
            writers.histogram(epoch, "advantages", advantages)
            if ratio_values.size:
                writers.histogram(epoch, "policy_ratio", ratio_values)

    return record


def run_train(
    config: JobConfig,
    out: str | pathlib.Path,
    *,
    resume: bool = False,
    quiet: bool = False,
    devices: int | None = None,
    reward_token: str | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the main job and write the run folder; returns the summary.

    With several devices (or processes), rows are sharded over a data mesh and parameters
    replicated; process 0 alone scores rewards and writes files.

    On SIGTERM or SIGINT the run finishes the epoch in progress, writes a checkpoint, says so
    and returns `{"stopped_at_epoch": E, "preempted": True}` (the command line then exits with
    `PREEMPTED_EXIT_STATUS`); a second signal stops at once. With several processes every
    process stops after the same epoch. `resume=True` then continues to the result an
    uninterrupted run would have had.

    **Arguments:**

    - `config`: the settings.
    - `out`: the run folder.
    - `resume`: continue from the newest intact checkpoint in `out/checkpoints` (damaged
        ones are reported by path and skipped).
    - `quiet`: no progress bars.
    - `devices`: shard rows over this many devices (default: every device of every
        process; 1 turns sharding off).
    - `reward_token`: the token for `config.reward_url`'s server (default: the
        `FLOWGRPO_REWARD_TOKEN` environment variable).
    - `log`: where messages go (process 0 only).

    **Returns:**

    The summary (also written to `summary.json`), or the stop record after a signal.

    **Raises:**

    - `CheckpointError`: when resuming and checkpoints exist but none is intact.
    - `RewardError`: when the reward fails (the run folder keeps its last checkpoint).
    """
    started = time.perf_counter()
    out = pathlib.Path(out)
    root = jax.process_index() == 0
    if not root:
        log = _silent
        quiet = True
    out.mkdir(parents=True, exist_ok=True)
    if root:
        (out / "config.toml").write_text(config_to_toml(config))
    job = ShapesJob(config, out, quiet, reward_token=reward_token)
    base, base_source = job.base_model(log)
    device_count = jax.device_count() if devices is None else devices
    mesh = data_mesh(device_count) if device_count > 1 else None
    policy = job.policy(base)
    objective = job.objective(policy)
    checkpoint_metadata = job.checkpoint_metadata(base)
    trained = job.train_objective(policy)
    rollout = job.rollout(trained, mesh)
    trainer = job.trainer(trained)
    checkpoints = Checkpointer(out / "checkpoints", keep=config.keep_checkpoints)
    # Only process 0 keeps the run's files; the others write to no log at all.
    metrics = MetricsLog(out / "metrics.jsonl" if root else None)
    placement = MetricsLog(out / "distributed.jsonl" if root else None)
    writers = (
        make_writers(config.log, out, config=dataclasses.asdict(config))
        if root and config.log
        else None
    )
    try:
        with GracefulStop(log) as stop:
            return _train_epochs(
                job, objective, rollout, trainer, checkpoints, metrics, placement, writers,
                stop, mesh=mesh, resume=resume, quiet=quiet, log=log, started=started,
                base_source=base_source, checkpoint_metadata=checkpoint_metadata,
            )  # fmt: skip
    finally:
        if writers is not None:
            writers.close()


def _train_epochs(
    job: "ShapesJob",
    objective: FlowGRPOObjective,
    rollout: FlowRollout,
    trainer: Trainer,
    checkpoints: Checkpointer,
    metrics: MetricsLog,
    placement: MetricsLog,
    writers: MetricsWriter | None,
    stop: GracefulStop,
    *,
    mesh: Mesh | None,
    resume: bool,
    quiet: bool,
    log: Callable[[str], None],
    started: float,
    base_source: str,
    checkpoint_metadata: dict[str, Any],
) -> dict[str, Any]:
    config = job.config
    out = job.out
    root = jax.process_index() == 0
    state = trainer.init(jax.random.key(config.seed + 2))
    if mesh is not None:
        state = shard_parameters(
            state, mesh, config.param_sharding, min_elements=config.fsdp_min_elements
        )
    first_epoch = 0
    # Restored arrays take the shardings of this run's state, whatever mesh wrote them.
    found = checkpoints.restore_latest(lora.without_bases(state), report=log) if resume else None
    if resume and found is None:
        log(f"No checkpoint in {checkpoints.directory}: starting from the beginning.")
    if found is not None:
        stored, meta, path = found
        state = job.from_checkpoint(stored, state, meta, path)
        first_epoch = int(meta["epoch"])
        base_measure = meta["base"]
        metrics.keep_only(lambda r: r.get("epoch", 0) <= first_epoch)
        placement.keep_only(lambda r: r.get("epoch", 0) <= first_epoch)
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
        if writers is not None:
            writers.scalars(0, {"heldout_accuracy": float(base_measure["accuracy"])})
            writers.image(0, "heldout_samples", out / "samples_before.png")
    log(
        f"Base model ({base_source}): held-out accuracy {base_measure['accuracy']:.3f}, "
        f"reward {base_measure['reward']:.3f}, diversity {base_measure['diversity']:.3f}"
    )
    run_key = jax.random.key(config.seed + 3)
    progress = Progress(config.epochs, "flow-grpo", disable=quiet, initial=first_epoch)
    for epoch in range(first_epoch + 1, config.epochs + 1):
        logs_ratios = config.log and config.algorithm == "flow_grpo"
        state, summary, info = rl_epoch(
            trainer,
            state,
            rollout,
            job.epoch_rows(epoch),
            jax.random.fold_in(run_key, epoch),
            epoch=epoch,
            inner_epochs=config.inner_epochs,
            minibatch_rows=config.minibatch_rows,
            after_updates=_log_distributions(writers, objective, epoch) if logs_ratios else None,
        )
        placement.write(
            {
                "epoch": epoch,
                "processes": jax.process_count(),
                "devices": 1 if mesh is None else int(mesh.devices.size),
                "reward_calls_per_process": process_counts(info.reward_calls_here),
                "rows_per_process": process_counts(owned_rows(info.samples)),
                "rows_total": int(info.samples.shape[0]),
                "param_sharding": config.param_sharding,
                "state_fraction_per_device": device_fraction(state),
            }
        )
        record: dict[str, Any] = {"epoch": epoch, **summary}
        if epoch % config.eval_every == 0 or epoch == config.epochs:
            measured = job.measure(objective, state.variables)
            record.update(heldout_accuracy=measured["accuracy"], heldout_reward=measured["reward"])
            if config.log:
                picture = out / "previews" / f"epoch_{epoch:05d}.png"
                job.preview(objective, state.variables, picture, f"epoch {epoch}")
                if writers is not None:
                    writers.image(epoch, "heldout_samples", picture)
        metrics.write(record)
        if writers is not None:
            writers.scalars(epoch, {k: float(v) for k, v in record.items() if k != "epoch"})
        progress.update(
            1,
            reward=summary["reward_mean"],
            loss=summary.get("loss", 0.0),
            acc=record.get("heldout_accuracy"),
        )
        stopping = stop.agreed(epoch)
        if epoch % config.checkpoint_every == 0 or epoch == config.epochs or stopping:
            # Collective: every process writes the shards it holds.
            checkpoints.save(
                epoch,
                lora.without_bases(state),
                {"epoch": epoch, "base": base_measure, **checkpoint_metadata},
            )
        if stopping and epoch < config.epochs:
            progress.close()
            cause = stop.received.name if stop.received is not None else "a peer's signal"
            log(
                f"Stopped after epoch {epoch} ({cause}); checkpoint in "
                f"{checkpoints.directory}; continue with --resume."
            )
            return {"stopped_at_epoch": epoch, "preempted": True}
    progress.close()
    final = job.measure(objective, state.variables)
    final_variables = local_copy(state.variables)
    if not root:
        return {"process_index": jax.process_index()}
    job.preview(
        objective,
        final_variables,
        out / "samples_after.png",
        f"after Flow-GRPO: held-out accuracy {final['accuracy']:.2f}",
    )
    if writers is not None:
        writers.image(config.epochs, "heldout_samples", out / "samples_after.png")
    job.save_policy(final_variables.policy)
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


def run_seeds(
    config: JobConfig,
    out: str | pathlib.Path,
    seeds: list[int],
    *,
    quiet: bool = False,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run one configuration once per training seed and summarise the runs.

    Each run goes to `out/seed_<s>` with `seed = s` (the base model and the evaluation noise
    are shared). `out/seeds_summary.json` holds, for every numeric summary figure, the mean,
    the standard deviation (population, over the seeds), the worst (lowest) and the best
    (highest) value, and every seed's value; `out/seeds_accuracy.png` plots every seed's
    held-out accuracy curve.

    **Arguments:**

    - `config`: the settings shared by every run (its `seed` is replaced).
    - `out`: the parent folder.
    - `seeds`: the training seeds, at least one, no repeats.
    - `quiet`: no progress bars.
    - `log`: where messages go.

    **Returns:**

    The summary (also written to `seeds_summary.json`).

    **Raises:**

    - `ValueError`: naming `seeds` if it is empty or repeats a seed.
    """
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"`seeds` must be distinct training seeds, at least one, got {seeds}.")
    out = pathlib.Path(out)
    runs: dict[int, dict[str, Any]] = {}
    curves: dict[int, list[tuple[int, float]]] = {}
    for index, seed in enumerate(seeds):
        folder = out / f"seed_{seed}"
        if index > 0:
            # Every seed fine-tunes the same base model: share the one the first run found or
            # pretrained instead of pretraining it again.
            folder.mkdir(parents=True, exist_ok=True)
            for base_file in (out / f"seed_{seeds[0]}").glob("base_*.eqx"):
                shutil.copy(base_file, folder / base_file.name)
        log(f"Training seed {seed} into {folder}.")
        runs[seed] = run_train(dataclasses.replace(config, seed=seed), folder, quiet=quiet, log=log)
        records = MetricsLog(folder / "metrics.jsonl").read()
        curves[seed] = [
            (r["epoch"], r["heldout_accuracy"]) for r in records if "heldout_accuracy" in r
        ]
    figures = sorted(
        name
        for name, value in runs[seeds[0]].items()
        if isinstance(value, (int, float)) and not isinstance(value, bool)
    )
    summary: dict[str, Any] = {"seeds": seeds, "folders": [f"seed_{seed}" for seed in seeds]}
    for name in figures:
        values = np.asarray([float(runs[seed][name]) for seed in seeds], np.float64)
        summary[name] = {
            "mean": float(values.mean()),
            "std": float(values.std()),
            "worst": float(values.min()),
            "best": float(values.max()),
            "per_seed": {str(seed): float(v) for seed, v in zip(seeds, values, strict=True)},
        }
    (out / "seeds_summary.json").write_text(json.dumps(summary, indent=2))
    plot_seed_curves(curves, out / "seeds_accuracy.png")
    accuracy = summary.get("final_accuracy")
    if accuracy is not None:
        log(
            f"Held-out accuracy over seeds {seeds}: {accuracy['mean']:.3f} ± {accuracy['std']:.3f} "
            f"(worst {accuracy['worst']:.3f}, best {accuracy['best']:.3f})."
        )
    return summary


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
        trainer = job.trainer(job.train_objective(start))
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
