"""The pieces of the main job for one configuration: the task and its reward, the model and
its base weights, LoRA, the objectives, the rollout, the trainer and the held-out measure."""

import pathlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jax.sharding import Mesh

from .. import (
    CFG,
    AbstractRLObjective,
    Euler,
    FlowGRPOObjective,
    FlowReward,
    FlowRollout,
    GuidedFlow,
    HttpReward,
    InputSpec,
    JpegCompressibility,
    JpegIncompressibility,
    RectifiedFlow,
    RewardError,
    WeightedReward,
    evaluate_policy,
    load_reward,
    local_copy,
    lora,
    preview_policy,
    score_on_root,
)
from ..models import DiT
from ..train import (
    FlowMatchingObjective,
    MetricsLog,
    SupervisedBatch,
    Trainer,
    TrainState,
    default_optimizer,
    load_model,
    minibatch_count,
    save_model,
    supervised_steps,
)
from ._progress import Progress
from .algorithms import AbstractAlgorithm, JobPieces, job_flow
from .config import JobConfig
from .settings import RewardSettings, parse_reward_weights
from .task import NULL_TOKEN, PROMPT_LENGTH, VOCAB_SIZE, ShapesReward, ShapesTask


BUILTIN_REWARDS: dict[str, Callable[[], FlowReward]] = {
    "partial": lambda: ShapesReward(ShapesTask(), kind="partial"),
    "strict": lambda: ShapesReward(ShapesTask(), kind="strict"),
    # Dense even for an untrained model: used by the tiny smoke preset.
    "jpeg_incompressibility": JpegIncompressibility,
    "jpeg_compressibility": JpegCompressibility,
}
"""The rewards `--reward` and `flowgrpo-eqx serve-reward` know by name."""

CHECKER_REWARDS: frozenset[str] = frozenset({"partial", "strict"})
"""The built-in rewards that are the task checker's own scores, which the held-out measure
reports anyway (`reward` and `accuracy`)."""


def measures_train_reward(settings: RewardSettings) -> bool:
    """Whether the held-out measure also scores its samples with the run's own train reward:
    a built-in reward that is more than the checker's scores (as the tiny preset's JPEG
    reward), or a reward server (`reward_url`), which process 0 asks as it asks for the
    rollouts' scores, so that a run through a server reports what the same run in process
    reports. Not the user's own reward (`custom_reward`), which is code of theirs.

    **Arguments:**

    - `settings`: the reward settings.

    **Returns:**

    `True` for a reward server, and for built-in rewards other than `partial` and `strict`
    alone.
    """
    if settings.custom_reward is not None:
        return False
    if settings.reward_url is not None:
        return True
    if settings.reward_weights is not None:
        names = set(parse_reward_weights(settings.reward_weights))
    else:
        names = {settings.reward}
    return not names <= CHECKER_REWARDS


SHIPPED_DIR = pathlib.Path(__file__).resolve().parent / "checkpoints"
"""Where the shipped base models live, named `base_<fingerprint>.eqx`."""


def train_reward(settings: RewardSettings, token: str | None) -> tuple[FlowReward, str]:
    """The train reward the settings choose, and what it is in their words (for pictures).

    **Arguments:**

    - `settings`: the reward settings.
    - `token`: the token for `reward_url`'s server, if any.

    **Returns:**

    `(reward, name)`: the user's own reward, a reward server's client, a weighted sum of
    built-in rewards, or one built-in reward.
    """
    if settings.custom_reward is not None:
        return load_reward(settings.custom_reward), settings.custom_reward
    if settings.reward_url is not None:
        client = HttpReward(
            settings.reward_url,
            timeout=settings.reward_timeout,
            retries=settings.reward_retries,
            token=token,
        )
        return client, "reward server"
    if settings.reward_weights is not None:
        weights = parse_reward_weights(settings.reward_weights)
        combined = WeightedReward(
            [(BUILTIN_REWARDS[name](), weight) for name, weight in weights.items()]
        )
        return combined, f"{settings.reward_weights}, {settings.reward_combination}"
    return BUILTIN_REWARDS[settings.reward](), settings.reward


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
        self.algorithm: AbstractAlgorithm = config.chosen_algorithm
        self.reward: FlowReward
        self.reward_name: str
        """What the train reward is, in the words of the settings (for pictures)."""
        self.reward, self.reward_name = train_reward(config.rewards, reward_token)
        self.measures_train_reward = measures_train_reward(config.rewards)
        """Whether `measure` reports `train_reward` (`measures_train_reward`)."""
        self.inputs = InputSpec(
            select="tokens",
            null=jnp.full((PROMPT_LENGTH,), NULL_TOKEN, jnp.int32),
            latent_shape=self.task.image_shape,
            caption=lambda rows: [self.task.caption(t) for t in np.asarray(rows["tokens"])],
        )
        self.model = DiT(
            image_size=self.task.image_shape[0],
            channels=self.task.image_shape[2],
            patch=config.model.patch,
            width=config.model.width,
            depth=config.model.depth,
            heads=config.model.heads,
            vocab_size=VOCAB_SIZE + 1,
            prompt_length=PROMPT_LENGTH,
            key=jax.random.key(config.pretraining.pretrain_seed),
        )
        self.guidance = CFG(config.rollout.guidance_scale)

    # -- the base model --------------------------------------------------------------

    def pretrain_objective(self) -> FlowMatchingObjective:
        return FlowMatchingObjective(
            GuidedFlow(self.model, RectifiedFlow(), self.inputs, guidance=self.guidance),
            cond_dropout=self.config.pretraining.cond_dropout,
        )

    def base_paths(self) -> list[pathlib.Path]:
        name = f"base_{self.config.base_fingerprint()}.eqx"
        return [self.out / name, SHIPPED_DIR / name]

    def pretrain(self, log: Callable[[str], None] = print) -> Any:
        """Flow-matching pretraining on rendered images of every prompt; returns the model."""
        config = self.config.pretraining
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
        model = self.config.model
        if model.lora_rank == 0:
            return base
        return lora.add(
            base,
            model.lora_rank,
            alpha=model.lora_scale_numerator,
            key=jax.random.key(self.config.training.seed + 4),
        )

    def checkpoint_metadata(self, base: Any) -> dict[str, Any]:
        """What a checkpoint records besides the state: the base model's `lora.fingerprint`
        when the policy has adapters (the state is stored without the base)."""
        if self.config.model.lora_rank == 0:
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
        if self.config.model.lora_rank > 0:
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
        if self.config.model.lora_rank > 0:
            path = self.out / "policy.lora"
            lora.save_adapters(path, policy)
        else:
            path = self.out / "policy.eqx"
            save_model(path, policy)
        return path

    # -- RL fine-tuning ----------------------------------------------------------------

    def pieces(self) -> JobPieces:
        """What the chosen algorithm builds its objective and rollout from."""
        return JobPieces(self.config, self.model, self.inputs, self.guidance, self.reward)

    def objective(self, base: Any) -> AbstractRLObjective[Any, Any]:
        """The objective the trainer trains: the chosen algorithm's, from `base`."""
        return self.algorithm.objective(self.pieces(), base)

    def flow_grpo_objective(self, base: Any) -> FlowGRPOObjective:
        """Flow-GRPO's objective from `base` as the chosen algorithm gives it
        (`algorithms.AbstractAlgorithm.flow_grpo_objective`): what the policy-ratio
        histograms rescore with and what `flowgrpo-eqx check` checks, whatever the
        algorithm."""
        return self.algorithm.flow_grpo_objective(self.pieces(), base)

    def rollout(
        self, objective: AbstractRLObjective[Any, Any], mesh: Mesh | None = None
    ) -> FlowRollout:
        """The chosen algorithm's rollout of `objective`'s guided flow."""
        return self.algorithm.rollout(self.pieces(), objective, mesh)

    def updates(self) -> int:
        """How many optimizer updates the Flow-GRPO run makes (epochs x inner epochs x
        minibatches per rollout)."""
        training = self.config.training
        rows = self.config.rollout.rollout_rows
        size = rows if training.minibatch_rows is None else training.minibatch_rows
        return training.epochs * training.inner_epochs * minibatch_count(rows, size)

    def trainer(self, objective: AbstractRLObjective[Any, Any]) -> Trainer:
        """The trainer of `objective`, with the job's optimizer and `ema_decay`."""
        config = self.config.training
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
        rng = np.random.default_rng([self.config.training.seed, 7, epoch])
        total = len(rows["tokens"])
        picked = rng.permutation(total)[: min(self.config.rollout.prompts_per_epoch, total)]
        return {name: np.asarray(values)[picked] for name, values in rows.items()}

    # -- measurement ------------------------------------------------------------------

    def evaluation_flow(self) -> GuidedFlow:
        """What the job measures and previews every policy with, whatever the algorithm:
        the job's model, process, inputs, guidance and precision."""
        return job_flow(self.pieces(), self.guidance)

    def measure(
        self, policy: Any, *, server_down: Callable[[str], None] | None = None
    ) -> dict[str, Any]:
        """Held-out strict accuracy, reward and diversity of `policy`, with fixed noise (ODE
        sampling: `Euler` on `eval_steps` points), and the mean of the run's own train reward
        on the same samples (`train_reward`) when `measures_train_reward` (scored once, on
        process 0, as the rollouts are).

        **Arguments:**

        - `policy`: the policy to measure.
        - `server_down`: with a reward server, where to say that it failed when the measure
            may go on without `train_reward` (`flowgrpo-eqx eval` of a run whose server is
            gone); `None` (training) raises its `RewardError`.

        **Returns:**

        `{"accuracy", "reward", "diversity"}`, and `"train_reward"` where measured.

        **Raises:**

        - `RewardError`: when the train reward fails (but a server, with `server_down`).
        """
        per_prompt = self.config.evaluation.eval_samples_per_prompt
        rows = self.task.rows("heldout")
        tokens = np.repeat(rows["tokens"], per_prompt, axis=0)
        key = jax.random.key(10_000 + self.config.evaluation.eval_seed)
        evaluation = evaluate_policy(
            self.evaluation_flow(),
            Euler(),
            self.config.evaluation.eval_steps,
            local_copy(policy),
            {"tokens": jnp.asarray(tokens)},
            key,
        )
        samples = np.asarray(evaluation.samples, np.float64)
        check = self.task.check(samples, tokens)
        grouped = samples.reshape(len(rows["tokens"]), per_prompt, -1)
        distances = [
            np.sqrt(np.mean((g[i] - g[j]) ** 2))
            for g in grouped
            for i in range(per_prompt)
            for j in range(i + 1, per_prompt)
        ]
        measured = {
            "accuracy": float(check.strict.mean()),
            "reward": float(check.partial.mean()),
            "diversity": float(np.mean(distances)) if distances else 0.0,
        }
        if self.measures_train_reward:
            here = np.asarray(evaluation.samples) if jax.process_index() == 0 else None
            try:
                scores = score_on_root(self.reward, here, {"tokens": tokens})
            except RewardError as error:
                if server_down is None or self.config.rewards.reward_url is None:
                    raise
                server_down(
                    f"The run's reward server did not score the held-out samples ({error}); "
                    "the measure goes on without the held-out train reward."
                )
            else:
                measured["train_reward"] = float(np.mean(scores))
        return measured

    def preview(self, policy: Any, path: pathlib.Path, title: str) -> None:
        """Samples of `policy` for the first held-out prompts with fixed noise, captioned
        with their partial scores, written by process 0 (every process takes part in
        gathering sharded parameters)."""
        policy = local_copy(policy)
        if jax.process_index() != 0:
            return
        tokens = self.task.rows("heldout")["tokens"][: self.config.evaluation.preview_prompts]
        preview_policy(
            self.evaluation_flow(),
            Euler(),
            self.config.evaluation.eval_steps,
            policy,
            {"tokens": jnp.asarray(tokens)},
            jax.random.key(20_000 + self.config.evaluation.eval_seed),
            scored=ShapesReward(self.task, kind="partial"),
            path=str(path),
            title=title,
        )
