"""Rank-0 scoring: a reward runs once, on process 0, and its float64 scores reach every
process as bytes."""

import struct
from typing import Any

import jax
import numpy as np
import numpy.typing as npt
from jax.experimental import multihost_utils
from jaxtyping import PyTree

from .._misc import leading_rows
from ._reward import FlowReward, RewardError, reward_name, score


MESSAGE_BYTES = 4096
"""The most bytes of process 0's error message that reach the other processes."""


def score_on_root(
    reward: FlowReward, samples: npt.NDArray[Any] | None, rows: PyTree[Any]
) -> npt.NDArray[np.float64]:
    """Run `reward` once, on process 0, and hand its float64 scores to every process.

    The scores travel as raw float64 bytes (with a status byte and, on failure, the error
    message), so their precision survives even when JAX's x64 mode is off. A reward failure
    on process 0 becomes the same `RewardError` on every process.

    **Arguments:**

    - `reward`: the reward.
    - `samples`: `[N, *sample]` host samples (used on process 0 only).
    - `rows`: the repeated source rows (host).

    **Returns:**

    `[N]` float64 scores on every process.

    **Raises:**

    - `RewardError`: on every process, when the reward fails on process 0.
    """
    if jax.process_count() == 1:
        assert samples is not None
        return score(reward, samples, rows)
    count = leading_rows(rows)
    payload = np.zeros(1 + 8 * count + MESSAGE_BYTES, np.uint8)
    if jax.process_index() == 0:
        assert samples is not None
        try:
            scores = score(reward, samples, rows)
            payload[1 : 1 + 8 * count] = np.frombuffer(scores.astype("<f8").tobytes(), np.uint8)
        except RewardError as error:
            encoded = str(error).encode()[: MESSAGE_BYTES - 4]
            payload[0] = 1
            header = struct.pack("<I", len(encoded))
            payload[1 + 8 * count : 1 + 8 * count + 4] = np.frombuffer(header, np.uint8)
            payload[1 + 8 * count + 4 : 1 + 8 * count + 4 + len(encoded)] = np.frombuffer(
                encoded, np.uint8
            )
    received = np.asarray(multihost_utils.broadcast_one_to_all(payload))
    if received[0] != 0:
        start = 1 + 8 * count
        (length,) = struct.unpack("<I", received[start : start + 4].tobytes())
        message = received[start + 4 : start + 4 + length].tobytes().decode(errors="replace")
        raise RewardError(f"(from process 0, reward {reward_name(reward)!r}) {message}")
    return np.frombuffer(received[1 : 1 + 8 * count].tobytes(), "<f8").copy()
