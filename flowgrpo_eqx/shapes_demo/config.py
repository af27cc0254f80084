"""The main job's settings: one dataclass whose fields carry their own help, checked up front.

`flowgrpo-eqx train --help` lists a flag for every field; presets are named sets of overrides.
"""

import dataclasses
import hashlib
import json
import math
import os
import tomllib
import types
import typing
from typing import Any, Literal, TypeAlias

from .. import OldLogProbs, ParamSharding, Precision, RewardCombination, is_int


# The allowed values of the library's settings, read from their public `Literal` types.
PARAM_SHARDINGS: tuple[ParamSharding, ...] = typing.get_args(ParamSharding)
PRECISIONS: tuple[Precision, ...] = typing.get_args(Precision)
OLD_LOG_PROBS: tuple[OldLogProbs, ...] = typing.get_args(OldLogProbs)

RewardName: TypeAlias = Literal["partial", "strict", "jpeg_incompressibility"]
"""The built-in rewards: the task checker's partial or strict score, or DDPO's JPEG size."""

LrSchedule: TypeAlias = Literal["constant", "cosine"]
"""The step size: constant, or a cosine from the peak down to 0 at the last update."""

WindowScheduleName: TypeAlias = Literal["fixed", "random", "sliding"]
"""Where the `sde_steps` stochastic transitions sit: the leading ones, a random position per
rollout, or MixGRPO's window sliding later every `window_shift_every` epochs."""

AlgorithmName: TypeAlias = Literal["flow_grpo", "nft"]
"""What fine-tunes the base model: Flow-GRPO's clipped policy gradient on recorded SDE
transitions, or DiffusionNFT's negative-aware flow matching on final samples."""

LogName: TypeAlias = Literal["tensorboard", "wandb"]
"""Where a run's metrics go besides `metrics.jsonl`."""

REWARD_NAMES: tuple[RewardName, ...] = ("partial", "strict", "jpeg_incompressibility")
LR_SCHEDULES: tuple[LrSchedule, ...] = ("constant", "cosine")
LOG_NAMES: tuple[LogName, ...] = ("tensorboard", "wandb")
ALGORITHMS: tuple[AlgorithmName, ...] = ("flow_grpo", "nft")
WINDOW_SCHEDULES: tuple[WindowScheduleName, ...] = ("fixed", "random", "sliding")
REWARD_COMBINATIONS: tuple[RewardCombination, ...] = ("sum", "normalize_each")


def _setting(default: Any, help: str) -> Any:
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass(frozen=True)
class JobConfig:
    """Every setting of the main job; `flowgrpo-eqx train --help` lists them as flags.

    Each field's help text is its `metadata["help"]`. The whole configuration is checked
    when it is made (`__post_init__`), before any work.

    **Raises:**

    - `ValueError`: naming the setting, for a value of the wrong type or outside its range,
        or settings that do not fit together (`sde_steps` longer than the rollout, a
        `minibatch_rows` that does not divide a rollout's rows, ...).
    """

    # model
    width: int = _setting(64, "DiT token width")
    depth: int = _setting(4, "DiT blocks")
    heads: int = _setting(4, "attention heads per block")
    patch: int = _setting(4, "patch side in pixels (16 / patch tokens per side)")
    # pretraining (flow matching)
    pretrain_steps: int = _setting(10000, "flow-matching steps of the base model")
    pretrain_batch: int = _setting(64, "images per flow-matching step")
    pretrain_lr: float = _setting(1e-3, "flow-matching AdamW learning rate")
    cond_dropout: float = _setting(0.1, "probability of the null prompt in pretraining (CFG)")
    # Flow-GRPO
    epochs: int = _setting(200, "Flow-GRPO epochs (one rollout each)")
    algorithm: AlgorithmName = _setting(
        "flow_grpo",
        "flow_grpo (clipped policy gradient on SDE transitions) | nft (DiffusionNFT: "
        "negative-aware flow matching on final samples; adv_clip_max is its A_max)",
    )
    nft_beta: float = _setting(
        1.0, "nft: strength of the implicit positive and negative policies, in (0, 1]"
    )
    nft_old_decay: float = _setting(
        0.5,
        "nft: decay per epoch of the old (sampling) policy towards the live one (0: the live "
        "policy)",
    )
    prompts_per_epoch: int = _setting(16, "training prompts per rollout")
    groups: int = _setting(16, "samples per prompt (the GRPO group)")
    rollout_steps: int = _setting(
        6, "time-grid points of the rollout sampler (steps - 1 transitions)"
    )
    train_steps: int | None = _setting(2, "leading transitions recorded and trained (none: all)")
    sde_steps: int | None = _setting(
        2, "leading transitions that sample noise, ODE after (Flow-GRPO-Fast; none: all)"
    )
    shared_noise: bool = _setting(
        False, "every sample of a group starts from the same noise (groups differ)"
    )
    window_schedule: WindowScheduleName = _setting(
        "fixed",
        "fixed (the first sde_steps transitions) | random (a random position per rollout) | "
        "sliding (MixGRPO: later by window_stride every window_shift_every epochs)",
    )
    window_shift_every: int = _setting(20, "epochs between moves of the sliding window")
    window_stride: int = _setting(1, "transitions per move of the sliding window")
    inner_epochs: int = _setting(1, "passes over each rollout")
    minibatch_rows: int | None = _setting(64, "rows per optimizer update (none: the whole rollout)")
    learning_rate: float = _setting(1e-4, "AdamW learning rate (the peak, with a schedule)")
    lr_schedule: LrSchedule = _setting("cosine", "constant | cosine (to 0 at the last update)")
    weight_decay: float = _setting(0.0, "AdamW decoupled weight decay")
    max_grad_norm: float = _setting(1.0, "global-norm gradient clip")
    beta: float = _setting(
        0.0,
        "KL weight to the base model (0: none; without LoRA, > 0 keeps a frozen copy of it)",
    )
    clip_range: float = _setting(0.2, "PPO ratio clip")
    grpo_guard: bool = _setting(
        False, "GRPO-Guard: the ratio normalised per step and 1/dt step weights (mathematics §5a)"
    )
    adv_clip_max: float = _setting(5.0, "advantage clip")
    noise_level: float = _setting(0.7, "SDE noise level a")
    guidance_scale: float = _setting(
        3.0, "classifier-free guidance scale (rollout, loss and evaluation)"
    )
    reward: RewardName = _setting(
        "partial", "partial | strict (the task checker) | jpeg_incompressibility"
    )
    reward_weights: str | None = _setting(
        None, "a weighted sum of built-in rewards instead of --reward, e.g. partial=1,strict=0.5"
    )
    reward_combination: RewardCombination = _setting(
        "sum",
        "sum (normalise the weighted sum in each group) | normalize_each (normalise each "
        "reward of --reward-weights in its group, then combine)",
    )
    custom_reward: str | None = _setting(
        None, "package.module:callable of your own FlowReward, used instead of --reward"
    )
    reward_url: str | None = _setting(
        None,
        "score through a reward server at this URL instead of in process (flowgrpo-eqx "
        "serve-reward; token from --reward-token or FLOWGRPO_REWARD_TOKEN)",
    )
    reward_timeout: float = _setting(60.0, "seconds one request to the reward server may take")
    reward_retries: int = _setting(2, "retries of a failed reward request (with backoff)")
    ema_decay: float | None = _setting(
        None,
        "decay of an EMA of the policy (of the adapters with LoRA) kept in the train state "
        "(none: off)",
    )
    transition_chunk: int | None = _setting(
        None, "transitions per scanned chunk of the loss (none: all at once)"
    )
    # LoRA
    lora_rank: int = _setting(
        0,
        "rank of LoRA adapters on every linear layer of the DiT, trained alone (0: full "
        "fine-tuning)",
    )
    lora_alpha: float | None = _setting(
        None,
        "LoRA scale numerator: updates are (alpha / rank) B A (none: 2 x rank, the "
        "Flow-GRPO release's ratio)",
    )
    # evaluation
    eval_steps: int = _setting(21, "ODE steps of held-out evaluation")
    eval_samples_per_prompt: int = _setting(8, "held-out samples per prompt (fixed noise)")
    eval_every: int = _setting(20, "epochs between held-out evaluations")
    preview_prompts: int = _setting(8, "prompts in samples_before.png / samples_after.png")
    eval_seed: int = _setting(
        0, "seed of the held-out evaluation's fixed noise (runs compare on the same samples)"
    )
    # bookkeeping
    precision: Precision = _setting(
        "float32",
        "float32 | bfloat16 (the model computes in bfloat16; master weights, the SDE, ratios "
        "and advantages stay float32 or wider)",
    )
    old_log_probs: OldLogProbs | None = _setting(
        None,
        "rollout | update: the ratio's old log densities as the rollout recorded them, or "
        "recomputed by the update's own program before each rollout's first update (exact "
        "ratio 1 in bfloat16, one more update-program run per minibatch; none: update in "
        "bfloat16, rollout in float32)",
    )
    param_sharding: ParamSharding = _setting(
        "replicated",
        "replicated (a full copy of parameters and optimizer state per device) | fsdp "
        "(each large array split over the devices)",
    )
    fsdp_min_elements: int = _setting(1024, "with fsdp, arrays smaller than this stay replicated")
    checkpoint_every: int = _setting(10, "epochs between checkpoints")
    keep_checkpoints: int = _setting(3, "checkpoints kept")
    log: tuple[LogName, ...] = _setting(
        (), "metrics writers besides metrics.jsonl: tensorboard, wandb (comma-separated)"
    )
    seed: int = _setting(
        0, "seed of the Flow-GRPO run: rollout noise and minibatch order (not the base model)"
    )
    pretrain_seed: int = _setting(
        0, "seed of the base model: its initial weights and pretraining data"
    )

    def __post_init__(self) -> None:
        at_least = {
            "width": 1,
            "depth": 1,
            "heads": 1,
            "patch": 1,
            "pretrain_steps": 0,
            "pretrain_batch": 1,
            "epochs": 1,
            "prompts_per_epoch": 1,
            "groups": 1,
            "rollout_steps": 2,
            "inner_epochs": 1,
            "eval_steps": 2,
            "eval_samples_per_prompt": 1,
            "eval_every": 1,
            "preview_prompts": 1,
            "checkpoint_every": 1,
            "keep_checkpoints": 1,
            "reward_retries": 0,
            "seed": 0,
            "pretrain_seed": 0,
            "eval_seed": 0,
            "lora_rank": 0,
            "window_shift_every": 1,
            "window_stride": 1,
            "fsdp_min_elements": 1,
        }
        for name, minimum in at_least.items():
            value = getattr(self, name)
            if not (is_int(value) and value >= minimum):
                raise ValueError(f"Setting `{name}` must be an int >= {minimum}, got {value!r}.")
        for name in ("shared_noise", "grpo_guard"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"Setting `{name}` must be true or false, got {getattr(self, name)!r}."
                )
        transitions = self.rollout_steps - 1
        for name in ("train_steps", "sde_steps"):
            value = getattr(self, name)
            if value is not None and not (is_int(value) and 1 <= value <= transitions):
                raise ValueError(
                    f"Setting `{name}` must be none or an int in 1..{transitions} "
                    f"(rollout_steps={self.rollout_steps} gives {transitions} transitions), "
                    f"got {value!r}."
                )
        for name in ("minibatch_rows", "transition_chunk"):
            value = getattr(self, name)
            if value is not None and not (is_int(value) and value >= 1):
                raise ValueError(f"Setting `{name}` must be none or an int >= 1, got {value!r}.")
        positive = (
            "pretrain_lr",
            "learning_rate",
            "max_grad_norm",
            "clip_range",
            "adv_clip_max",
            "reward_timeout",
        )
        non_negative = ("weight_decay", "beta", "noise_level", "guidance_scale")
        for name in positive + non_negative:
            value = getattr(self, name)
            bound_ok = value > 0 if name in positive else value >= 0
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and bound_ok):
                relation = "> 0" if name in positive else ">= 0"
                raise ValueError(f"Setting `{name}` must be a number {relation}, got {value!r}.")
        if not 0.0 <= self.cond_dropout < 1.0:
            raise ValueError(
                f"Setting `cond_dropout` must be in [0, 1), got {self.cond_dropout!r}."
            )
        if self.ema_decay is not None and not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(
                f"Setting `ema_decay` must be none or in [0, 1), got {self.ema_decay!r}."
            )
        if self.algorithm not in ALGORITHMS:
            raise ValueError(
                f"Setting `algorithm` must be one of {ALGORITHMS}, got {self.algorithm!r}."
            )
        if not (
            isinstance(self.nft_beta, (int, float))
            and not isinstance(self.nft_beta, bool)
            and 0 < self.nft_beta <= 1
        ):
            raise ValueError(f"Setting `nft_beta` must be in (0, 1], got {self.nft_beta!r}.")
        if not (
            isinstance(self.nft_old_decay, (int, float))
            and not isinstance(self.nft_old_decay, bool)
            and 0 <= self.nft_old_decay < 1
        ):
            raise ValueError(
                f"Setting `nft_old_decay` must be in [0, 1), got {self.nft_old_decay!r}."
            )
        if self.algorithm == "nft" and self.beta > 0:
            raise ValueError(
                "Setting `beta` (Flow-GRPO's KL weight) must be 0 with algorithm 'nft', got "
                f"{self.beta!r}."
            )
        if self.window_schedule not in WINDOW_SCHEDULES:
            raise ValueError(
                f"Setting `window_schedule` must be one of {WINDOW_SCHEDULES}, got "
                f"{self.window_schedule!r}."
            )
        if self.window_schedule != "fixed" and self.train_steps not in (None, self.sde_steps):
            raise ValueError(
                f"Setting `train_steps`={self.train_steps} must equal `sde_steps`="
                f"{self.sde_steps} (or be none) with window_schedule={self.window_schedule!r}: "
                "the moving window's transitions are the trained ones."
            )
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(
                f"Setting `lr_schedule` must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}."
            )
        if self.reward not in REWARD_NAMES:
            raise ValueError(
                f"Setting `reward` must be one of {REWARD_NAMES}, got {self.reward!r}."
            )
        if self.precision not in PRECISIONS:
            raise ValueError(
                f"Setting `precision` must be one of {PRECISIONS}, got {self.precision!r}."
            )
        if self.old_log_probs is not None and self.old_log_probs not in OLD_LOG_PROBS:
            raise ValueError(
                f"Setting `old_log_probs` must be one of {OLD_LOG_PROBS} or none, got "
                f"{self.old_log_probs!r}."
            )
        if self.param_sharding not in PARAM_SHARDINGS:
            raise ValueError(
                f"Setting `param_sharding` must be one of {PARAM_SHARDINGS}, got "
                f"{self.param_sharding!r}."
            )
        if self.reward_combination not in REWARD_COMBINATIONS:
            raise ValueError(
                f"Setting `reward_combination` must be one of {REWARD_COMBINATIONS}, got "
                f"{self.reward_combination!r}."
            )
        if self.reward_weights is not None:
            parse_reward_weights(self.reward_weights)
            if self.custom_reward is not None or self.reward_url is not None:
                raise ValueError(
                    "Setting `reward_weights` combines built-in rewards; it excludes "
                    "`custom_reward` and `reward_url`."
                )
        elif self.reward_combination != "sum":
            raise ValueError(
                f"Setting `reward_combination`={self.reward_combination!r} needs several rewards: "
                "set `reward_weights`."
            )
        if not isinstance(self.log, tuple) or any(name not in LOG_NAMES for name in self.log):
            raise ValueError(f"Setting `log` must name writers from {LOG_NAMES}, got {self.log!r}.")
        if self.custom_reward is not None and self.reward_url is not None:
            raise ValueError("Settings `custom_reward` and `reward_url` exclude each other.")
        if self.reward_url is not None and not self.reward_url.startswith(("http://", "https://")):
            raise ValueError(
                f"Setting `reward_url` must be an http(s) URL, got {self.reward_url!r}."
            )
        if self.custom_reward is not None and ":" not in self.custom_reward:
            raise ValueError(
                "Setting `custom_reward` must be package.module:callable, got "
                f"{self.custom_reward!r}."
            )
        if self.lora_alpha is not None:
            alpha = self.lora_alpha
            if not (
                isinstance(alpha, (int, float))
                and not isinstance(alpha, bool)
                and math.isfinite(alpha)
                and alpha > 0
            ):
                raise ValueError(
                    f"Setting `lora_alpha` must be none or a finite number > 0, got {alpha!r}."
                )
            if self.lora_rank == 0:
                raise ValueError(
                    "Setting `lora_alpha` needs `lora_rank` >= 1 (0 is full fine-tuning), got "
                    f"lora_alpha={alpha!r} with lora_rank=0."
                )
        if self.minibatch_rows is not None and self.rollout_rows % self.minibatch_rows != 0:
            raise ValueError(
                f"Setting `minibatch_rows`={self.minibatch_rows} must divide a rollout's "
                f"{self.rollout_rows} rows (prompts_per_epoch x groups)."
            )

    @property
    def lora_scale_numerator(self) -> float:
        """The LoRA `alpha` in use: `lora_alpha`, or 2 x `lora_rank` when it is none."""
        return float(2 * self.lora_rank if self.lora_alpha is None else self.lora_alpha)

    @property
    def rollout_rows(self) -> int:
        """Rows of one rollout: the epoch's training prompts times `groups`."""
        from .task import NUM_TRAIN_PROMPTS

        return min(self.prompts_per_epoch, NUM_TRAIN_PROMPTS) * self.groups

    def base_fingerprint(self) -> str:
        """A hash of everything that determines the pretrained base model (and nothing else:
        the Flow-GRPO `seed` does not enter, so every training seed reuses one base)."""
        fields = (
            "width",
            "depth",
            "heads",
            "patch",
            "pretrain_steps",
            "pretrain_batch",
            "pretrain_lr",
            "cond_dropout",
        )
        settings: dict[str, Any] = {name: getattr(self, name) for name in fields}
        # Stored under "seed", its name when one seed drove everything, so that the shipped
        # base model keeps its file name.
        settings["seed"] = self.pretrain_seed
        text = json.dumps(settings, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def parse_reward_weights(text: str) -> dict[RewardName, float]:
    """`partial=1,strict=0.5` as `{reward name: weight}`.

    **Arguments:**

    - `text`: comma-separated `name=weight` pairs naming built-in rewards.

    **Returns:**

    The weights by reward name, in the order given.

    **Raises:**

    - `ValueError`: naming `reward_weights`, for a malformed pair, an unknown or repeated
        reward, or a weight that is not a finite number.
    """
    weights: dict[RewardName, float] = {}
    for pair in text.split(","):
        name, equals, weight_text = (part.strip() for part in pair.partition("="))
        if not equals:
            raise ValueError(f"Setting `reward_weights` needs name=weight pairs, got {pair!r}.")
        if name not in REWARD_NAMES:
            raise ValueError(
                f"Setting `reward_weights` names an unknown reward {name!r}; the built-in "
                f"rewards are {REWARD_NAMES}."
            )
        if name in weights:
            raise ValueError(f"Setting `reward_weights` names {name!r} twice.")
        try:
            weight = float(weight_text)
        except ValueError:
            weight = math.nan
        if not math.isfinite(weight):
            raise ValueError(
                f"Setting `reward_weights` gives {name!r} the weight {weight_text!r}; it must "
                "be a finite number."
            )
        weights[name] = weight
    return weights


def setting_help(name: str) -> str:
    """The help line of setting `name`."""
    field = next(f for f in dataclasses.fields(JobConfig) if f.name == name)
    help_text: str = field.metadata["help"]
    return help_text


PRESETS: dict[str, dict[str, Any]] = {
    "default": {},
    "tiny": dict(
        width=16,
        depth=1,
        heads=2,
        patch=4,
        pretrain_steps=20,
        pretrain_batch=16,
        epochs=4,
        prompts_per_epoch=2,
        groups=4,
        minibatch_rows=4,
        rollout_steps=4,
        eval_steps=4,
        eval_samples_per_prompt=1,
        eval_every=2,
        checkpoint_every=1,
        preview_prompts=4,
        reward="jpeg_incompressibility",
    ),
}
"""Named sets of overrides: `default` (the main job) and `tiny` (a smoke run for tests)."""


def make_config(preset: str = "default", **overrides: Any) -> JobConfig:
    """A `JobConfig` from a preset and overrides, checked as a whole.

    **Raises:**

    - `ValueError`: for an unknown preset or setting, or a bad value (naming the setting).
    """
    if preset not in PRESETS:
        raise ValueError(f"`preset` must be one of {sorted(PRESETS)}, got {preset!r}.")
    names = {f.name for f in dataclasses.fields(JobConfig)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ValueError(f"Unknown settings {unknown}; known: {sorted(names)}.")
    return JobConfig(**{**PRESETS[preset], **overrides})


def _field_types() -> dict[str, Any]:
    return typing.get_type_hints(JobConfig)


def split_optional(annotation: Any) -> tuple[bool, Any]:
    """Whether a `JobConfig` field's type admits `None`, and the type without it.

    **Arguments:**

    - `annotation`: the field's type (`X | None` and `Optional[Literal[...]]` alike).

    **Returns:**

    `(optional, base)`: `base` is `X` for an optional type, else `annotation` itself.
    """
    args = typing.get_args(annotation)
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    if not (union and type(None) in args):
        return False, annotation
    return True, next(a for a in args if a is not type(None))


def _accepts(annotation: Any, value: Any) -> bool:
    """Whether a TOML value fits a `JobConfig` field's type (`"none"` stands for `None`)."""
    optional, inner = split_optional(annotation)
    if optional:
        return value == "none" or _accepts(inner, value)
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is Literal:
        return value in args
    if typing.get_origin(annotation) is tuple:
        return isinstance(value, list) and all(_accepts(args[0], item) for item in value)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, annotation)


def _from_toml(annotation: Any, value: Any) -> Any:
    if value == "none":
        return None
    if typing.get_origin(annotation) is tuple:
        return tuple(value)
    if annotation is float:
        return float(value)
    return value


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The settings a TOML file gives (a flat table of setting names; `"none"` for none).

    **Arguments:**

    - `path`: the `.toml` file, e.g. a run folder's `config.toml`.

    **Returns:**

    `{setting: value}` for the settings the file names.

    **Raises:**

    - `ValueError`: naming the file and the key, for a file that is not TOML, an unknown
        setting, or a value of the wrong type.
    """
    try:
        with open(path, "rb") as handle:
            table = tomllib.load(handle)
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise ValueError(f"Config file {os.fspath(path)!r}: {error}") from error
    hints = _field_types()
    values: dict[str, Any] = {}
    for key, value in table.items():
        if key not in hints:
            raise ValueError(
                f"Config file {os.fspath(path)!r}: unknown setting {key!r}; known: {sorted(hints)}."
            )
        if not _accepts(hints[key], value):
            raise ValueError(
                f"Config file {os.fspath(path)!r}: setting {key!r} = {value!r} is not of type "
                f"{hints[key]}."
            )
        values[key] = _from_toml(hints[key], value)
    return values


def _toml_value(value: Any) -> str:
    if value is None:
        return '"none"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    raise TypeError(f"No TOML form for {value!r}.")


def config_to_toml(config: JobConfig) -> str:
    """The whole configuration as TOML, one setting per line with its help as a comment.

    `read_config_file` of the text gives back the same configuration.
    """
    lines = ["# flowgrpo-eqx train --config THIS_FILE reproduces the run's settings."]
    for field in dataclasses.fields(JobConfig):
        lines.append(f"# {field.metadata['help']}")
        lines.append(f"{field.name} = {_toml_value(getattr(config, field.name))}")
    return "\n".join(lines) + "\n"
