"""Test configuration shared by `tests/` and `property_tests/`.

Rank promotion raises and dtype promotion is strict, so a test fails on any implicit
broadcast of mismatched ranks or mixing of dtypes in the library's arithmetic.

The `flowgrpo-eqx` runs that tests start compile the same programs run after run; they
share a persistent compilation cache (JAX's own, keyed by the program, the JAX version and
the devices), which leaves their results unchanged and saves most of each run's start. The
processes use it throughout; the test processes only for the duration of an in-process demo
run (`tests.cli_helpers.compilation_cache`), since tests that count compilations must see
real ones.

Under `bench/mutation.sh` (`FLOWGRPO_EQX_MUTATION=1`, docs/mutation.md) four things change.
None can turn a surviving mutant into a killed one; the last can only do the opposite, so the
score measured is a lower bound for the full suite:

- the test process uses a persistent compilation cache of its own: a program the mutant
  changed misses it and is compiled, an unchanged one is read back;
- Hypothesis does not shrink a failing example (a failure is all the run needs to know; on
  a TPU too, where shrinking would compile a program per candidate);
- the tests run fastest first, by the durations mutmut recorded, so that with `-x` a killed
  mutant stops at the cheapest test that kills it;
- the property tests run a quarter of their examples (`PROPERTY_TESTS_SCALE=0.25` unless
  set), because a surviving mutant runs every test that reaches it.
"""

import ctypes
import gc
import json
import os
import pathlib
import signal
import tempfile
from collections.abc import Callable, Iterator

import hypothesis
import jax
import pytest

from tests import suite_record


# Each test process's peak memory at the end of a run, a crashed worker named at once
# (`tests/worker_health.py`).
pytest_plugins = ["tests.worker_health"]

# The suite's programs are small and most of its time is XLA compiling them: LLVM at -O0 and
# XLA's classic CPU fusion code generator compile them about three times faster. Both compute
# the same operations in IEEE float arithmetic (no fast-math either way); only the speed of the
# compiled code differs. Set before the CPU backend starts; the processes tests start inherit it.
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
_user_xla_flags = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join(
    [_user_xla_flags, *(f for f in TEST_XLA_FLAGS if f not in _user_xla_flags)]
).strip()

# On a TPU, float32 matmuls default to one bfloat16 pass. The library calls every model at
# "highest" (`GuidedFlow.matmul_precision`); the tests call models directly too, and compare
# both with float64 statements, so they run at the library's policy (docs/accelerators.md).
if jax.default_backend() == "tpu":
    jax.config.update("jax_default_matmul_precision", "highest")

# A suite started in the background of a non-interactive shell (`cmd &`, nohup) inherits an
# ignored SIGINT, which `GracefulStop` rightly leaves ignored and every process a test starts
# inherits. The signal tests send SIGINT as a terminal's Ctrl-C would, so the suite runs with
# Python's own handler, as in a foreground run.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_enable_compilation_cache", False)

os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(tempfile.gettempdir(), f"flowgrpo-eqx-test-compilation-cache-{os.getuid()}"),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

MUTATION_RUN = os.environ.get("FLOWGRPO_EQX_MUTATION") == "1"

if MUTATION_RUN:
    os.environ.setdefault("PROPERTY_TESTS_SCALE", "0.25")
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update(
        "jax_compilation_cache_dir",
        os.path.join(tempfile.gettempdir(), f"flowgrpo-eqx-mutation-cache-{os.getuid()}"),
    )
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

# A failing example's shrinking compiles a program for each smaller candidate: minutes on a
# TPU's compiler, out of a command's ten. The first failing example is what a mutation run or
# a TPU run needs; every example runs as on the CPU until one fails. The TPU machine's host
# also stalls now and then (1.2 s for one draw of a wire-format batch's four, the others
# 2 ms), which Hypothesis's check of generation speed reads as a slow strategy and its
# deadline as a slow example; the CPU run keeps both.
if MUTATION_RUN or jax.default_backend() == "tpu":
    hypothesis.settings.register_profile(
        "no-shrinking",
        phases=[hypothesis.Phase.explicit, hypothesis.Phase.reuse, hypothesis.Phase.generate],
        suppress_health_check=[hypothesis.HealthCheck.too_slow],
        deadline=None,
    )
    hypothesis.settings.load_profile("no-shrinking")


LONGEST_FILES = (
    "tests/test_preemption.py",
    "tests/test_distributed.py",
    "tests/test_run_interfaces.py",
    "tests/test_distributed_fsdp.py",
    "tests/test_mmdit.py",
    "tests/test_fsdp.py",
    "property_tests/test_objective_properties.py",
    "tests/test_orbax_checkpoints.py",
    "tests/test_awm.py",
    "tests/test_lora_job.py",
    "tests/test_train.py",
    "tests/test_run_folders.py",
    "tests/test_docs.py",
)
"""The test files that take longest (each 30 s or more of `--durations` on a 2-core machine),
longest first. `--dist loadfile` hands each worker whole files in collection order, so these
are collected first and the other files after them, most tests first: a long file handed out
last would leave the other worker idle until it ends (pyproject.toml turns off xdist's own
reordering, which sorts by number of tests alone)."""


def _file_order(items: list[pytest.Item]) -> list[pytest.Item]:
    """`items` grouped by file: `LONGEST_FILES` first, then the others, most tests first."""
    by_file: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::")[0], []).append(item)

    def rank(path: str) -> tuple[int, int]:
        if path in LONGEST_FILES:
            return (LONGEST_FILES.index(path), 0)
        return (len(LONGEST_FILES), -len(by_file[path]))

    return [item for path in sorted(by_file, key=rank) for item in by_file[path]]


def _accelerator_skips() -> dict[str, str]:
    """The markers whose tests cannot run on this machine, with why (docs/accelerators.md).

    On a TPU the test process holds the chip, which opens in one process at a time, so a test
    that starts another JAX process cannot run there; and the TPU machines this project
    borrows refuse every TCP socket. On a CPU (and in CI) every test runs."""
    if jax.default_backend() != "tpu":
        return {}
    return {
        "several_processes": "the TPU chip is held by this test process and opens in one "
        "process at a time",
        "sockets": "the TPU machine's sandbox refuses TCP sockets (loopback included)",
    }


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Long files first (`LONGEST_FILES`); in a mutation run, the tests by the duration mutmut
    recorded for each instead. On a TPU, the tests marked `several_processes` or `sockets`
    are skipped with their marker's reason and the machine's. With `FLOWGRPO_TEST_RESUME`, the
    tests an earlier record finished are left out, and with `FLOWGRPO_TEST_RECORD` the run's
    line is written (`tests.suite_record`)."""
    skips = _accelerator_skips()
    for item in items:
        for name, why in skips.items():
            marker = item.get_closest_marker(name)
            if marker is not None:
                what = marker.args[0] if marker.args else name
                item.add_marker(pytest.mark.skip(reason=f"{what}: {why}"))
    stats = pathlib.Path("mutmut-stats.json")
    if not MUTATION_RUN or not stats.exists():
        items[:] = _file_order(items)
        _resume_and_record(config, items)
        return
    durations = json.loads(stats.read_text())["duration_by_test"]
    items.sort(key=lambda item: durations.get(item.nodeid, float("inf")))


_RECORDER = pytest.StashKey[suite_record.Recorder]()


def pytest_configure(config: pytest.Config) -> None:
    """Opens `FLOWGRPO_TEST_RECORD`'s file, if it is set, with `FLOWGRPO_TEST_DEADLINE`'s
    deadline.

    **Raises:**

    - `pytest.UsageError`: naming the variable, when the run is spread over xdist workers,
        whose events one file cannot order, or the deadline is not a number.
    """
    path = os.environ.get(suite_record.RECORD)
    if not path:
        return
    if getattr(config.option, "numprocesses", None) or hasattr(config, "workerinput"):
        raise pytest.UsageError(
            f"{suite_record.RECORD} records a run in one process: run it with -p no:xdist"
        )
    deadline = os.environ.get(suite_record.DEADLINE)
    try:
        when = float(deadline) if deadline else None
    except ValueError:
        raise pytest.UsageError(
            f"{suite_record.DEADLINE} must be seconds since the epoch, got {deadline!r}"
        ) from None
    recorder = suite_record.Recorder(pathlib.Path(path), deadline=when)
    config.stash[_RECORDER] = recorder
    config.pluginmanager.register(recorder, "flowgrpo-test-record")


def pytest_unconfigure(config: pytest.Config) -> None:
    """Closes the record, if one is open."""
    recorder = config.stash.get(_RECORDER, None)
    if recorder is not None:
        recorder.close()


def _resume_and_record(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect what `FLOWGRPO_TEST_RESUME`'s records finished for this code, and write the
    run's line to `FLOWGRPO_TEST_RECORD`'s file (`tests.suite_record`)."""
    resume = os.environ.get(suite_record.RESUME)
    recorder = config.stash.get(_RECORDER, None)
    if not resume and recorder is None:
        return
    source = suite_record.source_digest(pathlib.Path(__file__).parent)
    collected = [item.nodeid for item in items]
    if resume:
        folders = [pathlib.Path(folder) for folder in resume.split(os.pathsep) if folder]
        try:
            finished = suite_record.finished_tests(folders, source)
        except ValueError as error:
            raise pytest.UsageError(str(error)) from None
        dropped = [item for item in items if item.nodeid in finished]
        items[:] = [item for item in items if item.nodeid not in finished]
        config.hook.pytest_deselected(items=dropped)
    if recorder is not None:
        recorder.run(source, jax.default_backend(), collected, len(items))


# glibc's `malloc_trim` (None elsewhere): hands the C heap's free pages back to the system, so
# that a worker's resident memory is what it holds, not the most it ever held.
_MALLOC_TRIM: Callable[[int], int] | None
try:
    _MALLOC_TRIM = ctypes.CDLL(None).malloc_trim
except (AttributeError, OSError, TypeError):
    _MALLOC_TRIM = None


def _return_freed_memory() -> None:
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _release_programs() -> None:
    """Drops every program JAX has compiled (`jax.clear_caches`) and returns the memory they
    held to the system."""
    jax.clear_caches()
    gc.collect()
    _return_freed_memory()


RELEASE_ABOVE_MB = 2000.0
"""A test process holding more resident memory than this after a test drops its programs then,
not only at the end of the file (`_release_programs_when_large`)."""


@pytest.fixture(autouse=True, scope="module")
def _release_programs_after_each_file() -> Iterator[None]:
    """After each test file, the programs JAX compiled for it are dropped and the memory they
    held returned to the system.

    JAX keeps every program it compiles for as long as the process lives, with the constants
    it closed over: without this, each of the suite's two workers grew to 8 to 9 GB by the end
    of a run (docs/performance.md). A file's programs are seldom another's, so little is
    compiled twice (on six files run in one process: 4% more CPU time, the peak 1.5 GB
    instead of 3.4 GB). Fixtures of wider scope keep what they hold."""
    yield
    _release_programs()


@pytest.fixture(autouse=True)
def _release_programs_when_large() -> Iterator[None]:
    """After a test that leaves its process above `RELEASE_ABOVE_MB`, the programs are dropped
    there and then: some files' tests each compile programs no other test shares (each
    published model kind's, each algorithm's trainer), and one file alone grew a worker by
    3 GB. Never inside a test, so a test that counts its own compilations still sees them."""
    yield
    # Imported here: pytest_plugins imports it first, for pytest to rewrite its asserts.
    from tests.worker_health import resident_megabytes

    resident = resident_megabytes()
    if resident is not None and resident > RELEASE_ABOVE_MB:
        _release_programs()


@pytest.fixture
def key() -> jax.Array:
    """A fresh PRNG key for a test."""
    return jax.random.key(0)
