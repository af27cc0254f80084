"""What the variant experiments (`tools/tpu/norm_variants.py`, `tools/tpu/splash_blocks.py`)
share: a full-size row of the bench measured once per variant, in one process, each variant a
context within which the model is traced its way."""

import argparse
import contextlib
import json
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from types import ModuleType
from typing import Any

import jax


Variant = Callable[[], AbstractContextManager[Any]]
"""A variant: a function that makes the context within which the row is traced and run."""


@contextlib.contextmanager
def swapped(modules: Sequence[ModuleType], name: str, value: Any) -> Iterator[None]:
    """Within the block, `name` in each of `modules` is `value` (left as it is when `value`
    is `None`): a variant swaps the name a model's module looks up when the model is traced,
    and the block puts the first module's own back in all of them after."""
    library = getattr(modules[0], name)
    for module in modules:
        setattr(module, name, library if value is None else value)
    try:
        yield
    finally:
        for module in modules:
            setattr(module, name, library)


def chosen_variants(parser: argparse.ArgumentParser, text: str, known: Iterable[str]) -> list[str]:
    """The variants `text` names, comma-separated, in its order; argparse's usage error naming
    `--variants` (through `parser`) when it names none or one not in `known`."""
    known = list(known)
    names = [name for name in text.split(",") if name]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        parser.error(f"--variants: unknown {unknown or names}; the variants: {known}")
    return names


def compare(
    prog: str,
    doc: str,
    variants: dict[str, Variant],
    argv: list[str] | None,
    default_row: str = "sd35m b8 splash nothing",
) -> int:
    """Parse `argv` (`--row`, `--calls`, `--profile`, `--variants`), measure the row under
    each of the `variants` named (all by default) in turn (`bench._full_size.measure`) and
    print one JSON object: the JAX version, the device, and each variant's measurement by its
    name.

    **Arguments:**

    - `prog`: the command's name in its usage line.
    - `doc`: the module's docstring; what follows its first paragraph is the help text.
    - `variants`: the contexts to measure in, by name, in the order to measure them.
    - `argv`: the arguments (`None`: the command line's).
    - `default_row`: the row measured when `--row` is not given.

    **Returns:**

    0; a bad argument exits with argparse's usage error, naming it.
    """
    parser = argparse.ArgumentParser(
        prog=prog,
        description=doc.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--row", default=default_row, help=f"a full-size row ({default_row})")
    parser.add_argument("--calls", type=int, default=5, help="timed calls per variant (5)")
    parser.add_argument("--profile", action="store_true", help="profile each variant too")
    parser.add_argument(
        "--variants", default=",".join(variants), help="names, comma-separated (all of them)"
    )
    args = parser.parse_args(argv)
    if args.calls < 1:
        parser.error(f"--calls must be a positive number, got {args.calls}")
    names = chosen_variants(parser, args.variants, variants)
    from bench import _full_size as full_size

    try:
        (row,) = full_size.rows(args.row)
    except ValueError as error:
        parser.error(f"--row: {error}")
    device = jax.devices()[0]
    peak = full_size.device_peak_tflops(device)
    report: dict[str, Any] = {"jax": jax.__version__, "device": device.device_kind}
    for name in names:
        variant = variants[name]
        folder = tempfile.mkdtemp(prefix=f"flowgrpo-{name}-") if args.profile else None
        with variant():
            report[name] = full_size.measure(row, args.calls, None, peak, folder)
    print(json.dumps(report, indent=1))
    return 0
