"""What the command-line tests share: how to run `flowgrpo-eqx` (in this process, or as a
process where a test needs one), the tiny preset's base model, and how to compare runs."""

import contextlib
import fcntl
import io
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
import traceback

import jax
import numpy as np

from flowgrpo_eqx.train import MetricsLog


REPO = pathlib.Path(__file__).resolve().parent.parent
TIMEOUT = 600
RESULT_FIELDS = (
    "base_accuracy",
    "final_accuracy",
    "base_reward",
    "final_reward",
    "base_diversity",
    "final_diversity",
    "train_reward_first_epoch",
    "train_reward_last_epoch",
    "epochs",
)
"""The figures of `summary.json` that depend on the run's arithmetic alone (not on where the
base model came from, how long it took, or whether it was resumed)."""


def command(*args):
    """The `flowgrpo-eqx` command line, as this interpreter runs it."""
    return [sys.executable, "-m", "flowgrpo_eqx.shapes_demo.cli", *args]


def environment(**extra):
    """The environment of a CLI subprocess: unbuffered, and able to import `tests`."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO), **extra}


def simulated_devices(count):
    """The environment entry that gives a process `count` simulated CPU devices, keeping the
    XLA flags this process runs with (the suite's compile settings, conftest.py)."""
    flags = os.environ.get("XLA_FLAGS", "")
    return {"XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={count}".strip()}


def run_process(*args, **extra_env):
    """Run `flowgrpo-eqx ARGS` as a process to the end, capturing its output: for what needs
    a process of its own (`launch`, another XLA device count)."""
    return subprocess.run(
        command(*args), capture_output=True, text=True, env=environment(**extra_env),
        timeout=TIMEOUT,
    )  # fmt: skip


@contextlib.contextmanager
def compilation_cache():
    """JAX's persistent compilation cache, the one the `flowgrpo-eqx` processes share, on for
    the duration (the demo builds its jitted programs afresh for every run, so only this
    cache carries them from one run to the next); off again afterwards, so that tests that
    count compilations see real ones."""
    from jax.experimental.compilation_cache import compilation_cache as cache

    names = (
        "jax_enable_compilation_cache",
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    previous = {name: getattr(jax.config, name) for name in names}
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    cache.reset_cache()
    try:
        yield
    finally:
        for name, value in previous.items():
            jax.config.update(name, value)
        cache.reset_cache()


@contextlib.contextmanager
def _environment_variables(extra):
    saved = {name: os.environ.get(name) for name in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def run_cli(*args, **extra_env):
    """Run `flowgrpo-eqx ARGS` in this process (`cli.main`), capturing what it prints; returns
    what `subprocess.run` would: the exit status (2 for a usage error, 1 with the traceback
    on stderr for an uncaught exception), stdout and stderr."""
    from flowgrpo_eqx.shapes_demo import cli

    stdout, stderr = io.StringIO(), io.StringIO()
    with (
        contextlib.redirect_stdout(stdout),
        contextlib.redirect_stderr(stderr),
        _environment_variables(extra_env),
        compilation_cache(),
    ):
        try:
            status = cli.main([str(a) for a in args])
        except SystemExit as stop:
            status = stop.code if isinstance(stop.code, int) else 1
        except Exception:  # noqa: BLE001 - what the interpreter would print and exit 1 for
            traceback.print_exc()
            status = 1
    return subprocess.CompletedProcess(
        ["flowgrpo-eqx", *map(str, args)], status, stdout.getvalue(), stderr.getvalue()
    )


class RewardServer:
    """A `flowgrpo-eqx serve-reward REWARD` process on a free loopback port (`url`), with
    `extra_env` added to its environment; `stop()` ends it."""

    def __init__(self, reward, **extra_env):
        self.process = subprocess.Popen(
            command("serve-reward", reward, "--port", "0"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=environment(**extra_env),
        )  # fmt: skip
        line = self.process.stdout.readline()
        assert line.startswith("serving "), line
        self.url = line.split(" on ")[1].strip()

    def stop(self):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=60)
        self.process.stdout.close()


def with_base(reference, folder):
    """`folder`, created, holding copies of `reference`'s base model files (no pretraining)."""
    folder.mkdir(parents=True, exist_ok=True)
    for base in reference.glob("base_*.eqx"):
        shutil.copy(base, folder / base.name)
    return folder


def shared_folder(tmp_path_factory, name):
    """A folder under the temporary root that every xdist worker of this session shares."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    return root / name


def made_once(tmp_path_factory, name, make):
    """The folder `name` that `make(folder)` fills, made once per test session by whichever
    xdist worker comes first (the others wait on a file lock and reuse it); `made` in it marks
    it complete."""
    folder = shared_folder(tmp_path_factory, name)
    with open(folder.parent / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not (folder / "made").exists():
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir(parents=True)
                make(folder)
                (folder / "made").touch()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return folder


def tiny_base_folder(tmp_path_factory):
    """A folder holding the tiny preset's pretrained base model, pretrained once per test
    session (`made_once`). Every training seed shares it: the base's fingerprint leaves the
    seed out."""
    from flowgrpo_eqx.shapes_demo import make_config, run_pretrain

    def pretrain(folder):
        with contextlib.redirect_stdout(io.StringIO()), compilation_cache():
            run_pretrain(make_config("tiny"), folder / "pretraining", quiet=True)
        (made,) = (folder / "pretraining").glob("base_*.eqx")
        shutil.copy(made, folder / made.name)

    return made_once(tmp_path_factory, "tiny_base", pretrain)


def result_of(folder):
    """The `RESULT_FIELDS` of a run folder's `summary.json`."""
    summary = json.loads((folder / "summary.json").read_text())
    return {name: summary[name] for name in RESULT_FIELDS}


def metrics_of(folder):
    """The records of a run folder's `metrics.jsonl` without its wall times (the `seconds_*`
    fields), which two runs of the same settings never share."""
    return [
        {name: value for name, value in record.items() if not name.startswith("seconds_")}
        for record in MetricsLog(folder / "metrics.jsonl").read()
    ]


def epochs_done(folder):
    """The last epoch a run folder's `metrics.jsonl` records (0 before the first)."""
    path = folder / "metrics.jsonl"
    if not path.exists():
        return 0
    return max((r.get("epoch", 0) for r in MetricsLog(path).read()), default=0)


def started_past_first_epoch(out, *args):
    """`flowgrpo-eqx ARGS` started, returned once the run in `out` has finished an epoch."""
    process = subprocess.Popen(
        command(*args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=environment(),
    )  # fmt: skip
    while epochs_done(out) < 1 and process.poll() is None:
        time.sleep(0.05)
    return process


def assert_close_metrics(folder, reference, *, unmeasured=()):
    """`folder`'s metrics are `reference`'s, epoch by epoch, to float32 summation order, but
    for the names in `unmeasured`, which `folder`'s run does not record."""
    want = [{k: v for k, v in r.items() if k not in unmeasured} for r in metrics_of(reference)]
    got = metrics_of(folder)
    assert [r["epoch"] for r in got] == [r["epoch"] for r in want]
    for a, b in zip(want, got, strict=True):
        assert set(a) == set(b)
        for name in a:
            np.testing.assert_allclose(b[name], a[name], rtol=1e-5, atol=1e-6, err_msg=name)
