"""`python tools/tpu/tally.py FOLDER...`: what the suite's parts on a TPU ran, as a table.

Reads the `part_K_of_N.xml` (JUnit) and `part_K_of_N.log` files that
`bash tools/tpu/run.sh parts N K...` writes, from one folder per session, and prints one
Markdown row per part (passed, failed, skipped, seconds, and whether its timeout stopped it),
the totals of the parts that ran to their end, the parts of N never run or never finished,
and every failure by name. A part run in several folders counts once: the one from the
folder given last that finished, else the last one.
"""

import argparse
import dataclasses
import pathlib
import re
import sys
import xml.etree.ElementTree as ElementTree


PART_FILE = re.compile(r"part_(\d+)_of_(\d+)\.xml$")
STOPPED = ("KeyboardInterrupt", "!!!!!!! Interrupted")


@dataclasses.dataclass(frozen=True)
class Part:
    """One part's results.

    **Arguments:**

    - `number`, `count`: part `number` of `count`.
    - `passed`, `failed`, `skipped`: its tests by outcome (errors count as failed).
    - `seconds`: pytest's time for it.
    - `finished`: whether it ran to its end (its timeout did not stop it).
    - `failures`: the failed tests' ids.
    - `folder`: where it was read from.
    """

    number: int
    count: int
    passed: int
    failed: int
    skipped: int
    seconds: float
    finished: bool
    failures: tuple[str, ...]
    folder: str


def read_part(path: pathlib.Path) -> Part:
    """One part from its JUnit file and the log beside it.

    **Arguments:**

    - `path`: `.../part_K_of_N.xml`.

    **Returns:**

    The part's `Part`.

    **Raises:**

    - `ValueError`: naming the file, if its name is not `part_K_of_N.xml`.
    """
    named = PART_FILE.search(path.name)
    if named is None:
        raise ValueError(f"{path} is not named part_K_of_N.xml")
    root = ElementTree.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    assert suite is not None, f"{path} holds no testsuite"
    failures, skipped, passed = [], 0, 0
    for case in suite.iter("testcase"):
        test = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            failures.append(test)
        elif case.find("skipped") is not None:
            skipped += 1
        else:
            passed += 1
    log = path.with_suffix(".log")
    text = log.read_text(errors="replace") if log.exists() else ""
    return Part(
        number=int(named.group(1)),
        count=int(named.group(2)),
        passed=passed,
        failed=len(failures),
        skipped=skipped,
        seconds=float(suite.get("time", 0.0)),
        finished=bool(text) and not any(mark in text for mark in STOPPED),
        failures=tuple(failures),
        folder=str(path.parent),
    )


def latest_parts(folders: list[pathlib.Path]) -> list[Part]:
    """Each part once, from the last folder that finished it, else the last that ran it.

    **Arguments:**

    - `folders`: the sessions' folders, oldest first.

    **Returns:**

    The parts, by count and number.
    """
    chosen: dict[tuple[int, int], Part] = {}
    for folder in folders:
        for path in sorted(folder.glob("part_*_of_*.xml")):
            part = read_part(path)
            key = (part.count, part.number)
            if key not in chosen or part.finished or not chosen[key].finished:
                chosen[key] = part
    return [chosen[key] for key in sorted(chosen)]


def table(parts: list[Part]) -> str:
    """The Markdown table, totals, missing parts and failures of `parts`.

    **Arguments:**

    - `parts`: from `latest_parts`.

    **Returns:**

    The text to print.
    """
    lines = [
        "| part | passed | failed | skipped | seconds | ran to its end | folder |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in parts:
        ended = "yes" if p.finished else "no: stopped by its timeout"
        row = f"| {p.number}/{p.count} | {p.passed} | {p.failed} | {p.skipped} | "
        lines.append(row + f"{p.seconds:.0f} | {ended} | {p.folder} |")
    done = [p for p in parts if p.finished]
    lines.append("")
    lines.append(
        f"finished parts: {len(done)}; their tests: {sum(p.passed for p in done)} passed, "
        f"{sum(p.failed for p in done)} failed, {sum(p.skipped for p in done)} skipped, "
        f"in {sum(p.seconds for p in done):.0f} s"
    )
    for count in sorted({p.count for p in parts}):
        finished = {p.number for p in done if p.count == count}
        missing = [k for k in range(1, count + 1) if k not in finished]
        lines.append(f"of {count}: not yet run to their end: {missing or 'none'}")
    for p in parts:
        lines.extend(f"FAILED ({p.number}/{p.count}) {test}" for test in p.failures)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/tpu/tally.py", description=__doc__)
    parser.add_argument("folders", nargs="+", type=pathlib.Path)
    arguments = parser.parse_args(argv)
    print(table(latest_parts(arguments.folders)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
