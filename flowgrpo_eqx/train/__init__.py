"""Training: a generic trainer, flow-matching pretraining, checkpoints, and the main job."""

from ._checkpoint import (
    Checkpointer as Checkpointer,
    load_model as load_model,
    save_model as save_model,
)
from ._flow_matching import (
    FlowMatchingObjective as FlowMatchingObjective,
    SupervisedBatch as SupervisedBatch,
)
from ._job import (
    PRESETS as PRESETS,
    JobConfig as JobConfig,
    make_config as make_config,
    run_eval as run_eval,
    run_pretrain as run_pretrain,
    run_train as run_train,
)
from ._loops import (
    MetricsLog as MetricsLog,
    flow_grpo_epoch as flow_grpo_epoch,
    minibatches as minibatches,
    supervised_steps as supervised_steps,
)
from ._trainer import (
    Trainer as Trainer,
    TrainState as TrainState,
    default_optimizer as default_optimizer,
)
from ._writers import (
    WANDB_MODES as WANDB_MODES,
    WRITER_NAMES as WRITER_NAMES,
    ImageLike as ImageLike,
    JsonlWriter as JsonlWriter,
    MetricsWriter as MetricsWriter,
    MultiWriter as MultiWriter,
    TensorBoardWriter as TensorBoardWriter,
    WandbWriter as WandbWriter,
    finite_values as finite_values,
    image_pixels as image_pixels,
    make_writers as make_writers,
)
