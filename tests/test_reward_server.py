"""`HttpReward` against real reward server processes on 127.0.0.1.

Every server is its own process (`python -m flowgrpo_eqx.rewards.server ...`, or the
scripted misbehaving server in `tests/reward_fixtures.py`) bound to a free port chosen by
the server itself, and is terminated at the end of the module.
"""

import argparse
import io
import json
import os
import pathlib
import pickle
import re
import select
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

import flowgrpo_eqx as fg
from flowgrpo_eqx.rewards import (
    _connections as _reward_connections,
    _http as _http_reward,
    _server_requests as _reward_requests,
    _wire as _reward_wire,
    limits as reward_limits,
    server as reward_server,
)
from flowgrpo_eqx.rewards._reward import score, to_uint8_images
from flowgrpo_eqx.rewards._wire import MAGIC, decode_request, encode_request
from flowgrpo_eqx.rewards.server import load_reward

from . import reward_fixtures
from .errors import raises_named


ROOT = pathlib.Path(__file__).resolve().parents[1]
START_SECONDS = 120.0
FAST = {"timeout": 0.5, "retries": 1, "backoff": 0.01}


def start(arguments, log_path, token=None):
    """Start `python -m ...arguments` on a free port; returns (process, base URL)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.pop("FLOWGRPO_REWARD_TOKEN", None)
    if token is not None:
        env["FLOWGRPO_REWARD_TOKEN"] = token
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", *arguments],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
    first_line = []
    reader = threading.Thread(target=lambda: first_line.append(process.stdout.readline()))
    reader.start()
    reader.join(START_SECONDS)
    line = first_line[0] if first_line else ""
    if not line.startswith("serving "):
        process.kill()
        raise RuntimeError(f"{arguments} did not start: {line!r}\n{log_path.read_text()}")
    url = line.split(" on ")[-1].strip()
    assert url.startswith("http://127.0.0.1:")
    assert get_json(url + "/health")["status"] == "ok"
    return process, url


@pytest.fixture(scope="module")
def stopping():
    """Servers told to stop, waited for together at the end (each exit takes seconds)."""
    processes = []
    yield processes
    for process in processes:
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def get_json(url):
    with urllib.request.urlopen(url, timeout=10) as reply:
        return json.loads(reply.read())


def post(url, body, token=None):
    """POST raw bytes; returns (status, body bytes) for success and HTTP errors alike."""
    headers = {"Content-Type": _reward_wire.CONTENT_TYPE}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def server_fixture(arguments, token=None):
    @pytest.fixture(scope="module")
    def fixture(tmp_path_factory, stopping):
        log = tmp_path_factory.mktemp("server") / "stderr.txt"
        process, url = start(arguments, log, token)
        yield url
        process.terminate()
        stopping.append(process)

    return fixture


def reward_args(name, *extra):
    return ["flowgrpo_eqx.rewards.server", f"tests.reward_fixtures:{name}", "--port", "0", *extra]


brightness_url = server_fixture(reward_args("brightness"))
token_url = server_fixture(reward_args("sample_mean", "--token", "right-token"))
env_token_url = server_fixture(reward_args("sample_mean"), token="env-token")
slow_url = server_fixture(reward_args("slow"))
nan_url = server_fixture(reward_args("nan_scores"))
short_url = server_fixture(reward_args("one_score_short"))
jpeg_url = server_fixture(
    ["flowgrpo_eqx.rewards.server", "flowgrpo_eqx.JpegIncompressibility", "--port", "0"]
)
scripted_url = server_fixture(["tests.reward_fixtures"])
# Short limits, so that the fault tests stay fast.
READ_TIMEOUT = 1.0
CLOSE_MARGIN = 3.0  # generous: the machine running the tests may be busy
HARDENED_LIMIT = 1 << 16
hardened_url = server_fixture(
    reward_args(
        "brightness",
        *("--read-timeout", str(READ_TIMEOUT), "--max-request-bytes", str(HARDENED_LIMIT)),
        *("--max-concurrent-requests", "1", "--max-connections", "32"),
    )
)
# Small totals and per-request limits (the read timeout leaves a stalled body time to hold
# its bytes through a test).
TOTAL_BYTES = 300_000
DECODED_LIMIT = 200_000
limits_url = server_fixture(
    reward_args(
        "brightness",
        *("--read-timeout", "20", "--max-total-bytes", str(TOTAL_BYTES)),
        *("--max-decoded-bytes", str(DECODED_LIMIT), "--max-request-rows", "100"),
    )
)
# A reward that sleeps when asked, two places and three rows in all.
slow_limits_url = server_fixture(
    reward_args("slow", "--max-concurrent-requests", "2", "--max-total-rows", "3")
)
# Small per-peer shares of small totals, for one hostile peer (127.0.0.2) beside a client.
PEER_BYTES = 200_000
peers_url = server_fixture(
    reward_args(
        "slow",
        *("--read-timeout", "20", "--max-connections", "64", "--max-connections-per-peer", "8"),
        *("--max-total-bytes", str(2 * PEER_BYTES), "--max-bytes-per-peer", str(PEER_BYTES)),
        *("--max-request-bytes", str(PEER_BYTES), "--max-total-rows", "8"),
        *("--max-rows-per-peer", "4", "--max-requests-per-peer", "2"),
    )
)
# Chunks of a few rows.
chunks_url = server_fixture(reward_args("brightness", "--score-chunk-bytes", "2000"))


def batch(count=6, shape=(8, 8, 3), seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    samples = rng.uniform(-1, 1, size=(count, *shape)).astype(dtype)
    rows = {
        "offset": rng.normal(size=count),
        "meta": {"index": np.arange(count, dtype=np.int32)},
        "prompt": np.array([f"prompt {i}" * (i + 1) for i in range(count)]),
    }
    return samples, rows


def same_bits(got, want):
    return (
        got.dtype == np.float64
        and np.array_equal(got, want)
        and got.tobytes() == np.asarray(want, dtype=np.float64).tobytes()
    )


@pytest.fixture
def backoffs(monkeypatch):
    """The pauses HttpReward took, recorded instead of slept."""
    pauses = []
    monkeypatch.setattr(_http_reward, "_sleep", pauses.append)
    return pauses


@pytest.mark.several_processes("serves a reward from a process of its own")
@pytest.mark.sockets("serves or calls a reward over HTTP")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_scores_are_bit_identical_to_in_process(brightness_url, dtype):
    samples, rows = batch(dtype=dtype)
    remote = fg.HttpReward(brightness_url)
    got = remote(samples, rows)
    want = reward_fixtures.brightness(samples, rows)
    assert same_bits(got, want)
    assert same_bits(score(remote, samples, rows), want)
    assert remote.name == f"http:{brightness_url}"


@pytest.mark.sockets("serves or calls a reward over HTTP")
def test_uint8_images_on_the_grid_score_bit_identically(brightness_url):
    grid, rows = batch()
    levels = to_uint8_images(grid)
    samples = (levels / 127.5 - 1.0).astype(np.float32)
    got = fg.HttpReward(brightness_url, images_as_uint8=True)(samples, rows)
    assert same_bits(got, reward_fixtures.brightness(samples, rows))
    float_bytes = len(encode_request(samples, rows))
    assert (
        len(encode_request(samples, rows, images_as_uint8=True)) == float_bytes - 3 * samples.size
    )


@pytest.mark.several_processes("serves a reward from a process of its own")
@pytest.mark.sockets("serves or calls a reward over HTTP")
def test_64_image_batch_round_trip_through_the_module_entry(jpeg_url):
    samples = np.random.default_rng(3).uniform(-1, 1, (64, 16, 16, 3)).astype(np.float32)
    rows = {"id": np.arange(64)}
    assert get_json(jpeg_url + "/health")["reward"] == "jpeg_incompressibility"
    got = fg.HttpReward(jpeg_url)(samples, rows)
    assert got.shape == (64,)
    assert same_bits(got, fg.JpegIncompressibility()(samples, rows))


@pytest.mark.several_processes("serves a reward from a process of its own")
@pytest.mark.sockets("serves or calls a reward over HTTP")
def test_slow_reward_times_out_and_abandoned_attempts_are_dropped(slow_url, backoffs):
    samples, _ = batch(count=2)
    with pytest.raises(fg.RewardError, match="timed out") as raised:
        fg.HttpReward(slow_url, **FAST)(samples, {"sleep": np.ones(2, bool)})
    assert slow_url in str(raised.value) and "after 2 attempts" in str(raised.value)
    assert backoffs == [FAST["backoff"]]
    # The reward is still sleeping on its thread; health is answered by the event loop.
    assert get_json(slow_url + "/health") == {"status": "ok", "reward": "slow"}
    # Queued behind the sleeping call; the second, abandoned attempt never reached the
    # reward, so this is its second call.
    calls = fg.HttpReward(slow_url, timeout=60.0)(samples, {"sleep": np.zeros(2, bool)})
    assert calls.tolist() == [2.0, 2.0]


@pytest.mark.several_processes("serves a reward from a process of its own")
@pytest.mark.sockets("serves or calls a reward over HTTP")
def test_timeouts_are_retried_with_exponential_backoff(scripted_url, backoffs):
    samples, rows = batch(count=2)
    remote = fg.HttpReward(scripted_url + "/sleep", timeout=0.5, retries=2, backoff=0.25)
    with pytest.raises(fg.RewardError, match="timed out after 0.5 s") as raised:
        remote(samples, rows)
    assert f"{scripted_url}/sleep failed after 3 attempts" in str(raised.value)
    assert get_json(scripted_url + "/count")["posts"]["sleep"] == 3
    assert backoffs == [0.25, 0.5]


@pytest.mark.sockets("serves or calls a reward over HTTP")
def test_a_trickling_reply_cannot_outlast_the_timeout(scripted_url, backoffs):
    # The reply's 100 bytes arrive one by one over SLOW_SECONDS; no single read waits
    # longer than the timeout, so only the attempt's deadline stops it.
    samples, rows = batch(count=2)
    remote = fg.HttpReward(scripted_url + "/trickle", timeout=0.5, retries=0)
    with pytest.raises(fg.RewardError, match="failed after 1 attempt: timed out after 0.5 s"):
        remote(samples, rows)
    assert get_json(scripted_url + "/count")["posts"]["trickle"] == 1


@pytest.mark.several_processes("serves a reward from a process of its own")
@pytest.mark.sockets("serves or calls a reward over HTTP")
def test_token_checked(token_url, backoffs):
    samples, rows = batch()
    with pytest.raises(fg.RewardError, match="401") as raised:
        fg.HttpReward(token_url, token="wrong-token", **FAST)(samples, rows)
    assert token_url in str(raised.value) and "not retried" in str(raised.value)
    with pytest.raises(fg.RewardError, match="401 Unauthorized: unauthorized"):
        fg.HttpReward(token_url, **FAST)(samples, rows)
    assert backoffs == []
    got = fg.HttpReward(token_url, token="right-token")(samples, rows)
    assert same_bits(got, reward_fixtures.sample_mean(samples, rows))
    assert "right-token" not in repr(fg.HttpReward(token_url, token="right-token"))


@pytest.mark.several_processes("serves a reward from a process of its own")
@pytest.mark.sockets("serves or calls a reward over HTTP")
def test_token_read_from_the_environment_on_both_sides(env_token_url, monkeypatch):
    samples, rows = batch()
    monkeypatch.delenv("FLOWGRPO_REWARD_TOKEN", raising=False)
    with pytest.raises(fg.RewardError, match="401"):
        fg.HttpReward(env_token_url, **FAST)(samples, rows)
    monkeypatch.setenv("FLOWGRPO_REWARD_TOKEN", "env-token")
    got = fg.HttpReward(env_token_url)(samples, rows)
    assert same_bits(got, reward_fixtures.sample_mean(samples, rows))


@pytest.mark.sockets("serves or calls a reward over HTTP")
def test_server_without_token_accepts_any_token(brightness_url):
    samples, rows = batch()
    got = fg.HttpReward(brightness_url, token="anything")(samples, rows)
    assert same_bits(got, reward_fixtures.brightness(samples, rows))


@pytest.mark.several_processes("serves a reward from a process of its own")
@pytest.mark.sockets("serves or calls a reward over HTTP")
@pytest.mark.parametrize(
    ("fixture", "message"),
    [("nan_url", "non-finite scores"), ("short_url", r"returned shape \(5,\)")],
)
def test_failing_reward_gives_500_naming_the_reward(fixture, message, request, backoffs):
    url = request.getfixturevalue(fixture)
    samples, rows = batch()
    with pytest.raises(fg.RewardError, match=message) as raised:
        fg.HttpReward(url, **FAST)(samples, rows)
    assert url in str(raised.value) and "HTTP 500" in str(raised.value)
    assert "reward_failed" in str(raised.value)
    assert backoffs == [FAST["backoff"]]
    assert get_json(url + "/health")["status"] == "ok"


@pytest.mark.sockets("serves or calls a reward over HTTP")
@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("nan", "non-finite scores at rows"),
        ("short", r"expected float64 \(6,\)"),
        ("float32", r"holds float32 \(6,\)"),
        ("garbage", "malformed reply"),
    ],
)
def test_bad_replies_are_rejected_by_the_client(scripted_url, mode, message, backoffs):
    samples, rows = batch()
    url = f"{scripted_url}/{mode}"
    with pytest.raises(fg.RewardError, match=message) as raised:
        fg.HttpReward(url, **FAST)(samples, rows)
    assert f"{url} failed after 2 attempts" in str(raised.value)
    assert get_json(scripted_url + "/count")["posts"][mode] == 2


class _TouchOnUnpickle:
    """Unpickling this creates a file: proof that a server unpickled what it was sent."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.path),))


def container(named_blobs, samples="float", rows="dict"):
    header = json.dumps(
        {"samples": samples, "rows": rows, "arrays": [[n, len(b)] for n, b in named_blobs]}
    ).encode()
    return MAGIC + struct.pack("<I", len(header)) + header + b"".join(b for _, b in named_blobs)


def npy(array, allow_pickle=False):
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=allow_pickle)
    return buffer.getvalue()


@pytest.mark.sockets("serves or calls a reward over HTTP")
def test_pickles_are_refused_and_the_server_keeps_serving(brightness_url, tmp_path):
    sentinel = tmp_path / "unpickled"
    payload = _TouchOnUnpickle(str(sentinel))
    objects = np.empty(6, dtype=object)
    objects[:] = [payload] * 6
    samples, rows = batch()

    status, body = post(brightness_url + "/score", pickle.dumps(payload))
    assert status == 400 and json.loads(body)["error"] == "malformed_body"
    status, body = post(brightness_url + "/score", npy(objects, allow_pickle=True))
    assert status == 400 and json.loads(body)["error"] == "malformed_body"
    smuggled = container(
        [("samples", npy(samples)), ("rows/offset", npy(objects, allow_pickle=True))]
    )
    status, body = post(brightness_url + "/score", smuggled)
    assert status == 400 and json.loads(body)["error"] == "pickled_array"
    assert "rows/offset" in json.loads(body)["message"]
    assert not sentinel.exists()

    assert get_json(brightness_url + "/health")["status"] == "ok"
    got = fg.HttpReward(brightness_url)(samples, rows)
    assert same_bits(got, reward_fixtures.brightness(samples, rows))


@pytest.mark.sockets("serves or calls a reward over HTTP")
@pytest.mark.parametrize(
    "body",
    [
        b"",
        MAGIC,
        MAGIC + struct.pack("<I", 10**6),
        container([("samples", npy(np.zeros((2, 3))))], rows="none")[:-3],
        container([("samples", npy(np.zeros((2, 3)))), ("rows/a", npy(np.zeros(3)))]),
        container([("rows/a", npy(np.zeros(2))), ("samples", npy(np.zeros((2, 3))))]),
        container([("samples", npy(np.zeros((2, 3))))], samples="uint8", rows="none"),
        container([("samples", npy(np.zeros((2, 3)))), ("rows/x", b"\x93NUMPY junk")]),
    ],
    ids=["empty", "magic", "header", "truncated", "rows-axis", "order", "uint8", "npy"],
)
def test_malformed_bodies_give_400(brightness_url, body):
    status, reply = post(brightness_url + "/score", body)
    assert status == 400 and json.loads(reply)["error"] == "malformed_body"
    assert get_json(brightness_url + "/health")["status"] == "ok"


@pytest.mark.sockets("serves or calls a reward over HTTP")
def test_server_down_raises_after_every_attempt(backoffs):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    samples, rows = batch()
    with pytest.raises(fg.RewardError, match="connection refused") as raised:
        fg.HttpReward(url, timeout=0.5, retries=2, backoff=0.01)(samples, rows)
    assert f"{url} failed after 3 attempts" in str(raised.value)
    assert backoffs == [0.01, 0.02]


def test_wire_format_round_trips_rows_of_every_kind():
    samples, rows = batch()
    for sent in (rows, None, rows["offset"], {}):
        got_samples, got_rows = decode_request(encode_request(samples, sent))
        assert got_samples.dtype == samples.dtype and np.array_equal(got_samples, samples)
        if sent is None:
            assert got_rows is None
        elif isinstance(sent, dict):
            assert got_rows.keys() == sent.keys()
            if sent:
                assert np.array_equal(got_rows["meta"]["index"], sent["meta"]["index"])
                assert np.array_equal(got_rows["prompt"], sent["prompt"])
                assert same_bits(got_rows["offset"], sent["offset"])
        else:
            assert same_bits(got_rows, sent)
    grey = samples[..., 0]
    got_samples, _ = decode_request(encode_request(grey, None, images_as_uint8=True))
    assert got_samples.shape == grey.shape and got_samples.dtype == np.float32


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ({"a/b": np.zeros(6)}, "without '/'"),
        ({"a": [1, 2]}, "is a list"),
        ({"a": np.array([object()] * 6)}, "cannot be sent without pickling"),
    ],
)
def test_rows_that_cannot_be_sent_raise_before_any_request(rows, message):
    samples, _ = batch()
    remote = fg.HttpReward("http://127.0.0.1:9")
    with pytest.raises(fg.RewardError, match=message):
        remote(samples, rows)


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"url": "ftp://host"}, "url"),
        ({"url": "http://"}, "url"),
        ({"url": "http://h:1/?q=1"}, "url"),
        ({"timeout": 0.0}, "timeout"),
        ({"retries": -1}, "retries"),
        ({"backoff": -0.1}, "backoff"),
    ],
)
def test_arguments_checked(kwargs, argument):
    arguments = {"url": "http://127.0.0.1:8000", **kwargs}
    with pytest.raises(ValueError, match=f"`{argument}`"):
        fg.HttpReward(arguments.pop("url"), **arguments)


class _RewardClass:
    name = "from_class"

    def __call__(self, samples, rows):
        return np.ones(len(samples))


def _reward_factory(scale=2.0):
    return lambda samples, rows: np.full(len(samples), scale)


def test_load_reward_rule():
    samples = np.zeros((3, 2))
    assert load_reward("flowgrpo_eqx:JpegCompressibility").name == "jpeg_compressibility"
    assert load_reward("flowgrpo_eqx.JpegIncompressibility").name == "jpeg_incompressibility"
    assert isinstance(load_reward("tests.test_reward_server:_RewardClass"), _RewardClass)
    assert load_reward("tests.test_reward_server:_reward_factory")(samples, None)[0] == 2.0
    assert load_reward("tests.reward_fixtures:sample_mean") is reward_fixtures.sample_mean
    instance = _RewardClass()
    assert load_reward("mine", {"mine": lambda: instance}) is instance
    for bad in ("no_module_here:reward", "tests.reward_fixtures:missing", "nothing"):
        with pytest.raises(ValueError, match="Reward"):
            load_reward(bad)
    with pytest.raises(ValueError, match="not callable"):
        load_reward("tests.reward_fixtures:SLOW_SECONDS")


# --------------------------------------------------------------------------------------------
# Faults: slow clients, oversized and lying bodies, too many requests or connections. Every
# loop below is bounded and every connection goes to 127.0.0.1.


def connect(url):
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def head(method="POST", path="/score", **headers):
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    lines += [f"{name.replace('_', '-')}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def until_closed(sock, limit=10.0):
    """Everything `sock` receives until the server closes it; fails after `limit` seconds."""
    sock.settimeout(limit)
    received = b""
    try:
        while chunk := sock.recv(1 << 16):
            received += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError(f"still open after {limit} s; received {received[:200]!r}") from None
    return received


def one_reply(sock, limit=10.0):
    """One whole reply (head and Content-Length body), whether or not the server closes."""
    sock.settimeout(limit)
    received = b""
    while b"\r\n\r\n" not in received or len(received.partition(b"\r\n\r\n")[2]) < int(
        received.lower().partition(b"content-length: ")[2].split(b"\r\n")[0] or 0
    ):
        chunk = sock.recv(1 << 16)
        assert chunk, f"closed before a whole reply: {received!r}"
        received += chunk
    return received


def status_and_error(reply):
    status = int(reply.split(b" ", 2)[1])
    body = reply.partition(b"\r\n\r\n")[2]
    return status, (json.loads(body) if body.startswith(b"{") else None)


@pytest.mark.several_processes("serves a reward from a process of its own")
@pytest.mark.sockets("serves or calls a reward over HTTP")
def test_slow_clients_are_closed_within_the_timeout_while_health_answers(hardened_url):
    silent = [connect(hardened_url) for _ in range(8)]  # connect and send nothing
    partial = [connect(hardened_url) for _ in range(4)]  # half a head, then nothing
    trickling = [connect(hardened_url) for _ in range(4)]  # a head, one byte at a time
    kept_alive = connect(hardened_url)  # one good request, then idle on keep-alive
    for sock in partial + trickling:
        sock.sendall(b"POST /score HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
    kept_alive.sendall(head("GET", "/health"))
    start = time.monotonic()
    open_sockets = {*silent, *partial, *trickling, kept_alive}
    closed_after = {}
    received = dict.fromkeys(open_sockets, b"")
    health_checks = 0
    while open_sockets and time.monotonic() - start < READ_TIMEOUT + 2 * CLOSE_MARGIN:
        for sock in open_sockets & set(trickling):
            try:
                sock.send(b"a")
            except OSError:
                pass
        readable, _, _ = select.select(list(open_sockets), [], [], 0.1)
        for sock in readable:
            try:
                chunk = sock.recv(1 << 16)
            except ConnectionResetError:
                chunk = b""
            received[sock] += chunk
            if not chunk:
                closed_after[sock] = time.monotonic() - start
                open_sockets.discard(sock)
        # /health keeps answering on a new connection the whole time.
        assert get_json(hardened_url + "/health")["status"] == "ok"
        health_checks += 1
    assert not open_sockets, f"{len(open_sockets)} slow connections were never closed"
    assert max(closed_after.values()) <= READ_TIMEOUT + CLOSE_MARGIN
    assert health_checks >= 5
    assert received[kept_alive].startswith(b"HTTP/1.1 200")
    assert all(received[sock] == b"" for sock in silent + partial + trickling)
    for sock in silent + partial + trickling + [kept_alive]:
        sock.close()


@pytest.mark.sockets("serves or calls a reward over HTTP")
def test_a_trickling_body_gets_408_within_the_timeout(hardened_url):
    with connect(hardened_url) as sock:
        sock.sendall(head(Content_Length=1000, Content_Type=_reward_wire.CONTENT_TYPE))
        start = time.monotonic()
        sock.sendall(MAGIC)
        sent = len(MAGIC)
        reply = b""
        while time.monotonic() - start < READ_TIMEOUT + CLOSE_MARGIN and sent < 1000:
            if select.select([sock], [], [], 0.1)[0]:
                reply = until_closed(sock)
                break
            sock.sendall(b"x")
            sent += 1
            assert get_json(hardened_url + "/health")["status"] == "ok"
        closed_after = time.monotonic() - start
    status, error = status_and_error(reply)
    assert status == 408 and error["error"] == "read_timeout"
    assert closed_after <= READ_TIMEOUT + CLOSE_MARGIN


@pytest.mark.sockets("serves or calls a reward over HTTP")
@pytest.mark.parametrize("declared", [2_000_000_000, HARDENED_LIMIT + 1])
def test_a_body_over_the_limit_is_refused_by_its_content_length_before_reading(
    brightness_url, hardened_url, declared
):
    # The default server (256 MiB) refuses a 2 GB Content-Length; the test server's limit
    # is smaller. Only the head is sent: the 413 comes without any of the body.
    url = brightness_url if declared == 2_000_000_000 else hardened_url
    with connect(url) as sock:
        sock.sendall(head(Content_Length=declared, Content_Type=_reward_wire.CONTENT_TYPE))
        status, error = status_and_error(one_reply(sock))
    assert status == 413 and error["error"] == "too_large"
    assert str(declared) in error["message"]
    assert get_json(url + "/health")["status"] == "ok"


@pytest.mark.sockets("serves or calls a reward over HTTP")
def test_http_reward_over_the_limit_gets_413_not_retried(hardened_url, backoffs):
    samples = np.zeros((4, 32, 32, 4), np.float32)  # 64 KiB of samples: over the limit
    with pytest.raises(fg.RewardError, match="413 Request Entity Too Large: too_large"):
        fg.HttpReward(hardened_url, **FAST)(samples, None)
    assert backoffs == []


@pytest.mark.sockets("serves or calls a reward over HTTP")
def test_a_body_without_content_length_gets_411(hardened_url):
    with connect(hardened_url) as sock:
        sock.sendall(head(Transfer_Encoding="chunked") + b"5\r\nhello\r\n0\r\n\r\n")
        status, error = status_and_error(until_closed(sock))
    assert status == 411 and error["error"] == "length_required"


def npy_claiming(shape, data, descr="<f8"):
    """A `.npy` blob whose header claims `shape` of `descr`, followed by `data`."""
    buffer = io.BytesIO()
    header = {"descr": descr, "fortran_order": False, "shape": shape}
    np.lib.format.write_array_header_1_0(buffer, header)
    return buffer.getvalue() + data


@pytest.mark.sockets("serves or calls a reward over HTTP")
@pytest.mark.parametrize(
    ("arrays", "claim"),
    [
        ([("samples", npy_claiming((10**6, 10**6), bytes(48)))], "shape (1000000, 1000000)"),
        ([("samples", npy_claiming((2,), bytes(48)))], "shape (2,)"),
        ([("samples", npy_claiming((2**62, 8), bytes(16)))], "but 16 bytes follow"),
        (
            [("samples", npy(np.zeros((2, 3)))), ("rows/a", npy_claiming((10**12,), b""))],
            "'rows/a'",
        ),
    ],
    ids=["10^12-elements", "fewer", "overflowing", "rows"],
)
def test_lying_npy_headers_give_400_and_nothing_is_allocated(hardened_url, arrays, claim):
    body = container(arrays, rows="dict" if len(arrays) > 1 else "none")
    with pytest.raises(_reward_wire.WireError, match="claims shape") as raised:
        decode_request(body)
    assert claim.strip("'") in str(raised.value)
    status, reply = post(hardened_url + "/score", body)
    assert status == 400 and json.loads(reply)["error"] == "malformed_body"
    assert "claims shape" in json.loads(reply)["message"]
    assert get_json(hardened_url + "/health")["status"] == "ok"


@pytest.mark.sockets("serves or calls a reward over HTTP")
def test_a_full_server_answers_503_or_429_naming_the_limit_and_health_still_answers(
    slow_limits_url,
):
    """Only requests whose bodies have arrived take a place: one in the reward holds one of
    the two places and two of the three rows; two more rows get 429, one more row waits in
    the second place, and a fourth request gets 503."""
    samples, _ = batch(count=2)

    def request(count, sleep):
        rows = {"sleep": np.full(count, sleep)}
        return encode_request(samples[:count], rows)

    replies = {}

    def send(name, body):
        replies[name] = post(slow_limits_url + "/score", body)

    sleeping = threading.Thread(target=send, args=("sleeping", request(2, True)))
    sleeping.start()
    time.sleep(0.5)  # its body arrives and it takes a place in a few milliseconds
    status, reply = post(slow_limits_url + "/score", request(2, False))
    error = json.loads(reply)
    assert status == 429 and error["error"] == "over_capacity", error
    assert error["limit"] == "max_total_rows" and "--max-total-rows" in error["message"]
    waiting = threading.Thread(target=send, args=("waiting", request(1, False)))
    waiting.start()
    time.sleep(0.5)
    status, reply = post(slow_limits_url + "/score", request(1, False))
    error = json.loads(reply)
    assert status == 503 and error["error"] == "busy", error
    assert error["limit"] == "max_concurrent_requests"
    assert "--max-concurrent-requests" in error["message"]
    assert get_json(slow_limits_url + "/health")["status"] == "ok"
    sleeping.join(30)
    waiting.join(30)
    assert replies["sleeping"][0] == 200 and replies["waiting"][0] == 200
    # Both places and every row are given back.
    got = fg.HttpReward(slow_limits_url)(samples, {"sleep": np.zeros(2, bool)})
    assert got.shape == (2,)


@pytest.mark.sockets("serves or calls a reward over HTTP")
def test_four_trickling_bodies_do_not_starve_a_real_client(brightness_url):
    """Four clients that each announced a 1 MB body and sent a byte of it every 0.5 s took
    every place (a place was taken before the body was read, and held up to the 30 s read
    timeout): a real client got 503 "busy" three times within 1.5 s."""
    slow = [connect(brightness_url) for _ in range(4)]
    stop = threading.Event()

    def trickle():
        while not stop.wait(0.5):
            for sock in slow:
                try:
                    sock.send(b"x")
                except OSError:
                    pass

    for sock in slow:
        sock.sendall(head(Content_Length=1_000_000, Content_Type=_reward_wire.CONTENT_TYPE))
    trickling = threading.Thread(target=trickle, daemon=True)
    trickling.start()
    try:
        time.sleep(0.5)  # every head has reached its handler
        samples, rows = batch()
        got = fg.HttpReward(brightness_url, timeout=5.0, retries=2)(samples, rows)
        assert same_bits(got, reward_fixtures.brightness(samples, rows))
    finally:
        stop.set()
        trickling.join(5)
        for sock in slow:
            sock.close()


@pytest.mark.sockets("serves or calls a reward over HTTP")
def test_rows_past_the_default_limit_get_413_naming_it(brightness_url, backoffs):
    """200000 rows of 1x1 uint8 samples (a 200 kB body) were scored: 8.6 s of the one
    scoring thread under a JPEG reward, and a body at the size limit would have held it for
    hours. The default server refuses more than 65536 rows, naming the limit and its flag."""
    count = 200_000
    samples = np.zeros((count, 1, 1), np.float32)
    rows = {
        "offset": np.zeros(count),
        "meta": {"index": np.arange(count, dtype=np.int32)},
        "prompt": np.full(count, "p"),
    }
    remote = fg.HttpReward(brightness_url, images_as_uint8=True)
    with pytest.raises(fg.RewardError, match="not retried.*HTTP 413") as raised:
        remote(samples, rows)
    said = str(raised.value)
    assert "200000 rows" in said and "max_request_rows (--max-request-rows) 65536" in said
    assert backoffs == []
    assert get_json(brightness_url + "/health")["status"] == "ok"


@pytest.mark.sockets("serves or calls a reward over HTTP")
def test_decoded_bytes_past_the_limit_get_413_uint8_counted_as_float32(limits_url, backoffs):
    """uint8 samples become float32, four times their bytes: a 188 MiB uint8 body took the
    server from 205 MB to 5.4 GB. Their float32 bytes are held to max_decoded_bytes."""
    grid, rows = batch(count=5, shape=(64, 64, 3))  # 245760 bytes as float32, 61440 as uint8
    remote = fg.HttpReward(limits_url, images_as_uint8=True)
    with pytest.raises(fg.RewardError, match="not retried.*HTTP 413") as raised:
        remote(grid, rows)
    said = str(raised.value)
    assert "uint8 samples (5, 64, 64, 3), as float32" in said
    assert f"max_decoded_bytes (--max-decoded-bytes) {DECODED_LIMIT}" in said
    assert backoffs == []
    fewer = {"offset": rows["offset"][:4], "meta": {"index": rows["meta"]["index"][:4]}}
    fewer["prompt"] = rows["prompt"][:4]
    assert remote(grid[:4], fewer).shape == (4,)
    status, reply = post(limits_url + "/score", encode_request(np.zeros((101, 1)), None))
    error = json.loads(reply)
    assert status == 413 and error["limit"] == "max_request_rows", error


@pytest.mark.sockets("serves or calls a reward over HTTP")
def test_bytes_held_past_the_total_get_429_naming_it(limits_url, backoffs):
    """Bodies arriving at once are counted as their bytes arrive, against max_total_bytes:
    beyond it, 429 naming the limit (retried by HttpReward); once the bytes are given back,
    the same request is scored."""
    samples, rows = batch(count=3, shape=(64, 64, 3))  # 147456 bytes of float32 samples
    with connect(limits_url) as stalled:
        stalled.sendall(head(Content_Length=250_000, Content_Type=_reward_wire.CONTENT_TYPE))
        stalled.sendall(bytes(200_000))
        time.sleep(0.5)  # the server has read the 200000 bytes it holds
        remote = fg.HttpReward(limits_url, timeout=5.0, retries=0)
        with pytest.raises(fg.RewardError, match="HTTP 429") as raised:
            remote(samples, rows)
        said = str(raised.value)
        assert "over_capacity" in said
        assert f"max_total_bytes (--max-total-bytes) {TOTAL_BYTES}" in said
    time.sleep(0.5)  # the stalled connection is closed and its bytes given back
    got = remote(samples, rows)
    assert same_bits(got, reward_fixtures.brightness(samples, rows))
    # A body that could never be held is refused by its Content-Length.
    with connect(limits_url) as sock:
        sock.sendall(head(Content_Length=TOTAL_BYTES + 1, Content_Type=_reward_wire.CONTENT_TYPE))
        status, error = status_and_error(one_reply(sock))
    assert status == 413 and error["limit"] == "max_total_bytes", error


@pytest.mark.sockets("serves or calls a reward over HTTP")
def test_beyond_max_connections_the_longest_idle_are_closed(hardened_url):
    sockets = [connect(hardened_url) for _ in range(40)]  # the test server keeps 32
    assert get_json(hardened_url + "/health")["status"] == "ok"
    closed = set()
    for _ in range(10):  # the closes arrive within a few tenths of a second
        closed |= set(select.select(sockets, [], [], 0.05)[0])
    assert len(closed) >= 8
    assert sockets[0] in closed  # the longest idle goes first
    for sock in sockets:
        sock.close()


def test_off_loopback_without_a_token_is_refused(monkeypatch, capsys):
    def no_binding(host, port):
        raise AssertionError(f"bound {host}:{port}")

    monkeypatch.setattr(reward_server, "listening_socket", no_binding)
    for host in ("0.0.0.0", "::", "192.168.0.10", "example.com"):
        with pytest.raises(ValueError, match="`host`.*no `token`.*--allow-unauthenticated"):
            reward_server.serve(reward_fixtures.brightness, host=host, port=0)
    # The command lines refuse it too (a usage error), in this process: nothing is bound.
    from tests.cli_helpers import run_cli

    monkeypatch.delenv("FLOWGRPO_REWARD_TOKEN", raising=False)
    off_loopback = ["tests.reward_fixtures:brightness", "--host", "0.0.0.0", "--port", "0"]
    with pytest.raises(SystemExit) as stopped:
        reward_server.main(off_loopback)
    assert stopped.value.code == 2
    printed = capsys.readouterr()
    assert "no `token`" in printed.err and "serving" not in printed.out
    refused = run_cli("serve-reward", *off_loopback)
    assert refused.returncode == 2, refused.stderr
    assert "no `token`" in refused.stderr and "serving" not in refused.stdout


def test_an_empty_token_is_refused_naming_the_flag(monkeypatch, capsys):
    """`serve-reward --token ''` served with no token and no warning."""
    from tests.cli_helpers import run_cli

    def no_binding(host, port):
        raise AssertionError(f"bound {host}:{port}")

    monkeypatch.setattr(reward_server, "listening_socket", no_binding)
    monkeypatch.delenv("FLOWGRPO_REWARD_TOKEN", raising=False)
    arguments = ["tests.reward_fixtures:brightness", "--token", "", "--port", "0"]
    refused = run_cli("serve-reward", *arguments)
    assert refused.returncode == 2, refused.stderr
    (line,) = refused.stderr.strip().splitlines()
    assert "`--token` is empty" in line and "serving" not in refused.stdout
    with pytest.raises(SystemExit) as stopped:
        reward_server.main(arguments)
    assert stopped.value.code == 2
    assert "`--token` is empty" in capsys.readouterr().err


@pytest.mark.sockets("serves or calls a reward over HTTP")
def test_a_url_ending_in_score_means_its_base_and_a_404_names_the_url(brightness_url, backoffs):
    """`HttpReward("http://host:port/score")` posted to /score/score and said only
    "HTTP 404 Not Found: 404: Not Found"."""
    samples, rows = batch()
    for given in (brightness_url + "/score", brightness_url + "/score/"):
        remote = fg.HttpReward(given)
        assert remote.url == brightness_url and remote.name == f"http:{brightness_url}"
        assert same_bits(remote(samples, rows), reward_fixtures.brightness(samples, rows))
    with pytest.raises(fg.RewardError, match="not retried.*HTTP 404") as raised:
        fg.HttpReward(brightness_url + "/v1")(samples, rows)
    assert f"POST {brightness_url}/v1/score" in str(raised.value)
    assert "`url` must be the server's base URL" in str(raised.value)
    assert backoffs == []


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"max_request_bytes": 0}, "max_request_bytes"),
        ({"read_timeout": 0.0}, "read_timeout"),
        ({"read_timeout": float("inf")}, "read_timeout"),
        ({"max_concurrent_requests": 0}, "max_concurrent_requests"),
        ({"max_request_rows": 0}, "max_request_rows"),
        ({"max_decoded_bytes": 0}, "max_decoded_bytes"),
        ({"max_total_bytes": -1}, "max_total_bytes"),
        ({"max_total_rows": 0}, "max_total_rows"),
        ({"max_connections_per_peer": 0}, "max_connections_per_peer"),
        ({"max_bytes_per_peer": 0}, "max_bytes_per_peer"),
        ({"max_rows_per_peer": -2}, "max_rows_per_peer"),
        ({"max_requests_per_peer": 0}, "max_requests_per_peer"),
        ({"score_chunk_bytes": 0}, "score_chunk_bytes"),
    ],
)
def test_server_limits_checked(kwargs, argument):
    with pytest.raises(ValueError, match=f"`{argument}`"):
        reward_server.ServerLimits(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"max_connections": 0}, "max_connections"),
        ({"token": ""}, "token"),
    ],
)
def test_server_settings_checked(kwargs, argument, monkeypatch):
    monkeypatch.setattr(reward_server, "listening_socket", None)  # never reached
    with pytest.raises(ValueError, match=f"`{argument}`"):
        reward_server.serve(reward_fixtures.brightness, port=0, **kwargs)


def test_limits_must_be_server_limits():
    with raises_named("`limits` must be a ServerLimits, got {'max_request_bytes': 1}."):
        reward_server.make_app(reward_fixtures.brightness, limits={"max_request_bytes": 1})


def test_the_command_line_builds_server_limits_from_its_flags():
    parser = argparse.ArgumentParser()
    reward_limits.add_limit_arguments(parser)
    settings = reward_limits.limit_settings(
        vars(
            parser.parse_args(
                ["--max-total-rows", "7", "--read-timeout", "2.5", "--max-rows-per-peer", "3"]
                + ["--score-chunk-bytes", "4096", "--max-connections-per-peer", "5"]
            )
        )
    )
    assert settings == {
        "limits": reward_limits.ServerLimits(
            max_total_rows=7,
            read_timeout=2.5,
            max_rows_per_peer=3,
            score_chunk_bytes=4096,
            max_connections_per_peer=5,
        ),
        "max_connections": reward_limits.DEFAULT_MAX_CONNECTIONS,
        "allow_unauthenticated": False,
    }
    with pytest.raises(ValueError, match="`max_request_rows`"):
        reward_limits.limit_settings(vars(parser.parse_args(["--max-request-rows", "0"])))


def test_decoded_arrays_view_a_writable_body_without_copies():
    samples, rows = batch(count=5)
    body = np.frombuffer(encode_request(samples, rows), np.uint8).copy()
    got_samples, got_rows = decode_request(body)
    assert np.shares_memory(got_samples, body) and got_samples.flags.aligned
    assert np.array_equal(got_samples, samples)
    assert np.shares_memory(got_rows["prompt"], body)
    # A read-only body (bytes) gives writable copies, as np.load did.
    from_bytes, _ = decode_request(body.tobytes())
    assert from_bytes.flags.writeable and not np.shares_memory(from_bytes, body)


# Declared shapes, dtypes, a trickling reply head, and port errors.


@pytest.mark.sockets("serves or calls a reward over HTTP")
@pytest.mark.parametrize(
    ("arrays", "kind", "named"),
    [
        ([("samples", npy_claiming((3 * 10**9, 0, 16, 3), b""))], "malformed_body", "no element"),
        ([("samples", npy(np.zeros((0, 8, 8, 3), np.float32)))], "malformed_body", "no element"),
        (
            [("samples", npy(np.zeros((2, 3)))), ("rows/a", npy_claiming((2, 10**12, 0), b""))],
            "malformed_body",
            "rows/a has shape (2, 1000000000000, 0)",
        ),
        ([("samples", npy(np.zeros((2, 3), np.complex64)))], "unsupported_dtype", "complex64"),
        ([("samples", npy(np.zeros((2, 3), "datetime64[s]")))], "unsupported_dtype", "datetime64"),
        ([("samples", npy(np.zeros((2, 3), bool)))], "unsupported_dtype", "bool"),
        (
            [("samples", npy(np.zeros((2, 3)))), ("rows/t", npy(np.zeros(2, "timedelta64[s]")))],
            "unsupported_dtype",
            "rows/t has dtype timedelta64",
        ),
    ],
    ids=["3e9-rows-of-nothing", "no-rows", "rows-axis", "complex", "datetime", "bool", "rows-dt"],
)
def test_empty_or_non_real_arrays_get_400_naming_them(hardened_url, arrays, kind, named):
    """A 171-byte body declaring (3e9, 0, 16, 3) samples had the reward allocate a byte per
    declared row; complex and datetime samples were scored with 200."""
    body = container(arrays, rows="dict" if len(arrays) > 1 else "none")
    started = time.monotonic()
    status, reply = post(hardened_url + "/score", body)
    error = json.loads(reply)
    assert status == 400 and error["error"] == kind, error
    assert named in error["message"], error["message"]
    assert time.monotonic() - started < 5.0
    assert get_json(hardened_url + "/health")["status"] == "ok"


@pytest.mark.sockets("serves or calls a reward over HTTP")
def test_string_and_bool_rows_are_still_accepted(brightness_url):
    samples, rows = batch()
    rows["flag"] = np.arange(6) % 2 == 0
    got = fg.HttpReward(brightness_url)(samples, rows)
    assert same_bits(got, reward_fixtures.brightness(samples, rows))


@pytest.mark.sockets("serves or calls a reward over HTTP")
def test_complex_samples_are_rejected_by_name_not_retried(brightness_url, backoffs):
    samples, rows = batch()
    remote = fg.HttpReward(brightness_url, retries=2)
    with pytest.raises(fg.RewardError, match="not retried.*unsupported_dtype.*complex128"):
        remote(samples.astype(np.complex128), rows)
    assert backoffs == []


@pytest.fixture
def trickling_head_url():
    """A loopback server that reads a request, then sends its reply's status line and headers
    one byte every 0.1 s (a reply head of about 10 s)."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve():
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                continue
            with sock:
                sock.settimeout(0.2)
                try:
                    sock.recv(1 << 20)
                    for byte in b"HTTP/1.1 200 OK\r\n" + b"X-Slow: " + b"y" * 80 + b"\r\n\r\n":
                        if stop.is_set():
                            break
                        sock.sendall(bytes([byte]))
                        time.sleep(0.1)
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join(5)
    listener.close()


@pytest.mark.sockets("serves or calls a reward over HTTP")
def test_the_timeout_covers_a_trickling_reply_head(trickling_head_url, backoffs):
    """HttpReward(timeout=1) waited as long as the server trickled its headers (14 s)."""
    samples, rows = batch(count=2)
    remote = fg.HttpReward(trickling_head_url, timeout=1.0, retries=0)
    started = time.monotonic()
    with pytest.raises(fg.RewardError, match="failed after 1 attempt: timed out after 1 s"):
        remote(samples, rows)
    assert time.monotonic() - started < 5.0


@pytest.mark.sockets("serves or calls a reward over HTTP")
def test_serve_reward_port_errors_are_one_line(capsys):
    from tests.cli_helpers import run_cli

    out_of_range = run_cli("serve-reward", "tests.reward_fixtures:brightness", "--port", "99999")
    assert out_of_range.returncode == 2
    assert out_of_range.stderr.strip().splitlines() == [
        "flowgrpo-eqx: `port` must be an int in 0..65535 (0: any free port), got 99999."
    ]
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        in_use = run_cli("serve-reward", "tests.reward_fixtures:brightness", "--port", port)
        assert in_use.returncode == 1
        (line,) = in_use.stderr.strip().splitlines()
        assert f"cannot listen on 127.0.0.1:{port}" in line and "in use" in line
        assert reward_server.main(["tests.reward_fixtures:brightness", "--port", str(port)]) == 1
        assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stopped:
        reward_server.main(["tests.reward_fixtures:brightness", "--port", "99999"])
    assert stopped.value.code == 2
    assert "`port` must be an int in 0..65535" in capsys.readouterr().err


# Faults the fault probe found (tools/fault_probe, docs/faults.md).


@pytest.mark.sockets("serves or calls a reward over HTTP")
def test_a_header_nested_too_deep_or_a_number_too_long_to_print_gets_400(hardened_url):
    """A header nested 20000 deep raised RecursionError, and an axis of 4300 digits a
    ValueError while its message was written: both gave 500 and a traceback."""
    nested = b"[" * 20000 + b"]" * 20000
    deep = _reward_wire.MAGIC + len(nested).to_bytes(4, "little") + nested
    huge = container(
        [("samples", npy_claiming((10**4299, 16, 16, 3), bytes(64), "<f4"))], rows="none"
    )
    for body, named in [(deep, "nested too deep"), (huge, "claims shape (<a 14281-bit number>")]:
        with pytest.raises(_reward_wire.WireError, match=re.escape(named)):
            decode_request(body)
        status, reply = post(hardened_url + "/score", body)
        assert status == 400 and json.loads(reply)["error"] == "malformed_body"
        assert named in json.loads(reply)["message"]
    assert get_json(hardened_url + "/health")["status"] == "ok"


@pytest.mark.several_processes("serves a reward from a process of its own")
@pytest.mark.sockets("serves or calls a reward over HTTP")
def test_malformed_http_and_a_lost_body_are_logged_in_one_line(tmp_path):
    """aiohttp logged each malformed HTTP message with its parser's traceback and up to a
    megabyte of what the client sent; a connection reset mid-body gave two chained
    tracebacks. Now each is one line, and the server answers /health throughout."""
    log = tmp_path / "stderr.txt"
    process, url = start(reward_args("brightness", "--read-timeout", "2"), log)
    try:
        malformed = [
            head(Content_Length="ten"),
            b"POST /score HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
            head(X_Long="y" * (1 << 20)),
        ]
        for request in malformed:
            with connect(url) as sock:
                sock.sendall(request)
                status, _ = status_and_error(until_closed(sock))
                assert status == 400
        with connect(url) as sock:  # a client that resets its connection halfway through
            sock.sendall(head(Content_Length="100000") + bytes(5000))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        assert get_json(url + "/health")["status"] == "ok"
    finally:
        process.terminate()
        process.wait(30)
    logged = log.read_text()
    assert "Traceback" not in logged, logged[:2000]
    lines = [line for line in logged.splitlines() if line.strip()]
    assert len(lines) == len(malformed), lines
    assert all(line.startswith("refused a malformed HTTP request") for line in lines), lines
    assert max(map(len, lines)) < 300
    assert "y" * 200 not in logged


@pytest.mark.sockets("serves or calls a reward over HTTP")
@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("long400", "not retried.*HTTP 400"),
        ("redirect", r"not retried.*HTTP 302.*not followed; Location: http://127.0.0.1:9/score"),
    ],
)
def test_a_long_4xx_or_a_redirect_is_not_retried_and_keeps_its_status(
    scripted_url, backoffs, mode, message
):
    """A 400 whose JSON message passed 64 KiB was retried as "the reply exceeds 65536
    bytes", its status lost; a redirect was retried without a word of where it pointed."""
    samples, rows = batch(count=2)
    remote = fg.HttpReward(f"{scripted_url}/{mode}", **{**FAST, "retries": 2})
    with pytest.raises(fg.RewardError, match=message):
        remote(samples, rows)
    assert backoffs == []
    assert get_json(scripted_url + "/count")["posts"][mode] == 1


def test_a_npy_header_numpy_cannot_tokenize_is_a_malformed_body():
    # numpy parses a failing header again through `tokenize`, whose own error (not a
    # ValueError) an unbalanced bracket raises: it must still be the wire's 400.
    blob = npy(np.zeros((5, 2), np.float32))
    damaged = blob.replace(b"'descr':", b"'descr'[", 1)
    assert damaged != blob
    with pytest.raises(_reward_wire.WireError, match="not a .npy array") as raised:
        decode_request(container([("samples", damaged)], rows="none"))
    assert raised.value.kind == "malformed_body"


# --- one peer against the others -----------------------------------------------------------

HOSTILE = "127.0.0.2"
"""The hostile peer's address: on Linux every 127.x.y.z is this machine, and the server
tells its connections from those of 127.0.0.1 by it."""


def connect_from(address, url, timeout=20.0):
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=timeout, source_address=(address, 0))


def post_from(address, url, body):
    """POST `body` to `url`'s /score from `address`; (status, JSON or bytes) of the reply."""
    with connect_from(address, url) as sock:
        sock.sendall(head(Content_Length=len(body), Content_Type=_reward_wire.CONTENT_TYPE) + body)
        reply = one_reply(sock, limit=30.0)
    status = int(reply.split(b" ", 2)[1]) if reply else 0
    return status, reply.partition(b"\r\n\r\n")[2]


def fair_calls(url, count=3):
    """`count` calls of a well-behaved `HttpReward` from 127.0.0.1, each scored."""
    samples, _ = batch(count=2)
    remote = fg.HttpReward(url, timeout=20.0, retries=2)
    for _ in range(count):
        assert remote(samples, {"sleep": np.zeros(2, bool)}).shape == (2,)


@pytest.mark.sockets("serves or calls a reward over HTTP")
def test_one_peers_slow_uploads_beyond_its_connections_do_not_starve_another(peers_url):
    """300 slow uploads (more than --max-connections) made three real HttpReward calls and
    /health fail with connection resets: they were busy, so no idle connection could be
    closed for a new one, and each new one was closed. One peer now keeps at most
    --max-connections-per-peer (8 here); its next ones are answered 429 naming the limit."""
    body_head = head(Content_Length=100_000, Content_Type=_reward_wire.CONTENT_TYPE)
    held, refused = [], []
    try:
        for _ in range(80):  # beyond the server's 64 connections in all
            sock = connect_from(HOSTILE, peers_url)
            try:
                sock.sendall(body_head + b"x" * 10)
            except OSError:
                pass
            held.append(sock)
        time.sleep(0.5)
        fair_calls(peers_url)
        assert get_json(peers_url + "/health")["status"] == "ok"
        for sock in held:
            readable, _, _ = select.select([sock], [], [], 0)
            if readable:
                try:
                    refused.append(one_reply(sock, limit=5.0))
                except (AssertionError, OSError):
                    refused.append(b"")
    finally:
        for sock in held:
            sock.close()
    assert len(held) - len(refused) <= 8
    # Beyond its share, a peer's new connections are answered 429 naming the limit (or, while
    # more than --max-connections are open at once, closed as the longest idle).
    said = [reply for reply in refused if reply]
    assert len(said) > len(refused) // 2
    for reply in said:
        assert reply.startswith(b"HTTP/1.1 429"), reply[:100]
        assert b'"limit": "max_connections_per_peer"' in reply
        assert b"--max-connections-per-peer" in reply


@pytest.mark.sockets("serves or calls a reward over HTTP")
def test_one_peers_held_bodies_do_not_take_the_whole_byte_budget(peers_url):
    """Two 256 MiB uploads held one byte short of complete took the whole --max-total-bytes,
    so every real client got 429 until they timed out. One peer now holds at most
    --max-bytes-per-peer; its second body gets 429 naming it, and others are served."""
    first = connect_from(HOSTILE, peers_url)
    second = connect_from(HOSTILE, peers_url)
    try:
        for sock in (first, second):
            sock.sendall(head(Content_Length=PEER_BYTES, Content_Type=_reward_wire.CONTENT_TYPE))
        first.sendall(bytes(PEER_BYTES - 1))
        time.sleep(0.3)
        try:
            second.sendall(bytes(PEER_BYTES - 1))
        except OSError:
            pass
        reply = one_reply(second)
        assert reply.startswith(b"HTTP/1.1 429"), reply[:200]
        error = json.loads(reply.partition(b"\r\n\r\n")[2])
        assert error["limit"] == "max_bytes_per_peer" and "--max-bytes-per-peer" in error["message"]
        fair_calls(peers_url)
    finally:
        first.close()
        second.close()


@pytest.mark.sockets("serves or calls a reward over HTTP")
def test_one_peers_stream_of_requests_leaves_rows_and_places_for_another(peers_url):
    """Four senders of 65536-row requests took the rows and places: 3,133 of their requests
    got 429, and so did all three real calls. One peer now holds at most --max-rows-per-peer
    rows and --max-requests-per-peer places; a real call waits at most behind what it holds."""
    samples, _ = batch(count=4)
    body = encode_request(samples, {"sleep": np.ones(4, bool)})
    stop = threading.Event()
    statuses = []

    def send():
        while not stop.is_set():
            statuses.append(post_from(HOSTILE, peers_url, body))

    senders = [threading.Thread(target=send, daemon=True) for _ in range(4)]
    for sender in senders:
        sender.start()
    try:
        time.sleep(0.5)
        fair_calls(peers_url, count=2)
    finally:
        stop.set()
        for sender in senders:
            sender.join(30)
    limits = {json.loads(reply)["limit"] for status, reply in statuses if status == 429}
    assert limits <= {"max_rows_per_peer", "max_requests_per_peer"} and limits, statuses[:3]


@pytest.mark.sockets("serves or calls a reward over HTTP")
def test_a_large_request_is_scored_in_chunks_as_it_would_be_whole(chunks_url):
    """The reward is called on chunks of --score-chunk-bytes (here 2 rows of 8x8x3 float32
    and their rows): what it scores sample by sample comes back the same, bit for bit."""
    samples, rows = batch(count=25)
    got = fg.HttpReward(chunks_url)(samples, rows)
    assert same_bits(got, reward_fixtures.brightness(samples, rows))
    as_uint8 = fg.HttpReward(chunks_url, images_as_uint8=True)(samples, rows)
    sent, _ = decode_request(encode_request(samples, rows, images_as_uint8=True))
    assert same_bits(as_uint8, reward_fixtures.brightness(sent, rows))


def test_a_chunk_the_reward_refuses_is_named_by_its_rows_in_the_request():
    samples = np.zeros((10, 4, 4, 3), np.float32)
    samples[7, 0, 0, 0] = np.nan
    parsed = _reward_wire.parse_request(encode_request(samples, None))
    with pytest.raises(fg.RewardError) as raised:
        _reward_requests.score_decoded(fg.JpegIncompressibility(), parsed, 3 * 4 * 4 * 3 * 4)
    said = str(raised.value)
    assert "at rows [1]" in said and "(rows 6 to 8 of the request, scored as one chunk" in said
    assert "score_chunk_bytes (--score-chunk-bytes) 576" in said


def test_the_memory_a_request_is_scored_in_is_a_chunks_not_the_requests():
    """The shipped JPEG reward took a server 28.9 times a 60 MiB body of uint8 images (+1.7
    GB) and 6.9 times a 188 MiB float32 one: the uint8 samples became float32 all at once
    (through an 8-byte index per byte), and the reward copied the whole batch to float64
    several times. Scored in chunks, a request's scoring allocates about a chunk's worth."""
    import tracemalloc

    rng = np.random.default_rng(0)
    samples = rng.uniform(-1, 1, (600, 32, 32, 3)).astype(np.float32)  # 7 MiB as float32
    reward = fg.JpegIncompressibility()
    want = reward(samples, None)
    for uint8 in (False, True):
        body = np.frombuffer(encode_request(samples, None, images_as_uint8=uint8), np.uint8)
        parsed = _reward_wire.parse_request(body.copy())
        tracemalloc.start()
        try:
            got = _reward_requests.score_decoded(reward, parsed, 1 << 20)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 4 << 20, (uint8, peak)
        if not uint8:
            assert same_bits(got, want)


def test_the_peer_of_an_address_is_its_ipv4_address_or_its_ipv6_64():
    key = _reward_connections.peer_key
    assert key(("127.0.0.2", 4567)) == "127.0.0.2"
    assert key(("2001:db8:1:2:aaaa::1", 80, 0, 0)) == key(("2001:db8:1:2:bbbb::9", 81, 0, 0))
    assert key(("2001:db8:1:2::1", 80, 0, 0)) == "2001:db8:1:2::/64"
    assert key(("2001:db8:1:3::1", 80, 0, 0)) != key(("2001:db8:1:2::1", 80, 0, 0))
    assert key(("::ffff:10.0.0.7", 80, 0, 0)) == "10.0.0.7"
    assert key(("fe80::1%eth0", 80, 0, 2)) == "fe80::/64"
    assert key(None) == "local"
