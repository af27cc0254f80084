"""`flowgrpo-eqx finetune CONFIG.toml` and `flowgrpo-eqx export RUN`: the real-model trainer's
command line.

- `flowgrpo-eqx finetune CONFIG.toml --out RUN`: fine-tune the pipeline the file names
  (`--set section.key=value` overrides a setting, `--print-config` prints the resolved
  configuration with every default and exits, `--resume` continues a stopped run,
  `--replace` moves a run already in the folder aside).
- `flowgrpo-eqx export RUN [--checkpoint ckpt_N] [--to DIR]`: the LoRA adapters and the merged
  transformer of a run's checkpoint (its newest by default) as diffusers folders.

The multi-process flags (`--coordinator HOST:PORT --num-processes N --process-id I`) start
`jax.distributed` as the demo's commands do; `flowgrpo-eqx launch --local N -- finetune ...`
runs N local processes.
"""

import argparse
import pathlib
import sys
from collections.abc import Sequence


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flowgrpo-eqx",
        description="Fine-tune a published diffusers pipeline with online RL.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    finetune = commands.add_parser(
        "finetune", help="fine-tune the pipeline a configuration file names"
    )
    finetune.add_argument("config", help="the TOML configuration file")
    finetune.add_argument(
        "--out", default="runs/finetune", help="run folder (default runs/finetune)"
    )
    finetune.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a setting (repeatable); the value is read as TOML",
    )
    finetune.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved configuration with every default, and exit",
    )
    finetune.add_argument("--resume", action="store_true", help="continue the run in --out")
    finetune.add_argument(
        "--replace", action="store_true", help="move a run already in --out aside first"
    )
    finetune.add_argument("--quiet", action="store_true", help="no progress bars")
    _add_processes(finetune)
    export = commands.add_parser("export", help="a run's checkpoint out to diffusers folders")
    export.add_argument("run", help="the run folder (its config.toml is read)")
    export.add_argument(
        "--checkpoint", default=None, help="ckpt_<n> of the run (default: its newest)"
    )
    export.add_argument(
        "--to", default=None, help="where lora/ and transformer/ go (default RUN/export)"
    )
    return parser


def _add_processes(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("scale out")
    group.add_argument("--coordinator", default=None, help="HOST:PORT of process 0")
    group.add_argument("--num-processes", type=int, default=None)
    group.add_argument("--process-id", type=int, default=None)


def main(argv: Sequence[str] | None = None) -> int:
    """Run `finetune` or `export`; returns the exit status (0, 1 for a failed run, 2 for a
    refused configuration or folder, the preempted status after a graceful stop).

    **Arguments:**

    - `argv`: the arguments after the program's name, starting with the subcommand.
    """
    arguments = _parser().parse_args(argv)
    from ._config import ConfigError, config_to_toml, read_config

    if arguments.command == "export":
        return _export(arguments)
    try:
        config = read_config(arguments.config, arguments.overrides)
        if arguments.print_config:
            print(config_to_toml(config.resolved()), end="")
            return 0
    except (ConfigError, ValueError) as error:
        print(f"flowgrpo-eqx: {error}", file=sys.stderr)
        return 2
    return _finetune(arguments, config)


def _finetune(arguments: argparse.Namespace, config: object) -> int:
    from .. import RewardError, initialize
    from ..train import PREEMPTED_EXIT_STATUS, CheckpointError, RunFolderError, TrainingDiverged
    from ._run import run_finetune

    command = f"flowgrpo-eqx finetune {arguments.config}"
    try:
        initialize(arguments.coordinator, arguments.num_processes, arguments.process_id)
        result = run_finetune(
            config,  # type: ignore[arg-type]
            pathlib.Path(arguments.out),
            config_text=command,
            resume=arguments.resume,
            replace=arguments.replace,
            quiet=arguments.quiet,
        )
    except (RunFolderError, CheckpointError) as error:
        print(f"flowgrpo-eqx: {error}", file=sys.stderr)
        return 2
    except (RewardError, TrainingDiverged) as error:
        print(f"flowgrpo-eqx: {error}", file=sys.stderr)
        return 1
    except ValueError as error:
        print(f"flowgrpo-eqx: {error}", file=sys.stderr)
        return 2
    return PREEMPTED_EXIT_STATUS if result.get("preempted") else 0


def _export(arguments: argparse.Namespace) -> int:
    from ._config import ConfigError
    from ._resume import export_checkpoint

    try:
        written = export_checkpoint(
            pathlib.Path(arguments.run),
            arguments.checkpoint,
            None if arguments.to is None else pathlib.Path(arguments.to),
        )
    except (ConfigError, ValueError, OSError) as error:
        print(f"flowgrpo-eqx: {error}", file=sys.stderr)
        return 2
    print("Wrote " + ", ".join(str(path) for path in written))
    return 0
