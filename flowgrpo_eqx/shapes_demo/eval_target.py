"""What `flowgrpo-eqx eval` measures, and with which settings: a run folder's policy and its
`config.toml`, or a file or checkpoint named on its own (read with the run's `config.toml` when
it lies inside a run folder).

Imports nothing of JAX: the command line resolves this before it builds the configuration.
"""

import dataclasses
import pathlib


CONFIG_FILE = "config.toml"
"""A run folder's settings, as `flowgrpo-eqx train` writes them."""

POLICY_FILES: tuple[str, ...] = ("policy.eqx", "policy.lora")
"""What a finished run exports (full fine-tuning, or LoRA's adapters)."""

_CHECKPOINT_PREFIX = "ckpt_"


@dataclasses.dataclass(frozen=True)
class EvalTarget:
    """A policy to measure and the settings file of its run.

    **Arguments:**

    - `policy`: `policy.eqx`, `policy.lora`, a `base_<fingerprint>.eqx` or a `ckpt_<n>` folder.
    - `config_file`: the run's `config.toml`, or `None` when the policy lies in no run folder.
    - `newest_of`: the run's `checkpoints` folder, when `policy` is the newest checkpoint in
        it, chosen for `--run` of a run that has exported no policy (yet): a run still
        training prunes its older checkpoints, perhaps this one while it is read, and eval
        then measures the newest one again. `None` for a policy named on its own.
    """

    policy: pathlib.Path
    config_file: pathlib.Path | None
    newest_of: pathlib.Path | None = None


def checkpoint_folders(folder: pathlib.Path) -> list[pathlib.Path]:
    """The `ckpt_<n>` folders in `folder`, oldest first (empty if none or no folder; a folder
    removed while it is listed, by the run that writes it, is left out)."""
    try:
        entries = list(folder.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = [
        path
        for path in entries
        if path.name.startswith(_CHECKPOINT_PREFIX)
        and path.name[len(_CHECKPOINT_PREFIX) :].isdigit()
        and path.is_dir()
    ]
    return sorted(found, key=lambda path: int(path.name[len(_CHECKPOINT_PREFIX) :]))


def _run_policy(run: pathlib.Path) -> EvalTarget:
    """The exported policy of a run folder, else its newest checkpoint."""
    config_file = run / CONFIG_FILE
    for name in POLICY_FILES:
        if (run / name).is_file():
            return EvalTarget(run / name, config_file)
    kept = checkpoint_folders(run / "checkpoints")
    if kept:
        return EvalTarget(kept[-1], config_file, newest_of=run / "checkpoints")
    raise ValueError(
        f"`--run` {run} holds no {' or '.join(POLICY_FILES)} and no checkpoints/ckpt_<n> "
        "folder: the run has neither finished nor checkpointed."
    )


def _enclosing_config(policy: pathlib.Path) -> pathlib.Path | None:
    """The `config.toml` of the run folder `policy` lies in: beside a file, or two folders up
    from a `checkpoints/ckpt_<n>` folder; `None` if there is none."""
    if policy.is_dir() and policy.parent.name == "checkpoints":
        candidate = policy.parent.parent / CONFIG_FILE
    else:
        candidate = policy.parent / CONFIG_FILE
    return candidate if candidate.is_file() else None


def eval_target(checkpoint: str | None, run: str | None) -> EvalTarget:
    """The policy `flowgrpo-eqx eval` measures and the run settings it reads.

    **Arguments:**

    - `checkpoint`: `--checkpoint`: a policy file, a base model, a `ckpt_<n>` folder, or a
        run folder; `None` if not given.
    - `run`: `--run`: a run folder (one holding `config.toml`); its `policy.eqx` or
        `policy.lora`, else its newest checkpoint (`EvalTarget.newest_of`), is measured
        unless `checkpoint` names another; `None` if not given.

    **Returns:**

    The `EvalTarget`: with `run`, its `config.toml`; with `checkpoint` alone, the
    `config.toml` of the run folder it lies in, if any.

    **Raises:**

    - `ValueError`: naming the argument, if neither is given, `run` is not a run folder,
        `checkpoint` does not exist, or it is a folder of checkpoints (naming the `ckpt_<n>`
        folders in it).
    """
    if run is None and checkpoint is None:
        raise ValueError(
            "`eval` needs `--run RUN_FOLDER` (a `flowgrpo-eqx train --out` folder) or "
            "`--checkpoint PATH` (policy.eqx, policy.lora, base_<hash>.eqx or a ckpt_<n> folder)."
        )
    if run is not None:
        folder = pathlib.Path(run)
        config_file = folder / CONFIG_FILE
        if not config_file.is_file():
            raise ValueError(
                f"`--run` {folder} is not a run folder: it holds no {CONFIG_FILE} (the folder "
                "`flowgrpo-eqx train --out` wrote; for a seed sweep, one of its seed_<s> folders)."
            )
        if checkpoint is None:
            return _run_policy(folder)
        return EvalTarget(_checked(pathlib.Path(checkpoint)), config_file)
    path = pathlib.Path(str(checkpoint))
    if path.is_dir() and (path / CONFIG_FILE).is_file():
        return eval_target(None, str(path))
    return EvalTarget(_checked(path), _enclosing_config(path))


def _checked(path: pathlib.Path) -> pathlib.Path:
    """`path`, if it exists and is not a folder of checkpoints rather than one checkpoint."""
    if not path.exists():
        raise ValueError(f"`--checkpoint` {path} does not exist.")
    kept = checkpoint_folders(path)
    if kept and not (path / "meta.json").exists():
        names = ", ".join(str(folder) for folder in kept)
        raise ValueError(
            f"`--checkpoint` {path} is a folder of checkpoints; name one of them: {names}."
        )
    return path
