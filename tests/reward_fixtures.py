"""Rewards served by `tests/test_reward_server.py`, and a scripted misbehaving server.

The rewards are loaded by `python -m flowgrpo_eqx.rewards.server tests.reward_fixtures:NAME`.
`python -m tests.reward_fixtures` runs a stdlib HTTP server that answers `POST /MODE/score`
as MODE says (so `HttpReward("http://host:port/MODE")` meets it) and reports the POSTs it
saw per mode at `GET /count`.
"""

import http.server
import io
import json
import sys
import threading
import time

import numpy as np

from flowgrpo_eqx.rewards._wire import decode_request


SLOW_SECONDS = 3.0


def brightness(samples, rows):
    """Mean brightness in float64 plus terms from every kind of row leaf."""
    flat = np.asarray(samples, dtype=np.float64).reshape(samples.shape[0], -1)
    return (
        flat.mean(axis=1)
        + rows["offset"]
        + 1e-3 * rows["meta"]["index"]
        + 1e-6 * np.char.str_len(rows["prompt"])
    )


def sample_mean(samples, rows):
    """Mean of each sample in float64; ignores the rows."""
    del rows
    return np.asarray(samples, dtype=np.float64).reshape(samples.shape[0], -1).mean(axis=1)


_slow_calls = 0


def slow(samples, rows):
    """Sleeps `SLOW_SECONDS` if `rows["sleep"]` says so; scores are the calls so far."""
    global _slow_calls
    _slow_calls += 1
    if rows["sleep"].any():
        time.sleep(SLOW_SECONDS)
    return np.full(samples.shape[0], float(_slow_calls))


def nan_scores(samples, rows):
    return np.full(samples.shape[0], np.nan)


def one_score_short(samples, rows):
    return np.zeros(samples.shape[0] - 1)


class _Scripted(http.server.BaseHTTPRequestHandler):
    posts: dict[str, int] = {}
    lock = threading.Lock()

    def log_message(self, format, *args):
        del format, args

    def _reply(self, status, body, content_type="application/x-npy"):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        with _Scripted.lock:
            body = json.dumps({"status": "ok", "posts": _Scripted.posts}).encode()
        self._reply(200, body, "application/json")

    def do_POST(self):
        mode = self.path.removesuffix("/score").strip("/")
        with _Scripted.lock:
            _Scripted.posts[mode] = _Scripted.posts.get(mode, 0) + 1
        count = decode_request(self.rfile.read(int(self.headers["Content-Length"])))[0].shape[0]
        if mode == "sleep":
            time.sleep(SLOW_SECONDS)
            scores = np.zeros(count)
        elif mode == "nan":
            scores = np.full(count, np.nan)
        elif mode == "short":
            scores = np.zeros(count - 1)
        elif mode == "float32":
            scores = np.zeros(count, dtype=np.float32)
        elif mode == "trickle":
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            for _ in range(100):
                self.wfile.write(b"x")
                time.sleep(SLOW_SECONDS / 100)
            return
        elif mode == "garbage":
            self._reply(200, b"not an npy array")
            return
        elif mode == "redirect":
            self.send_response(302)
            self.send_header("Location", "http://127.0.0.1:9/score")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        elif mode == "long400":
            message = "x" * (1 << 20)
            body = json.dumps({"error": "malformed_body", "message": message}).encode()
            self._reply(400, body, "application/json")
            return
        else:
            raise ValueError(mode)
        buffer = io.BytesIO()
        np.save(buffer, scores)
        self._reply(200, buffer.getvalue())


def main(port):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), _Scripted)
    server.daemon_threads = True
    print(f"serving scripted on http://127.0.0.1:{server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
