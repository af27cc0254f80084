"""`flowgrpo-eqx`: the command line.

`finetune` and `export` (the real-model trainer, `flowgrpo_eqx.finetune.cli`) fine-tune a
published diffusers pipeline; every other subcommand (`train`, `eval`, `pretrain`, `check`,
`serve-reward`, `launch`) is the shapes demo's (`flowgrpo_eqx.shapes_demo.cli`).
"""

import sys
from collections.abc import Sequence


FINETUNE_COMMANDS = ("finetune", "export")
"""The subcommands of the real-model trainer."""


def main(argv: Sequence[str] | None = None, *, own_process: bool = False) -> int:
    """Run the command line; returns the exit status.

    **Arguments:**

    - `argv`: the arguments after the program's name (default `sys.argv[1:]`).
    - `own_process`: as `flowgrpo_eqx.shapes_demo.cli.main`'s.
    """
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments and arguments[0] in FINETUNE_COMMANDS:
        from .finetune.cli import main as finetune_main

        return finetune_main(arguments)
    from .shapes_demo.cli import main as demo_main

    return demo_main(arguments, own_process=own_process)


def run_command() -> int:
    """The `flowgrpo-eqx` script: `main(own_process=True)` on `sys.argv[1:]`."""
    return main(own_process=True)


if __name__ == "__main__":
    raise SystemExit(run_command())
