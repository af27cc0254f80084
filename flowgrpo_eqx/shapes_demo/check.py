"""`flowgrpo-eqx check`: the porting check on the demo's setup or on a user's own."""

import importlib
import pathlib
from collections.abc import Callable
from typing import Any

import jax

from .. import ConsistencyReport, check_consistency
from .config import JobConfig
from .parts import ShapesJob


def load_factory(spec: str) -> Callable[[], tuple[Any, Any, Any, Any]]:
    """The zero-argument callable named by `spec`, `package.module:callable`.

    **Raises:**

    - `ValueError`: naming `spec`, when it is malformed, cannot be imported, or is not
        callable.
    """
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"`--factory` must be package.module:callable, got {spec!r}.")
    try:
        found = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"`--factory` {spec!r}: {error}") from error
    if not callable(found):
        raise ValueError(f"`--factory` {spec!r} is not callable.")
    return found  # type: ignore[no-any-return]


def run_check(
    config: JobConfig,
    out: str | pathlib.Path,
    *,
    factory: str | None = None,
    quiet: bool = False,
    log: Callable[[str], None] = print,
) -> ConsistencyReport:
    """Build the setup, run `check_consistency` on it and print the table.

    **Arguments:**

    - `config`: the demo's settings (unused with `factory`).
    - `out`: where the demo's base model is written if it must be pretrained.
    - `factory`: `package.module:callable`, a zero-argument callable returning
        `(objective, rollout, variables, rows)`; `None` checks the demo's own setup.
    - `quiet`: no progress bars.
    - `log`: where the table goes.

    **Returns:**

    The report.

    **Raises:**

    - `ValueError`: for a bad `factory`, or one that does not return four things.
    """
    key = jax.random.key(config.training.seed + 3)
    if factory is not None:
        made = load_factory(factory)()
        if not (isinstance(made, tuple) and len(made) == 4):
            raise ValueError(
                f"`--factory` {factory!r} must return (objective, rollout, variables, rows), "
                f"got {type(made).__name__}."
            )
        objective, rollout, variables, rows = made
        report = check_consistency(objective, rollout, variables, rows, key)
    else:
        job = ShapesJob(config, out, quiet)
        base, _ = job.base_model(log)
        objective = job.flow_grpo_objective(base)
        report = check_consistency(
            objective,
            job.rollout(objective),
            objective.init(key),
            job.epoch_rows(1),
            key,
            trainer=job.trainer(objective),
        )
    log(report.table())
    return report
