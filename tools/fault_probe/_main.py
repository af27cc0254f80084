"""`python -m tools.fault_probe`: run the faults, print each verdict as it comes, and write
`probe.jsonl` (one outcome per line) and `probe.md` (the counts, then every finding) to
`--out`. Exits 1 if any fault is a finding."""

import argparse
import collections
import concurrent.futures
import dataclasses
import importlib
import json
import pathlib
import shutil
import sys
import tempfile
import time

from ._probe import FINDINGS, PASSING, Fault, Outcome, attempt


GROUP_MODULES = (
    "_settings",
    "_run_folders",
    "_server",
    "_client",
    "_library",
    "_image_side",
    "_tpu_script",
)
"""The modules of faults, each with `faults() -> list[Fault]`, in the order they run."""


def all_faults() -> list[Fault]:
    """Every fault of every module of `GROUP_MODULES`."""
    found: list[Fault] = []
    for name in GROUP_MODULES:
        found += importlib.import_module(f"{__package__}.{name}").faults()
    return found


def report(outcomes: list[Outcome]) -> str:
    """The Markdown report: counts by group and verdict, then every finding."""
    verdicts = (*PASSING, *FINDINGS)
    by_group: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for outcome in outcomes:
        by_group[outcome.group][outcome.verdict] += 1
    total = collections.Counter(outcome.verdict for outcome in outcomes)
    lines = [
        f"{len(outcomes)} faults: "
        + ", ".join(f"{total[v]} {v}" for v in verdicts if total[v] or v in PASSING),
        "",
        "| group | faults | " + " | ".join(verdicts) + " |",
        "|---|---|" + "---|" * len(verdicts),
    ]
    for group, counts in [*by_group.items(), ("all", total)]:
        row = " | ".join(str(counts[v]) for v in verdicts)
        lines.append(f"| {group} | {sum(counts.values())} | {row} |")
    findings = [o for o in outcomes if o.verdict in FINDINGS]
    lines += ["", f"## Findings ({len(findings)})", ""]
    lines += [f"- {o.group} / {o.name}: **{o.verdict}**: {o.detail}" for o in findings]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the probe (see the module's docstring).

    **Arguments:**

    - `argv`: the command-line arguments; `None` reads `sys.argv`.

    **Returns:**

    0 when every fault held or was named, 1 otherwise.
    """
    parser = argparse.ArgumentParser(prog="python -m tools.fault_probe", description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("fault_probe_out"))
    parser.add_argument("--jobs", type=int, default=2, help="faults run at once (default 2)")
    parser.add_argument("--groups", default="", help="comma-separated groups to run (all)")
    parser.add_argument("--match", default="", help="only faults whose name holds this text")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    wanted = {g for g in args.groups.split(",") if g}
    faults = [
        f
        for f in all_faults()
        if (not wanted or f.group in wanted) and args.match.lower() in f.name.lower()
    ]
    if not faults:
        parser.error("no fault matches --groups and --match")
    args.out.mkdir(parents=True, exist_ok=True)
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="fault-probe-"))
    start = time.perf_counter()
    outcomes: list[Outcome] = []
    try:
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            pending = [pool.submit(attempt, fault, scratch) for fault in faults]
            for done, future in enumerate(concurrent.futures.as_completed(pending), 1):
                outcome = future.result()
                outcomes.append(outcome)
                print(
                    f"[{done}/{len(faults)}] {outcome.verdict:9} {outcome.group} / "
                    f"{outcome.name} ({outcome.seconds:.1f} s): {outcome.detail}",
                    flush=True,
                )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    order = {(f.group, f.name): i for i, f in enumerate(faults)}
    outcomes.sort(key=lambda o: order[(o.group, o.name)])
    with open(args.out / "probe.jsonl", "w") as file:
        for outcome in outcomes:
            file.write(json.dumps(dataclasses.asdict(outcome)) + "\n")
    text = report(outcomes)
    (args.out / "probe.md").write_text(text)
    print(text + f"\n{time.perf_counter() - start:.0f} s; written to {args.out}", file=sys.stderr)
    return 1 if any(o.verdict in FINDINGS for o in outcomes) else 0
