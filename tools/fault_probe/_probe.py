"""What every fault of the probe shares: how a fault is stated, run and judged.

A fault is one hostile-but-fair thing a user, a machine or a network does to the project:
a setting no model can hold, a damaged run folder, a body no client would send, a server
that trickles its reply. Each is run against the real thing (the `flowgrpo-eqx` command as
a process, a `serve-reward` process over loopback, the library in a process of its own) and
judged by what a user would see:

- `held`: the program did the right thing and went on (a resume after a kill, a bad request
  answered and the server still healthy);
- `named`: it refused, with a one-line message naming the bad argument, file or value, and
  changed nothing it should keep.

Anything else is a finding:

- `lost`: a file the user would keep changed or disappeared;
- `hang`: no answer within the fault's time limit;
- `traceback`: a raw Python traceback, or the process died of a signal (an abort);
- `litter`: a refusal that left files behind (a run folder for a run that never started);
- `unnamed`: refused, but the message does not name what was wrong;
- `accepted`: the fault was taken as valid input;
- `unprobed`: the probe itself failed before it could judge (a fault not carried out is not
  a pass).
"""

import dataclasses
import hashlib
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Literal


Verdict = Literal[
    "held", "named", "lost", "hang", "traceback", "litter", "unnamed", "accepted", "unprobed"
]
PASSING: tuple[Verdict, ...] = ("held", "named")
FINDINGS: tuple[Verdict, ...] = (
    "lost",
    "hang",
    "traceback",
    "litter",
    "unnamed",
    "accepted",
    "unprobed",
)
REPO = pathlib.Path(__file__).resolve().parents[2]


class Finding(Exception):
    """Raised inside a probe to judge its fault a finding of `verdict`, with `detail`."""

    def __init__(self, verdict: Verdict, detail: str):
        super().__init__(detail)
        self.verdict: Verdict = verdict
        self.detail = detail


@dataclasses.dataclass(frozen=True)
class Judgement:
    """What a probe concluded: `verdict` and the line that shows it."""

    verdict: Verdict
    detail: str


@dataclasses.dataclass(frozen=True)
class Fault:
    """One fault: its `group` (where it strikes), a `name` that says what is done, and
    `probe(workdir)`, which does it in a fresh empty folder and returns a `Judgement` (or
    raises `Finding`)."""

    group: str
    name: str
    probe: Callable[[pathlib.Path], Judgement]


@dataclasses.dataclass(frozen=True)
class Outcome:
    """A fault's result, as the probe's report writes it."""

    group: str
    name: str
    verdict: Verdict
    detail: str
    seconds: float


@dataclasses.dataclass(frozen=True)
class Ran:
    """A finished (or stopped) process: its exit `status` (negative: killed by that signal),
    what it printed, and whether it ran past its time limit."""

    status: int
    stdout: str
    stderr: str
    timed_out: bool


def flowgrpo_eqx(*args: object) -> list[str]:
    """The `flowgrpo-eqx ARGS` command line for this interpreter (the checkout's package)."""
    return [sys.executable, "-m", "flowgrpo_eqx.shapes_demo.cli", *map(str, args)]


def environment(**extra: str) -> dict[str, str]:
    """A child process's environment: unbuffered, quiet progress, on the CPU."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu", **extra}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def run(
    command: Sequence[str],
    *,
    timeout: float,
    cwd: pathlib.Path | None = None,
    env: Mapping[str, str] | None = None,
    stdin: str | None = None,
) -> Ran:
    """Run `command` to its end or for `timeout` seconds, capturing its output."""
    process = subprocess.Popen(
        list(command), cwd=cwd, env=dict(env or environment()), text=True,
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = process.communicate(stdin, timeout=timeout)
        return Ran(process.returncode, out, err, timed_out=False)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        out, err = process.communicate()
        return Ran(process.returncode, out, err, timed_out=True)


def python(code: str, *, timeout: float = 120.0) -> Ran:
    """Run `code` in a fresh interpreter of the checkout (for faults of the library)."""
    return run([sys.executable, "-c", code], timeout=timeout)


def snapshot(folder: pathlib.Path, *, ignore: Iterable[str] = ()) -> dict[str, str]:
    """Every file under `folder` (but the relative paths in `ignore`), by relative path, with
    the SHA-256 of its bytes: what a fault must not change."""
    skipped = set(ignore)
    files = {}
    for path in sorted(folder.rglob("*")):
        name = path.relative_to(folder).as_posix()
        if path.is_file() and name not in skipped:
            files[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return files


def changes(before: Mapping[str, str], after: Mapping[str, str]) -> list[str]:
    """The files of `before` that `after` lacks or holds with other bytes, then those added."""
    gone = [f"{name} removed" for name in before if name not in after]
    edited = [f"{name} changed" for name in before if name in after and after[name] != before[name]]
    added = [f"{name} added" for name in after if name not in before]
    return gone + edited + added


def raw_failure(ran: Ran, limit: float) -> Judgement | None:
    """A `hang` or a `traceback` verdict if `ran` shows one, else None."""
    if ran.timed_out:
        return Judgement("hang", f"no exit within {limit:g} s")
    for text in (ran.stderr, ran.stdout):
        if "Traceback (most recent call last)" in text:
            last = text.strip().splitlines()[-1]
            return Judgement("traceback", f"exit {ran.status}: {last}")
    if ran.status < 0 or ran.status > 128:
        return Judgement("traceback", f"died of a signal (exit {ran.status})")
    return None


def message(ran: Ran) -> str:
    """What a refused command said: its stderr, stripped (stdout when stderr is empty)."""
    return (ran.stderr.strip() or ran.stdout.strip()).strip()


def judge_refusal(
    ran: Ran,
    *,
    limit: float,
    names: Sequence[str],
    kept: tuple[Mapping[str, str], Mapping[str, str]] | None = None,
    litter: pathlib.Path | None = None,
) -> Judgement:
    """Judge a command that should have refused its fault.

    **Arguments:**

    - `ran`: the finished command.
    - `limit`: its time limit in seconds (for the message of a hang).
    - `names`: words of which the refusal's line must hold at least one (the bad argument's
      name, the damaged file's).
    - `kept`: the files it must keep, before and after (`snapshot`), if any.
    - `litter`: a path that must not exist afterwards (the run folder of a refused run).

    **Returns:**

    The `Judgement`: `named` when it refused with one line holding one of `names` and kept
    everything; else the first finding that applies. argparse's own errors (a bad choice or
    type) print the command's usage before their one line; that usage is not counted.
    """
    failure = raw_failure(ran, limit)
    if failure is not None:
        return failure
    if kept is not None and (lost := changes(*kept)):
        return Judgement("lost", "; ".join(lost[:4]))
    said = message(ran)
    if ran.status == 0:
        return Judgement("accepted", f"exit 0: {said.splitlines()[-1] if said else '(silent)'}")
    if litter is not None and litter.exists():
        left = sorted(p.name for p in litter.iterdir()) if litter.is_dir() else [litter.name]
        return Judgement("litter", f"{litter.name}/ left holding {left}: {said[-160:]}")
    said_lines = [line for line in said.splitlines() if line.strip()]
    if said_lines and said_lines[0].startswith("usage:"):
        said_lines = [line for line in said_lines if ": error: " in line]
    if len(said_lines) != 1:
        return Judgement("unnamed", f"{len(said_lines)} lines: {said[-300:]}")
    (line,) = said_lines
    if not any(name.lower() in line.lower() for name in names):
        return Judgement("unnamed", f"names none of {list(names)}: {line[:200]}")
    return Judgement("named", f"exit {ran.status}: {line[:200]}")


def attempt(fault: Fault, root: pathlib.Path) -> Outcome:
    """Run `fault` in a fresh folder under `root` and judge it; an exception of the probe
    itself is reported as such (a fault the probe could not carry out is not a pass)."""
    folder = root / f"{fault.group}-{fault.name}".replace("/", "_").replace(" ", "_")
    folder.mkdir(parents=True)
    start = time.perf_counter()
    try:
        judgement = fault.probe(folder)
    except Finding as finding:
        judgement = Judgement(finding.verdict, finding.detail)
    except Exception as error:  # noqa: BLE001 - the probe's own failure, reported
        judgement = Judgement("unprobed", f"{type(error).__name__}: {error}")
    return Outcome(
        fault.group, fault.name, judgement.verdict, judgement.detail,
        time.perf_counter() - start,
    )  # fmt: skip
