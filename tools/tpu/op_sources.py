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
    # anywhere: one bar per captured row, its time by what made it (CATEGORIES)
    python -m tools.tpu.op_sources plot DIR/ROW [DIR/ROW ...] --out PNG

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


CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("products with the weights", ("models/_layers.py dense",)),
    ("attention kernels", ("[splash_mha",)),
    (
        "moving queries, keys and values",
        (
            "models/_splash.py",
            "models/_sequence.py",
            "models/_layers.py attend",
            "models/_joint.py JointAttention.qkv",
            "models/_wan.py _WanAttention",
        ),
    ),
    (
        "norms",
        (
            "models/_layers.py head_rms_norm",
            "models/_layers.py rms_norm",
            "models/_layers.py layer_norm",
        ),
    ),
    ("rotary embedding", ("models/_rope.py",)),
    ("the scan over the blocks", ("models/_stacked.py",)),
)
"""What `plot` draws: each category and the beginnings of the `by_function` names it sums;
what none begins is `the rest`."""


def by_category(functions: list[tuple[str, float]]) -> list[tuple[str, float]]:
    """`by_function`'s totals summed by `CATEGORIES`, in their order, then `the rest`."""
    totals = {name: 0.0 for name, _ in CATEGORIES} | {"the rest": 0.0}
    for function, ms in functions:
        category = next(
            (name for name, starts in CATEGORIES if function.startswith(starts)), "the rest"
        )
        totals[category] += ms
    return list(totals.items())


def _read(stem: pathlib.Path) -> list[dict[str, Any]]:
    with gzip.open(f"{stem}.hlo.txt.gz", "rt") as handle:
        metadata = instruction_metadata(handle.read())
    rows: list[dict[str, Any]] = summarise(
        json.loads(pathlib.Path(f"{stem}.ops.json").read_text()), metadata
    )
    return rows


def plot(stems: list[pathlib.Path], path: pathlib.Path) -> None:
    """Draw each captured row (`DIR/ROW`, as `capture` wrote it) as one bar of its step's
    device time by category (`by_category`), each part labelled in ms where it is wide
    enough, and write a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [by_category(by_function(_read(stem))) for stem in stems]
    names = [stem.name.replace("_", " ") for stem in stems]
    figure, axis = plt.subplots(figsize=(11, 0.7 * len(stems) + 2.0), dpi=100)
    widest = max(sum(ms for _, ms in row) for row in parts)
    colours = plt.get_cmap("tab10").colors
    for index, (category, _) in enumerate(parts[0]):
        starts = [sum(ms for _, ms in row[:index]) for row in parts]
        widths = [row[index][1] for row in parts]
        axis.barh(names, widths, left=starts, label=category, color=colours[index])
        for bar, (start, width) in enumerate(zip(starts, widths, strict=True)):
            if width > 0.06 * widest:
                axis.text(start + width / 2, bar, f"{width:.0f}", ha="center", va="center")
    for bar, row in enumerate(parts):
        total = sum(ms for _, ms in row)
        axis.text(total, bar, f" {total:.0f} ms", va="center")
    axis.invert_yaxis()
    axis.set_xlim(0, widest * 1.12)
    axis.set_xlabel("device ms per step, by what made the ops (python -m tools.tpu.op_sources)")
    axis.set_title("Where a step's device time goes")
    figure.legend(loc="lower center", ncol=4, frameon=False, fontsize=9)
    figure.tight_layout(rect=(0, 0.12, 1, 1))
    figure.savefig(path)
    plt.close(figure)


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
    draw = verbs.add_parser("plot", help="anywhere: captured rows as bars by category")
    draw.add_argument("stems", type=pathlib.Path, nargs="+", help="DIR/ROW, as for summarise")
    draw.add_argument("--out", type=pathlib.Path, required=True, help="the PNG to write")
    args = parser.parse_args(argv)
    if args.verb == "capture":
        if not args.out.is_dir():
            parser.error(f"--out {args.out} is not a folder")
        capture(args.row, args.out)
        return 0
    stems = args.stems if args.verb == "plot" else [args.stem]
    for stem in stems:
        for path in (pathlib.Path(f"{stem}.ops.json"), pathlib.Path(f"{stem}.hlo.txt.gz")):
            if not path.is_file():
                parser.error(f"no {path}: capture the row first")
    if args.verb == "plot":
        plot(stems, args.out)
        return 0
    if args.top < 1:
        parser.error(f"--top must be a positive number, got {args.top}")
    print(table(_read(args.stem), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
