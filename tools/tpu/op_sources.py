"""`python -m tools.tpu.op_sources`: which JAX operations a full-size row's device time goes to.

`--profile-row` of `python -m bench.models --full-size` sums a step's device time by kind of
XLA op (matrix products, the splash kernels, elementwise fusions, copies, reductions). This
tool says what made each kind's ops: the JAX operation and the source line named in the
compiled program's metadata (`op_name`, `stack_frame_id`), and whether it ran in the forward,
the recomputed forward or the backward. Two steps, run from the repository's root:

    # on the TPU machine: DIR/ROW.hlo.txt.gz (the compiled program) and DIR/ROW.ops.json
    # (each XLA op's device ms and calls per step over three profiled steps, and its kind)
    bash tools/tpu/run.sh python -m tools.tpu.op_sources capture "sd35m b8 splash nothing" --out DIR
    # anywhere: the Markdown table of the largest groups
    python -m tools.tpu.op_sources summarise DIR/sd35m_b8_splash_nothing --top 30

The trace itself (tens of MB) stays on the machine; the two files come back.
"""

import argparse
import collections
import gzip
import json
import pathlib
import re
import sys
import tempfile
from typing import Any


PASSES = ("forward", "recomputed", "backward", "unnamed")
"""Where an op runs in a training step: the forward, the forward recomputed for the backward
(remat), or the backward; `unnamed` for an op without an `op_name` (a kernel's custom call,
an asynchronous copy's end), which could be any."""

_WRAPPERS = re.compile(
    r"^(?:jvp\(.*\)|transpose\(.*\)|vmap\(.*\)|while|body|closed_call|checkpoint"
    r"|rematted_computation)$"
)


def _numbered(hlo_text: str, title: str) -> dict[int, str]:
    """The numbered lines of one of the program text's tables (`FileNames`, `FunctionNames`,
    `FileLocations`, `StackFrames`): number to the rest of its line."""
    lines = hlo_text.splitlines()
    try:
        start = lines.index(title) + 1
    except ValueError:
        return {}
    table = {}
    for line in lines[start:]:
        entry = re.match(r"^(\d+) (.*)$", line)
        if entry is None:
            break
        table[int(entry.group(1))] = entry.group(2)
    return table


def source_lines(hlo_text: str) -> dict[int, str]:
    """Each stack frame of a compiled program's text by number: the source line it was
    traced from, `file:line function` (the file's folder and name)."""
    files = _numbered(hlo_text, "FileNames")
    functions = _numbered(hlo_text, "FunctionNames")
    locations = _numbered(hlo_text, "FileLocations")
    found = {}
    for number, frame in _numbered(hlo_text, "StackFrames").items():
        location = re.search(r"file_location_id=(\d+)", frame)
        place = locations.get(int(location.group(1))) if location else None
        if place is None:
            continue
        ids = re.search(r"file_name_id=(\d+) function_name_id=(\d+) line=(\d+)", place)
        if ids is None:
            continue
        path = files.get(int(ids.group(1)), "?").strip('"').split("/")
        function = functions.get(int(ids.group(2)), "?").strip('"')
        found[number] = f"{'/'.join(path[-2:])}:{ids.group(3)} {function}"
    return found


def instruction_metadata(hlo_text: str) -> dict[str, tuple[str, str, str]]:
    """Each instruction of a compiled program's text (`Compiled.as_text()`) by name: the
    element type of its result (`bf16`, `f32`, `tuple` for several results), its metadata's
    `op_name`, and the source line it was traced from (`source_lines`); empty where the
    metadata has none."""
    sources = source_lines(hlo_text)
    found = {}
    for line in hlo_text.splitlines():
        instruction = re.match(r"^\s*(?:ROOT )?%([\w.-]+) = (\(?)([a-z]\w*)?", line)
        if instruction is None:
            continue
        result = "tuple" if instruction.group(2) else (instruction.group(3) or "?")
        op_name = re.search(r'op_name="([^"]*)"', line)
        frame = re.search(r"stack_frame_id=(\d+)", line)
        found[instruction.group(1)] = (
            result,
            op_name.group(1) if op_name else "",
            sources.get(int(frame.group(1)), "") if frame else "",
        )
    return found


def jax_operation(op_name: str, instruction: str) -> tuple[str, str]:
    """The pass (`PASSES`) and the JAX operation of the XLA op `instruction` whose metadata
    names `op_name`: the path without the jitted function's name and the transformations'
    wrappers (`jvp`, `transpose`, `vmap`, the scan's `while/body/closed_call`, remat's
    `checkpoint/rematted_computation`), so that the same operation of every block, in every
    pass, has one name. Without an `op_name`, the instruction's name without its number,
    in brackets (`[splash_mha_fwd_residuals]`)."""
    if not op_name:
        return "unnamed", "[" + re.sub(r"(\.\d+|\.clone)+$", "", instruction) + "]"
    parts = op_name.split("/")
    step = parts[1:] if len(parts) > 1 else parts
    if "rematted_computation" in step:
        where = "recomputed"
    elif step[0].startswith("transpose("):
        where = "backward"
    else:
        where = "forward"
    kept = [part for part in step if not _WRAPPERS.match(part)]
    return where, "/".join(kept) or "(the step itself)"


def summarise(
    ops: list[dict[str, Any]], metadata: dict[str, tuple[str, str, str]]
) -> list[dict[str, Any]]:
    """The ops' device time grouped by kind, JAX operation, result type and source line, with
    each pass's share, largest first. Loops (`while`), whose spans hold their bodies' ops, are
    left out.

    **Arguments:**

    - `ops`: `{"op", "ms", "kind"}` per XLA op (`ROW.ops.json`).
    - `metadata`: `instruction_metadata` of the program the ops ran.

    **Returns:**

    One dict a group: `kind`, `operation`, `result`, `source`, `ms` and `ms_by_pass`.
    """
    groups: dict[tuple[str, str, str, str], dict[str, float]] = collections.defaultdict(
        lambda: dict.fromkeys(PASSES, 0.0)
    )
    for op in ops:
        if op["kind"] == "loops":
            continue
        result, op_name, source = metadata.get(op["op"], ("?", "", ""))
        where, operation = jax_operation(op_name, op["op"])
        groups[(op["kind"], operation, result, source)][where] += float(op["ms"])
    rows = [
        {
            "kind": kind,
            "operation": operation,
            "result": result,
            "source": source,
            "ms": sum(by_pass.values()),
            "ms_by_pass": by_pass,
        }
        for (kind, operation, result, source), by_pass in groups.items()
    ]
    return sorted(rows, key=lambda row: -row["ms"])


def by_function(rows: list[dict[str, Any]]) -> list[tuple[str, float]]:
    """`summarise`'s groups summed by the function of their source line (`file function`,
    every line of it; an op without a source under its operation), largest first."""
    totals: collections.Counter[str] = collections.Counter()
    for row in rows:
        source = row["source"]
        if source:
            place, function = source.split(" ", 1)
            totals[f"{place.rsplit(':', 1)[0]} {function}"] += row["ms"]
        else:
            totals[row["operation"]] += row["ms"]
    return totals.most_common()


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
    from bench.models import trace_events

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
