"""Serving benchmark: throughput and p50/p99 latency of single-review requests.

    python bench/serve_bench.py --model-dir models/NAME [--duration 5] [--concurrency 1,8,32,64]

Measures, in one run and on the same machine:
  - `serve`: `python -m serve` (waitress + dynamic batcher), TF Serving REST :predict;
  - `naive`: a plain Flask route calling the SavedModel once per request, under the same WSGI
    server and thread count, same request/response JSON;
  - the in-process model-call rate (no HTTP) for 1 and 64 reviews per call.
Clients are separate processes with keep-alive connections; they share the CPUs with the
server, so on a small machine the figures are a lower bound for the server alone. Both servers
run throughout; each level is measured in --rounds slices alternating which server goes first.
Without --model-dir a model is trained (1 epoch, bundled corpus) and exported in a temp dir.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing as mp
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REVIEW = ("I went in expecting a dull, by-the-numbers sequel, but the story was surprisingly fun, the acting "
          "was great and the plot kept me guessing until the end. A few scenes drag and the score is forgettable, "
          "yet overall it is one of the better films of the year and I would happily watch it again. ")


# -- the naive baseline server -------------------------------------------------------------------

def naive_server(model_dir: str, port: int, threads: int) -> None:
    import numpy as np
    import tensorflow as tf
    from flask import Flask, Response, request
    from waitress import serve

    versions = sorted(int(p.name) for p in Path(model_dir).iterdir() if p.name.isdigit())
    fn = tf.saved_model.load(str(Path(model_dir) / str(versions[-1]))).signatures["serving_default"]
    app = Flask("naive")

    @app.post("/v1/models/<name>:predict")
    def predict(name: str) -> Response:
        texts = request.get_json()["instances"]
        out = fn(text=tf.constant(np.array([t.encode() for t in texts], dtype=object)))
        labels = [x.decode() for x in out["label"].numpy()]
        rows = [{"label": lab, "probabilities": p, "logits": lg} for lab, p, lg in
                zip(labels, out["probabilities"].numpy().tolist(), out["logits"].numpy().tolist())]
        return Response(json.dumps({"predictions": rows}), mimetype="application/json")

    @app.get("/readyz")
    def ready() -> str:
        return "ok"

    serve(app, host="127.0.0.1", port=port, threads=threads, connection_limit=256, _quiet=True)


# -- load generation -----------------------------------------------------------------------------

def _client(args: tuple[int, str, int, float, int]) -> list[float]:
    """One client process: `threads` keep-alive connections posting for `duration` seconds."""
    import threading

    port, path, threads, duration, seed = args
    latencies: list[float] = []
    errors = [0]
    lock = threading.Lock()
    end = time.monotonic() + duration

    def run(k: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        mine, i = [], 0
        while time.monotonic() < end:
            body = json.dumps({"instances": [f"{REVIEW} ({seed}.{k}.{i})"]}).encode()
            t0 = time.perf_counter()
            conn.request("POST", path, body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            resp.read()
            mine.append(time.perf_counter() - t0)
            if resp.status != 200:
                errors[0] += 1
            i += 1
        conn.close()
        with lock:
            latencies.extend(mine)

    ts = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors[0]:
        print(f"  warning: {errors[0]} non-200 responses", file=sys.stderr)
    return latencies


def run_load(port: int, path: str, concurrency: int, duration: float, procs: int) -> list[float]:
    """Latencies (seconds) of `concurrency` keep-alive clients posting for `duration` seconds."""
    procs = max(1, min(procs, concurrency))
    split = [concurrency // procs + (1 if i < concurrency % procs else 0) for i in range(procs)]
    _client((port, path, 1, 0.5, -1))  # warm connections / code paths
    with mp.get_context("spawn").Pool(procs) as pool:
        parts = pool.map(_client, [(port, path, n, duration, i) for i, n in enumerate(split)])
    return [x for part in parts for x in part]


def summarize(latencies: list[float], duration: float) -> dict[str, float]:
    lat = sorted(latencies)
    q = statistics.quantiles(lat, n=100, method="inclusive")
    return {"rps": len(lat) / duration, "p50": q[49] * 1e3, "p99": q[98] * 1e3, "n": len(lat)}


def measure(port: int, path: str, concurrency: int, duration: float, procs: int) -> dict[str, float]:
    return summarize(run_load(port, path, concurrency, duration, procs), duration)


def _wait_ready(port: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"server on port {port} exited with {proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            conn.request("GET", "/readyz")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"server on port {port} not ready after {timeout}s")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batch_stats(port: int) -> tuple[float, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request("GET", "/monitoring/prometheus/metrics")
    text = conn.getresponse().read().decode()
    total = float(re.search(r"^serve_batch_size_sum ([0-9.e+]+)$", text, re.M).group(1))
    count = float(re.search(r"^serve_batch_size_count ([0-9.e+]+)$", text, re.M).group(1))
    return total, count


def model_call_rate(model_dir: str) -> dict[int, float]:
    """Seconds per in-process call of serving_default for 1 and 64 reviews."""
    import numpy as np
    import tensorflow as tf

    versions = sorted(int(p.name) for p in Path(model_dir).iterdir() if p.name.isdigit())
    fn = tf.saved_model.load(str(Path(model_dir) / str(versions[-1]))).signatures["serving_default"]
    out = {}
    for rows in (1, 64):
        x = tf.constant(np.array([REVIEW.encode()] * rows, dtype=object))
        for _ in range(20):
            fn(text=x)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 1.5:
            fn(text=x)
            n += 1
        out[rows] = (time.perf_counter() - t0) / n
    return out


def build_default_model(workdir: Path) -> str:
    """The real pipeline, small: `python -m train` (1 epoch, bundled corpus) then `python -m export`."""
    run_dir, model_dir = workdir / "run", workdir / "sentiment"
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    for cmd in (
        ["-m", "train", "--run-dir", str(run_dir), "--epochs", "1", "--no-progress"],
        ["-m", "export", "--checkpoint-dir", str(run_dir), "--model-dir", str(model_dir)],
    ):
        subprocess.run([sys.executable, *cmd], cwd=REPO, env=env, check=True, capture_output=True)
    return str(model_dir)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", help="models/NAME (default: train and export one)")
    p.add_argument("--duration", type=float, default=5.0, help="seconds per concurrency level")
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--threads", type=int, default=64, help="WSGI threads for both servers")
    p.add_argument("--rounds", type=int, default=2,
                   help="slices per level, alternating which server is measured first")
    p.add_argument("--client-procs", type=int, default=2, help="load-generator processes")
    p.add_argument("--serve-args", default="", help="extra arguments for python -m serve")
    p.add_argument("--naive-server", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.naive_server:
        naive_server(a.model_dir, a.port, a.threads)
        return

    tmp = None
    if a.model_dir is None:
        tmp = tempfile.TemporaryDirectory()
        a.model_dir = build_default_model(Path(tmp.name))
        print(f"(no --model-dir: trained 1 epoch on the bundled corpus and exported to {a.model_dir})")
    name = Path(a.model_dir).name
    levels = [int(c) for c in a.concurrency.split(",")]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}

    rate = model_call_rate(a.model_dir)
    results: dict[str, dict[int, dict[str, float]]] = {"serve": {}, "naive": {}}
    batches: dict[int, float] = {}
    ports = {kind: _free_port() for kind in ("serve", "naive")}
    cmds = {
        "serve": [sys.executable, "-m", "serve", "--model-dir", a.model_dir, "--host", "127.0.0.1",
                  "--port", str(ports["serve"]), "--threads", str(a.threads), "--poll-interval", "0",
                  "--log-level", "WARNING", *a.serve_args.split()],
        "naive": [sys.executable, __file__, "--naive-server", "--model-dir", a.model_dir,
                  "--port", str(ports["naive"]), "--threads", str(a.threads)],
    }
    # Both servers run for the whole measurement (the idle one sleeps in select), and each level is
    # measured in `rounds` slices that alternate which server goes first: neither gets a systematic
    # advantage from warm-up, page cache, CPU frequency or what ran just before it.
    procs = {kind: subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for kind, cmd in cmds.items()}
    try:
        for kind, proc in procs.items():
            _wait_ready(ports[kind], proc)
        path = f"/v1/models/{name}:predict"
        for kind in ("serve", "naive"):  # equal warm-up for both, beyond run_load's per-slice one
            run_load(ports[kind], path, max(levels), 1.0, a.client_procs)
        rounds = max(1, a.rounds)
        for li, c in enumerate(levels):
            lat: dict[str, list[float]] = {"serve": [], "naive": []}
            rows = calls = 0.0
            for r in range(rounds):
                order = ("serve", "naive") if (li + r) % 2 == 0 else ("naive", "serve")
                for kind in order:
                    before = _batch_stats(ports[kind]) if kind == "serve" else None
                    lat[kind] += run_load(ports[kind], path, c, a.duration / rounds, a.client_procs)
                    if before is not None:
                        after = _batch_stats(ports[kind])
                        rows += after[0] - before[0]
                        calls += after[1] - before[1]
            batches[c] = rows / max(1.0, calls)
            for kind in ("serve", "naive"):
                r_ = results[kind][c] = summarize(lat[kind], a.duration)
                print(f"  {kind:5s} c={c:<3d} {r_['rps']:8.0f} req/s  p50 {r_['p50']:7.2f} ms  "
                      f"p99 {r_['p99']:7.2f} ms", file=sys.stderr)
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(30)

    print(f"\nSingle-review requests, {a.duration:g}s per level and server (in {max(1, a.rounds)} alternating "
          f"slices), {os.cpu_count()} CPUs shared by clients and server")
    print(f"{'conc':>4} | {'serve req/s':>11} {'p50 ms':>7} {'p99 ms':>7} {'rows/call':>9} | "
          f"{'naive req/s':>11} {'p50 ms':>7} {'p99 ms':>7} | speed-up")
    for c in levels:
        s, n = results["serve"][c], results["naive"][c]
        print(f"{c:>4} | {s['rps']:>11.0f} {s['p50']:>7.2f} {s['p99']:>7.2f} {batches[c]:>9.1f} | "
              f"{n['rps']:>11.0f} {n['p50']:>7.2f} {n['p99']:>7.2f} | {s['rps'] / n['rps']:.2f}x")
    print(f"in-process model call (no HTTP): 1 review {rate[1] * 1e3:.2f} ms ({1 / rate[1]:.0f} calls/s); "
          f"64 reviews {rate[64] * 1e3:.2f} ms ({64 / rate[64]:.0f} reviews/s)")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
