"""`flowgrpo-eqx`: the command line.

- `flowgrpo-eqx train --out DIR`: pretrain (or load) the base model, measure it, fine-tune
  it with Flow-GRPO, measure again.
- `flowgrpo-eqx pretrain --out DIR`: flow-matching pretraining of the base model only.
- `flowgrpo-eqx eval --checkpoint PATH`: measure a saved policy.
- `flowgrpo-eqx check`: the porting check (one collect, one update, a verdict per line) on
  the demo's setup, or on a user's with `--factory package.module:callable`; exit status 1
  if any line fails.
- `flowgrpo-eqx launch --local N -- train ...`: run a subcommand as N local processes on
  JAX's distributed runtime.

Multi-process flags (`--coordinator HOST:PORT --num-processes N --process-id I`, or the
environment variables `FLOWGRPO_COORDINATOR`, `FLOWGRPO_NUM_PROCESSES`,
`FLOWGRPO_PROCESS_ID`) start `jax.distributed`; `--devices` limits the data mesh.

Every `JobConfig` setting has a flag (`--learning-rate 1e-4`, `--train-steps none`, ...).
"""

import argparse
import dataclasses
import os
import sys
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any

from .config import JobConfig, make_config


def _parser_for(annotation: Any) -> Callable[[str], Any]:
    """A string parser for a `JobConfig` field's type (`int`, `float | None`, a `Literal`)."""
    args = typing.get_args(annotation)
    optional = isinstance(annotation, types.UnionType) and type(None) in args
    base = next((a for a in args if a is not type(None)), annotation) if optional else annotation

    def parse(text: str) -> Any:
        if optional and text.lower() == "none":
            return None
        if typing.get_origin(base) is typing.Literal:
            return text
        return base(text)

    parse.__name__ = getattr(base, "__name__", "value")
    return parse


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("settings (default: the preset's)")
    hints = typing.get_type_hints(JobConfig)
    for field in dataclasses.fields(JobConfig):
        flag = "--" + field.name.replace("_", "-")
        annotation = hints[field.name]
        choices = (
            typing.get_args(annotation) if typing.get_origin(annotation) is typing.Literal else None
        )
        group.add_argument(
            flag,
            dest=field.name,
            type=_parser_for(annotation),
            choices=choices,
            default=argparse.SUPPRESS,
            help=f"{field.metadata['help']} (default {field.default!r})",
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flowgrpo-eqx",
        description="Flow-GRPO for rectified-flow models in JAX/Equinox, on an embedded "
        "compositional shapes task.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="pretrain or load the base model, then Flow-GRPO")
    train.add_argument("--out", default="runs/train", help="run folder (default runs/train)")
    train.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    _add_common(train)

    pretrain = commands.add_parser("pretrain", help="flow-matching pretraining of the base model")
    pretrain.add_argument("--out", default="runs/pretrain", help="where base_<hash>.eqx goes")
    _add_common(pretrain)

    evaluate = commands.add_parser("eval", help="measure a saved policy or checkpoint")
    evaluate.add_argument(
        "--checkpoint",
        required=True,
        help="policy.eqx, base_<hash>.eqx, or a checkpoints/ckpt_* folder",
    )
    evaluate.add_argument("--out", default="runs/eval", help="where samples_eval.png goes")
    _add_common(evaluate)

    check = commands.add_parser(
        "check", help="the porting check: one collect and one update, a verdict per line"
    )
    check.add_argument("--out", default="runs/check", help="where a pretrained base goes")
    check.add_argument(
        "--factory",
        default=None,
        help="package.module:callable returning (objective, rollout, variables, rows)",
    )
    _add_common(check)

    launch = commands.add_parser(
        "launch", help="run a subcommand as N local processes (jax.distributed, gloo on CPU)"
    )
    launch.add_argument("--local", type=int, required=True, help="number of local processes")
    launch.add_argument(
        "--grace-seconds",
        type=float,
        default=60.0,
        help="after a failure, how long the others may take to stop",
    )
    launch.add_argument(
        "rest", nargs=argparse.REMAINDER, help="-- then the subcommand and its arguments"
    )
    return parser


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="default", help="default | tiny (fast, for tests)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    distributed = parser.add_argument_group("scale out")
    distributed.add_argument("--coordinator", default=None, help="HOST:PORT of process 0")
    distributed.add_argument("--num-processes", type=int, default=None)
    distributed.add_argument("--process-id", type=int, default=None)
    distributed.add_argument(
        "--devices",
        type=int,
        default=None,
        help="data-mesh size (default: every device of every process)",
    )
    _add_config_flags(parser)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    arguments = vars(build_parser().parse_args(argv))
    command = arguments.pop("command")
    if command == "launch":
        from .launch import launch_local

        rest = (
            [a for a in arguments["rest"] if a != "--"]
            if arguments["rest"][:1] == ["--"]
            else list(arguments["rest"])
        )
        try:
            return launch_local(arguments["local"], rest, grace_seconds=arguments["grace_seconds"])
        except ValueError as error:
            print(f"flowgrpo-eqx: {error}", file=sys.stderr)
            return 2
    names = {f.name for f in dataclasses.fields(JobConfig)}
    overrides = {k: v for k, v in arguments.items() if k in names}
    try:
        config = make_config(arguments["preset"], **overrides)
    except (ValueError, TypeError) as error:
        print(f"flowgrpo-eqx: {error}", file=sys.stderr)
        return 2
    from .._distributed import initialize
    from .._reward import RewardError

    try:
        initialize(arguments["coordinator"], arguments["num_processes"], arguments["process_id"])
        return _run(command, config, arguments)
    except RewardError as error:
        print(f"flowgrpo-eqx: error on process {_rank()}: {error}", file=sys.stderr, flush=True)
        return _exit_failed(1)
    except Exception as error:  # noqa: BLE001 - a peer's death surfaces as a runtime error
        if _processes() == 1:
            raise
        first = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        print(
            f"flowgrpo-eqx: error on process {_rank()}: another process failed or stopped "
            f"responding ({type(error).__name__}: {first})",
            file=sys.stderr,
            flush=True,
        )
        return _exit_failed(1)


def _processes() -> int:
    import jax

    count: int = jax.process_count()
    return count


def _exit_failed(status: int) -> int:
    """With several processes, leave at once: the runtime's shutdown barrier would wait for
    peers that are gone."""
    if _processes() > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


def _rank() -> int:
    import jax

    index: int = jax.process_index()
    return index


def _run(command: str, config: JobConfig, arguments: dict[str, Any]) -> int:
    """Run one subcommand in this process (jax.distributed already started)."""
    from .job import run_eval, run_pretrain, run_train

    if command == "train":
        run_train(
            config,
            arguments["out"],
            resume=arguments["resume"],
            quiet=arguments["quiet"],
            devices=arguments["devices"],
        )
    elif command == "check":
        from .check import run_check

        report = run_check(
            config, arguments["out"], factory=arguments["factory"], quiet=arguments["quiet"]
        )
        return 0 if report.passed else 1
    elif command == "pretrain":
        run_pretrain(config, arguments["out"], quiet=arguments["quiet"])
    else:
        run_eval(config, arguments["checkpoint"], arguments["out"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
