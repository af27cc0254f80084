"""Fine-tune a published diffusers pipeline with online RL: the trainer behind
`flowgrpo-eqx finetune CONFIG.toml`, callable from Python too.

`read_config` reads a configuration file (with `--set`-style overrides), `run_finetune` runs
it into a run folder, `export_checkpoint` writes a run's checkpoint out as diffusers
folders. The shapes demo (`flowgrpo_eqx.shapes_demo`) is the other room of the command line;
neither imports the other.
"""

from ._config import (
    ConfigError as ConfigError,
    FinetuneConfig as FinetuneConfig,
    config_to_toml as config_to_toml,
    read_config as read_config,
)
from ._kinds import PipelineError as PipelineError
from ._plan import MeshPlanError as MeshPlanError
from ._prompts import PromptsError as PromptsError
from ._resume import export_checkpoint as export_checkpoint
from ._rewards import RewardSetupError as RewardSetupError
from ._run import run_finetune as run_finetune
