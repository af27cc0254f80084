"""What made a profiled program's device time: each XLA op's JAX operation, source line and
pass, read from the compiled program's text (its `op_name` metadata and stack frames).

`bench._full_size.summarise_trace` adds the functions that made the most to `--profile-row`'s
summary; `python -m tools.tpu.op_sources` captures a row's program and ops and prints the
whole grouping.
"""

import collections
import glob
import gzip
import json
import re
from typing import Any


LOOPS = "loops"
"""The kind of a `while` or `conditional` op (`bench._full_size.op_kind`): its span holds the
ops of its body, each counted under its own kind, so a summary leaves it out."""

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
        if op["kind"] == LOOPS:
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


def trace_events(folder: str) -> list[dict[str, Any]]:
    """The events of the newest `jax.profiler` trace written under `folder`."""
    paths = sorted(glob.glob(f"{folder}/**/*.trace.json.gz", recursive=True))
    with gzip.open(paths[-1]) as handle:
        trace = json.load(handle)
    events: list[dict[str, Any]] = trace["traceEvents"] if isinstance(trace, dict) else trace
    return events
