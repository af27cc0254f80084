"""The reward protocol: `FlowReward`, validation of what a reward returns, scoring in blocks,
loading a reward by name, and `WeightedReward`.

Rewards run on the host, on numpy arrays, and return float64 scores: they keep full
precision through collection, transport between processes and the group statistics.
"""

import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, final, runtime_checkable

import numpy as np
import numpy.typing as npt


@runtime_checkable
class FlowReward(Protocol):
    """Score decoded [-1, 1] samples and repeated source rows, one scalar per sample.

    Any callable `reward(samples, rows) -> scores` satisfies it:

    - `samples`: numpy `[N, *sample]` in [-1, 1] (images are channels-last `[N, H, W, C]`).
    - `rows`: the source rows repeated once per sample (numpy leaves with leading axis `N`).
    - returns `[N]` scores, converted to float64.

    A `name` attribute, if present, is used in error messages and metrics.
    """

    def __call__(self, samples: npt.NDArray[Any], rows: Any) -> npt.ArrayLike:
        """Score a batch of samples.

        **Arguments:**

        - `samples`: numpy `[N, *sample]` in [-1, 1].
        - `rows`: the source rows repeated once per sample.

        **Returns:**

        `[N]` finite scores (anything `np.asarray(..., dtype=np.float64)` accepts).

        **Raises:**

        Anything: the library's callers turn an exception, a wrong shape, NaN or inf into a
        `RewardError` naming the reward.
        """
        ...


class RewardError(ValueError):
    """A reward raised, or returned the wrong shape or non-finite scores.

    A `ValueError`; its message names the reward (and for `HttpReward` the URL). With many
    processes, a failure on process 0 is raised as the same `RewardError` on every process.
    """


def reward_name(reward: Any) -> str:
    """A readable name for a reward: its `name`, its `__name__`, or its class name."""
    name = getattr(reward, "name", None) or getattr(reward, "__name__", None)
    return str(name) if name else type(reward).__name__


def check_finite_samples(name: str, samples: Any) -> None:
    """Refuse an empty batch, or one holding NaN or inf, naming the reward (and the rows
    that hold NaN or inf).

    Rewards that turn samples into images or files would otherwise score NaN as some
    finite number (JPEG sizes of whatever NaN casts to), and the policy would be trained
    toward it; an empty batch is always a caller's mistake (a rollout has rows).

    **Arguments:**

    - `name`: the reward's name, for the message.
    - `samples`: `[N, *sample]` samples, `N >= 1` (integer samples are always finite).

    **Raises:**

    - `RewardError`: naming the reward and `samples`, for an empty batch (`N = 0`) or the
        rows that hold NaN or inf.
    """
    array = np.asarray(samples)
    if array.ndim >= 1 and array.shape[0] == 0:
        raise RewardError(
            f"Reward {name!r} was given an empty batch (`samples` of shape {array.shape}); "
            "it scores one or more samples."
        )
    if array.ndim == 0 or not np.issubdtype(array.dtype, np.inexact):
        return
    flat = array.reshape(array.shape[0], -1)
    step = _rows_per_block(flat[0].nbytes)
    bad = np.concatenate(
        [
            start + np.flatnonzero(~np.isfinite(flat[start : start + step]).all(axis=1))
            for start in range(0, flat.shape[0], step)
        ]
    )
    if bad.size:
        shown = bad[:10].tolist()
        more = f" and {bad.size - 10} more" if bad.size > 10 else ""
        raise RewardError(
            f"Reward {name!r} was given non-finite `samples` (NaN or inf) at rows "
            f"{shown}{more}; it scores only finite samples."
        )


def score(reward: FlowReward, samples: npt.NDArray[Any], rows: Any) -> npt.NDArray[np.float64]:
    """Call `reward` once and check what it returns.

    **Arguments:**

    - `reward`: the reward.
    - `samples`: `[N, *sample]` numpy samples in [-1, 1].
    - `rows`: the repeated source rows.

    **Returns:**

    `[N]` float64 scores.

    **Raises:**

    - `RewardError`: naming the reward, if it raises, returns a shape other than `[N]`, or
        returns NaN or inf (naming the offending rows).
    """
    name = reward_name(reward)
    count = int(samples.shape[0])
    try:
        raw = reward(samples, rows)
    except Exception as error:  # noqa: BLE001 - re-raised with the reward's name
        raise RewardError(f"Reward {name!r} raised {type(error).__name__}: {error}") from error
    try:
        values = np.asarray(raw, dtype=np.float64)
    except (TypeError, ValueError) as error:
        raise RewardError(
            f"Reward {name!r} returned {type(raw).__name__}, not an array of numbers."
        ) from error
    if values.shape != (count,):
        raise RewardError(
            f"Reward {name!r} returned shape {values.shape}; expected one score per sample, "
            f"[N] = ({count},)."
        )
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        raise RewardError(
            f"Reward {name!r} returned non-finite scores {values[bad].tolist()} at rows "
            f"{bad.tolist()}."
        )
    return values


def load_reward(
    spec: str, builtins: Mapping[str, Callable[[], FlowReward]] | None = None
) -> FlowReward:
    """The reward a command line names.

    Rule: `spec` is first looked up in `builtins` (whose factories are called with no
    arguments). Otherwise it is `package.module:attribute` (the attribute may be dotted) or
    `package.module.attribute`, and the attribute becomes the reward as follows:

    - a class is instantiated with no arguments;
    - a function that needs no arguments is a factory and is called;
    - anything else callable (a reward function `f(samples, rows)`, a reward instance) is
      the reward itself.

    **Arguments:**

    - `spec`: the reward's name or import path.
    - `builtins`: named factories of built-in rewards.

    **Returns:**

    The reward.

    **Raises:**

    - `ValueError`: naming `spec`, if it cannot be imported or does not give a callable.
    """
    if builtins is not None and spec in builtins:
        return _callable_reward(builtins[spec](), spec)
    module_name, colon, attribute_path = spec.partition(":")
    if not colon:
        module_name, _, attribute_path = spec.rpartition(".")
    if not module_name or not attribute_path:
        known = f" or one of {sorted(builtins)}" if builtins else ""
        raise ValueError(f"Reward {spec!r} must be 'package.module:callable'{known}.")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attribute_path.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"Reward {spec!r} cannot be loaded: {error}") from error
    if inspect.isclass(target) or (inspect.isfunction(target) and _needs_no_arguments(target)):
        try:
            target = target()
        except TypeError as error:
            raise ValueError(
                f"Reward {spec!r} must be constructible with no arguments: {error}"
            ) from error
    return _callable_reward(target, spec)


def _needs_no_arguments(function: Callable[..., Any]) -> bool:
    parameters = inspect.signature(function).parameters.values()
    return all(
        p.default is not inspect.Parameter.empty
        or p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        for p in parameters
    )


def _callable_reward(reward: Any, spec: str) -> FlowReward:
    if not callable(reward):
        raise ValueError(f"Reward {spec!r} gave {type(reward).__name__}, which is not callable.")
    try:
        signature = inspect.signature(reward)
    except (TypeError, ValueError):
        signature = None  # a callable without a signature to read is taken on trust
    if signature is not None:
        try:
            signature.bind(None, None)
        except TypeError as error:
            raise ValueError(
                f"Reward {spec!r} must be called as reward(samples, rows), but its signature "
                f"{signature} cannot be: {error}."
            ) from None
    loaded: FlowReward = reward
    return loaded


def to_uint8_images(samples: npt.NDArray[Any]) -> npt.NDArray[np.uint8]:
    """Samples in [-1, 1], `[N, H, W]` or `[N, H, W, C]` with C in (1, 3, 4), as uint8 images.

    **Raises:**

    - `ValueError`: if `samples` is not a batch of images.
    """
    array = np.asarray(samples)
    if array.ndim == 3:
        array = array[..., None]
    if array.ndim != 4 or array.shape[-1] not in (1, 3, 4):
        raise ValueError(
            f"`samples` must be images [N, H, W] or [N, H, W, C] with C in (1, 3, 4), got "
            f"shape {array.shape}."
        )
    images: npt.NDArray[np.uint8] = np.empty(array.shape, np.uint8)
    # A block of images at a time, in float64: no temporary larger than a block.
    step = _rows_per_block(8 * array[0].size)
    for start in range(0, array.shape[0], step):
        block = np.array(array[start : start + step], dtype=np.float64)
        np.clip(block, -1.0, 1.0, out=block)
        block += 1.0
        block *= 127.5
        np.round(block, out=block)
        images[start : start + step] = block.astype(np.uint8)
    return images


_BLOCK_BYTES = 16 << 20
"""The bytes of the temporaries the host rewards work in at a time (a block of rows)."""


def _rows_per_block(row_bytes: int) -> int:
    """Rows of `row_bytes` each that fit `_BLOCK_BYTES` (at least one)."""
    return max(1, _BLOCK_BYTES // max(1, row_bytes))


@final
class WeightedReward:
    """A weighted sum of rewards, each scored and checked, then combined in float64.

    **Arguments:**

    - `terms`: `(reward, weight)` pairs.

    **Raises:**

    - `ValueError`: if `terms` is empty or a weight is not finite.
    """

    def __init__(self, terms: Sequence[tuple[FlowReward, float]]):
        if not terms:
            raise ValueError("`terms` must name at least one (reward, weight) pair.")
        for reward, weight in terms:
            if not np.isfinite(weight):
                raise ValueError(f"`terms` weight for {reward_name(reward)!r} is {weight}.")
        self.terms = tuple((reward, float(weight)) for reward, weight in terms)
        self.name = " + ".join(f"{w:g}*{reward_name(r)}" for r, w in self.terms)

    def components(
        self, samples: npt.NDArray[Any], rows: Any
    ) -> dict[str, npt.NDArray[np.float64]]:
        """Each term's (unweighted, checked) float64 scores, by reward name.

        **Arguments:**

        - `samples`: `[N, *sample]` numpy samples in [-1, 1].
        - `rows`: the repeated source rows.

        **Returns:**

        `{name: [N] float64 scores}`, one entry per term (metrics log each one).

        **Raises:**

        - `RewardError`: naming the rows, if samples hold NaN or inf; naming the term's
            reward, if it fails.
        """
        check_finite_samples(self.name, samples)
        return {reward_name(r): score(r, samples, rows) for r, _ in self.terms}

    def __call__(self, samples: npt.NDArray[Any], rows: Any) -> npt.NDArray[np.float64]:
        """The weighted sum of the terms' scores.

        **Arguments:**

        - `samples`: `[N, *sample]` numpy samples in [-1, 1].
        - `rows`: the repeated source rows.

        **Returns:**

        `[N]` float64 `sum(weight * score)`.

        **Raises:**

        - `RewardError`: naming the rows, if samples hold NaN or inf; naming the term's
            reward, if one fails.
        """
        check_finite_samples(self.name, samples)
        total = np.zeros(int(np.shape(samples)[0]), dtype=np.float64)
        for reward, weight in self.terms:
            total += weight * score(reward, samples, rows)
        return total
