"""Faults of run folders: damaged checkpoints and metrics, two writers, resumes that cannot be
done, signals at awkward moments, and a seed sweep. Every fault strikes a copy of one
finished tiny run (`reference_run`, made once per probe), and what the user keeps (the
checkpoints, `metrics.jsonl`, `config.toml`, the policy and summary) is compared byte for
byte before and after: a refusal must change nothing; a run that goes on must end with each
epoch recorded once."""

import contextlib
import functools
import json
import os
import pathlib
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence

from ._probe import (
    Fault,
    Finding,
    Judgement,
    Ran,
    changes,
    environment,
    flowgrpo_eqx,
    judge_refusal,
    raw_failure,
    run,
    snapshot,
)


LIMIT = 240.0
"""Seconds a command on a run folder may take (a resume of the tiny job takes about 20)."""
EPOCHS = 2
"""The reference run's epochs; a fault that continues it asks for `EPOCHS + 1`."""
PREEMPTED = 75
"""The exit status of a run stopped by a signal with a checkpoint kept (EX_TEMPFAIL)."""
LOCK = "run.lock"

_made = threading.RLock()


@functools.cache
def _cache_dir() -> pathlib.Path:
    return pathlib.Path(tempfile.mkdtemp(prefix="fault-probe-cache-"))


def _env() -> dict[str, str]:
    """A child's environment sharing one JAX compilation cache (each resume compiles the same
    programs)."""
    return environment(
        JAX_COMPILATION_CACHE_DIR=str(_cache_dir()),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )


def _train(out: pathlib.Path, *flags: object) -> list[str]:
    return flowgrpo_eqx(
        "train", "--preset", "tiny", "--quiet", "--epochs", EPOCHS, "--checkpoint-every", 1,
        "--out", out, *flags,
    )  # fmt: skip


@functools.cache
def reference_run() -> pathlib.Path:
    """A finished tiny run of `EPOCHS` epochs with a checkpoint each epoch (made once)."""
    with _made:
        out = _cache_dir() / "reference"
        if not (out / "summary.json").exists():
            ran = run(_train(out), timeout=LIMIT, env=_env())
            if ran.status != 0:
                raise RuntimeError(f"the reference run failed: {ran.stderr[-500:]}")
        return out


@functools.cache
def reference_sweep() -> pathlib.Path:
    """A finished sweep over seeds 0 and 1 of one epoch each, sharing the reference's base."""
    with _made:
        out = _cache_dir() / "sweep"
        if not (out / "seeds_summary.json").exists():
            base = next(reference_run().glob("base_*.eqx"))
            for seed in (0, 1):
                (out / f"seed_{seed}").mkdir(parents=True, exist_ok=True)
                shutil.copy(base, out / f"seed_{seed}" / base.name)
            ran = run(
                flowgrpo_eqx(
                    "train", "--preset", "tiny", "--quiet", "--epochs", 1, "--seeds", "0,1",
                    "--out", out,
                ),
                timeout=2 * LIMIT, env=_env(),
            )  # fmt: skip
            if ran.status != 0:
                raise RuntimeError(f"the reference sweep failed: {ran.stderr[-500:]}")
        return out


def _copy(workdir: pathlib.Path, source: pathlib.Path | None = None) -> pathlib.Path:
    out = workdir / "run"
    shutil.copytree(source or reference_run(), out)
    return out


def _kept(out: pathlib.Path) -> dict[str, str]:
    """What the user keeps of a run folder (not the lock file, whose text names its holder)."""
    locks = [path.relative_to(out).as_posix() for path in out.rglob(LOCK)]
    return snapshot(out, ignore=locks)


def _epochs(out: pathlib.Path) -> list[int]:
    """The epochs `metrics.jsonl` records training for, in order (epoch 0 is the base's
    evaluation)."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["epoch"] for r in records if "epoch" in r and "loss" in r]


def _continued(out: pathlib.Path, ran: Ran, epochs: int, what: str) -> Judgement:
    """`held` when `ran` finished the run in `out` to `epochs` epochs, each recorded once."""
    if (failure := raw_failure(ran, LIMIT)) is not None:
        return failure
    if ran.status != 0:
        return Judgement("unnamed", f"exit {ran.status}: {ran.stderr.strip()[-200:]}")
    recorded = _epochs(out)
    if recorded != list(range(1, epochs + 1)):
        return Judgement("lost", f"metrics.jsonl records epochs {recorded}, not 1..{epochs}")
    summary = json.loads((out / "summary.json").read_text())
    if summary.get("epochs") != epochs:
        return Judgement("lost", f"summary.json says {summary.get('epochs')} epochs, not {epochs}")
    return Judgement("held", what)


def _refused(
    out: pathlib.Path,
    command: Sequence[str],
    names: Sequence[str],
    *,
    kept: dict[str, str] | None = None,
) -> Judgement:
    """Run `command` on `out`, which must refuse naming one of `names` and change nothing."""
    before = kept if kept is not None else _kept(out)
    ran = run(command, timeout=LIMIT, env=_env())
    return judge_refusal(ran, limit=LIMIT, names=names, kept=(before, _kept(out)))


def _resume_refused(
    damage: Callable[[pathlib.Path], None],
    names: Sequence[str],
    flags: Sequence[object],
    workdir: pathlib.Path,
) -> Judgement:
    out = _copy(workdir)
    damage(out)
    return _refused(out, _train(out, "--resume", *flags), names)


def _resume_continues(
    damage: Callable[[pathlib.Path], None], what: str, workdir: pathlib.Path
) -> Judgement:
    out = _copy(workdir)
    damage(out)
    ran = run(_train(out, "--resume", "--epochs", EPOCHS + 1), timeout=LIMIT, env=_env())
    return _continued(out, ran, EPOCHS + 1, what)


# -- damage done to a copy of the reference run -------------------------------------------------


def _newest_checkpoint(out: pathlib.Path) -> pathlib.Path:
    return sorted((out / "checkpoints").glob("ckpt_*"))[-1]


def _edit_meta(change: Callable[[dict[str, object]], None], out: pathlib.Path) -> None:
    path = _newest_checkpoint(out) / "meta.json"
    meta = json.loads(path.read_text())
    change(meta)
    path.write_text(json.dumps(meta))


def _set_epoch(epoch: object, meta: dict[str, object]) -> None:
    meta["epoch"] = epoch


def _drop(name: str, meta: dict[str, object]) -> None:
    del meta[name]


def _every_meta_garbled(out: pathlib.Path) -> None:
    for meta in (out / "checkpoints").glob("ckpt_*/meta.json"):
        meta.write_text("{not json")


def _remove_checkpoints(out: pathlib.Path) -> None:
    shutil.rmtree(out / "checkpoints")


def _empty_checkpoints(out: pathlib.Path) -> None:
    for checkpoint in (out / "checkpoints").glob("ckpt_*"):
        shutil.rmtree(checkpoint)
        checkpoint.mkdir()


def _insert_metrics_line(text: str, at: int, out: pathlib.Path) -> None:
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    lines.insert(at, text + "\n")
    path.write_text("".join(lines))


def _garble_metrics(out: pathlib.Path) -> None:
    (out / "metrics.jsonl").write_bytes(os.urandom(300))


def _newest_state_removed(out: pathlib.Path) -> None:
    shutil.rmtree(_newest_checkpoint(out) / "state")


def _newest_arrays_truncated(out: pathlib.Path) -> None:
    for blob in (_newest_checkpoint(out) / "state").rglob("d/*"):
        blob.write_bytes(blob.read_bytes()[:10])


def _newest_meta_truncated(out: pathlib.Path) -> None:
    path = _newest_checkpoint(out) / "meta.json"
    path.write_bytes(path.read_bytes()[:40])


def _unfinished(out: pathlib.Path) -> None:
    """The reference as a run preempted after its first epoch's checkpoint: the second
    checkpoint, the summary and the policy are not there yet."""
    shutil.rmtree(_newest_checkpoint(out))
    for name in ("summary.json", "policy.eqx", "samples_after.png", "reward_curve.png"):
        (out / name).unlink(missing_ok=True)
    lines = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    kept = [line for line in lines if json.loads(line).get("epoch", 0) <= 1]
    (out / "metrics.jsonl").write_text("".join(kept))


def _unfinished_with_torn_metrics(out: pathlib.Path) -> None:
    """Unfinished, and the process died while writing the second epoch's metrics line."""
    _unfinished(out)
    with open(out / "metrics.jsonl", "a") as file:
        file.write('{"approx_kl": 0.1, "epoch": 2, "lo')


def _stale_lock(out: pathlib.Path) -> None:
    (out / LOCK).write_text("pid 999999 on host a-machine-long-gone\n")


def _stray_checkpoint_folder(out: pathlib.Path) -> None:
    (out / "checkpoints" / "ckpt_notanumber").mkdir()
    (out / "checkpoints" / "ckpt_notanumber" / "meta.json").write_text("{}")


def _config_removed(out: pathlib.Path) -> None:
    (out / "config.toml").unlink()


def _base_truncated(out: pathlib.Path) -> None:
    base = next(out.glob("base_*.eqx"))
    base.write_bytes(base.read_bytes()[:100])


def _summary_garbled(out: pathlib.Path) -> None:
    (out / "summary.json").write_text("{garbled")


def _first_write_cut_short(out: pathlib.Path) -> None:
    """The reference as a run SIGKILLed while it wrote its first checkpoint: a save writes
    into `.tmp-<step>` and renames it when complete, so only that unfinished folder is left
    (no `meta.json` yet); nothing after epoch 1 happened."""
    _unfinished(out)
    first = _newest_checkpoint(out)
    (first / "meta.json").unlink()
    first.rename(first.parent / ".tmp-00000001")


# -- faults that need more than one command -----------------------------------------------------


def _wait_for_lock_holder(process: subprocess.Popen[str], out: pathlib.Path) -> None:
    deadline = time.monotonic() + LIMIT
    while time.monotonic() < deadline and process.poll() is None:
        holder = (out / LOCK).read_text() if (out / LOCK).exists() else ""
        if f"pid {process.pid} " in holder:
            return
        time.sleep(0.05)
    raise Finding("hang", "the first run never took the run folder's lock")


def _start(command: Sequence[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        list(command), env=_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True,
    )  # fmt: skip


def _finish(process: subprocess.Popen[str]) -> Ran:
    try:
        out, err = process.communicate(timeout=LIMIT)
        return Ran(process.returncode, out, err, timed_out=False)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        return Ran(process.returncode, out, err, timed_out=True)


def _second_writer(workdir: pathlib.Path) -> Judgement:
    out = _copy(workdir)
    first = _start(_train(out, "--resume", "--epochs", EPOCHS + 1))
    _wait_for_lock_holder(first, out)
    second = run(_train(out, "--resume", "--epochs", EPOCHS + 2), timeout=LIMIT, env=_env())
    refusal = judge_refusal(second, limit=LIMIT, names=(f"pid {first.pid}",))
    finished = _continued(out, _finish(first), EPOCHS + 1, "")
    if finished.verdict != "held":
        return finished
    return refusal


def _two_resumes_at_once(workdir: pathlib.Path) -> Judgement:
    out = _copy(workdir)
    processes = [_start(_train(out, "--resume", "--epochs", EPOCHS + 1)) for _ in range(2)]
    results = [_finish(p) for p in processes]
    for ran in results:
        if (failure := raw_failure(ran, LIMIT)) is not None:
            return failure
    if sorted(r.status for r in results) != [0, 1]:
        return Judgement("lost", f"exit statuses {[r.status for r in results]}: not one refused")
    refused = next(r for r in results if r.status == 1)
    if "in use by another run" not in refused.stderr:
        return Judgement("unnamed", refused.stderr.strip()[-200:])
    winner = next(r for r in results if r.status == 0)
    return _continued(out, winner, EPOCHS + 1, "one ran to the end, the other was refused")


def _signalled(
    signals: Sequence[signal.Signals], after_epoch: bool, workdir: pathlib.Path
) -> Judgement:
    """Send `signals` to a resume (once its lock is held, or once it has finished an epoch),
    then resume again: 75 and a run that ends as if never stopped."""
    out = _copy(workdir)
    _unfinished(out)
    process = _start(_train(out, "--resume", "--epochs", EPOCHS + 2))
    _wait_for_lock_holder(process, out)
    if after_epoch:
        deadline = time.monotonic() + LIMIT
        while 2 not in _epochs(out) and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
    for sent in signals:
        process.send_signal(sent)
        time.sleep(0.1)
    stopped = _finish(process)
    if (failure := raw_failure(stopped, LIMIT)) is not None:
        return failure
    if stopped.status != PREEMPTED:
        return Judgement("unnamed", f"exit {stopped.status}, not {PREEMPTED}, with a checkpoint")
    again = run(_train(out, "--resume", "--epochs", EPOCHS + 2), timeout=LIMIT, env=_env())
    return _continued(out, again, EPOCHS + 2, f"exit {PREEMPTED}, then resumed to the end")


def _killed_mid_run(workdir: pathlib.Path) -> Judgement:
    out = _copy(workdir)
    _unfinished(out)
    process = _start(_train(out, "--resume", "--epochs", EPOCHS + 2))
    deadline = time.monotonic() + LIMIT
    while 2 not in _epochs(out) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)
    process.communicate()
    again = run(_train(out, "--resume", "--epochs", EPOCHS + 2), timeout=LIMIT, env=_env())
    return _continued(out, again, EPOCHS + 2, "killed with SIGKILL, then resumed to the end")


def _resume_finished(workdir: pathlib.Path) -> Judgement:
    out = _copy(workdir)
    before = _kept(out)
    ran = run(_train(out, "--resume"), timeout=LIMIT, env=_env())
    if (failure := raw_failure(ran, LIMIT)) is not None:
        return failure
    if lost := changes(before, _kept(out)):
        return Judgement("lost", "; ".join(lost[:4]))
    if ran.status != 0 or "nothing written" not in ran.stdout:
        return Judgement("unnamed", f"exit {ran.status}: {(ran.stdout + ran.stderr)[-200:]}")
    return Judgement("held", "nothing to resume, nothing written")


def _replace(workdir: pathlib.Path) -> Judgement:
    out = _copy(workdir)
    before = _kept(out)
    ran = run(_train(out, "--replace"), timeout=LIMIT, env=_env())
    moved = [p for p in workdir.iterdir() if p.name.startswith("run.replaced")]
    if len(moved) != 1:
        return Judgement("lost", f"the replaced run is not kept aside: {moved}")
    if lost := changes(before, _kept(moved[0])):
        return Judgement("lost", f"{moved[0].name}: " + "; ".join(lost[:4]))
    return _continued(out, ran, EPOCHS, f"the old run kept in {moved[0].name}, a new one made")


def _eval_of(
    damage: Callable[[pathlib.Path], None], names: Sequence[str], workdir: pathlib.Path
) -> Judgement:
    out = _copy(workdir)
    damage(out)
    return _refused(out, flowgrpo_eqx("eval", "--run", out, "--out", workdir / "eval"), names)


def _truncate_policy(out: pathlib.Path) -> None:
    policy = out / "policy.eqx"
    policy.write_bytes(policy.read_bytes()[:1000])


def _garble_config(out: pathlib.Path) -> None:
    (out / "config.toml").write_text("width = = 1\n")


def _sweep_again(flags: Sequence[object], workdir: pathlib.Path) -> Judgement:
    out = _copy(workdir, reference_sweep())
    command = flowgrpo_eqx(
        "train", "--preset", "tiny", "--quiet", "--epochs", 1, "--seeds", "0,1", "--out", out,
        *flags,
    )  # fmt: skip
    if "--resume" not in flags:
        return _refused(out, command, ("--resume",))
    before = _kept(out)
    ran = run(command, timeout=2 * LIMIT, env=_env())
    if (failure := raw_failure(ran, 2 * LIMIT)) is not None:
        return failure
    if lost := changes(before, _kept(out)):
        return Judgement("lost", "; ".join(lost[:4]))
    if ran.status != 0:
        return Judgement("unnamed", f"exit {ran.status}: {ran.stderr.strip()[-200:]}")
    return Judgement("held", "each finished seed reported, nothing written")


def _continue_with(
    damage: Callable[[pathlib.Path], None], what: str, workdir: pathlib.Path
) -> Judgement:
    """A fault after which continuing is right (`held`) and refusing by name acceptable
    (`named`, nothing changed): anything else is a finding."""
    out = _copy(workdir)
    damage(out)
    before = _kept(out)
    ran = run(_train(out, "--resume", "--epochs", EPOCHS + 1), timeout=LIMIT, env=_env())
    if ran.status == 0:
        return _continued(out, ran, EPOCHS + 1, what)
    return judge_refusal(ran, limit=LIMIT, names=("config.toml", "summary.json", "base"),
                         kept=(before, _kept(out)))  # fmt: skip


def _file_size_limit(workdir: pathlib.Path) -> Judgement:
    """A fresh run under `ulimit -f 100` (its base model shared with the reference): its first
    checkpoint cannot be written. It must stop with one named line (no traceback of Orbax's
    threads), `--resume` must then say that no checkpoint was ever completed and give the
    command that starts the run afresh in the same folder, and that command must."""
    out = workdir / "run"
    out.mkdir()
    base = next(reference_run().glob("base_*.eqx"))
    shutil.copy(base, out / base.name)
    limited = ["sh", "-c", 'ulimit -f 100 && exec "$@"', "sh", *_train(out)]
    # No compilation cache: an entry past the limit would not be written.
    ran = run(limited, timeout=LIMIT, env=environment())
    first = judge_refusal(ran, limit=LIMIT, names=("File too large while writing a checkpoint",))
    if first.verdict != "named":
        return first
    kept = _kept(out)
    resumed = run(_train(out, "--resume"), timeout=LIMIT, env=_env())
    again = judge_refusal(
        resumed, limit=LIMIT, names=("no checkpoint to resume from",), kept=(kept, _kept(out))
    )
    if again.verdict != "named":
        return again
    line = resumed.stderr.strip()
    given = line.partition("in the same folder with: ")[2].partition(" (the old run")[0]
    words = shlex.split(given) if given.startswith("flowgrpo-eqx train ") else []
    if "--replace" not in words:
        return Judgement("unnamed", f"--resume gave no command to start over: {line[-200:]}")
    restarted = run(flowgrpo_eqx(*words[1:], "--quiet"), timeout=LIMIT, env=_env())
    if (failure := raw_failure(restarted, LIMIT)) is not None:
        return failure
    if restarted.status != 0 or not (out / "summary.json").exists():
        said = restarted.stderr.strip()[-200:]
        return Judgement(
            "unnamed", f"`{given}` did not start over (exit {restarted.status}): {said}"
        )
    return Judgement(
        "held",
        f"{first.detail[:70]} ...; --resume gave `{given[-90:]}`, which ran the job afresh",
    )


def _eval_while_training(workdir: pathlib.Path) -> Judgement:
    """`eval --run` three times on a run still training (keeping one checkpoint, so each is
    pruned as soon as the next is written): each must measure its newest checkpoint."""
    out = _copy(workdir)
    _unfinished(out)
    training = _start(_train(out, "--resume", "--epochs", 400, "--keep-checkpoints", 1))
    try:
        deadline = time.monotonic() + LIMIT
        while 4 not in _epochs(out) and training.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        for attempt in range(3):
            if training.poll() is not None:
                raise Finding("unprobed", f"the run ended (exit {training.returncode}) first")
            ran = run(
                flowgrpo_eqx("eval", "--run", out, "--out", workdir / f"eval_{attempt}"),
                timeout=LIMIT, env=_env(),
            )  # fmt: skip
            if (failure := raw_failure(ran, LIMIT)) is not None:
                return failure
            if ran.status != 0:
                return Judgement("unnamed", f"eval {attempt + 1}: {ran.stderr.strip()[-200:]}")
        if training.poll() is not None:
            raise Finding("unprobed", "the run ended before the last eval did")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(training.pid, signal.SIGKILL)
        training.communicate()
    return Judgement("held", "three evals of a run still training each measured a checkpoint")


def faults() -> list[Fault]:
    """The run folders' faults."""
    p = functools.partial
    refused = _resume_refused
    return [
        Fault("run folders", "a second writer while a run holds the folder", _second_writer),
        Fault("run folders", "two --resume processes at once", _two_resumes_at_once),
        Fault("run folders", "--resume of a finished run", _resume_finished),
        Fault("run folders", "--resume of a finished run whose checkpoints are gone",
              p(refused, _remove_checkpoints, ("no checkpoint",), ())),
        Fault("run folders", "... and with other settings",
              p(refused, _remove_checkpoints, ("no checkpoint", "learning_rate"),
                ("--learning-rate", "0.003"))),
        Fault("run folders", "--resume after every checkpoint's folder was emptied",
              p(refused, _empty_checkpoints, ("usable",), ("--epochs", EPOCHS + 1))),
        Fault("run folders", "--resume with every meta.json garbled and a changed setting",
              p(refused, _every_meta_garbled, ("usable",), ("--eval-every", 3))),
        Fault("run folders", "a checkpoint's epoch edited to -3",
              p(refused, p(_edit_meta, p(_set_epoch, -3)), ("epoch -3",),
                ("--epochs", EPOCHS + 1))),
        Fault("run folders", "a checkpoint's epoch edited to a string",
              p(refused, p(_edit_meta, p(_set_epoch, "two")), ("epoch",),
                ("--epochs", EPOCHS + 1))),
        Fault("run folders", "meta.json without `base`",
              p(refused, p(_edit_meta, p(_drop, "base")), ("base",), ("--epochs", EPOCHS + 1))),
        Fault("run folders", "meta.json without `settings`",
              p(refused, p(_edit_meta, p(_drop, "settings")), ("settings",),
                ("--epochs", EPOCHS + 1))),
        Fault("run folders", "a mid-file metrics line {\"epoch\": \"x\"}",
              p(refused, p(_insert_metrics_line, '{"epoch": "x"}', 2), ("metrics.jsonl",),
                ("--epochs", EPOCHS + 1))),
        Fault("run folders", "metrics.jsonl replaced by random bytes",
              p(refused, _garble_metrics, ("metrics.jsonl",), ("--epochs", EPOCHS + 1))),
        Fault("run folders", "--resume to fewer epochs than done",
              p(refused, lambda out: None, ("epochs",), ("--epochs", 1))),
        Fault("run folders", "--resume with a changed learning rate",
              p(refused, lambda out: None, ("learning_rate",),
                ("--epochs", EPOCHS + 1, "--learning-rate", "0.003"))),
        Fault("run folders", "--resume and --replace together",
              p(refused, lambda out: None, ("replace",), ("--replace",))),
        Fault("run folders", "train again without --resume over a finished run",
              lambda workdir: _refused(_copy(workdir), _train(workdir / "run"), ("--resume",))),
        Fault("run folders", "--replace of a finished run", _replace),
        Fault("run folders", "the newest checkpoint's arrays removed",
              p(_resume_continues, _newest_state_removed, "resumed from the older checkpoint")),
        Fault("run folders", "the newest checkpoint's arrays truncated",
              p(_resume_continues, _newest_arrays_truncated, "resumed from the older checkpoint")),
        Fault("run folders", "the newest checkpoint's meta.json truncated",
              p(_resume_continues, _newest_meta_truncated, "resumed from the older checkpoint")),
        Fault("run folders", "a stale run.lock of a process long gone",
              p(_resume_continues, _stale_lock, "the lock of a dead process does not bind")),
        Fault("run folders", "a stray ckpt_notanumber folder",
              p(_resume_continues, _stray_checkpoint_folder, "the stray folder is passed over")),
        Fault("run folders", "a torn last metrics line of a killed run",
              p(_resume_continues, _unfinished_with_torn_metrics,
                "the torn line after the checkpoint is dropped")),
        Fault("run folders", "config.toml removed",
              p(_continue_with, _config_removed, "resumed; config.toml written again")),
        Fault("run folders", "summary.json garbled",
              p(_continue_with, _summary_garbled, "resumed past the garbled summary")),
        Fault("run folders", "the run's base model truncated",
              p(_continue_with, _base_truncated, "resumed from its checkpoint")),
        Fault("run folders", "SIGTERM once an epoch is done",
              p(_signalled, (signal.SIGTERM,), True)),
        Fault("run folders", "SIGTERM twice",
              p(_signalled, (signal.SIGTERM, signal.SIGTERM), True)),
        Fault("run folders", "SIGTERM before the first epoch",
              p(_signalled, (signal.SIGTERM,), False)),
        Fault("run folders", "SIGINT then SIGTERM", p(_signalled, (signal.SIGINT, signal.SIGTERM),
                                                     True)),
        Fault("run folders", "SIGKILL mid-run, then --resume", _killed_mid_run),
        Fault("run folders", "SIGKILL during the first checkpoint's write, then --resume",
              p(refused, _first_write_cut_short, ("first checkpoint",), ())),
        Fault("run folders", "a run under a file-size limit (ulimit -f 100), then --resume",
              _file_size_limit),
        Fault("run folders", "eval --run of a run still training", _eval_while_training),
        Fault("run folders", "eval --run with policy.eqx truncated",
              p(_eval_of, _truncate_policy, ("policy.eqx",))),
        Fault("run folders", "eval --run with config.toml garbled",
              p(_eval_of, _garble_config, ("config.toml",))),
        Fault("run folders", "a finished sweep run again without --resume",
              p(_sweep_again, ())),
        Fault("run folders", "a finished sweep resumed", p(_sweep_again, ("--resume",))),
    ]  # fmt: skip
