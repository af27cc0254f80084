"""`flowgrpo-eqx`: the command line.

- `flowgrpo-eqx train --out DIR`: pretrain (or load) the base model, measure it, fine-tune
  it with Flow-GRPO, measure again.
- `flowgrpo-eqx pretrain --out DIR`: flow-matching pretraining of the base model only.
- `flowgrpo-eqx eval --run DIR` (or `--checkpoint PATH`): measure a saved policy, with the
  settings of its run's `config.toml`.
- `flowgrpo-eqx serve-reward REWARD --port P`: serve a reward over HTTP for `--reward-url`.
- `flowgrpo-eqx train --seeds 0,1,2 --out DIR`: one run per training seed and a summary.
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
import contextlib
import os
import pathlib
import signal
import sys
import threading
import types
import typing
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..rewards.limits import add_limit_arguments, limit_settings, server_token
from ..train import PREEMPTED_EXIT_STATUS, exit_now
from .config import (
    SETTINGS,
    JobConfig,
    Setting,
    UnreadSettingWarning,
    config_to_toml,
    make_config,
    read_config_file,
)
from .eval_target import eval_target
from .settings import MAX_SEED, split_optional


_BOOLEANS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}


def _seed_list(text: str) -> list[int]:
    """`--seeds`: comma-separated ints in 0..MAX_SEED, none repeated, at least one."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts or not all(part.isdecimal() and int(part) <= MAX_SEED for part in parts):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated ints in 0..{MAX_SEED}, e.g. 0,1,2; got {text!r}"
        )
    seeds = [int(part) for part in parts]
    if len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"repeats a seed: {text!r}")
    return seeds


def _parser_for(setting: Setting) -> Callable[[str], Any]:
    """A string parser for a setting's type (`int`, `float | None`, one of its `choices`,
    a tuple given comma-separated)."""
    optional, base = split_optional(setting.annotation)
    choices = setting.choices

    def parse(text: str) -> Any:
        if optional and text.lower() == "none":
            return None
        if typing.get_origin(base) is tuple:
            return tuple(item.strip() for item in text.split(",") if item.strip())
        if choices is not None:
            if optional and text not in choices:
                allowed = ", ".join([*choices, "none"])
                raise argparse.ArgumentTypeError(f"expected one of {allowed}, got {text!r}")
            return text
        if base is bool:
            if text.lower() not in _BOOLEANS:
                raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
            return _BOOLEANS[text.lower()]
        return base(text)

    parse.__name__ = getattr(base, "__name__", "value")
    return parse


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("settings (default: the preset's)")
    for name, setting in SETTINGS.items():
        flag = "--" + name.replace("_", "-")
        optional, _ = split_optional(setting.annotation)
        choices, metavar = setting.choices, None
        if choices is not None and optional:
            # argparse checks `choices` on the parsed value, and `none` parses to `None`: the
            # parser checks the choices of an optional setting itself.
            metavar = "{" + ",".join([*choices, "none"]) + "}"
            choices = None
        group.add_argument(
            flag,
            dest=name,
            type=_parser_for(setting),
            choices=choices,
            metavar=metavar,
            default=argparse.SUPPRESS,
            # argparse %-formats help texts: a literal % in a setting's help is doubled.
            help=f"{setting.help} (default {setting.default!r})".replace("%", "%%"),
        )


_Flag: typing.TypeAlias = tuple[str, dict[str, Any]]

_COMMANDS: tuple[tuple[str, str, tuple[_Flag, ...], bool], ...] = (
    (
        "train",
        "pretrain or load the base model, then Flow-GRPO",
        (
            ("--out", {"default": "runs/train", "help": "run folder (default runs/train)"}),
            (
                "--resume",
                {
                    "action": "store_true",
                    "help": "continue from the newest intact checkpoint (damaged ones are "
                    "reported and skipped)",
                },
            ),
            (
                "--replace",
                {
                    "action": "store_true",
                    "help": "move a run already in --out aside (to OUT.replaced-<k>) and start "
                    "afresh",
                },
            ),
            (
                "--config",
                {
                    "default": None,
                    "help": "a TOML file of settings (a run folder's config.toml reproduces that "
                    "run); precedence: preset < file < flags",
                },
            ),
            (
                "--print-config",
                {
                    "action": "store_true",
                    "help": "print the resolved settings as TOML and exit",
                },
            ),
            (
                "--seeds",
                {
                    "default": None,
                    "type": _seed_list,
                    "help": "comma-separated training seeds: one run per seed in OUT/seed_<s>, "
                    "then OUT/seeds_summary.json (mean, std, worst, best) and "
                    "OUT/seeds_accuracy.png",
                },
            ),
            (
                "--reward-token",
                {
                    "default": None,
                    "help": "token for --reward-url's server (default: $FLOWGRPO_REWARD_TOKEN)",
                },
            ),
        ),
        True,
    ),
    (
        "serve-reward",
        "serve a reward over HTTP for --reward-url (needs aiohttp)",
        (
            (
                "reward",
                {
                    "help": "a built-in reward name (partial, strict, jpeg_incompressibility, "
                    "jpeg_compressibility) or package.module:callable",
                },
            ),
            ("--host", {"default": "127.0.0.1", "help": "address to bind (default loopback)"}),
            ("--port", {"type": int, "default": 8000, "help": "port (0: any free port)"}),
            (
                "--token",
                {
                    "default": None,
                    "help": "a token clients must send (default: $FLOWGRPO_REWARD_TOKEN, or none)",
                },
            ),
        ),
        False,
    ),
    (
        "pretrain",
        "flow-matching pretraining of the base model",
        (("--out", {"default": "runs/pretrain", "help": "where base_<hash>.eqx goes"}),),
        True,
    ),
    (
        "eval",
        "measure a saved policy or checkpoint",
        (
            (
                "--run",
                {
                    "default": None,
                    "help": "a run folder (train's --out): its policy, or its newest checkpoint, "
                    "measured with the settings of its config.toml",
                },
            ),
            (
                "--checkpoint",
                {
                    "default": None,
                    "help": "policy.eqx, policy.lora, base_<hash>.eqx, or a checkpoints/ckpt_<n> "
                    "folder; inside a run folder, read with the run's config.toml",
                },
            ),
            ("--out", {"default": "runs/eval", "help": "where samples_eval.png goes"}),
        ),
        True,
    ),
    (
        "check",
        "the porting check: one collect and one update, a verdict per line",
        (
            ("--out", {"default": "runs/check", "help": "where a pretrained base goes"}),
            (
                "--factory",
                {
                    "default": None,
                    "help": "package.module:callable returning (objective, rollout, variables, "
                    "rows)",
                },
            ),
        ),
        True,
    ),
    (
        "launch",
        "run a subcommand as N local processes (jax.distributed, gloo on CPU)",
        (
            ("--local", {"type": int, "required": True, "help": "number of local processes"}),
            (
                "--grace-seconds",
                {
                    "type": float,
                    "default": 60.0,
                    "help": "after a failure, how long the others may take to stop",
                },
            ),
            (
                "rest",
                {
                    "nargs": argparse.REMAINDER,
                    "help": "-- then the subcommand and its arguments",
                },
            ),
        ),
        False,
    ),
)
"""Each subcommand: its name, its help, its own flags, and whether it takes the job's
settings and the scale-out flags (`_add_common`)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flowgrpo-eqx",
        description="Flow-GRPO for rectified-flow models in JAX/Equinox, on an embedded "
        "compositional shapes task.",
        epilog="Fine-tune a published diffusers pipeline instead: flowgrpo-eqx finetune "
        "CONFIG.toml (flowgrpo-eqx finetune --help), and export a run's checkpoint with "
        "flowgrpo-eqx export RUN.",
    )
    # Also before the subcommand (`flowgrpo-eqx --preset tiny train`), where people put it.
    parser.add_argument(
        "--preset",
        dest="preset_first",
        default=None,
        help="default | tiny, as the subcommand's --preset",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text, flags, common in _COMMANDS:
        command = commands.add_parser(name, help=help_text)
        for flag, options in flags:
            command.add_argument(flag, **options)
        if name == "serve-reward":
            add_limit_arguments(command)
        if common:
            _add_common(command)
    return parser


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preset", default=None, help="default | tiny (fast, for tests); default: default"
    )
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


def main(argv: Sequence[str] | None = None, *, own_process: bool = False) -> int:
    """Run the command line; returns the exit status.

    **Arguments:**

    - `argv`: the arguments after the program's name (default `sys.argv[1:]`).
    - `own_process`: whether the command is all this process does (`run_command`, the
        `flowgrpo-eqx` script). `train` then keeps its early-stop signal handlers until the
        process ends, so that a SIGTERM or SIGINT arriving while the interpreter shuts down
        still exits with `PREEMPTED_EXIT_STATUS` when a checkpoint is kept, and `launch`
        keeps passing signals on (to no one, once its processes are gone) and exits with
        their status. Otherwise (the default, for callers in a process that goes on, such as
        a test suite) the previous handlers come back when `main` returns.

    **Returns:**

    The exit status: 0, 1 for a failed check or run, 2 for refused settings,
    `PREEMPTED_EXIT_STATUS` after a graceful stop.
    """
    parser = build_parser()
    arguments = vars(parser.parse_args(argv))
    command = arguments.pop("command")
    preset_first = arguments.pop("preset_first")
    if "preset" in arguments:
        if preset_first is not None and arguments["preset"] not in (None, preset_first):
            parser.error(f"--preset {preset_first} and --preset {arguments['preset']} disagree")
        arguments["preset"] = arguments["preset"] or preset_first or "default"
    elif preset_first is not None:
        parser.error(f"{command} takes no --preset (train, pretrain, eval and check do)")
    if command == "serve-reward":
        return _serve_reward(arguments)
    if command == "launch":
        from .launch import launch_local

        rest = (
            [a for a in arguments["rest"] if a != "--"]
            if arguments["rest"][:1] == ["--"]
            else list(arguments["rest"])
        )
        try:
            return launch_local(
                arguments["local"],
                rest,
                grace_seconds=arguments["grace_seconds"],
                own_process=own_process,
            )
        except ValueError as error:
            print(f"flowgrpo-eqx: {error}", file=sys.stderr)
            return 2
    if command == "train":
        with _early_stop(pathlib.Path(arguments["out"]), restore=not own_process):
            return _configure_and_run(command, arguments)
    return _configure_and_run(command, arguments)


def run_command() -> int:
    """The `flowgrpo-eqx` script: `main(own_process=True)` on `sys.argv[1:]`."""
    return main(own_process=True)


@contextlib.contextmanager
def _early_stop(out: pathlib.Path, *, restore: bool) -> Iterator[None]:
    """Until the run's own `GracefulStop` is in place (imports, the folder's checks, and after
    it again), SIGTERM or SIGINT end `train` at once: with the preempted exit status when
    `out` (or a seed folder in it) keeps a checkpoint, so that a scheduler resumes the run;
    else by the signal, as without a handler. With `restore`, the previous handlers come back
    at the end; without, these stay until the process ends (its shutdown included)."""

    def stop(signum: int, frame: types.FrameType | None) -> None:
        del frame
        kept = [*out.glob("checkpoints/ckpt_*"), *out.glob("seed_*/checkpoints/ckpt_*")]
        exit_now(signum, PREEMPTED_EXIT_STATUS if kept else None)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = [s for s in (signal.SIGTERM, signal.SIGINT) if signal.getsignal(s) != signal.SIG_IGN]
    previous = {s: signal.signal(s, stop) for s in caught}
    try:
        yield
    finally:
        for caught_signal, handler in previous.items() if restore else ():
            signal.signal(caught_signal, signal.SIG_DFL if handler is None else handler)


def _configure_and_run(command: str, arguments: dict[str, Any]) -> int:
    """The settings of a job subcommand, then the subcommand, errors named in one line."""
    overrides = {k: v for k, v in arguments.items() if k in SETTINGS}
    try:
        from_file = read_config_file(arguments["config"]) if arguments.get("config") else {}
        if command == "eval":
            target = eval_target(arguments["checkpoint"], arguments["run"])
            arguments["checkpoint"] = target.policy
            arguments["newest_of"] = target.newest_of
            if target.config_file is not None:
                from_file = read_config_file(target.config_file)
                print(f"Settings from {target.config_file}.", flush=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", UnreadSettingWarning)
            config = make_config(
                arguments["preset"], file_settings=from_file, named=set(overrides), **overrides
            )
        for warning in caught:
            if issubclass(warning.category, UnreadSettingWarning):
                print(f"flowgrpo-eqx: warning: {warning.message}", file=sys.stderr, flush=True)
            else:
                warnings.warn_explicit(
                    warning.message, warning.category, warning.filename, warning.lineno
                )
    except (ValueError, TypeError) as error:
        print(f"flowgrpo-eqx: {error}", file=sys.stderr)
        return 2
    if arguments.get("print_config"):
        print(config_to_toml(config), end="")
        return 0
    from .. import RewardError, initialize
    from ..train import CheckpointError, TrainingDiverged

    try:
        initialize(arguments["coordinator"], arguments["num_processes"], arguments["process_id"])
        return _run(command, config, arguments)
    except Exception as error:  # noqa: BLE001 - a peer's death surfaces as a runtime error
        named = isinstance(
            error, (RewardError, CheckpointError, TrainingDiverged, OSError, ValueError)
        )
        if named and not (_processes() > 1 and _is_runtime_status(error)):
            print(f"flowgrpo-eqx: error on process {_rank()}: {error}", file=sys.stderr, flush=True)
            return _exit_failed(1)
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


def _serve_reward(arguments: dict[str, Any]) -> int:
    """`flowgrpo-eqx serve-reward`: serve a built-in or imported reward until SIGINT/SIGTERM."""
    from .. import load_reward
    from .job import BUILTIN_REWARDS

    try:
        reward = load_reward(arguments["reward"], BUILTIN_REWARDS)
        from ..rewards.server import serve
    except (ValueError, ModuleNotFoundError) as error:
        print(f"flowgrpo-eqx: {error}", file=sys.stderr)
        return 2
    try:
        serve(
            reward,
            host=arguments["host"],
            port=arguments["port"],
            token=server_token(arguments["token"]),
            **limit_settings(arguments),
        )
    except ValueError as error:
        print(f"flowgrpo-eqx: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"flowgrpo-eqx: {error}", file=sys.stderr)
        return 1
    return 0


# The status codes with which the XLA runtime prefixes its errors. JAX raises a failed collective
# as `JaxRuntimeError`, or as `ValueError` when the failure reaches a later operation on its result.
_RUNTIME_STATUSES = (
    "ABORTED",
    "CANCELLED",
    "DEADLINE_EXCEEDED",
    "FAILED_PRECONDITION",
    "INTERNAL",
    "UNAVAILABLE",
    "UNKNOWN",
)


def _is_runtime_status(error: Exception) -> bool:
    """Whether `error` carries a status from the XLA runtime rather than one of our messages."""
    return str(error).startswith(tuple(f"{status}:" for status in _RUNTIME_STATUSES))


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
    from ..train import PREEMPTED_EXIT_STATUS
    from .job import run_eval, run_pretrain, run_seeds, run_train

    if command == "train":
        if arguments["seeds"] is not None:
            result = run_seeds(
                config,
                arguments["out"],
                arguments["seeds"],
                quiet=arguments["quiet"],
                resume=arguments["resume"],
                replace=arguments["replace"],
            )
        else:
            result = run_train(
                config,
                arguments["out"],
                resume=arguments["resume"],
                replace=arguments["replace"],
                quiet=arguments["quiet"],
                devices=arguments["devices"],
                reward_token=arguments["reward_token"],
            )
        if result.get("preempted"):
            return PREEMPTED_EXIT_STATUS
    elif command == "check":
        from .check import run_check

        report = run_check(
            config, arguments["out"], factory=arguments["factory"], quiet=arguments["quiet"]
        )
        return 0 if report.passed else 1
    elif command == "pretrain":
        run_pretrain(config, arguments["out"], quiet=arguments["quiet"])
    else:
        run_eval(
            config, arguments["checkpoint"], arguments["out"], newest_of=arguments["newest_of"]
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(run_command())
