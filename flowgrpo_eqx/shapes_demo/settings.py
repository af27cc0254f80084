"""The main job's settings, one frozen dataclass per concern, each checked when it is made.

A setting is a field whose metadata carries its help text and its bounds (`_setting`); its
flag, its TOML key and its name in `make_config` are the field's name, unique over the
sections. `config.JobConfig` holds one of each section and checks what crosses sections.
"""

import math
import typing
from typing import Literal, TypeAlias

from .. import OldLogProbs, ParamSharding, Precision, RewardCombination
from ..settings import (
    MAX_SEED as MAX_SEED,
    section,
    seed_setting,
    setting,
    split_optional as split_optional,
)
from .task import NUM_TRAIN_PROMPTS


RewardName: TypeAlias = Literal["partial", "strict", "jpeg_incompressibility"]
"""The built-in rewards: the task checker's partial or strict score, or DDPO's JPEG size."""

LrSchedule: TypeAlias = Literal["constant", "cosine"]
"""The step size: constant, or a cosine from the peak down to 0 at the last update."""

WindowScheduleName: TypeAlias = Literal["fixed", "random", "sliding", "progressive"]
"""Where the `sde_steps` stochastic transitions sit: the leading ones, a random position per
rollout, a whole window sliding later every `window_shift_every` epochs (`SlidingWindow`), or
MixGRPO's released window (`ProgressiveWindow`): later by `window_stride` every
`window_shift_every` epochs, cut short of the grid's last two transitions, empty at its last
position, then from the first transition again."""

AlgorithmName: TypeAlias = Literal[
    "flow_grpo",
    "nft",
    "awm",
    "dgpo",
    "mixgrpo",
    "mixgrpo-flash",
    "mixgrpo-flash-star",
    "dppo",
    "dancegrpo",
]
"""What fine-tunes the base model: Flow-GRPO's clipped policy gradient on recorded SDE
transitions, DiffusionNFT's negative-aware flow matching on final samples, Advantage
Weighted Matching's advantage-weighted flow matching on final samples, Direct Group
Preference Optimization's group-level preference loss on final samples, or Flow-GRPO's
objective on MixGRPO's rollout (a moving SDE window, ODE steps around it; `mixgrpo-flash`
with DPM-Solver++(2M) on a compressed grid after it; `mixgrpo-flash-star`, MixGRPO-Flash*,
with a window that never moves and a grid compressed further). `dppo` is Flow-DPPO: Flow-GRPO's
unclipped policy gradient on recorded SDE transitions, masked by a per-step KL trust region.
`dancegrpo` is DanceGRPO: Flow-GRPO's clipped policy gradient on a constant-noise SDE, each
sample trained on its own random steps, one surrogate per reward.

The type of the `algorithm` setting: the names of `algorithms.ALGORITHMS`, the registry the
flags and files take their choices from (`config.REGISTRY_CHOICES`)."""

DPPOKLStdName: TypeAlias = Literal["released", "transition", "unit"]
"""The std Flow-DPPO's KL divides by (`FlowDPPOObjective.kl_std`): the release's recomputed
Flow-SDE std, clamped at `t = 1` (`ReleasedKLStd`); each transition's own (`TransitionKLStd`,
the release's open fix); or 1 (`UnitKLStd`)."""

LogName: TypeAlias = Literal["tensorboard", "wandb"]
"""Where a run's metrics go besides `metrics.jsonl`."""

REWARD_NAMES: tuple[RewardName, ...] = typing.get_args(RewardName)


MAX_PARAMETERS = 2**32
"""The largest DiT the settings describe, in parameters (at least `12 x depth x width**2`:
the blocks' attention and MLP weights; 16 GiB in float32). A model beyond it is refused
before anything is allocated, rather than aborting with `std::bad_alloc`."""


@section
class ModelSettings:
    """The DiT that is pretrained and fine-tuned, its LoRA adapters and its precision.

    **Raises:**

    - `ValueError`: naming the setting, for a bad value, a `lora_alpha` without adapters,
        or a `width` and `depth` whose DiT would exceed `MAX_PARAMETERS`.
    """

    width: int = setting(64, "DiT token width", minimum=1)
    depth: int = setting(4, "DiT blocks", minimum=1)
    heads: int = setting(4, "attention heads per block", minimum=1)
    patch: int = setting(4, "patch side in pixels (16 / patch tokens per side)", minimum=1)
    lora_rank: int = setting(
        0,
        "rank of LoRA adapters on every linear layer of the DiT, trained alone (0: full "
        "fine-tuning)",
        minimum=0,
    )
    lora_alpha: float | None = setting(
        None,
        "LoRA scale numerator: updates are (alpha / rank) B A (none: 2 x rank, the "
        "Flow-GRPO release's ratio)",
        minimum=0,
        include_minimum=False,
    )
    precision: Precision = setting(
        "float32",
        "float32 | bfloat16 (the model computes in bfloat16; master weights, the SDE, ratios "
        "and advantages stay float32 or wider)",
    )

    def __post_init__(self) -> None:
        at_least = 12 * self.depth * self.width**2
        if at_least > MAX_PARAMETERS:
            raise ValueError(
                f"Settings `width` ({self.width}) and `depth` ({self.depth}) make a DiT of at "
                f"least {at_least:.3g} parameters (12 x depth x width**2), beyond the demo's "
                f"bound of {MAX_PARAMETERS:.3g} (settings.MAX_PARAMETERS)."
            )
        if self.lora_alpha is not None and self.lora_rank == 0:
            raise ValueError(
                "Setting `lora_alpha` needs `lora_rank` >= 1 (0 is full fine-tuning), got "
                f"lora_alpha={self.lora_alpha!r} with lora_rank=0."
            )

    @property
    def lora_scale_numerator(self) -> float:
        """The LoRA `alpha` in use: `lora_alpha`, or 2 x `lora_rank` when it is none."""
        return float(2 * self.lora_rank if self.lora_alpha is None else self.lora_alpha)


@section
class PretrainingSettings:
    """The base model's flow-matching pretraining.

    A bad value raises a `ValueError` naming the setting (`section`).
    """

    pretrain_steps: int = setting(10000, "flow-matching steps of the base model", minimum=0)
    pretrain_batch: int = setting(64, "images per flow-matching step", minimum=1)
    pretrain_lr: float = setting(
        1e-3, "flow-matching AdamW learning rate", minimum=0, include_minimum=False
    )
    cond_dropout: float = setting(
        0.1,
        "probability of the null prompt in pretraining (CFG)",
        minimum=0,
        maximum=1,
        include_maximum=False,
    )
    pretrain_seed: int = seed_setting(
        "seed of the base model: its initial weights and pretraining data"
    )


@section
class RolloutSettings:
    """What one epoch's rollout samples: its prompts and groups, its time grid, which
    transitions are stochastic and recorded, and the guidance.

    **Raises:**

    - `ValueError`: naming the setting, for a bad value, `train_steps` or `sde_steps` longer
        than the rollout, or a moving window whose transitions are not the trained ones.
    """

    prompts_per_epoch: int = setting(16, "training prompts per rollout", minimum=1)
    groups: int = setting(16, "samples per prompt (the GRPO group)", minimum=2)
    rollout_steps: int = setting(
        6,
        "time-grid points of the rollout sampler (steps - 1 transitions)",
        minimum=2,
    )
    train_steps: int | None = setting(
        2, "leading transitions recorded and trained (none: all)", minimum=1
    )
    sde_steps: int | None = setting(
        2,
        "leading transitions that sample noise, ODE after (Flow-GRPO-Fast; none: all)",
        minimum=1,
    )
    shared_noise: bool = setting(
        True, "every sample of a group starts from the same noise (groups differ)"
    )
    window_schedule: WindowScheduleName = setting(
        "fixed",
        "fixed (the first sde_steps transitions) | random (a random position per rollout) | "
        "sliding (later by window_stride every window_shift_every epochs) | progressive "
        "(MixGRPO as released: the same, cut short of the grid's last two transitions, empty "
        "at its last position, then from the first again)",
    )
    window_shift_every: int = setting(20, "epochs between moves of the moving window", minimum=1)
    window_stride: int = setting(
        1, "transitions per move of the moving window (0: never, progressive only)", minimum=0
    )
    noise_level: float = setting(0.7, "SDE noise level a", minimum=0)
    guidance_scale: float = setting(
        3.0,
        "classifier-free guidance scale (rollout, loss and evaluation)",
        minimum=0,
    )

    def __post_init__(self) -> None:
        transitions = self.rollout_steps - 1
        for name in ("train_steps", "sde_steps"):
            value = getattr(self, name)
            if value is not None and not value <= transitions:
                raise ValueError(
                    f"Setting `{name}` must be none or an int in 1..{transitions} "
                    f"(rollout_steps={self.rollout_steps} gives {transitions} transitions), "
                    f"got {value!r}."
                )
        if self.window_stride == 0 and self.window_schedule != "progressive":
            raise ValueError(
                f"Setting `window_stride` must be an int >= 1 with window_schedule="
                f"{self.window_schedule!r}, got 0 (a window that never moves, 0, is the "
                "progressive window's only)."
            )
        if self.window_schedule != "fixed" and self.train_steps not in (None, self.sde_steps):
            raise ValueError(
                f"Setting `train_steps`={self.train_steps} must equal `sde_steps`="
                f"{self.sde_steps} (or be none) with window_schedule={self.window_schedule!r}: "
                "the moving window's transitions are the trained ones."
            )

    @property
    def rollout_rows(self) -> int:
        """Rows of one rollout: the epoch's training prompts times `groups`."""
        return min(self.prompts_per_epoch, NUM_TRAIN_PROMPTS) * self.groups


@section
class RewardSettings:
    """What scores a rollout's samples: one built-in reward, a weighted sum of them, the
    user's own, or a reward server.

    **Raises:**

    - `ValueError`: naming the setting, for a bad value or rewards that exclude each other.
    """

    reward: RewardName = setting(
        "partial",
        "partial | strict (the task checker) | jpeg_incompressibility: one built-in reward, "
        "used when reward_weights is none (naming it, --custom-reward or --reward-url turns "
        "the default reward_weights off)",
    )
    reward_weights: str | None = setting(
        "partial=1,strict=1",
        "a weighted sum of built-in rewards instead of --reward, e.g. partial=1,strict=0.5 "
        "(none: --reward alone)",
    )
    reward_combination: RewardCombination = setting(
        "normalize_each",
        "sum (normalise the weighted sum in each group) | normalize_each (normalise each "
        "reward of --reward-weights in its group, then combine)",
    )
    custom_reward: str | None = setting(
        None, "package.module:callable of your own FlowReward, used instead of --reward"
    )
    reward_url: str | None = setting(
        None,
        "score through a reward server at this URL instead of in process (flowgrpo-eqx "
        "serve-reward; token from --reward-token or FLOWGRPO_REWARD_TOKEN)",
    )
    reward_timeout: float = setting(
        60.0, "seconds one request to the reward server may take", minimum=0, include_minimum=False
    )
    reward_retries: int = setting(2, "retries of a failed reward request (with backoff)", minimum=0)

    def __post_init__(self) -> None:
        self._check_choice()
        if self.reward_url is not None and not self.reward_url.startswith(("http://", "https://")):
            raise ValueError(
                f"Setting `reward_url` must be an http(s) URL, got {self.reward_url!r}."
            )
        if self.custom_reward is not None and ":" not in self.custom_reward:
            raise ValueError(
                "Setting `custom_reward` must be package.module:callable, got "
                f"{self.custom_reward!r}."
            )

    def _check_choice(self) -> None:
        """At most one of `reward_weights`, `custom_reward` and `reward_url`; a
        `reward_combination` other than `sum` only with `reward_weights`."""
        if self.reward_weights is not None:
            parse_reward_weights(self.reward_weights)
            if self.custom_reward is not None or self.reward_url is not None:
                raise ValueError(
                    f"Setting `reward_weights`={self.reward_weights!r} combines built-in "
                    "rewards; it excludes `custom_reward` and `reward_url` (set "
                    "reward_weights to none to use either)."
                )
        elif self.reward_combination != "sum":
            raise ValueError(
                f"Setting `reward_combination`={self.reward_combination!r} needs several rewards: "
                "set `reward_weights`."
            )
        if self.custom_reward is not None and self.reward_url is not None:
            raise ValueError("Settings `custom_reward` and `reward_url` exclude each other.")


@section
class ObjectiveSettings:
    """Which RL algorithm fine-tunes the base model, and the settings of each one's objective
    (all kept, whichever is chosen; `algorithms.ALGORITHMS[algorithm]` checks those that
    must fit it).

    **Raises:**

    - `ValueError`: naming the setting, for a bad value.
    """

    algorithm: AlgorithmName = setting(
        "flow_grpo",
        "flow_grpo (clipped policy gradient on SDE transitions) | nft (DiffusionNFT: "
        "negative-aware flow matching on final samples; adv_clip_max is its A_max) | awm "
        "(Advantage Weighted Matching as released: beta is its KL weight to the base model) "
        "| dgpo (Direct Group Preference Optimization as released: beta is its KL weight, "
        "clip_range its DSM clip) | mixgrpo (Flow-GRPO's objective on MixGRPO's rollout as "
        "released: ODE steps around a progressive SDE window) | mixgrpo-flash (the same, "
        "DPM-Solver++(2M) on a compressed grid after the window) | mixgrpo-flash-star "
        "(MixGRPO-Flash*: Flash with a window that never moves, the grid compressed by 0.2) "
        "| dppo (Flow-DPPO as released: the unclipped ratio surrogate, each step dropped "
        "where its KL to the rollout's policy reaches dppo_kl_threshold and it pushes further) "
        "| dancegrpo (DanceGRPO as released: the clipped ratio on a constant-noise SDE, each "
        "sample trained on 60% of its steps drawn at random, one surrogate per reward)",
    )
    nft_beta: float = setting(
        1.0,
        "nft: strength of the implicit positive and negative policies, in (0, 1]",
        minimum=0,
        maximum=1,
        include_minimum=False,
    )
    nft_old_decay: float = setting(
        0.5,
        "nft: the cap of the released ramp min(0.001 step, cap) by which the old (sampling) "
        "policy keeps its weights at each epoch's end (0: the live policy)",
        minimum=0,
        maximum=1,
        include_maximum=False,
    )
    beta: float = setting(
        0.0,
        "KL weight to the base model (0: none; without LoRA, > 0 keeps a frozen copy of it)",
        minimum=0,
    )
    clip_range: float = setting(0.2, "PPO ratio clip", minimum=0, include_minimum=False)
    grpo_guard: bool = setting(
        False,
        "GRPO-Guard as released (GRPOGuard: the drift added back to the log-ratio, scaled per "
        "step, and each step's loss divided by its mean(sqrt(dt))^2; mathematics §5a)",
    )
    adv_clip_max: float = setting(5.0, "advantage clip", minimum=0, include_minimum=False)
    dppo_kl_threshold: float = setting(
        1e-5,
        "dppo: the per-step KL (a mean over the latent's coordinates) from which a step that "
        "pushes further is dropped",
        minimum=0,
        include_minimum=False,
    )
    dppo_kl_std: DPPOKLStdName = setting(
        "released",
        "dppo: the std its KL divides by: released (the release's, clamped at t = 1) | "
        "transition (each transition's own: the release's open fix) | unit (1: the release's "
        "add_kl_coefficient false)",
    )
    transition_chunk: int | None = setting(
        None,
        "transitions per scanned chunk of the loss (none: all at once)",
        minimum=1,
    )
    old_log_probs: OldLogProbs | None = setting(
        None,
        "rollout | update: the ratio's old log densities as the rollout recorded them, or "
        "recomputed by the update's own program before each rollout's first update (exact "
        "ratio 1 in bfloat16, one more update-program run per minibatch; none: update in "
        "bfloat16, rollout in float32)",
    )


@section
class TrainingSettings:
    """The optimisation: epochs, updates per rollout, the optimizer, the EMA, how parameters
    lie on the devices, and the run's seed.

    **Raises:**

    - `ValueError`: naming the setting, for a bad value.
    """

    epochs: int = setting(300, "Flow-GRPO epochs (one rollout each)", minimum=1)
    inner_epochs: int = setting(1, "passes over each rollout", minimum=1)
    minibatch_rows: int | None = setting(
        64, "rows per optimizer update (none: the whole rollout)", minimum=1
    )
    learning_rate: float = setting(
        1e-4, "AdamW learning rate (the peak, with a schedule)", minimum=0, include_minimum=False
    )
    lr_schedule: LrSchedule = setting("cosine", "constant | cosine (to 0 at the last update)")
    weight_decay: float = setting(0.0, "AdamW decoupled weight decay", minimum=0)
    max_grad_norm: float = setting(
        1.0, "global-norm gradient clip", minimum=0, include_minimum=False
    )
    ema_decay: float | None = setting(
        None,
        "decay of an EMA of the policy (of the adapters with LoRA) kept in the train state "
        "(none: off)",
        minimum=0,
        maximum=1,
        include_maximum=False,
    )
    param_sharding: ParamSharding = setting(
        "replicated",
        "replicated (a full copy of parameters and optimizer state per device) | fsdp "
        "(each large array split over the devices)",
    )
    fsdp_min_elements: int = setting(
        1024, "with fsdp, arrays smaller than this stay replicated", minimum=1
    )
    seed: int = seed_setting(
        "seed of the Flow-GRPO run: rollout noise and minibatch order (not the base model)"
    )


@section
class EvaluationSettings:
    """The held-out measure and the preview pictures.

    A bad value raises a `ValueError` naming the setting (`section`).
    """

    eval_steps: int = setting(21, "ODE steps of held-out evaluation", minimum=2)
    eval_samples_per_prompt: int = setting(
        8, "held-out samples per prompt (fixed noise)", minimum=1
    )
    eval_every: int = setting(20, "epochs between held-out evaluations", minimum=1)
    preview_prompts: int = setting(
        8, "prompts in samples_before.png / samples_after.png", minimum=1
    )
    eval_seed: int = seed_setting(
        "seed of the held-out evaluation's fixed noise (runs compare on the same samples)"
    )


@section
class LoggingSettings:
    """What a run keeps: checkpoints and metrics writers.

    A bad value raises a `ValueError` naming the setting (`section`).
    """

    checkpoint_every: int = setting(10, "epochs between checkpoints", minimum=1)
    keep_checkpoints: int = setting(3, "checkpoints kept", minimum=1)
    log: tuple[LogName, ...] = setting(
        (), "metrics writers besides metrics.jsonl: tensorboard, wandb (comma-separated)"
    )


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
