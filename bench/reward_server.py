"""What scoring through a local reward server costs: `python -m bench.reward_server`.

Prints one JSON object on stdout. A 64-image 16x16x3 float32 batch is scored by a cheap
float64 reward (`brightness`, below) in process, and by the same reward served by
`python -m flowgrpo_eqx.rewards.server` on 127.0.0.1 through `flowgrpo_eqx.HttpReward`.
Each round times every variant once in a rotated order; the figures are per-round ratios
to the in-process call, summarised by their median and quartiles:

- `http_over_in_process`: one `HttpReward` call (encode, POST, decode, score, reply);
- `http_uint8_over_in_process`: the same with `images_as_uint8=True`;
- `wire_over_in_process`: only the encoding and decoding both ends do, no HTTP.

With a reward this cheap the ratio is the request's fixed cost in units of almost nothing;
`detail.median_ms_absolute_informational` gives the times themselves.

`load` (skip with `--load-requests 0`) is the load test of the hardened server, with its
default limits: `--clients` threads each send `--load-requests` requests of the same batch
(`HttpReward`, no retries) while a further thread asks `/health` and `--idle-connections`
connections sit open sending nothing. It reports requests per second (all replies, and
those scored), the latency p50/p99
of `/score` and of `/health`, the replies by status (503 when more than
`max_concurrent_requests` are held), and the server's memory: its peak RSS (`VmHWM`) before
and after one large request of `--large-mib` MiB of float32 samples, the growth per body
byte being what one request costs.
"""

import argparse
import json
import os
import pathlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import flowgrpo_eqx as fg
from flowgrpo_eqx.rewards._wire import decode_request, encode_request, load_npy, npy_bytes

from ._timing import log, median, summary


ROOT = pathlib.Path(__file__).resolve().parents[1]


def brightness(samples: Any, rows: Any) -> Any:
    """Mean brightness in float64 plus a row term: a reward that costs next to nothing."""
    # Averaged in float64 without a float64 copy, so the memory figure is the server's own.
    flat = np.asarray(samples).reshape(samples.shape[0], -1)
    return flat.mean(axis=1, dtype=np.float64) + 1e-3 * rows["index"]


def start_server() -> tuple[subprocess.Popen[str], str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    process = subprocess.Popen(
        [sys.executable, "-m", "flowgrpo_eqx.rewards.server", "bench.reward_server:brightness"]
        + ["--port", "0"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line.startswith("serving "):
        process.kill()
        raise RuntimeError(f"the reward server did not start: {line!r}")
    return process, line.split(" on ")[-1].strip()


def peak_rss_mib(pid: int) -> float:
    """The process's peak resident memory (`VmHWM`), MiB (Linux)."""
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc: the memory figure needs Linux")


def percentiles_ms(seconds: list[float]) -> dict[str, float]:
    values = np.asarray(seconds) * 1e3
    return {
        "p50": round(float(np.percentile(values, 50)), 2),
        "p99": round(float(np.percentile(values, 99)), 2),
    }


def load(url: str, pid: int, samples: Any, rows: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The load test: bounded requests from `args.clients` threads, /health alongside."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    idle = [socket.create_connection((host, int(port))) for _ in range(args.idle_connections)]
    latencies: list[float] = []
    statuses: dict[str, int] = {}
    health: list[float] = []
    done = threading.Event()
    lock = threading.Lock()

    def client() -> None:
        remote = fg.HttpReward(url, timeout=30.0, retries=0)
        for _ in range(args.load_requests):
            start = time.perf_counter()
            try:
                remote(samples, rows)
                outcome = "200"
            except fg.RewardError as error:
                outcome = "503" if "HTTP 503" in str(error) else "failed"
            with lock:
                latencies.append(time.perf_counter() - start)
                statuses[outcome] = statuses.get(outcome, 0) + 1

    def ask_health() -> None:
        import urllib.request

        while not done.is_set():
            start = time.perf_counter()
            with urllib.request.urlopen(url + "/health", timeout=10) as reply:
                reply.read()
            health.append(time.perf_counter() - start)
            time.sleep(0.01)

    watcher = threading.Thread(target=ask_health)
    clients = [threading.Thread(target=client) for _ in range(args.clients)]
    watcher.start()
    started = time.perf_counter()
    for thread in clients:
        thread.start()
    for thread in clients:
        thread.join()
    seconds = time.perf_counter() - started
    done.set()
    watcher.join()
    for sock in idle:
        sock.close()
    before = peak_rss_mib(pid)
    count = max(1, (args.large_mib << 20) // (16 * 16 * 3 * 4))
    large = np.zeros((count, 16, 16, 3), np.float32)
    fg.HttpReward(url, timeout=120.0)(large, {"index": np.arange(count)})
    after = peak_rss_mib(pid)
    body_mib = large.nbytes / 2**20
    return {
        "clients": args.clients,
        "requests": len(latencies),
        "idle_connections_held": args.idle_connections,
        "requests_per_second": round(len(latencies) / seconds, 1),
        "scored_per_second": round(statuses.get("200", 0) / seconds, 1),
        "score_latency_ms": percentiles_ms(latencies),
        "health_latency_ms": percentiles_ms(health),
        "health_requests": len(health),
        "replies": statuses,
        "memory": {
            "large_body_mib": round(body_mib, 1),
            "server_peak_rss_mib_before": round(before, 1),
            "server_peak_rss_mib_after": round(after, 1),
            "peak_growth_per_body_byte": round((after - before) / body_mib, 2),
        },
    }


def interleave(
    variants: dict[str, Callable[[], Any]], rounds: int, warmup: int
) -> dict[str, list[float]]:
    """Wall seconds of every variant once per round, in a rotated order (numpy only)."""
    names = list(variants)
    for name in names:
        for _ in range(warmup):
            variants[name]()
    wall: dict[str, list[float]] = {name: [] for name in names}
    for index in range(rounds):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            variants[name]()
            wall[name].append(time.perf_counter() - start)
    return wall


def ratios(wall: dict[str, list[float]], numerator: str) -> Any:
    return np.asarray(wall[numerator]) / np.asarray(wall["in_process"])


def wire_round_trip(samples: Any, rows: Any) -> Any:
    decoded = decode_request(encode_request(samples, rows))
    return load_npy(npy_bytes(brightness(*decoded)), "reply")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.reward_server", description=__doc__)
    parser.add_argument("--rounds", type=int, default=51)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--load-requests", type=int, default=50, help="per client; 0: no load")
    parser.add_argument("--idle-connections", type=int, default=200)
    parser.add_argument("--large-mib", type=int, default=128)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    levels = rng.integers(0, 256, size=(64, 16, 16, 3))
    samples = (levels / 127.5 - 1.0).astype(np.float32)
    rows = {"index": np.arange(64)}
    started = time.perf_counter()
    process, url = start_server()
    try:
        remote = fg.HttpReward(url, timeout=30.0)
        remote_uint8 = fg.HttpReward(url, timeout=30.0, images_as_uint8=True)
        want = brightness(samples, rows)
        for reward in (remote, remote_uint8):
            if not np.array_equal(reward(samples, rows), want):
                raise AssertionError(f"{reward.name} scores differ from the in-process ones")
        log(f"serving on {url}; {args.rounds} rounds")
        wall = interleave(
            {
                "in_process": lambda: brightness(samples, rows),
                "http": lambda: remote(samples, rows),
                "http_uint8": lambda: remote_uint8(samples, rows),
                "wire": lambda: wire_round_trip(samples, rows),
            },
            rounds=args.rounds,
            warmup=3,
        )
        if args.load_requests > 0:
            log(f"load: {args.clients} clients x {args.load_requests} requests")
            loaded = load(url, process.pid, samples, rows, args)
    finally:
        process.terminate()
        process.wait(30)
    output = {
        "batch": {"images": 64, "shape": [16, 16, 3], "dtype": "float32"},
        "http_over_in_process": summary(ratios(wall, "http"), 1),
        "http_uint8_over_in_process": summary(ratios(wall, "http_uint8"), 1),
        "wire_over_in_process": summary(ratios(wall, "wire"), 1),
        "detail": {
            "median_ms_absolute_informational": {
                name: median(np.asarray(values) * 1e3, 4) for name, values in wall.items()
            },
        },
        "seconds": round(time.perf_counter() - started, 1),
    }
    if args.load_requests > 0:
        output["load"] = loaded
    print(json.dumps(output, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
