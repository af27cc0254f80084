"""Summarise mutmut's results in mutants/: the mutation score per module and the survivors.

`python bench/mutation_score.py _advantages _sde` prints, per module, how many mutants were
killed (a test failed), errored (mutmut's exit 255, which it files under "timeout": the test
run raised, in practice a test module that failed to import with the mutant), timed out,
survived, were not reached by any test, or are listed as equivalent in
`bench/mutation_equivalent.txt` (an edit that changes no behaviour, with the reason). The
score is `killed / (mutants run - equivalent)`, killed counting errors and timeouts.
"""

import argparse
import json
import pathlib
from collections import Counter


KILLED = {1, 3}
ERRORED = {255}
TIMEOUT = {24, -24, 152, 36}
SURVIVED = {0}
UNTESTED = {5, 33}
MODULES = [
    "_advantages",
    "_process",
    "_sde",
    "objectives._flow_grpo",
    "_guided_flow",
    "objectives._nft",
]
EQUIVALENT = pathlib.Path(__file__).with_name("mutation_equivalent.txt")


def equivalent_mutants(path: pathlib.Path = EQUIVALENT) -> dict[str, str]:
    """The mutants listed as equivalent, each with its reason (`name  reason` per line)."""
    listed = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, reason = line.partition(" ")
            listed[name] = reason.strip()
    return listed


def summarise(modules: list[str], root: pathlib.Path = pathlib.Path("mutants")) -> int:
    equivalent = equivalent_mutants()
    killed_all = counted_all = 0
    for module in modules:
        meta = root / "flowgrpo_eqx" / f"{module.replace('.', '/')}.py.meta"
        if not meta.exists():
            print(f"{module}: no results (run bench/mutation.sh {module})")
            continue
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        tally: Counter[str] = Counter()
        survivors = []
        for name, code in sorted(codes.items()):
            if code is None:
                tally["not run"] += 1
            elif name in equivalent:
                tally["equivalent"] += 1
                if code not in SURVIVED | UNTESTED:
                    print(f"    listed as equivalent but exit {code}: {name}")
            elif code in KILLED:
                tally["killed"] += 1
            elif code in ERRORED:
                tally["errored"] += 1
            elif code in TIMEOUT:
                tally["timeout"] += 1
            elif code in SURVIVED:
                tally["survived"] += 1
                survivors.append(name)
            elif code in UNTESTED:
                tally["untested"] += 1
                survivors.append(name + " (no test)")
            else:
                tally[f"exit {code}"] += 1
                survivors.append(f"{name} (exit {code})")
        killed = tally["killed"] + tally["errored"] + tally["timeout"]
        counted = sum(tally.values()) - tally["not run"] - tally["equivalent"]
        killed_all += killed
        counted_all += counted
        score = 100.0 * killed / counted if counted else float("nan")
        print(f"{module}: {dict(sorted(tally.items()))}; score {killed}/{counted} = {score:.1f}%")
        for name in survivors:
            print(f"    survived: {name}")
    if counted_all:
        print(f"all: {killed_all}/{counted_all} = {100.0 * killed_all / counted_all:.1f}%")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/mutation_score.py", description=__doc__)
    parser.add_argument(
        "modules",
        nargs="*",
        default=MODULES,
        help=f"modules of flowgrpo_eqx whose mutants to count (default: {' '.join(MODULES)})",
    )
    parser.add_argument(
        "--mutants",
        type=pathlib.Path,
        default=pathlib.Path("mutants"),
        help="mutmut's folder of mutants and results (default: mutants)",
    )
    arguments = parser.parse_args(argv)
    return summarise(arguments.modules, arguments.mutants)


if __name__ == "__main__":
    raise SystemExit(main())
