"""A checkpoint's arrays through Orbax (`_checkpoint.py` holds the folder, its atomic rename
and its checks): where each array is stored (`storage_plan`: its own Orbax array if split
over devices, else a slice of one packed buffer per dtype), writing them (`write_state`) and
reading them back (`restore_arrays`, `restore_target`, `placed_array`), the event loops Orbax
makes finishing their writes before they close (`finishing_event_loops`), and the `OSError`
behind a failed write (`os_error_of`). Orbax is imported only when a checkpoint is saved or
read.
"""

import asyncio
import contextlib
import logging
import os
import pathlib
import re
import threading
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
import numpy.typing as npt

from .._distributed import local_copy
from ._checkpoint_integrity import PYTHON_SCALARS, describe_array


def is_split(leaf: Any) -> bool:
    """Whether `leaf` is a global array split over devices (not whole on each of them)."""
    return isinstance(leaf, jax.Array) and not leaf.sharding.is_fully_replicated


def storage_plan(leaves: list[tuple[str, Any]]) -> list[str]:
    """Where each leaf is stored: `"<index>"` for an array of its own (a split one: every
    process writes its shards), or `"packed_<dtype>:<offset>"` inside one flat buffer per
    dtype holding every whole array (Orbax's cost is per array, and the main job's state has
    hundreds of small ones)."""
    plan: list[str] = []
    offsets: dict[str, int] = {}
    for index, (_, leaf) in enumerate(leaves):
        if is_split(leaf):
            plan.append(f"{index:06d}")
            continue
        shape, dtype = describe_array(leaf)
        offset = offsets.get(dtype, 0)
        plan.append(f"packed_{dtype}:{offset}")
        offsets[dtype] = offset + int(np.prod(shape, dtype=np.int64))
    return plan


def orbax_checkpointer() -> Any:
    import orbax.checkpoint as ocp

    return ocp.Checkpointer(ocp.StandardCheckpointHandler())


def write_state(folder: pathlib.Path, leaves: list[tuple[str, Any]], plan: list[str]) -> None:
    """Every process writes its shards of the split leaves, process 0 the packed buffers
    of the whole ones, into `folder` (collective)."""
    import orbax.checkpoint as ocp

    arrays: dict[str, Any] = {}
    packed: dict[str, list[npt.NDArray[Any]]] = {}
    for (_, leaf), where in zip(leaves, plan, strict=True):
        if where.startswith("packed_"):
            # A whole array's local copy: nothing is gathered.
            packed.setdefault(where.split(":")[0], []).append(np.asarray(local_copy(leaf)).ravel())
        else:
            arrays[where] = leaf
    for name, parts in packed.items():
        arrays[name] = np.concatenate(parts)
    with orbax_call():
        orbax_checkpointer().save(folder.absolute(), args=ocp.args.StandardSave(arrays))


@contextlib.contextmanager
def orbax_call() -> Iterator[None]:
    """Around a call of Orbax: its logs held back (`orbax_quiet`), and the event loops it
    makes finish their writes before they close (`finishing_event_loops`)."""
    with orbax_quiet(), finishing_event_loops():
        yield


@contextlib.contextmanager
def orbax_quiet() -> Iterator[None]:
    """Orbax (through absl) logs a failed write's traceback, about 100 lines on a full disk,
    before raising; the caller names the error in one line, so those logs are held back."""
    loggers = [logging.getLogger(name) for name in ("absl", "orbax")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


LOOP_DRAIN_SECONDS = 120.0
"""How long a closing event loop waits for the writes still running on it."""


class FinishingEventLoop(asyncio.SelectorEventLoop):
    """An event loop that, when closed with tasks still running, lets them finish first.

    Orbax runs each save in an event loop of its own, which it closes as soon as the save's
    coroutine ends. When one write of many fails (a full disk, a file-size limit), the
    coroutine ends with that error while TensorStore's other writes still run; each of them,
    on finishing, hands its result to the closed loop, which raises `RuntimeError: Event loop
    is closed` in TensorStore's thread and prints its traceback. Writes still going on would
    also race the removal of the unfinished checkpoint. This loop waits for them instead.

    A write that failed in the loop's last turn before it stopped is done, but the callbacks
    it scheduled have not run: among them `asyncio.gather`'s, which marks a second failure as
    seen. Closed with them unrun, the loop would log `Task exception was never retrieved` with
    the write's traceback when the task is collected, so one more turn runs them.
    """

    def close(self) -> None:
        if not self.is_running() and not self.is_closed():
            pending = [task for task in asyncio.all_tasks(self) if not task.done()]
            if pending:
                self.run_until_complete(asyncio.wait(pending, timeout=LOOP_DRAIN_SECONDS))
            self.run_until_complete(asyncio.sleep(0))
        super().close()


class FinishingPolicy(asyncio.DefaultEventLoopPolicy):
    """asyncio's default policy, whose new event loops are `FinishingEventLoop`s."""

    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        return FinishingEventLoop()


_POLICY_LOCK = threading.Lock()
_policy_users = 0


@contextlib.contextmanager
def finishing_event_loops() -> Iterator[None]:
    """New event loops are `FinishingEventLoop`s for the duration (when the process uses
    asyncio's default policy; another, such as uvloop's, is left alone)."""
    global _policy_users
    with _POLICY_LOCK:
        policy = asyncio.get_event_loop_policy()
        ours = isinstance(policy, FinishingPolicy)
        if not ours and type(policy) is not asyncio.DefaultEventLoopPolicy:
            active = False
        else:
            active = True
            if _policy_users == 0:
                asyncio.set_event_loop_policy(FinishingPolicy())
            _policy_users += 1
    try:
        yield
    finally:
        if active:
            with _POLICY_LOCK:
                _policy_users -= 1
                if _policy_users == 0:
                    asyncio.set_event_loop_policy(None)


_OS_ERROR_CODE = re.compile(r"\[os_error_code='?(\d+)'?\]")


def os_error_of(error: Exception) -> OSError | None:
    """The `OSError` behind a failed write: `error` itself, or the one TensorStore reports
    inside its own error (`... File too large [os_error_code='27']`); `None` for neither."""
    if isinstance(error, OSError):
        return error
    found = _OS_ERROR_CODE.search(str(error))
    if found is None:
        return None
    code = int(found.group(1))
    return OSError(code, os.strerror(code))


def restore_target(leaf: Any) -> Any:
    """What Orbax restores a split leaf as: an array with `leaf`'s sharding, or NumPy."""
    if isinstance(leaf, jax.Array):
        # jax.ShapeDtypeStruct.__init__ carries no annotations.
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)  # type: ignore[no-untyped-call]
    shape, dtype = describe_array(leaf)
    return np.zeros(shape, dtype)


def placed_array(value: npt.NDArray[Any], leaf: Any) -> Any:
    """A whole array read from a packed buffer, placed like the template's `leaf`."""
    if isinstance(leaf, PYTHON_SCALARS):
        return type(leaf)(value.item())
    if isinstance(leaf, jax.Array):
        return jax.make_array_from_callback(value.shape, leaf.sharding, lambda index: value[index])
    return value


def restore_arrays(folder: pathlib.Path, target: dict[str, Any]) -> Any:
    """The arrays Orbax stored in `folder` (a checkpoint's `state/`), read as `target`'s:
    split ones with their template's sharding, packed buffers as NumPy."""
    import orbax.checkpoint as ocp

    with orbax_call():
        return orbax_checkpointer().restore(
            folder.absolute(), args=ocp.args.StandardRestore(target)
        )
