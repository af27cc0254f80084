"""The main job's training run: a run folder, the base model's measure, the RL epochs with
their checkpoints and metrics, and the final measure and files."""

import contextlib
import dataclasses
import json
import numbers
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jaxtyping import Array

from .. import (
    AbstractVariables,
    FlowGRPOObjective,
    FlowRollout,
    RewardTransitions,
    RolloutInfo,
    Transitions,
    data_mesh,
    device_fraction,
    host_samples,
    local_copy,
    lora,
    owned_rows,
    process_counts,
    shard_parameters,
    sync_processes,
)
from ..train import (
    PREEMPTED_EXIT_STATUS,
    Checkpointer,
    GracefulStop,
    MetricsLog,
    MetricsWriter,
    Trainer,
    TrainState,
    make_writers,
    rl_epoch,
)
from ._progress import Progress
from .config import JobConfig, config_to_toml
from .parts import ShapesJob
from .report import plot_curve
from .run_folder import (
    RunFolderError,
    check_out_folder,
    check_resumable,
    check_run_folder,
    identity,
    lock_run_folder,
    replace_run,
)


def _silent(message: str) -> None:
    del message


@eqx.filter_jit
def _kept_ratios(
    objective: FlowGRPOObjective, variables: AbstractVariables, batch: Transitions
) -> tuple[Array, Array]:
    ratios = jnp.exp(objective.log_probs(variables, batch) - batch.old_log_probs)
    return ratios, objective.kept(batch)


def _log_distributions(
    writers: MetricsWriter | None, objective: FlowGRPOObjective, epoch: int
) -> Callable[[TrainState, Transitions | RewardTransitions, RolloutInfo], None]:
    """After an epoch's updates: histograms of the advantages and of the policy ratio of the
    kept transitions (run on every process, since gathering rows is collective)."""

    def record(
        state: TrainState, batch: Transitions | RewardTransitions, info: RolloutInfo
    ) -> None:
        del info
        if isinstance(batch, RewardTransitions):  # DanceGRPO's: its rewards' advantages apart
            batch = batch.transitions
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
    replace: bool = False,
    quiet: bool = False,
    devices: int | None = None,
    reward_token: str | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the main job and write the run folder; returns the summary.

    With several devices (or processes), rows are sharded over a data mesh and parameters
    replicated; process 0 alone scores rewards and writes files.

    Process 0 holds the run folder's lock (`run_folder.lock_run_folder`) for the whole run:
    a second process training into the same folder is refused, naming the first.

    On SIGTERM or SIGINT the run finishes the epoch in progress, writes a checkpoint, says so
    and returns `{"stopped_at_epoch": E, "preempted": True}` (the command line then exits with
    `PREEMPTED_EXIT_STATUS`); a signal before the first epoch stops the run before it, with
    the same record (E the epoch it would have continued from). A second signal stops at
    once: with `PREEMPTED_EXIT_STATUS` when the folder keeps a checkpoint, else killed by that
    signal. With several processes every process stops after the same epoch. `resume=True`
    then continues to the result an uninterrupted run would have had.

    `config.toml` is written once the run's starting point is known: after the checkpoint to
    resume from is loaded and checked. `resume=True` on a finished run with as many epochs
    as it has done returns its `summary.json` and writes nothing.

    **Arguments:**

    - `config`: the settings.
    - `out`: the run folder.
    - `resume`: continue from the newest intact checkpoint in `out/checkpoints` (damaged
        ones are reported by path and skipped), whose recorded settings must be this run's
        but for those `run_folder.FREE_ON_RESUME` names; in a folder that never
        checkpointed, start from the beginning.
    - `replace`: move a run already in `out` aside (`run_folder.replace_run`) and start
        afresh; without it, a folder that holds a run is refused unless `resume`.
    - `quiet`: no progress bars.
    - `devices`: shard rows over this many devices (default: every device of every
        process; 1 turns sharding off).
    - `reward_token`: the token for `config.reward_url`'s server (default: the
        `FLOWGRPO_REWARD_TOKEN` environment variable).
    - `log`: where messages go (process 0 only).

    **Returns:**

    The summary (also written to `summary.json`), or the stop record after a signal.

    **Raises:**

    - `ValueError`: naming `devices`, before any work, if it is not in 1..the devices of
        every process.
    - `RunFolderError`: before any work, if `out` is a file or lies under one (saying a
        folder is needed), if another process holds the folder (naming its pid and host),
        if `out` holds another run and neither `resume` nor `replace` is set, or if
        `resume` would change a setting of the run (each named with both values), run
        fewer epochs than it has done, or start over a run that checkpointed or finished
        but has no checkpoint left.
    - `CheckpointError`: when resuming and checkpoints exist but none is intact, or the one
        to resume from records no usable epoch, settings or base measure.
    - `ValueError`: naming `metrics.jsonl` and the line, when resuming and a record before
        its last line cannot be read (nothing is cut).
    - `RewardError`: when the reward fails (the run folder keeps its last checkpoint).
    """
    started = time.perf_counter()
    out = pathlib.Path(out)
    # Before the base model is pretrained: the mesh is built only after it.
    if devices is not None and not (
        isinstance(devices, numbers.Integral)
        and not isinstance(devices, bool)
        and 1 <= devices <= jax.device_count()
    ):
        raise ValueError(
            f"`devices` must be an int in 1..{jax.device_count()} (the devices of every "
            f"process), got {devices!r}."
        )
    root = jax.process_index() == 0
    if not root:
        log = _silent
        quiet = True
    if resume and replace:
        raise RunFolderError("`resume` and `replace` exclude each other.")
    check_out_folder(out)
    # The job's parts (the DiT, the reward) are checked before the folder is touched: a
    # setting they refuse leaves nothing behind.
    job = ShapesJob(config, out, quiet, reward_token=reward_token)
    with lock_run_folder(out) if root else contextlib.nullcontext():
        finished = _claim_folder(out, config, resume=resume, replace=replace, root=root, log=log)
        if finished is not None:
            log(
                f"The run in {out} is finished ({config.training.epochs} epochs): nothing to "
                "resume, nothing written. Pass a larger --epochs to train it further."
            )
            return finished
        checkpoints = Checkpointer(out / "checkpoints")

        def kept_checkpoint() -> int | None:
            return PREEMPTED_EXIT_STATUS if checkpoints.paths() else None

        with GracefulStop(log, exit_status=kept_checkpoint) as stop:
            base, base_source = job.base_model(log)
            run = _Run.build(job, base, devices=devices, root=root, log=log, started=started)
            try:
                return run.train(stop, resume=resume, quiet=quiet, base_source=base_source)
            finally:
                if run.writers is not None:
                    run.writers.close()


def _claim_folder(
    out: pathlib.Path,
    config: JobConfig,
    *,
    resume: bool,
    replace: bool,
    root: bool,
    log: Callable[[str], None],
) -> dict[str, Any] | None:
    """Check the run folder (or move its run aside with `replace`); the run's `config.toml`
    is written later, once its starting point is loaded (`_Run.train`).

    **Returns:**

    The summary of a finished run that `resume` asks to continue to the epochs it has
    done (nothing to do), else `None`.

    **Raises:**

    - `RunFolderError`: as `run_train` says.
    """
    if replace:
        moved = replace_run(out) if root else None
        if moved is not None:
            log(f"Moved the run that was in {out} to {moved}.")
    else:
        check_run_folder(out, config, resume=resume)
    finished = _finished_summary(out, config) if resume else None
    # Every process has read the folder before process 0 writes into it.
    sync_processes("run folder checked")
    out.mkdir(parents=True, exist_ok=True)
    return finished


def _finished_summary(out: pathlib.Path, config: JobConfig) -> dict[str, Any] | None:
    """The `summary.json` of a finished run of `config.training.epochs` epochs, whose newest
    checkpoint is of that epoch, or `None`."""
    summary_path = out / "summary.json"
    found = Checkpointer(out / "checkpoints").latest_metadata()
    if not summary_path.exists() or found is None:
        return None
    metadata, _ = found
    try:
        summary: dict[str, Any] = json.loads(summary_path.read_text())
    except ValueError:
        return None
    epochs = config.training.epochs
    if metadata.get("epoch") != epochs or summary.get("epochs") != epochs:
        return None
    return summary


@dataclasses.dataclass
class _Run:
    """The pieces of one training run and what it writes: the metrics logs, the writers, the
    checkpoints, the previews and the final files (process 0 alone writes files)."""

    job: ShapesJob
    ratio_objective: FlowGRPOObjective | None
    rollout: FlowRollout
    trainer: Trainer
    checkpoints: Checkpointer
    metrics: MetricsLog
    placement: MetricsLog
    writers: MetricsWriter | None
    mesh: Mesh | None
    log: Callable[[str], None]
    checkpoint_metadata: dict[str, Any]
    started: float

    @classmethod
    def build(
        cls,
        job: ShapesJob,
        base: Any,
        *,
        devices: int | None,
        root: bool,
        log: Callable[[str], None],
        started: float,
    ) -> "_Run":
        """The run of `job` from the base model `base` over `devices` devices (default:
        all); only process 0 (`root`) writes files."""
        config, out = job.config, job.out
        device_count = jax.device_count() if devices is None else devices
        mesh = data_mesh(device_count) if device_count > 1 else None
        policy = job.policy(base)
        trained = job.objective(policy)
        logs = config.logging.log
        # Only process 0 keeps the run's files; the others write to no log at all.
        writers = make_writers(logs, out, config=config.settings()) if root and logs else None
        return cls(
            job=job,
            ratio_objective=(
                job.flow_grpo_objective(policy) if job.algorithm.trains_on_ratios else None
            ),
            rollout=job.rollout(trained, mesh),
            trainer=job.trainer(trained),
            checkpoints=Checkpointer(out / "checkpoints", keep=config.logging.keep_checkpoints),
            metrics=MetricsLog(out / "metrics.jsonl" if root else None),
            placement=MetricsLog(out / "distributed.jsonl" if root else None),
            writers=writers,
            mesh=mesh,
            log=log,
            checkpoint_metadata={"settings": identity(config), **job.checkpoint_metadata(base)},
            started=started,
        )

    def train(
        self, stop: GracefulStop, *, resume: bool, quiet: bool, base_source: str
    ) -> dict[str, Any]:
        """Every epoch still to do, with its checkpoint when due, then the final files; or,
        after a signal `stop` agrees on, a checkpoint and the stop record."""
        epochs, seed = self.job.config.training.epochs, self.job.config.training.seed
        if stop.agreed(0):
            return self.stopped_before(None, stop)
        state, first_epoch, base_measure = self.start(resume)
        if jax.process_index() == 0:
            # Only now: a resume refused above leaves the run's own config.toml as it was.
            (self.job.out / "config.toml").write_text(config_to_toml(self.job.config))
        if stop.agreed(first_epoch):
            return self.stopped_before(first_epoch, stop)
        self.log(
            f"Base model ({base_source}): held-out accuracy "
            f"{base_measure['accuracy']:.3f}, reward {base_measure['reward']:.3f}, "
            f"diversity {base_measure['diversity']:.3f}"
            + _train_reward_text(self.job.reward_name, base_measure)
        )
        run_key = jax.random.key(seed + 3)
        progress = Progress(epochs, "flow-grpo", disable=quiet, initial=first_epoch)
        for epoch in range(first_epoch + 1, epochs + 1):
            state, record = self.epoch(state, epoch, jax.random.fold_in(run_key, epoch))
            progress.update(
                1,
                reward=record["reward_mean"],
                loss=record.get("loss", 0.0),
                acc=record.get("heldout_accuracy"),
            )
            stopping = stop.agreed(epoch)
            every = self.job.config.logging.checkpoint_every
            if epoch % every == 0 or epoch == epochs or stopping:
                self.save(state, epoch, base_measure)
            if stopping and epoch < epochs:
                progress.close()
                cause = stop.received.name if stop.received is not None else "a peer's signal"
                self.log(
                    f"Stopped after epoch {epoch} ({cause}); checkpoint in "
                    f"{self.checkpoints.directory}; continue with --resume."
                )
                return {"stopped_at_epoch": epoch, "preempted": True}
        progress.close()
        return self.finish(state, base_measure, base_source, resume)

    def stopped_before(self, epoch: int | None, stop: GracefulStop) -> dict[str, Any]:
        """The stop record of a signal that came before the first epoch of this session (with
        `epoch`, the last one done, once the starting point is loaded)."""
        cause = stop.received.name if stop.received is not None else "a peer's signal"
        where = "before loading" if epoch is None else f"after epoch {epoch}, before training"
        kept = f"; checkpoint in {self.checkpoints.directory}" if self.checkpoints.paths() else ""
        self.log(f"Stopped {where} ({cause}){kept}; continue with --resume.")
        sys.stdout.flush()
        return {"stopped_at_epoch": epoch or 0, "preempted": True}

    def start(self, resume: bool) -> tuple[TrainState, int, dict[str, Any]]:
        """The first state, the last epoch done and the base model's measure: from the newest
        intact checkpoint when resuming, else fresh (the base measured and previewed)."""
        job, config, out = self.job, self.job.config, self.job.out
        training = config.training
        state = self.trainer.init(jax.random.key(training.seed + 2))
        if self.mesh is not None:
            state = shard_parameters(
                state, self.mesh, training.param_sharding, min_elements=training.fsdp_min_elements
            )
        # Restored arrays take the shardings of this run's state, whatever mesh wrote them.
        found = None
        if resume:
            found = self.checkpoints.restore_latest(lora.without_bases(state), report=self.log)
            if found is None:
                self.log(
                    f"No checkpoint in {self.checkpoints.directory}: starting from the beginning."
                )
        if found is not None:
            stored, meta, path = found
            check_resumable(meta, path)
            first_epoch = int(meta["epoch"])
            self.metrics.keep_only(lambda r: r.get("epoch", 0) <= first_epoch, report=self.log)
            self.placement.keep_only(lambda r: r.get("epoch", 0) <= first_epoch, report=self.log)
            return job.from_checkpoint(stored, state, meta, path), first_epoch, meta["base"]
        self.metrics.clear()
        self.placement.clear()
        base_measure = job.measure(state.variables.policy)
        job.preview(
            state.variables.policy,
            out / "samples_before.png",
            f"base model: held-out accuracy {base_measure['accuracy']:.2f}",
        )
        self.metrics.write({"epoch": 0, **_heldout_record(base_measure)})
        if self.writers is not None:
            self.writers.scalars(0, {"heldout_accuracy": float(base_measure["accuracy"])})
            self.writers.image(0, "heldout_samples", out / "samples_before.png")
        return state, 0, base_measure

    def epoch(self, state: TrainState, epoch: int, key: Any) -> tuple[TrainState, dict[str, Any]]:
        """One RL epoch, its placement record, its held-out measure when due, and its metrics."""
        job, config, out = self.job, self.job.config, self.job.out
        ratios = self.ratio_objective if config.logging.log else None
        state, summary, info = rl_epoch(
            self.trainer,
            state,
            self.rollout,
            job.epoch_rows(epoch),
            key,
            epoch=epoch,
            inner_epochs=config.training.inner_epochs,
            minibatch_rows=config.training.minibatch_rows,
            after_updates=(
                None if ratios is None else _log_distributions(self.writers, ratios, epoch)
            ),
        )
        self.placement.write(
            {
                "epoch": epoch,
                "processes": jax.process_count(),
                "devices": 1 if self.mesh is None else int(self.mesh.devices.size),
                "reward_calls_per_process": process_counts(info.reward_calls_here),
                "rows_per_process": process_counts(owned_rows(info.samples)),
                "rows_total": int(info.samples.shape[0]),
                "param_sharding": config.training.param_sharding,
                "state_fraction_per_device": device_fraction(state),
            }
        )
        record: dict[str, Any] = {"epoch": epoch, **summary}
        if epoch % config.evaluation.eval_every == 0 or epoch == config.training.epochs:
            measuring = time.perf_counter()
            measured = job.measure(state.variables.policy)
            record.update(
                _heldout_record(measured), seconds_evaluation=time.perf_counter() - measuring
            )
            if config.logging.log:
                picture = out / "previews" / f"epoch_{epoch:05d}.png"
                job.preview(state.variables.policy, picture, f"epoch {epoch}")
                if self.writers is not None:
                    self.writers.image(epoch, "heldout_samples", picture)
        record["seconds_elapsed"] = time.perf_counter() - self.started
        self.metrics.write(record)
        if self.writers is not None:
            self.writers.scalars(epoch, {k: float(v) for k, v in record.items() if k != "epoch"})
        return state, record

    def save(self, state: TrainState, epoch: int, base_measure: dict[str, Any]) -> None:
        """A checkpoint of `state` after `epoch` (collective: every process writes the shards
        it holds)."""
        self.checkpoints.save(
            epoch,
            lora.without_bases(state),
            {"epoch": epoch, "base": base_measure, **self.checkpoint_metadata},
        )

    def finish(
        self,
        state: TrainState,
        base_measure: dict[str, Any],
        base_source: str,
        resumed: bool,
    ) -> dict[str, Any]:
        """The final measure, preview, policy, reward curve and `summary.json`."""
        job, config, out = self.job, self.job.config, self.job.out
        final = job.measure(state.variables.policy)
        final_variables = local_copy(state.variables)
        if jax.process_index() != 0:
            return {"process_index": jax.process_index()}
        job.preview(
            final_variables.policy,
            out / "samples_after.png",
            f"after Flow-GRPO: held-out accuracy {final['accuracy']:.2f}",
        )
        if self.writers is not None:
            self.writers.image(config.training.epochs, "heldout_samples", out / "samples_after.png")
        job.save_policy(final_variables.policy)
        records = self.metrics.read()
        plot_curve(records, out / "reward_curve.png", job.reward_name)
        train_rewards = [r["reward_mean"] for r in records if "reward_mean" in r]
        summary = {
            "base_accuracy": base_measure["accuracy"],
            "final_accuracy": final["accuracy"],
            "base_reward": base_measure["reward"],
            "final_reward": final["reward"],
            "base_diversity": base_measure["diversity"],
            "final_diversity": final["diversity"],
            # The run's own reward on the held-out samples, where measured (else null).
            "base_heldout_train_reward": base_measure.get("train_reward"),
            "final_heldout_train_reward": final.get("train_reward"),
            "train_reward_first_epoch": train_rewards[0] if train_rewards else None,
            "train_reward_last_epoch": train_rewards[-1] if train_rewards else None,
            "epochs": config.training.epochs,
            "base_source": base_source,
            "processes": jax.process_count(),
            "devices": 1 if self.mesh is None else int(self.mesh.devices.size),
            "wall_seconds": time.perf_counter() - self.started,
            "resumed": resumed,
        }
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        self.log(
            f"Final: held-out accuracy {final['accuracy']:.3f} (base "
            f"{base_measure['accuracy']:.3f}), diversity {final['diversity']:.3f} (base "
            f"{base_measure['diversity']:.3f})"
            + _train_reward_text(job.reward_name, final, base_measure)
            + "."
        )
        return summary


def _heldout_record(measured: dict[str, Any]) -> dict[str, float]:
    """A held-out measure as metrics: `heldout_accuracy`, `heldout_reward`,
    `heldout_diversity` and, where measured, `heldout_train_reward`."""
    names = ("accuracy", "reward", "diversity", "train_reward")
    return {f"heldout_{name}": measured[name] for name in names if name in measured}


def _train_reward_text(
    reward_name: str, measured: dict[str, Any], base: dict[str, Any] | None = None
) -> str:
    """`", held-out <reward name> 0.612 (base 0.598)"`: the run's own reward on the held-out
    samples, for a line of figures (with the base's when `base` is given); empty where it was
    not measured."""
    if "train_reward" not in measured:
        return ""
    text = f", held-out {reward_name} {measured['train_reward']:.3f}"
    if base is not None and "train_reward" in base:
        text += f" (base {base['train_reward']:.3f})"
    return text
