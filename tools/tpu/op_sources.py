"""`python -m tools.tpu.op_sources`: which JAX operations a full-size row's device time goes to.

`--profile-row` of `python -m bench.models --full-size` sums a step's device time by kind of
XLA op (matrix products, the splash kernels, elementwise fusions, copies, reductions) and by
the function of the model that made the ops. This tool keeps the row's program and ops and
prints the whole grouping (`bench._op_sources`): by kind, JAX operation, result type and
source line, named in the compiled program's metadata (`op_name`, `stack_frame_id`), with
each group's share in the forward, the recomputed forward and the backward. Two steps, run
from the repository's root:

    # on the TPU machine: DIR/ROW.hlo.txt.gz (the compiled program) and DIR/ROW.ops.json
    # (each XLA op's device ms and calls per step over three profiled steps, and its kind)
    bash tools/tpu/run.sh python -m tools.tpu.op_sources capture "sd35m b8 splash nothing" --out DIR
    # anywhere: the Markdown table of the largest groups
    python -m tools.tpu.op_sources summarise DIR/sd35m_b8_splash_nothing --top 30

The trace itself (tens of MB) stays on the machine; the two files come back.
"""

import argparse
import gzip
import json
import pathlib
import sys
import tempfile
from typing import Any

from bench._op_sources import PASSES, by_function, instruction_metadata, summarise


def table(rows: list[dict[str, Any]], top: int) -> str:
    """Markdown: the `top` largest groups, a line for the rest, then the `top` functions
    that made the most (`by_function`)."""
    header = ["ms per step", "kind", "JAX operation", "result", "source", *PASSES]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows[:top]:
        passes = " | ".join(f"{row['ms_by_pass'][p]:.1f}" for p in PASSES)
        lines.append(
            f"| {row['ms']:.1f} | {row['kind']} | `{row['operation']}` | {row['result']} "
            f"| {row['source'] and '`' + row['source'] + '`'} | {passes} |"
        )
    rest = sum(row["ms"] for row in rows[top:])
    lines.append(
        f"\n{len(rows)} groups, {sum(r['ms'] for r in rows):.1f} ms per step; "
        f"the {max(len(rows) - top, 0)} not shown: {rest:.1f} ms\n"
    )
    lines += ["| ms per step | made by |", "|---|---|"]
    lines += [f"| {ms:.1f} | `{function}` |" for function, ms in by_function(rows)[:top]]
    return "\n".join(lines)


def capture(name: str, out: pathlib.Path, steps: int = 3) -> None:
    """Compile the row on this machine's first device, profile `steps` steps, and write
    `out/NAME.hlo.txt.gz` and `out/NAME.ops.json` (NAME: the row's name, spaces as `_`)."""
    import jax

    from bench import _full_size as full_size
    from bench._op_sources import trace_events

    (row,) = full_size.rows(name)
    function, args = full_size.program(row)
    compiled = jax.jit(function).lower(*args).compile()
    text = compiled.as_text()
    stem = out / name.replace(" ", "_")
    with gzip.open(f"{stem}.hlo.txt.gz", "wt") as handle:
        handle.write(text)
    arguments = full_size.random_arguments(args)
    jax.block_until_ready(compiled(*arguments))
    folder = tempfile.mkdtemp(prefix="flowgrpo-op-sources-")
    with jax.profiler.trace(folder):
        for _ in range(steps):
            jax.block_until_ready(compiled(*arguments))
    ops = full_size.device_ops(trace_events(folder), steps)
    products = full_size.fusions_with_products(text)
    rows = [
        {"op": op, "ms": round(ms, 4), "calls": runs, "kind": full_size.op_kind(op, products)}
        for op, (ms, runs) in sorted(ops.items(), key=lambda item: -item[1][0])
    ]
    pathlib.Path(f"{stem}.ops.json").write_text(json.dumps(rows))
    if not rows:
        print(f"{name}: the trace holds no device ops ('XLA Ops' threads): run it on a TPU")
        return
    total = sum(row["ms"] for row in rows)
    print(f"{name}: {len(rows)} ops, {total:.1f} ms per step with the loops' spans")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.tpu.op_sources",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verbs = parser.add_subparsers(dest="verb", required=True)
    take = verbs.add_parser("capture", help="on the accelerator: profile one full-size row")
    take.add_argument("row", help="a row of `python -m bench.models --full-size`")
    take.add_argument("--out", type=pathlib.Path, required=True, help="an existing folder")
    read = verbs.add_parser("summarise", help="anywhere: the table of a captured row")
    read.add_argument("stem", type=pathlib.Path, help="DIR/ROW, without .ops.json")
    read.add_argument("--top", type=int, default=30, help="groups to list (30)")
    args = parser.parse_args(argv)
    if args.verb == "capture":
        if not args.out.is_dir():
            parser.error(f"--out {args.out} is not a folder")
        capture(args.row, args.out)
        return 0
    if args.top < 1:
        parser.error(f"--top must be a positive number, got {args.top}")
    ops_path = pathlib.Path(f"{args.stem}.ops.json")
    hlo_path = pathlib.Path(f"{args.stem}.hlo.txt.gz")
    for path in (ops_path, hlo_path):
        if not path.is_file():
            parser.error(f"no {path}: capture the row first")
    with gzip.open(hlo_path, "rt") as handle:
        metadata = instruction_metadata(handle.read())
    print(table(summarise(json.loads(ops_path.read_text()), metadata), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
