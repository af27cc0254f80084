"""A fine-tuning run: its folder, its prompts' embeddings, its epochs, evaluations,
checkpoints and exports.

The run folder holds `config.toml` (the resolved configuration), `embeddings/` (every
prompt's condition, made once), `metrics.jsonl`, `checkpoints/`, `previews/` (image grids of
the fixed held-out prompts: before, at each evaluation, after), `tensorboard/`, and at the end
`summary.json`, `lora/` (the adapters as diffusers' `load_lora_weights` reads them) and
`transformer/` (the trained transformer as a diffusers folder). One process writes it at a
time; a resumed run ends as an uninterrupted one would.
"""

import contextlib
import dataclasses
import json
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from .. import (
    RewardError,
    RolloutInfo,
    data_mesh,
    group_advantages,
    host_samples,
    local_copy,
    lora,
    per_reward_advantages,
    preview_grid,
    shard_parameters,
)
from .._distributed import place_rows
from ..rewards import score_on_root
from ..train import (
    PREEMPTED_EXIT_STATUS,
    Checkpointer,
    GracefulStop,
    MetricsLog,
    MetricsWriter,
    RunFolderError,
    TrainState,
    check_out_folder,
    lock_run_folder,
    make_writers,
    rl_updates,
)
from ._config import FinetuneConfig, config_to_toml
from ._embedding import Embedded as Embedded, Rows as Rows, embed_prompts
from ._export import export_policy
from ._job import Job, advantages_program, evaluation_program, rollout_program
from ._pipeline import check_pipeline, load_pipeline
from ._plan import MeshPlan
from ._prompts import PromptSet, read_prompts
from ._rewards import HostTerm, build_terms, host_scores
from ._run_folder import RUN_FILES as RUN_FILES, claim_folder


def _silent(message: str) -> None:
    del message


def run_finetune(
    config: FinetuneConfig,
    out: str | pathlib.Path,
    *,
    config_text: str | None = None,
    resume: bool = False,
    replace: bool = False,
    quiet: bool = False,
    reward_token: str | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Fine-tune the configured pipeline into the run folder `out`; returns the summary.

    **Arguments:**

    - `config`: the configuration (`read_config`).
    - `out`: the run folder.
    - `config_text`: how the command was asked for, for the messages that say how to go on.
    - `resume`: continue from the newest intact checkpoint, with the same settings but those
        `FREE_ON_RESUME` names.
    - `replace`: move a run already in `out` aside first.
    - `quiet`: no progress bars.
    - `reward_token`: the reward servers' token.
    - `log`: where messages go (process 0 only).

    **Returns:**

    The summary (also `summary.json`), or `{"stopped_at_epoch": E, "preempted": True}` after a
    signal (the command then exits with `PREEMPTED_EXIT_STATUS`).

    **Raises:**

    - `ConfigError`, `PipelineError`, `PromptsError`, `MeshPlanError`, `RewardSetupError`:
        naming the setting or the file, before anything is written.
    - `RunFolderError`: for a folder that holds another run (unless `resume` or `replace`),
        another process writing it, a resume whose settings differ from the checkpoint's
        (each named), or a resume with no checkpoint where a run began (saying how to start
        over).
    - `RewardError`: when a reward fails (the folder keeps its last checkpoint).
    """
    started = time.perf_counter()
    out = pathlib.Path(out)
    root = jax.process_index() == 0
    if not root:
        log, quiet = _silent, True
    if resume and replace:
        raise RunFolderError("`--resume` and `--replace` exclude each other.")
    check_out_folder(out)
    config = config.resolved()
    check_pipeline(config)
    plan = MeshPlan.of(config)
    train = read_prompts(config.prompts.train, "prompts.train")
    heldout = None
    if config.prompts.heldout is not None:
        heldout = read_prompts(config.prompts.heldout, "prompts.heldout").first(
            config.prompts.heldout_limit
        )
    dtype = jnp.bfloat16 if config.pipeline.dtype == "bfloat16" else jnp.float32
    device_terms, host_terms = build_terms(config.rewards, dtype, reward_token)
    with lock_run_folder(out) if root else contextlib.nullcontext():
        finished = claim_folder(out, config, resume, replace, config_text, log)
        if finished is not None:
            log(f"The run in {out} is finished: nothing to resume, nothing written.")
            return finished
        checkpoints = Checkpointer(out / "checkpoints", keep=config.checkpoint.keep)

        def kept() -> int | None:
            return PREEMPTED_EXIT_STATUS if checkpoints.paths() else None

        with GracefulStop(log, exit_status=kept) as stop:
            pipeline = load_pipeline(config)
            embedded = embed_prompts(
                out, config, pipeline, train, heldout, device_terms, quiet, log
            )
            mesh = data_mesh(plan.devices, sequence=plan.sequence) if plan.devices > 1 else None
            writers = make_writers(config.logging.writers, out) if root else None
            # The run alone holds the job, and so the model, until the trainer's state holds its
            # own copy (`_Run.start`): then the job keeps only the model's shapes.
            run = _Run(
                Job.build(config, plan, pipeline, embedded.null, device_terms, host_terms, mesh),
                out,
                train,
                heldout,
                embedded,
                checkpoints,
                writers,
                log,
                started,
            )
            pipeline.transformer = None
            try:
                return run.train(stop, resume=resume, quiet=quiet)
            finally:
                if writers is not None:
                    writers.close()


@dataclasses.dataclass
class _Run:
    job: Job
    out: pathlib.Path
    train_prompts: PromptSet
    heldout_prompts: PromptSet | None
    embedded: Embedded
    checkpoints: Checkpointer
    writers: MetricsWriter | None
    log: Callable[[str], None]
    started: float

    def __post_init__(self) -> None:
        self.metrics = MetricsLog(self.out / "metrics.jsonl" if jax.process_index() == 0 else None)

    @property
    def config(self) -> FinetuneConfig:
        return self.job.config

    def train(self, stop: GracefulStop, *, resume: bool, quiet: bool) -> dict[str, Any]:
        """Every epoch still to do, with checkpoints, evaluations and previews when due, then
        the final measure and exports; or, after a signal, a checkpoint and the stop
        record."""
        config = self.config
        epochs = config.training.epochs
        state, first_epoch = self.start(resume)
        if jax.process_index() == 0:
            (self.out / "config.toml").write_text(config_to_toml(config))
        run_key = jax.random.key(config.seed + 3)
        bar = tqdm.tqdm(total=epochs, initial=first_epoch, desc="finetune", disable=quiet)
        with bar:
            for epoch in range(first_epoch + 1, epochs + 1):
                state, record = self.epoch(state, epoch, jax.random.fold_in(run_key, epoch))
                bar.set_postfix(reward=f"{record['reward_mean']:.4f}", loss=f"{record['loss']:.4g}")
                bar.update(1)
                stopping = stop.agreed(epoch)
                if epoch % config.checkpoint.every == 0 or epoch == epochs or stopping:
                    self.save(state, epoch)
                if stopping and epoch < epochs:
                    self.log(
                        f"Stopped after epoch {epoch}; checkpoint in {self.checkpoints.directory}; "
                        "continue with --resume."
                    )
                    return {"stopped_at_epoch": epoch, "preempted": True}
        return self.finish(state, resume)

    def start(self, resume: bool) -> tuple[TrainState, int]:
        state = self.job.trainer.init(jax.random.key(self.config.seed + 2))
        self.job = self.job.without_model_arrays()
        if self.job.mesh is not None:
            state = shard_parameters(
                state,
                self.job.mesh,
                "fsdp" if self.config.mesh.fsdp else "replicated",
                min_elements=self.config.mesh.fsdp_min_elements,
            )
        if resume:
            found = self.checkpoints.restore_latest(lora.without_bases(state), report=self.log)
            if found is not None:
                stored, meta, path = found
                epoch = int(meta["epoch"])
                self.metrics.keep_only(lambda r: r.get("epoch", 0) <= epoch, report=self.log)
                self.log(f"Resuming after epoch {epoch} from {path}.")
                return lora.with_bases(stored, state), epoch
        self.metrics.clear()
        if self.config.evaluation.before and self.heldout_prompts is not None:
            measured = self.evaluate(state, "samples_before.png", "base model")
            self.record(0, measured)
        return state, 0

    def prompt_indices(self, epoch: int) -> np.ndarray:
        """The epoch's training prompts: drawn without replacement (with, when the file has
        fewer than an epoch takes), from the seed and the epoch alone."""
        count = len(self.train_prompts)
        wanted = self.config.sampling.prompts_per_epoch
        rng = np.random.default_rng([self.config.seed, epoch])
        return rng.choice(count, size=wanted, replace=count < wanted)

    def rows(self, rows: Rows, indices: np.ndarray) -> Rows:
        return {name: np.asarray(values[indices]) for name, values in rows.items()}

    def epoch(self, state: TrainState, epoch: int, key: Any) -> tuple[TrainState, dict[str, Any]]:
        """One rollout (sampled, decoded and scored on the device, call by call), its
        advantages and the updates."""
        job, plan, config = self.job, self.job.plan, self.config
        groups = config.sampling.group_size
        rollout_key, shuffle_key = jax.random.split(key)
        started = time.perf_counter()
        prompts = np.repeat(self.prompt_indices(epoch), groups)
        host_rows = self.rows(self.embedded.train, prompts)
        policy = job.objective.sampling_policy(state.variables)
        first = job.rollout.window_start(epoch, rollout_key)
        pieces = []
        for call in range(plan.rollout_calls):
            part = slice(call * plan.rollout_rows, (call + 1) * plan.rollout_rows)
            placed = place_rows({k: v[part] for k, v in host_rows.items()}, job.mesh)
            generated, scores = rollout_program(
                job.rollout,
                policy,
                placed,
                jax.random.fold_in(rollout_key, call),
                jnp.asarray(first, jnp.int32),
                job.device_terms,
            )
            pieces.append((placed, generated, scores))
        rows_placed = _concatenate([p[0] for p in pieces])
        generated = _concatenate([p[1] for p in pieces])
        device_scores = _concatenate([p[2] for p in pieces])
        jax.block_until_ready(generated)  # type: ignore[no-untyped-call]
        sampled = time.perf_counter()
        total, advantages, per_term = self.advantages(generated, device_scores, prompts)
        scored = time.perf_counter()
        draw = job.rollout.draw(policy, rows_placed, first)
        batch = job.rollout.active_sampler.batch(draw, generated, advantages)
        grouped = total.reshape(-1, groups)
        info = RolloutInfo(
            rewards=total,
            reward_mean=np.float32(total.mean()),
            zero_std_fraction=float(np.mean(np.all(grouped == grouped[:, :1], axis=1))),
            mean_group_std=float(np.mean(grouped.std(axis=1))),
            samples=generated.samples,
            final=generated.final,
            seconds={"generation": sampled - started, "reward": scored - sampled},
            reward_calls_here=int(jax.process_index() == 0),
            window_start=first,
        )
        state, summary = rl_updates(
            job.trainer,
            state,
            batch,
            info,
            shuffle_key,
            epoch=epoch,
            inner_epochs=config.training.inner_epochs,
            minibatch_rows=plan.update_rows,
        )
        record: dict[str, Any] = {"epoch": epoch, **summary}
        record.update({f"reward_{name}": float(np.mean(v)) for name, v in per_term.items()})
        if self.heldout_prompts is not None and (
            epoch % config.evaluation.every == 0 or epoch == config.training.epochs
        ):
            measuring = time.perf_counter()
            record.update(self.evaluate(state, f"previews/epoch_{epoch:05d}.png", f"epoch {epoch}"))
            record["seconds_evaluation"] = time.perf_counter() - measuring
        record["seconds_epoch"] = time.perf_counter() - started
        record["seconds_elapsed"] = time.perf_counter() - self.started
        self.record(epoch, record)
        return state, record

    def advantages(
        self, generated: Any, device_scores: dict[str, Any], prompts: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        """The rollout's total rewards, advantages and each term's scores (host arrays of
        `N` floats: the samples stay on the device unless a host term scores them).

        **Raises:**

        - `RewardError`: naming the term, for a device score that is NaN or inf; as
            `host_scores` for a host term.
        """
        job = self.job
        groups = self.config.sampling.group_size
        std = self.config.algorithm_table.rollout_advantage_std()
        per_term = {name: _on_host(v, np.float64) for name, v in device_scores.items()}
        for name, values in per_term.items():
            bad = np.flatnonzero(~np.isfinite(values))
            if bad.size:
                raise RewardError(
                    f"Reward {name!r} gave non-finite scores at rows {bad[:10].tolist()} (a "
                    "sample decoded to NaN, or the reward model's weights hold NaN)."
                )
        combination = self.config.sampling.reward_combination
        if not job.host_terms:
            weights = {term.name: term.weight for term in job.device_terms}
            on_device = advantages_program(device_scores, weights, groups, std, combination)
            return (
                _on_host(on_device[0], np.float64),
                _on_host(on_device[1], np.float32),
                per_term,
            )
        samples = host_samples(generated.samples)
        here = samples if jax.process_index() == 0 else None
        per_term.update(_host_scores_on_root(job.host_terms, here, self.train_prompts, prompts))
        weights = {t.name: t.weight for t in job.device_terms} | {
            t.name: t.weight for t in job.host_terms
        }
        names = sorted(per_term)
        totals: np.ndarray = np.sum([weights[name] * per_term[name] for name in names], axis=0)
        if combination == "sum":
            return totals, group_advantages(totals, groups, std=std), per_term
        components = np.stack([per_term[name] for name in names])
        weighted = per_reward_advantages(
            components, [weights[name] for name in names], groups, std=std
        )
        return totals, weighted, per_term

    def evaluate(self, state: TrainState, picture: str, title: str) -> dict[str, float]:
        """The evaluation policy on the held-out prompts: ODE samples from fixed noise, each
        term's mean score and the weighted total, and the image grid of the first
        `prompts.preview` prompts (written by process 0)."""
        job, plan, config = self.job, self.job.plan, self.config
        assert self.heldout_prompts is not None and self.embedded.heldout is not None
        count = len(self.heldout_prompts)
        policy = job.evaluation_policy(state)
        steps = (config.sampling.eval_steps or 1) + 1
        latent_shape = job.flow.inputs.latent_shape
        assert latent_shape is not None
        key = jax.random.key(config.evaluation.seed)
        device_scores: dict[str, list[np.ndarray]] = {t.name: [] for t in job.device_terms}
        previews: list[np.ndarray] = []
        host_pieces: list[np.ndarray] = []
        for start in range(0, count, plan.eval_rows):
            indices = np.arange(start, start + plan.eval_rows) % count
            real = min(plan.eval_rows, count - start)
            rows = place_rows(self.rows(self.embedded.heldout, indices), job.mesh)
            noise = jax.random.normal(
                jax.random.fold_in(key, start), (plan.eval_rows, *latent_shape), jnp.float32
            )
            samples, scores = evaluation_program(
                job.flow, steps, policy, rows, noise, job.device_terms
            )
            for name, term_scores in scores.items():
                device_scores[name].append(_on_host(term_scores, np.float64)[:real])
            wanted = max(0, min(config.prompts.preview, count) - start)
            if wanted or job.host_terms:
                on_host = host_samples(samples)[:real]
                previews.append(on_host[:wanted])
                if job.host_terms:
                    host_pieces.append(on_host)
        measured: dict[str, float] = {}
        totals = np.zeros(count, np.float64)
        for term in job.device_terms:
            values = np.concatenate(device_scores[term.name])
            measured[f"heldout_{term.name}"] = float(values.mean())
            totals += term.weight * values
        if job.host_terms:
            samples_host = np.concatenate(host_pieces)
            here = samples_host if jax.process_index() == 0 else None
            host = _host_scores_on_root(
                job.host_terms, here, self.heldout_prompts, np.arange(count)
            )
            for host_term in job.host_terms:
                measured[f"heldout_{host_term.name}"] = float(host[host_term.name].mean())
                totals += host_term.weight * host[host_term.name]
        measured["heldout_reward"] = float(totals.mean())
        if jax.process_index() == 0 and previews:
            shown = np.concatenate(previews)
            images = shown[:, shown.shape[1] // 2] if shown.ndim == 5 else shown
            captions = [p[:40] for p in self.heldout_prompts.prompts[: len(images)]]
            path = self.out / picture
            preview_grid(
                images,
                path,
                captions,
                totals[: len(images)],
                title=f"{title}: reward {measured['heldout_reward']:.4f}",
            )
            if self.writers is not None:
                self.writers.image(int(state.step), "heldout_samples", path)
        return measured

    def record(self, epoch: int, record: dict[str, Any]) -> None:
        self.metrics.write({"epoch": epoch, **record})
        if self.writers is not None:
            self.writers.scalars(
                epoch,
                {k: float(v) for k, v in record.items() if k != "epoch" and _is_number(v)},
            )

    def save(self, state: TrainState, epoch: int) -> None:
        self.checkpoints.save(
            epoch,
            lora.without_bases(state),
            {
                "epoch": epoch,
                "settings": self.config.identity(),
                "prompts": self.train_prompts.fingerprint(),
            },
        )

    def finish(self, state: TrainState, resumed: bool) -> dict[str, Any]:
        final: dict[str, float] = {}
        if self.heldout_prompts is not None:
            final = self.evaluate(state, "samples_after.png", "after training")
        policy = local_copy(self.job.evaluation_policy(state))
        if jax.process_index() != 0:
            return {"process_index": jax.process_index()}
        exported = export_policy(policy, self.out, dtype=self.config.pipeline.dtype)
        records = self.metrics.read()
        rewards = [r["reward_mean"] for r in records if "reward_mean" in r]
        summary = {
            **final,
            "epochs": self.config.training.epochs,
            "train_reward_first_epoch": rewards[0] if rewards else None,
            "train_reward_last_epoch": rewards[-1] if rewards else None,
            "exported": [str(path) for path in exported],
            "wall_seconds": time.perf_counter() - self.started,
            "resumed": resumed,
        }
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        self.log(
            f"Done: {self.config.training.epochs} epochs; "
            + (f"held-out reward {final['heldout_reward']:.4f}; " if final else "")
            + f"exported {', '.join(str(p) for p in exported)}."
        )
        sys.stdout.flush()
        return summary


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float | np.floating | np.integer) and not isinstance(value, bool)


def _on_host(values: Any, dtype: Any) -> np.ndarray:
    """A row-sharded device array whole on the host of every process (`host_samples`)."""
    return np.asarray(host_samples(values), dtype)


def _concatenate(pieces: list[Any]) -> Any:
    if len(pieces) == 1:
        return pieces[0]
    return jax.tree.map(lambda *leaves: jnp.concatenate(leaves), *pieces)


def _host_scores_on_root(
    terms: list[HostTerm], samples: np.ndarray | None, prompts: PromptSet, indices: np.ndarray
) -> dict[str, np.ndarray]:
    """Each host term's scores, computed on process 0 and handed to every process."""
    if jax.process_count() == 1:
        assert samples is not None
        return host_scores(terms, samples, prompts, indices)
    return {
        term.name: score_on_root(_OneTerm(term, prompts, indices), samples, {"index": indices})
        for term in terms
    }


@dataclasses.dataclass(frozen=True)
class _OneTerm:
    """One host term as a `FlowReward` of the samples alone (its rows are the prompts')."""

    term: HostTerm
    prompts: PromptSet
    indices: np.ndarray

    @property
    def name(self) -> str:
        return self.term.name

    def __call__(self, samples: np.ndarray, rows: Any) -> np.ndarray:
        del rows
        return host_scores([self.term], samples, self.prompts, self.indices)[self.term.name]
