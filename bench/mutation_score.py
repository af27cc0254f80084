"""Summarise mutmut's results in mutants/: the mutation score per module and the survivors.

`python bench/mutation_score.py _advantages _sde` prints, per module, how many mutants were
killed (a test failed), timed out (counted as killed: the mutant made a test hang), survived
or were not reached by any test, and the score `killed / (killed + survived + untested)`.
"""

import json
import pathlib
import sys
from collections import Counter


KILLED = {1, 3}
TIMEOUT = {24, -24, 152, 36, 255}
SURVIVED = {0}
UNTESTED = {5, 33}


def summarise(modules: list[str], root: pathlib.Path = pathlib.Path("mutants")) -> int:
    killed_all = counted_all = 0
    for module in modules:
        meta = root / "flowgrpo_eqx" / f"{module}.py.meta"
        if not meta.exists():
            print(f"{module}: no results (run bench/mutation.sh {module})")
            continue
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        tally: Counter[str] = Counter()
        survivors = []
        for name, code in sorted(codes.items()):
            if code in KILLED:
                tally["killed"] += 1
            elif code in TIMEOUT:
                tally["timeout"] += 1
            elif code in SURVIVED:
                tally["survived"] += 1
                survivors.append(name)
            elif code in UNTESTED:
                tally["untested"] += 1
                survivors.append(name + " (no test)")
            elif code is None:
                tally["not run"] += 1
            else:
                tally[f"exit {code}"] += 1
        killed = tally["killed"] + tally["timeout"]
        counted = killed + tally["survived"] + tally["untested"]
        killed_all += killed
        counted_all += counted
        score = 100.0 * killed / counted if counted else float("nan")
        print(f"{module}: {dict(tally)}; score {killed}/{counted} = {score:.1f}%")
        for name in survivors:
            print(f"    survived: {name}")
    if counted_all:
        print(f"all: {killed_all}/{counted_all} = {100.0 * killed_all / counted_all:.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(summarise(sys.argv[1:] or ["_advantages", "_process", "_sde"]))
