"""The suite in parts: `FLOWGRPO_TEST_PART=K/N` keeps the files of part K of N (conftest.py).

A machine whose commands are limited in time (the borrowed TPU machine's 10 minutes,
docs/accelerators.md) runs the suite as N commands, one part each. Files are dealt to the
parts in the order the suite runs them (the longest first, conftest.py), one file at a time,
so every part gets some of the long files; a file is never split, so a part runs its file's
shared fixtures once.
"""

import pytest


VARIABLE = "FLOWGRPO_TEST_PART"


def parse_part(value: str) -> tuple[int, int]:
    """`"K/N"` as `(K, N)`, with `1 <= K <= N`.

    **Arguments:**

    - `value`: the variable's value.

    **Returns:**

    The part's number and the number of parts.

    **Raises:**

    - `pytest.UsageError`: naming `FLOWGRPO_TEST_PART` and the value, if it is not `K/N`
        with whole numbers `1 <= K <= N`.
    """
    part, _, count = value.partition("/")
    try:
        k, n = int(part), int(count)
    except ValueError:
        k, n = 0, 0
    if not 1 <= k <= n:
        raise pytest.UsageError(
            f"{VARIABLE} must be K/N with whole numbers 1 <= K <= N (part K of N), got {value!r}"
        )
    return k, n


def files_of_part(files: list[str], part: int, count: int) -> set[str]:
    """The files of part `part` of `count`: every `count`-th file of `files`, in their order,
    from the `part`-th.

    **Arguments:**

    - `files`: the test files, in the order the suite runs them.
    - `part`: the part's number, from 1.
    - `count`: the number of parts.

    **Returns:**

    The part's files.
    """
    return set(files[part - 1 :: count])
