"""Faults of `tools/tpu/run.sh`, the script that installs and runs the project on a TPU
machine without a package registry: an index it cannot reach, folders it did not make, and
environment variables that are not what they should be.

Each fault runs a copy of the script in a fresh folder (so that the script's `cd` to its
checkout lands there), with a `python3` first on the `PATH` that reaches no network (its `pip
download` and `pip install` make empty wheel files, or fail as an unreachable index does), so
that nothing of this checkout or of the machine is touched. The script must refuse with a
non-zero status and one line naming the variable or folder, change nothing it did not make,
and never loop."""

import os
import pathlib
import subprocess
import sys
from collections.abc import Callable, Sequence

from ._probe import (
    REPO,
    Fault,
    Judgement,
    Ran,
    changes,
    judge_refusal,
    raw_failure,
    run,
    snapshot,
)


GROUP = "tpu script"
LIMIT = 30.0
"""Seconds the script may take: none of these faults does any real work."""

FAKE_PYTHON = """#!/usr/bin/env bash
# python3 as run.sh calls it, without a network.
if [ "$1 $2" = "-m pip" ]; then
    if [ -n "${FAKE_PIP_FAILS:-}" ]; then
        echo "ERROR: Could not find a version that satisfies the requirement equinox" \\
            "(network is unreachable)" >&2
        exit 1
    fi
    while [ $# -gt 0 ]; do
        case "$1" in
            -d|--target) mkdir -p "$2"; touch "$2/pkg-$RANDOM.whl"; shift ;;
        esac
        shift
    done
    exit 0
fi
echo "python3 $*"
"""


def _sandbox(workdir: pathlib.Path) -> pathlib.Path:
    """A checkout holding only the script, and the network-less `python3`."""
    checkout = workdir / "checkout"
    (checkout / "tools" / "tpu").mkdir(parents=True)
    script = REPO / "tools" / "tpu" / "run.sh"
    (checkout / "tools" / "tpu" / "run.sh").write_bytes(script.read_bytes())
    (workdir / "bin").mkdir()
    fake = workdir / "bin" / "python3"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    return checkout


def _run_script(workdir: pathlib.Path, *args: str, **env: str) -> Ran:
    checkout = workdir / "checkout"
    environment = {
        **os.environ,
        "PATH": f"{workdir / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "FLOWGRPO_TPU_HOLDER": str(workdir / "holder.pid"),
        "FLOWGRPO_TPU_SITE": str(workdir / "site"),
        "OUT": str(workdir / "records"),
        **env,
    }
    return run(["bash", str(checkout / "tools" / "tpu" / "run.sh"), *args],
               timeout=LIMIT, env=environment)  # fmt: skip


def _wheels_unreachable(workdir: pathlib.Path) -> Judgement:
    """`wheels` where pip reaches no index: it emptied .whl-tpu/ before it failed. It must
    fail, say why, and keep the wheels it had."""
    checkout = _sandbox(workdir)
    made = _run_script(workdir, "wheels")
    if made.status != 0:
        return Judgement("unprobed", f"the first `wheels` failed: {made.stderr.strip()[-200:]}")
    before = snapshot(checkout / ".whl-tpu")
    ran = _run_script(workdir, "wheels", FAKE_PIP_FAILS="1")
    failure = raw_failure(ran, LIMIT)
    if failure is not None:
        return failure
    if lost := changes(before, snapshot(checkout / ".whl-tpu")):
        return Judgement("lost", "; ".join(lost[:4]))
    left = sorted(p.name for p in checkout.iterdir() if p.name.startswith(".whl-tpu."))
    if left:
        return Judgement("litter", f"left {left}")
    last = ran.stderr.strip().splitlines()[-1] if ran.stderr.strip() else "(silent)"
    if ran.status == 0:
        return Judgement("accepted", f"exit 0: {last}")
    if ".whl-tpu is unchanged" not in last:
        return Judgement("unnamed", f"exit {ran.status}: {last[:200]}")
    return Judgement("held", f"exit {ran.status}, the wheels kept: {last[:160]}")


def _refused(
    workdir: pathlib.Path,
    args: Sequence[str],
    names: Sequence[str],
    kept: pathlib.Path | None = None,
    setup: str = "",
    **env: str,
) -> Judgement:
    """`run.sh ARGS` must refuse in one line naming one of `names`, leaving `kept` as it was."""
    checkout = _sandbox(workdir)
    if setup == "wheels":
        if _run_script(workdir, "wheels").status != 0:
            return Judgement("unprobed", "`wheels` failed in the sandbox")
    elif setup == "user wheels":
        (checkout / ".whl-tpu").mkdir()
        (checkout / ".whl-tpu" / "mine.whl").write_text("a wheel of the user's")
    elif setup == "site file":
        if _run_script(workdir, "wheels").status != 0:
            return Judgement("unprobed", "`wheels` failed in the sandbox")
        (workdir / "site").write_text("a file of the user's\n")
    if kept is not None and not kept.exists():
        kept.mkdir(parents=True)
        (kept / "notes.txt").write_text("the user's\n")
    before = snapshot(kept) if kept is not None else None
    # A live Python process holding the chip, as a `test` or `python` command leaves one.
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    (workdir / "holder.pid").write_text(f"{holder.pid}\n")
    try:
        ran = _run_script(workdir, *args, **env)
    finally:
        holder.kill()
        holder.wait()
    site = workdir / "site"
    kept_file = site.is_file() and site.read_text() == "a file of the user's\n"
    if setup == "site file" and not kept_file:
        return Judgement("lost", "the file FLOWGRPO_TPU_SITE names was removed or changed")
    after = (before, snapshot(kept)) if kept is not None and before is not None else None
    return judge_refusal(ran, limit=LIMIT, names=names, kept=after)


FAULTS: tuple[tuple[str, Callable[[pathlib.Path], Judgement]], ...] = (
    ("wheels where the index is unreachable", _wheels_unreachable),
    ("wheels over a .whl-tpu it did not make",
     lambda w: _refused(w, ["wheels"], (".whl-tpu",), kept=w / "checkout" / ".whl-tpu",
                        setup="user wheels")),
    ("FLOWGRPO_TPU_SITE naming a folder of the user's",
     lambda w: _refused(w, ["python", "-c", "pass"], ("FLOWGRPO_TPU_SITE",), kept=w / "site",
                        setup="wheels")),
    ("FLOWGRPO_TPU_SITE naming a file",
     lambda w: _refused(w, ["python", "-c", "pass"], ("FLOWGRPO_TPU_SITE",), setup="site file")),
    ("FLOWGRPO_TPU_AWAIT=abc, a process holding the chip",
     lambda w: _refused(w, ["await"], ("FLOWGRPO_TPU_AWAIT",), FLOWGRPO_TPU_AWAIT="abc")),
    ("FLOWGRPO_TPU_TIMEOUT=ten",
     lambda w: _refused(w, ["test"], ("FLOWGRPO_TPU_TIMEOUT",), setup="wheels",
                        FLOWGRPO_TPU_TIMEOUT="ten")),
    ("FLOWGRPO_TPU_BUDGET=soon",
     lambda w: _refused(w, ["suite"], ("FLOWGRPO_TPU_BUDGET",), FLOWGRPO_TPU_BUDGET="soon")),
    ("suite without .whl-tpu", lambda w: _refused(w, ["suite"], (".whl-tpu",))),
)  # fmt: skip


def faults() -> list[Fault]:
    """Every fault of `tools/tpu/run.sh`."""
    return [Fault(GROUP, name, probe) for name, probe in FAULTS]
