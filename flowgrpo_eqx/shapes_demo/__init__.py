"""The shapes demo: an application built on the library, beside it, never imported by it.

A procedural compositional task (two coloured shapes, a rule-based checker), the main job
that pretrains a small DiT on it and fine-tunes it with Flow-GRPO, its configuration, report
pictures and the `flowgrpo-eqx` command line.
"""

from .algorithms import (
    ALGORITHMS as ALGORITHMS,
    NFT as NFT,
    AbstractAlgorithm as AbstractAlgorithm,
    FlowGRPO as FlowGRPO,
)
from .config import (
    PRESETS as PRESETS,
    SETTINGS as SETTINGS,
    JobConfig as JobConfig,
    make_config as make_config,
    setting_help as setting_help,
)
from .job import (
    SHIPPED_DIR as SHIPPED_DIR,
    ShapesJob as ShapesJob,
    run_eval as run_eval,
    run_pretrain as run_pretrain,
    run_train as run_train,
)
from .settings import (
    EvaluationSettings as EvaluationSettings,
    LoggingSettings as LoggingSettings,
    LrSchedule as LrSchedule,
    ModelSettings as ModelSettings,
    ObjectiveSettings as ObjectiveSettings,
    PretrainingSettings as PretrainingSettings,
    RewardName as RewardName,
    RewardSettings as RewardSettings,
    RolloutSettings as RolloutSettings,
    TrainingSettings as TrainingSettings,
)
from .task import (
    COLOURS as COLOURS,
    HALF as HALF,
    IMAGE_SIZE as IMAGE_SIZE,
    NULL_TOKEN as NULL_TOKEN,
    NUM_COLOURS as NUM_COLOURS,
    NUM_PROMPTS as NUM_PROMPTS,
    NUM_SHAPES as NUM_SHAPES,
    NUM_TRAIN_PROMPTS as NUM_TRAIN_PROMPTS,
    OBJECT_SIZES as OBJECT_SIZES,
    PALETTE as PALETTE,
    PROMPT_LENGTH as PROMPT_LENGTH,
    REWARD_KINDS as REWARD_KINDS,
    SHAPES as SHAPES,
    SPLITS as SPLITS,
    VOCAB as VOCAB,
    VOCAB_SIZE as VOCAB_SIZE,
    CheckResult as CheckResult,
    Prompts as Prompts,
    RewardKind as RewardKind,
    ShapesReward as ShapesReward,
    ShapesTask as ShapesTask,
    Split as Split,
)
