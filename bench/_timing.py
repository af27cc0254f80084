"""Side-by-side timing and compile counting.

Every figure is a ratio of two things timed in the same rounds: each round calls every
variant once (in a rotated order, so no variant always runs first or last), waits for its
outputs with `block_until_ready`, and records wall and process-CPU time. A ratio is taken
per round and summarised by its median (with the quartiles as the spread), so load from
other processes on a shared machine cancels as far as it can.
"""

import dataclasses
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np


COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def log(message: str) -> None:
    """Progress goes to stderr; stdout carries only the final JSON."""
    print(f"[bench] {message}", file=sys.stderr, flush=True)


@dataclasses.dataclass
class Timings:
    """Per-round seconds of each variant: `wall[name][round]`, `cpu[name][round]`."""

    wall: dict[str, list[float]]
    cpu: dict[str, list[float]]

    def per_round(self, numerator: str, denominator: str, clock: str = "wall") -> np.ndarray:
        """`numerator / denominator` seconds, one ratio per round."""
        table = self.wall if clock == "wall" else self.cpu
        ratios: np.ndarray = np.asarray(table[numerator]) / np.asarray(table[denominator])
        return ratios


def interleave(variants: Mapping[str, Callable[[], Any]], rounds: int, warmup: int = 1) -> Timings:
    """Time every variant once per round, in a rotated order; `warmup` untimed calls first."""
    names = list(variants)
    for name in names:
        for _ in range(warmup):
            jax.block_until_ready(variants[name]())  # type: ignore[no-untyped-call]
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for index in range(rounds):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            wall_start = time.perf_counter()
            cpu_start = time.process_time()
            jax.block_until_ready(variants[name]())  # type: ignore[no-untyped-call]
            cpu[name].append(time.process_time() - cpu_start)
            wall[name].append(time.perf_counter() - wall_start)
    return Timings(wall=wall, cpu=cpu)


def summary(values: Any, digits: int = 4) -> dict[str, Any]:
    """Median and quartiles of per-round values."""
    array = np.asarray(values, dtype=np.float64)
    p25, median, p75 = np.percentile(array, [25, 50, 75])
    return {
        "median": round(float(median), digits),
        "p25": round(float(p25), digits),
        "p75": round(float(p75), digits),
        "rounds": int(array.size),
    }


def median(values: Any, digits: int = 4) -> float:
    return round(float(np.median(np.asarray(values, dtype=np.float64))), digits)


class CompileCounter:
    """Counts XLA backend compilations (JAX's `backend_compile_duration` event) while active."""

    def __init__(self) -> None:
        self.count = 0
        self.active = False
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event: str, duration_secs: float, **kwargs: str | int) -> None:
        del duration_secs, kwargs
        if self.active and event == COMPILE_EVENT:
            self.count += 1

    def start(self) -> None:
        self.count = 0
        self.active = True

    def stop(self) -> int:
        self.active = False
        return self.count


_COUNTER: CompileCounter | None = None


def compile_counter() -> CompileCounter:
    """The process's one compile counter (listeners cannot be removed cheaply; share one)."""
    global _COUNTER
    if _COUNTER is None:
        _COUNTER = CompileCounter()
    return _COUNTER
