"""Training: a generic trainer, training loops, flow-matching pretraining and checkpoints."""

from ._checkpoint import (
    LAYOUT_VERSION as LAYOUT_VERSION,
    Checkpointer as Checkpointer,
    CheckpointError as CheckpointError,
    CheckpointVersionError as CheckpointVersionError,
    load_model as load_model,
    save_model as save_model,
)
from ._diverged import TrainingDiverged as TrainingDiverged
from ._flow_matching import (
    FlowMatchingObjective as FlowMatchingObjective,
    SupervisedBatch as SupervisedBatch,
    TimeSampling as TimeSampling,
)
from ._loops import (
    minibatch_count as minibatch_count,
    minibatch_indices as minibatch_indices,
    minibatches as minibatches,
    rl_epoch as rl_epoch,
    rl_updates as rl_updates,
    supervised_steps as supervised_steps,
)
from ._metrics_log import MetricsLog as MetricsLog
from ._multi_writer import MultiWriter as MultiWriter, make_writers as make_writers
from ._preemption import (
    PREEMPTED_EXIT_STATUS as PREEMPTED_EXIT_STATUS,
    GracefulStop as GracefulStop,
    exit_now as exit_now,
)
from ._run_folder import (
    LOCK_FILE as LOCK_FILE,
    RunFolderError as RunFolderError,
    check_out_folder as check_out_folder,
    lock_run_folder as lock_run_folder,
    move_run_aside as move_run_aside,
    replaced_name as replaced_name,
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
    TensorBoardWriter as TensorBoardWriter,
    WandbWriter as WandbWriter,
    finite_values as finite_values,
    image_pixels as image_pixels,
)
