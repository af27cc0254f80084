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
    AbstractVariables,
    AbstractWindowSchedule,
    DiffusionNFTObjective,
    FlowGRPOObjective,
    FlowReward,
    FlowRollout,
    FlowSDE,
    GRPOGuard,
    Heun,
    HttpReward,
    InputSpec,
    JpegCompressibility,
    JpegIncompressibility,
    RampedDecay,
    RandomWindow,
    RectifiedFlow,
    SlidingWindow,
    Step,
    WeightedReward,
    load_reward,
    local_copy,
    lora,
    window_for_indices,
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
from .config import JobConfig, parse_reward_weights
from .task import NULL_TOKEN, PROMPT_LENGTH, VOCAB_SIZE, ShapesReward, ShapesTask


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
        self.reward_name: str
        """What the train reward is, in the words of the settings (for pictures)."""
        if config.custom_reward is not None:
            self.reward = load_reward(config.custom_reward)
            self.reward_name = config.custom_reward
        elif config.reward_url is not None:
            self.reward = HttpReward(
                config.reward_url,
                timeout=config.reward_timeout,
                retries=config.reward_retries,
                token=reward_token,
            )
            self.reward_name = "reward server"
        elif config.reward_weights is not None:
            weights = parse_reward_weights(config.reward_weights)
            self.reward = WeightedReward(
                [(BUILTIN_REWARDS[name](), weight) for name, weight in weights.items()]
            )
            self.reward_name = f"{config.reward_weights}, {config.reward_combination}"
        else:
            self.reward = BUILTIN_REWARDS[config.reward]()
            self.reward_name = config.reward
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
            # The update program's densities matter only to a Flow-GRPO run in bfloat16.
            bfloat16_grpo = config.precision == "bfloat16" and config.algorithm == "flow_grpo"
            old_log_probs = "update" if bfloat16_grpo else "rollout"
        return FlowGRPOObjective(
            self.model,
            RectifiedFlow(),
            self.inputs,
            sde=self.sde(),
            beta=config.beta,
            clip_range=config.clip_range,
            adv_clip_max=config.adv_clip_max,
            transition_chunk=config.transition_chunk,
            guard=GRPOGuard() if config.grpo_guard else None,
            old_log_probs=old_log_probs,
            **self._shared_settings(base),
        )

    def nft_objective(self, base: Any) -> DiffusionNFTObjective:
        """DiffusionNFT's objective for `--algorithm nft`, as released: `adv_clip_max` is its
        `A_max`, no guidance, and its old policy follows the live one once per epoch by the
        released ramp `min(0.001 step, nft_old_decay)` over the optimizer steps done."""
        config = self.config
        settings = self._shared_settings(base)
        settings["guidance"] = None
        return DiffusionNFTObjective(
            self.model,
            RectifiedFlow(),
            self.inputs,
            beta=config.nft_beta,
            adv_max=config.adv_clip_max,
            old_decay=RampedDecay(maximum=config.nft_old_decay),
            **settings,
        )

    def _shared_settings(self, base: Any) -> dict[str, Any]:
        """What both objectives take alike: guidance, the evaluation grid, the starting
        weights and the precision."""
        config = self.config
        return {
            "guidance": self.guidance,
            "steps": config.eval_steps,
            "pretrained": base,
            "precision": config.precision,
        }

    def train_objective(self, base: Any) -> AbstractRLObjective[Any, Any]:
        """The objective the trainer trains: `objective(base)`, or with `--algorithm nft`
        `nft_objective(base)` (the rollout samples with the same SDE either way)."""
        if self.config.algorithm == "nft":
            return self.nft_objective(base)
        return self.objective(base)

    def rollout(
        self, objective: AbstractRLObjective[Any, Any], mesh: Mesh | None = None
    ) -> FlowRollout:
        """The rollout of `objective`'s guided flow with the job's SDE (`sde()`); with
        `--algorithm nft`, as released, the deterministic second-order `Heun` solver and
        advantages over the global reward std."""
        config = self.config
        shared: dict[str, Any] = {
            "groups": config.groups,
            "steps": config.rollout_steps,
            "shared_noise": config.shared_noise,
            "reward_combination": config.reward_combination,
            "mesh": mesh,
        }
        if config.algorithm == "nft":
            return FlowRollout(
                objective.flow, Heun(), self.reward, advantage_std="global", **shared
            )
        return FlowRollout(
            objective.flow,
            self.sde(),
            self.reward,
            train_steps=config.train_steps if config.window_schedule == "fixed" else None,
            window_schedule=self.window_schedule(),
            record_means=config.grpo_guard,
            **shared,
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
        total = len(rows["tokens"])
        picked = rng.permutation(total)[: min(self.config.prompts_per_epoch, total)]
        return {name: np.asarray(values)[picked] for name, values in rows.items()}

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
