"""The sections of `flowgrpo-eqx finetune`'s configuration: one frozen dataclass per TOML
section (`SECTIONS`), the reward terms and the algorithm choice, and `ConfigError`;
`FinetuneConfig` (in `_config`) holds them."""

from typing import Any, Literal, TypeAlias

from .. import RewardCombination
from ..settings import MAX_SEED, section, setting
from ._algorithms import ALGORITHM_TABLES, AlgorithmName
from ._kinds import PUBLISHED_SIZES


class ConfigError(ValueError):
    """A configuration file or override that cannot be used: the message names the key (and
    the file), what was expected, and the nearest known key for a misspelt one."""


Dtype: TypeAlias = Literal["bfloat16", "float32"]
RewardKind: TypeAlias = Literal["pickscore", "clipscore", "http", "python"]
Remat: TypeAlias = Literal["none", "nothing", "qkv", "attention", "dots"]
AttentionKind: TypeAlias = Literal["auto", "xla", "splash", "chunked", "cudnn"]
Schedule: TypeAlias = Literal["constant", "cosine"]
LoraInit: TypeAlias = Literal["gaussian", "kaiming"]
WriterName: TypeAlias = Literal["tensorboard", "wandb"]


@section
class PipelineSettings:
    """`[pipeline]`: the published pipeline to fine-tune."""

    path: str | None = setting(
        None, "the diffusers pipeline folder (model_index.json, transformer/, vae/, ...)"
    )
    random_weights: str | None = setting(
        None,
        "instead of a folder, random weights of a published model's sizes (no folder is read; "
        f"for benchmarks): one of {', '.join(PUBLISHED_SIZES)}",
    )
    dtype: Dtype = setting("bfloat16", "dtype of the frozen weights (transformer, VAE, encoders)")

    def __post_init__(self) -> None:
        if (self.path is None) == (self.random_weights is None):
            raise ValueError(
                "Setting `path` or `random_weights` must be given, and only one of them: "
                f"got path={self.path!r}, random_weights={self.random_weights!r}."
            )
        if self.random_weights is not None and self.random_weights not in PUBLISHED_SIZES:
            raise ValueError(
                f"Setting `random_weights` must be one of {', '.join(PUBLISHED_SIZES)}, got "
                f"{self.random_weights!r}."
            )


@section
class PromptSettings:
    """`[prompts]`: the prompts files and how they are embedded."""

    train: str = setting("", "training prompts: one a line (.txt) or JSON objects (.jsonl)")
    heldout: str | None = setting(None, "held-out prompts, the same formats (none: no evaluation)")
    text_length: int | None = setting(
        None, "T5's max_sequence_length (none: the pipeline's default)", minimum=1
    )
    negative: str = setting("", "the negative prompt of classifier-free guidance")
    preview: int = setting(8, "fixed held-out prompts drawn in the image grids", minimum=1)
    heldout_limit: int | None = setting(
        None, "evaluate on the first N held-out prompts only (none: all)", minimum=1
    )

    def __post_init__(self) -> None:
        if not self.train:
            raise ValueError("Setting `train` must name the training prompts file.")


@section
class RewardTerm:
    """`[reward.<name>]`: one term of the weighted reward."""

    kind: RewardKind = setting("pickscore", "pickscore | clipscore | http | python")
    weight: float = setting(1.0, "the term's weight in the sum")
    model: str | None = setting(None, "pickscore/clipscore: the CLIPModel folder")
    processor: str | None = setting(
        None, "pickscore/clipscore: the tokenizer folder (none: the model's folder)"
    )
    url: str | None = setting(None, "http: the reward server's URL")
    timeout: float = setting(600.0, "http: seconds per request", minimum=0, include_minimum=False)
    retries: int = setting(2, "http: retries of a failed request", minimum=0)
    function: str | None = setting(None, "python: the host reward, 'package.module:function'")

    def __post_init__(self) -> None:
        needs = REWARD_KEYS[self.kind]
        for key in needs:
            if getattr(self, key) is None:
                raise ValueError(
                    f"Setting `{key}` must be given for a reward of kind {self.kind!r}."
                )


REWARD_KEYS: dict[str, tuple[str, ...]] = {
    "pickscore": ("model",),
    "clipscore": ("model",),
    "http": ("url",),
    "python": ("function",),
}
REWARD_OPTIONAL: dict[str, tuple[str, ...]] = {
    "pickscore": ("processor",),
    "clipscore": ("processor",),
    "http": ("timeout", "retries"),
    "python": (),
}
"""Which keys each reward kind reads (besides `kind` and `weight`)."""


@section
class AlgorithmChoice:
    """`[algorithm]`: which algorithm; its own settings are `[algorithm.<name>]`."""

    name: AlgorithmName = setting("flow_grpo", "one of " + ", ".join(ALGORITHM_TABLES))


@section
class LoraSettings:
    """`[lora]`: the adapters (rank 0 trains every weight of the transformer)."""

    rank: int = setting(32, "adapter rank (0: full fine-tuning)", minimum=0)
    alpha: float = setting(
        64.0, "scale numerator: the update is alpha / rank B A", minimum=0, include_minimum=False
    )
    targets: tuple[str, ...] | None = setting(
        None, "diffusers module names adapted, PEFT's rule (none: the model kind's default)"
    )
    init: LoraInit = setting("gaussian", "A's draw: PEFT's gaussian or kaiming")


@section
class SamplingSettings:
    """`[sampling]`: the images, the grids, the guidance and the groups."""

    resolution: int | None = setting(
        None, "image side in pixels (none: the model kind's)", minimum=1
    )
    height: int | None = setting(None, "image height, for a non-square image", minimum=1)
    width: int | None = setting(None, "image width, for a non-square image", minimum=1)
    frames: int | None = setting(None, "video frames (Wan; none: the model kind's)", minimum=1)
    train_steps: int | None = setting(None, "denoising steps of the rollout", minimum=1)
    eval_steps: int | None = setting(None, "denoising steps of evaluation", minimum=1)
    guidance_scale: float | None = setting(None, "guidance scale (none: the pipeline's)", minimum=0)
    group_size: int = setting(24, "samples per prompt (the group)", minimum=2)
    prompts_per_epoch: int = setting(48, "training prompts per epoch", minimum=1)
    batch: int = setting(8, "samples per rollout program call, per data slot", minimum=1)
    eval_batch: int = setting(16, "samples per evaluation call, per data slot", minimum=1)
    shared_noise: bool = setting(False, "a group's samples start from one noise draw")
    time_shift: float | None = setting(
        None,
        "sample on the uniform grid shifted by this (DanceGRPO's and MixGRPO's --shift) "
        "instead of the scheduler's grid",
        minimum=0,
        include_minimum=False,
    )
    reward_combination: RewardCombination = setting(
        "sum",
        "sum: advantages of the weighted sum of the rewards; normalize_each: each reward "
        "normalised in its group, then the weighted sum (MixGRPO's advantage_aggr)",
    )

    def __post_init__(self) -> None:
        if self.resolution is not None and (self.height is not None or self.width is not None):
            raise ValueError(
                "Setting `resolution` excludes `height` and `width`: give a square side or both "
                "sides."
            )
        if (self.height is None) != (self.width is None):
            raise ValueError("Setting `height` and `width` go together: give both.")


@section
class TrainingSettings:
    """`[training]`: the optimizer and the updates."""

    epochs: int = setting(1000, "epochs (one rollout and its updates each)", minimum=1)
    learning_rate: float = setting(3e-4, "AdamW step size", minimum=0, include_minimum=False)
    schedule: Schedule = setting("constant", "constant | cosine (to 0 at the last update)")
    warmup_steps: int = setting(0, "linear warm-up updates", minimum=0)
    weight_decay: float = setting(1e-4, "AdamW decoupled weight decay", minimum=0)
    max_grad_norm: float | None = setting(
        1.0, "global-norm gradient clip (none: off)", minimum=0, include_minimum=False
    )
    updates_per_epoch: int = setting(2, "optimizer updates per epoch", minimum=1)
    batch: int = setting(8, "rows per microbatch, per data slot", minimum=1)
    inner_epochs: int = setting(1, "passes over each rollout", minimum=1)
    ema: bool = setting(True, "evaluate and export an EMA of the trained weights")
    ema_decay: float = setting(0.9, "the EMA's decay", minimum=0, maximum=1, include_maximum=False)
    ema_every: int = setting(8, "updates between EMA steps", minimum=1)


@section
class MeshSettings:
    """`[mesh]`: the devices."""

    devices: int | None = setting(None, "devices of the mesh (none: all)", minimum=1)
    sequence: int = setting(1, "sequence-parallel axis size", minimum=1)
    fsdp: bool = setting(False, "shard the weights over the mesh (FSDP) instead of copying")
    fsdp_min_elements: int = setting(4096, "with fsdp, smaller arrays stay whole", minimum=1)


@section
class PrecisionSettings:
    """`[precision]`: compute precision, rematerialisation and attention."""

    compute: Dtype = setting("bfloat16", "the transformer's compute precision")
    remat: Remat = setting("nothing", "the blocks' rematerialisation policy")
    attention: AttentionKind = setting("auto", "attention kernel")


@section
class CheckpointSettings:
    """`[checkpoint]`: how often the run is saved."""

    every: int = setting(20, "epochs between checkpoints", minimum=1)
    keep: int = setting(3, "checkpoints kept", minimum=1)


@section
class EvaluationSettings:
    """`[evaluation]`: the held-out evaluation."""

    every: int = setting(20, "epochs between held-out evaluations", minimum=1)
    before: bool = setting(True, "evaluate the base model before training")
    seed: int = setting(0, "seed of the evaluation's fixed noise", minimum=0, maximum=MAX_SEED)


@section
class LoggingSettings:
    """`[logging]`: where metrics go besides `metrics.jsonl`."""

    writers: tuple[WriterName, ...] = setting(("tensorboard",), "tensorboard, wandb")


SECTIONS: dict[str, type[Any]] = {
    "pipeline": PipelineSettings,
    "prompts": PromptSettings,
    "algorithm": AlgorithmChoice,
    "lora": LoraSettings,
    "sampling": SamplingSettings,
    "training": TrainingSettings,
    "mesh": MeshSettings,
    "precision": PrecisionSettings,
    "checkpoint": CheckpointSettings,
    "evaluation": EvaluationSettings,
    "logging": LoggingSettings,
}
"""Every section but `reward` (a table of named terms) and the top-level `seed`."""
