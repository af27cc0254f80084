"""`python -m tools.tpu.tally FOLDER...`: what the suite's runs on a TPU have finished.

Run from the repository's root. Reads the records (`*.jsonl`) that
`bash tools/tpu/run.sh suite` writes, one folder per command, oldest first
(`tests/suite_record.py`). For the code of the newest run (its source digest), it counts each
test once, by its last outcome: passed, failed, skipped (with each reason and how many it
skipped), still to run (collected, never finished), and names every failure and every test
that began and never ended (its run was stopped in it, or died). Records of other code are
counted apart and not mixed in.

`--unfinished FILE` also writes the ids of the tests that have not passed or been skipped,
one per line, in the order collected: `bash tools/tpu/run.sh suite -- @FILE` runs them
first when the code has changed since (docs/accelerators.md).
"""

import argparse
import collections
import pathlib
import sys

from tests.suite_record import Result, Run, read_records, record_files


def tally(folders: list[pathlib.Path]) -> str:
    """The Markdown summary of the records in `folders`.

    **Arguments:**

    - `folders`: folders of `.jsonl` records, oldest first.

    **Returns:**

    The text to print.

    **Raises:**

    - `ValueError`: naming the folder, if one is missing or holds no run.
    """
    runs, mine, collected, last = _newest(folders)
    source = mine[-1].source
    lines = [
        f"code {source} (the newest run's); backends: "
        f"{', '.join(sorted({run.backend for run in mine}))}",
        "",
        "| record | tests whose last outcome it holds | their seconds |",
        "|---|---|---|",
    ]
    lines.extend(_run_row(run, last) for run in mine)
    known = [last[test] for test in collected if test in last]
    outcomes = collections.Counter(result.outcome for result in known)
    to_run = len(collected) - len(known) + outcomes["started"]
    lines += [
        "",
        f"of {len(collected)} tests: {outcomes['passed']} passed, {outcomes['failed']} failed, "
        f"{outcomes['skipped']} skipped, {to_run} not yet run to their end "
        f"({sum(result.seconds for result in known):.0f} s of tests)",
    ]
    reasons = collections.Counter(r.reason for r in known if r.outcome == "skipped")
    lines.extend(f"skipped {count}: {reason}" for reason, count in reasons.most_common())
    for result in known:
        if result.outcome == "failed":
            lines.append(f"FAILED {result.test}: {result.reason}")
        elif result.outcome == "started":
            lines.append(f"NOT ENDED {result.test} (in {result.record})")
    others = sorted({run.source for run in runs} - {source})
    if others:
        lines.append(f"records of other code, not counted: {', '.join(others)}")
    return "\n".join(lines)


def unfinished(folders: list[pathlib.Path]) -> list[str]:
    """The tests of the newest run's code that its records have not seen pass or be skipped
    (failed, begun and never ended, or never run), in the order its runs collected them.

    **Arguments:**

    - `folders`: folders of `.jsonl` records, oldest first.

    **Returns:**

    The test ids.

    **Raises:**

    - `ValueError`: naming the folder, if one is missing or holds no run.
    """
    _, _, collected, last = _newest(folders)
    return [test for test in collected if test not in last or not last[test].finished]


def _newest(
    folders: list[pathlib.Path],
) -> tuple[list[Run], list[Run], list[str], dict[str, Result]]:
    """The runs of `folders`; those of the newest run's code; the tests they collected (in
    order) and each one's last outcome for that code."""
    runs, results = read_records(record_files(folders))
    if not runs:
        raise ValueError(f"no record of a run in {', '.join(map(str, folders))}")
    source = runs[-1].source
    mine = [run for run in runs if run.source == source]
    collected = list(dict.fromkeys(test for run in mine for test in run.collected))
    return runs, mine, collected, results.get(source, {})


def _run_row(run: Run, last: dict[str, Result]) -> str:
    ended = [r for r in last.values() if r.record == run.record and r.outcome != "started"]
    return f"| {run.record} | {len(ended)} | {sum(r.seconds for r in ended):.0f} |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.tpu.tally", description=__doc__)
    parser.add_argument("folders", nargs="+", type=pathlib.Path)
    parser.add_argument(
        "--unfinished",
        type=pathlib.Path,
        metavar="FILE",
        help="write the ids of the tests not yet passed or skipped to FILE, one per line",
    )
    arguments = parser.parse_args(argv)
    try:
        print(tally(arguments.folders))
        if arguments.unfinished is not None:
            tests = unfinished(arguments.folders)
            arguments.unfinished.write_text("".join(f"{test}\n" for test in tests))
            print(f"{len(tests)} test ids not yet passed or skipped: {arguments.unfinished}")
    except ValueError as error:
        print(f"tally: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
