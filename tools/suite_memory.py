"""`python -m tools.suite_memory`: the test suite's time and peak memory, file by file or whole.

`files [FILE ...] [--out TABLE.md]`: each test file (by default every `test_*.py` under
`tests/` and `property_tests/`) runs alone in a fresh process,
`python -m pytest -q -p no:cacheprovider -n 0 FILE`, one after the other; the table gives its
tests' outcome, its wall seconds and the test process's peak resident memory (the kernel's
high-water mark, written by `tests/worker_health.py`). Processes a test starts are not
counted in it.

`suite [--interval S] [--out FILE.json] -- PYTEST_ARGS`: runs `python -m pytest PYTEST_ARGS`
(the README's command: `-- -n 2 --dist loadfile`) and samples, every `--interval` seconds,
the resident memory of each xdist worker alone and with the processes it started; prints
each worker's peaks, the test it was running at its own peak (from each worker's log,
`FLOWGRPO_TEST_MEMORY_LOG`), and the kernel's high-water mark of each worker, and exits
with pytest's status.

Both print Markdown tables; the measurements belong outside the repository (docs cite the
command, not a file of results).
"""

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time
from typing import Any

import psutil  # type: ignore[import-untyped]


ROOT = pathlib.Path(__file__).resolve().parent.parent
TEST_FOLDERS = ("tests", "property_tests")
OUTCOMES = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")


def suite_files(root: pathlib.Path = ROOT) -> list[str]:
    """Every `test_*.py` under the test folders, relative to `root`, in name order."""
    return sorted(
        str(path.relative_to(root))
        for folder in TEST_FOLDERS
        for path in root.glob(f"{folder}/test_*.py")
    )


def outcome_of(output: str) -> str:
    """The counts of pytest's closing line (`12 passed, 1 skipped`), or `?` when it has none."""
    lines = [line for line in output.splitlines() if OUTCOMES.search(line)]
    if not lines:
        return "?"
    return ", ".join(f"{n} {what}" for n, what in OUTCOMES.findall(lines[-1]))


def run_file(path: str, extra: list[str]) -> dict[str, Any]:
    """One test file alone: its outcome, wall seconds and peak resident memory in MB."""
    with tempfile.TemporaryDirectory() as folder:
        record = pathlib.Path(folder) / "memory.json"
        env = {**os.environ, "FLOWGRPO_TEST_MEMORY": str(record)}
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0"]
        start = time.monotonic()
        done = subprocess.run(
            [*command, *extra, path], cwd=ROOT, env=env, capture_output=True, text=True
        )
        seconds = time.monotonic() - start
        peak = json.loads(record.read_text())["peak_mb"] if record.exists() else None
    return {
        "file": path,
        "outcome": outcome_of(done.stdout),
        "status": done.returncode,
        "seconds": seconds,
        "peak_mb": peak,
    }


def files_table(rows: list[dict[str, Any]]) -> str:
    """The Markdown table of `run_file`'s rows, largest peak first."""
    lines = ["| file | tests | seconds | peak MB |", "|---|---|---:|---:|"]
    for row in sorted(rows, key=lambda r: -(r["peak_mb"] or 0)):
        peak = "?" if row["peak_mb"] is None else f"{row['peak_mb']:,.0f}"
        lines.append(f"| `{row['file']}` | {row['outcome']} | {row['seconds']:.0f} | {peak} |")
    return "\n".join(lines)


def _tree(process: Any) -> list[Any]:
    """The processes under `process` (psutil), or none once it is gone."""
    try:
        return list(process.children(recursive=True))
    except psutil.Error:
        return []


def _resident(process: Any) -> tuple[float, float]:
    """A process's resident memory in MB, alone and with every process under it."""
    try:
        own = process.memory_info().rss
        tree = own
        for child in process.children(recursive=True):
            try:
                tree += child.memory_info().rss
            except psutil.Error:
                pass
    except psutil.Error:
        return 0.0, 0.0
    return own / 1e6, tree / 1e6


def _running(records: list[dict[str, Any]], when: float) -> str:
    """The test a worker's log (`FLOWGRPO_TEST_MEMORY_LOG`) shows running at `when`: the first
    to finish after it."""
    for record in records:
        if record["time"] >= when:
            return str(record["test"])
    return f"after {records[-1]['test']}" if records else "?"


def run_suite(
    pytest_args: list[str],
    interval: float,
    keep: pathlib.Path | None = None,
    limit_mb: float | None = None,
    cgroup_mb: float | None = None,
) -> tuple[int, dict[str, Any]]:
    """`python -m pytest PYTEST_ARGS`, its workers' memory sampled: (pytest's status, peaks).
    The workers' logs are kept in `keep` if given. A worker whose resident memory with the
    processes it started is seen above `limit_mb` is killed (SIGKILL), as a cgroup's memory
    limit would kill it; between two samples it goes unseen. With `cgroup_mb`, each worker
    is moved, when first seen, into a memory cgroup of its own limited to `cgroup_mb`
    (`confine`), which the processes it starts inherit: the kernel holds the limit."""
    with tempfile.TemporaryDirectory() as folder:
        logs = pathlib.Path(folder) if keep is None else keep
        logs.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            "FLOWGRPO_TEST_MEMORY_LOG": str(logs),
            "FLOWGRPO_TEST_MEMORY": str(logs / "peak.json"),
        }
        start = time.monotonic()
        command = [sys.executable, "-m", "pytest", *pytest_args]
        process = subprocess.Popen(command, cwd=ROOT, env=env)
        watched = psutil.Process(process.pid)
        by_pid: dict[int, dict[str, Any]] = {}
        groups: dict[int, pathlib.Path] = {}
        while process.poll() is None:
            try:
                workers = watched.children()
            except psutil.Error:
                workers = []
            for child in workers:
                if cgroup_mb is not None and child.pid not in groups:
                    groups[child.pid] = confine(child.pid, cgroup_mb)
                own, tree = _resident(child)
                peak = by_pid.setdefault(child.pid, {"own_mb": 0.0, "tree_mb": 0.0})
                if limit_mb is not None and tree > limit_mb and "killed_mb" not in peak:
                    peak["killed_mb"] = tree
                    print(f"suite_memory: killing worker {child.pid}: {tree:,.0f} MB", flush=True)
                    for doomed in [*_tree(child), child]:
                        try:
                            doomed.kill()
                        except psutil.Error:
                            pass
                if own > peak["own_mb"]:
                    peak.update(own_mb=own, own_at=time.time())
                if tree > peak["tree_mb"]:
                    peak.update(tree_mb=tree, tree_at=time.time())
            time.sleep(interval)
        seconds = time.monotonic() - start
        for pid, group in groups.items():
            by_pid.setdefault(pid, {}).update(release(group))
        peaks = {}
        for log in sorted(logs.glob("*.jsonl")):
            records = [json.loads(line) for line in log.read_text().splitlines()]
            for pid in dict.fromkeys(record["pid"] for record in records):
                if pid not in by_pid:
                    continue
                ran = [record for record in records if record["pid"] == pid]
                peak = by_pid[pid]
                peak["own_test"] = _running(ran, peak.get("own_at", 0.0))
                peak["tree_test"] = _running(ran, peak.get("tree_at", 0.0))
                peak["tests"] = len(ran)
                peaks[f"{log.stem} (pid {pid})"] = peak
            kernel = logs / f"peak.json.{log.stem}"
            if kernel.exists():
                peaks.setdefault(f"{log.stem} (kernel)", {})["kernel_mb"] = json.loads(
                    kernel.read_text()
                )["peak_mb"]
        return process.returncode, {"seconds": seconds, "workers": peaks}


CGROUP_MEMORY = pathlib.Path("/sys/fs/cgroup/memory")
"""Where cgroup v1's memory controller is mounted (writable by root)."""


def confine(pid: int, limit_mb: float) -> pathlib.Path:
    """Move process `pid` into a memory cgroup of its own, limited to `limit_mb` MB, with
    the memory it already holds (cgroup v1, as root; a process it starts later is in the
    cgroup too). Returns the cgroup's folder.

    **Raises:**

    - `OSError`: when the memory controller is not writable here (not root, or cgroup v2).
    """
    group = CGROUP_MEMORY / f"flowgrpo_suite_{pid}"
    group.mkdir(exist_ok=True)
    try:
        (group / "memory.move_charge_at_immigrate").write_text("3")
    except OSError:  # some kernels refuse it: what the process held stays charged outside
        pass
    (group / "memory.limit_in_bytes").write_text(str(int(limit_mb * 2**20)))
    (group / "cgroup.procs").write_text(str(pid))
    return group


def release(group: pathlib.Path) -> dict[str, Any]:
    """A cgroup of `confine` after its processes ended: its peak usage in MB, how often
    the limit was hit, how many processes the kernel killed for it; then removed."""

    def read(name: str) -> str:
        return (group / name).read_text()

    oom = dict(line.split() for line in read("memory.oom_control").splitlines())
    found = {
        "cgroup_limit_mb": int(read("memory.limit_in_bytes")) / 2**20,
        "cgroup_peak_mb": int(read("memory.max_usage_in_bytes")) / 2**20,
        "cgroup_limit_hits": int(read("memory.failcnt")),
        "cgroup_oom_kills": int(oom.get("oom_kill", 0)),
    }
    try:
        group.rmdir()
    except OSError:
        pass
    return found


def suite_table(result: dict[str, Any]) -> str:
    """The Markdown table of `run_suite`'s peaks, one row per worker."""
    lines = [
        f"whole run: {result['seconds']:.0f} s",
        "",
        "| worker | tests | peak MB | during | with the processes it started | during "
        "| its cgroup: peak MB of the limit, limit hits, processes killed |",
        "|---|---:|---:|---|---:|---|---|",
    ]
    for worker, p in sorted(result["workers"].items()):
        if "kernel_mb" in p:
            lines.append(f"| {worker} | | {p['kernel_mb']:,.0f} | (its high-water mark) | | | |")
            continue
        killed = f" (killed at {p['killed_mb']:,.0f} MB)" if "killed_mb" in p else ""
        cgroup = (
            f"{p['cgroup_peak_mb']:,.0f} of {p['cgroup_limit_mb']:,.0f}, "
            f"{p['cgroup_limit_hits']}, {p['cgroup_oom_kills']}"
            if "cgroup_peak_mb" in p
            else ""
        )
        lines.append(
            f"| {worker} | {p['tests']} | {p['own_mb']:,.0f} | `{p['own_test']}` "
            f"| {p['tree_mb']:,.0f}{killed} | `{p['tree_test']}` | {cgroup} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.suite_memory",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    files = commands.add_parser("files", help="each test file alone: seconds and peak MB")
    files.add_argument("paths", nargs="*", help="test files (every one by default)")
    files.add_argument("--out", type=pathlib.Path, help="also write the table here")
    files.add_argument("--pytest-arg", action="append", default=[], help="passed to each run")
    suite = commands.add_parser("suite", help="the whole suite, each worker's memory sampled")
    suite.add_argument("--interval", type=float, default=0.5, help="seconds between samples")
    suite.add_argument("--out", type=pathlib.Path, help="also write the peaks here, as JSON")
    suite.add_argument("--logs", type=pathlib.Path, help="keep each worker's log of tests here")
    suite.add_argument(
        "--limit-mb",
        type=float,
        help="kill a worker seen holding more, with the processes it started (as a cgroup would)",
    )
    suite.add_argument(
        "--cgroup-mb",
        type=float,
        help="put each worker in a memory cgroup of its own with this limit (cgroup v1, root)",
    )
    suite.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: pytest's")
    args = parser.parse_args(argv)
    if args.command == "files":
        rows = []
        for path in args.paths or suite_files():
            row = run_file(path, args.pytest_arg)
            rows.append(row)
            peak = "?" if row["peak_mb"] is None else f"{row['peak_mb']:,.0f}"
            print(f"{path}: {row['outcome']}, {row['seconds']:.0f} s, {peak} MB", flush=True)
        table = files_table(rows)
        total = sum(row["seconds"] for row in rows)
        print(f"\n{table}\n\n{len(rows)} files, {total:.0f} s in all")
        if args.out:
            args.out.write_text(table + "\n")
        return 0 if all(row["status"] in (0, 5) for row in rows) else 1
    pytest_args = (
        [a for a in args.pytest_args if a != "--"]
        if args.pytest_args[:1] == ["--"]
        else args.pytest_args
    )
    status, result = run_suite(pytest_args, args.interval, args.logs, args.limit_mb, args.cgroup_mb)
    print(suite_table(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return status


if __name__ == "__main__":
    sys.exit(main())
