"""The fault soak (`make soak-faults`): three replicas on this machine, `make soak`'s Locust load
through the failover Client, one replica killed with SIGKILL every two minutes and restarted.

    .venv/bin/python load_tests/soak_faults.py [--duration 600] [--users 32] [--every 120] [--out soak_faults_out]

Reports (and writes to OUT/report.txt): calls sent, completed and failed, by call (Generate and
StreamGenerate go through the failover Client; the walk-away calls, cancelled streams and short
deadlines, through a plain stub), failovers (calls sent again and streams resumed), p50/p99
latency inside fault windows (a kill and the 30 s after it) and outside, each replica's memory and
KV pool at idle, and a sample of greedy and seeded streams sent through the failover client during
the faults, each against the same request on an undisturbed replica afterwards (goal: identical).
Exits non-zero if a failover call failed, a sample differs, or a pool is not back to full.
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from batchserve.server.client import Client  # noqa: E402

PY = os.environ.get("PYTHON", str(ROOT / ".venv" / "bin" / "python"))
BASE_PORT = 50271
WINDOW_S = 30.0  # a fault window: the kill and the 30 s after it
SAMPLE_PROMPTS = ["def fibonacci(n):", "Write a haiku about the sea.", "def is_prime(n):", "List three colors."]


class Replica:
    """One `batchserve serve` process (small pool, no HTTP), restartable on the same ports."""

    def __init__(self, index: int, out: Path) -> None:
        self.index, self.out = index, out
        self.port, self.metrics = BASE_PORT + 2 * index, BASE_PORT + 2 * index + 1
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        args = [PY, "-m", "batchserve.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                "--metrics-port", str(self.metrics), "--http-port", "0", "--num-blocks", "256",
                "--max-num-seqs", "8"]  # fmt: skip
        log = open(self.out / f"replica-{self.index}.log", "a", encoding="utf-8")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        self.starts += 1

    def wait_healthy(self, timeout: float = 300) -> None:
        stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{self.port}"))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise SystemExit(f"replica {self.index} exited during start-up; see replica-{self.index}.log")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"replica {self.index} not healthy after {timeout:.0f} s")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=120)

    def rss_mb(self) -> float:
        out = subprocess.run(["ps", "-o", "rss=", "-p", str(self.proc.pid)], capture_output=True, text=True)
        return int(out.stdout.strip() or 0) / 1024

    def idle(self, wait: float = 60) -> tuple[float, float]:
        """(requests running or waiting, KV pool used) once idle, or at the end of `wait` seconds."""
        deadline = time.monotonic() + wait
        while True:
            body = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics}/metrics", timeout=5).read().decode()
            values = {line.split(" ")[0]: float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
                      if line and not line.startswith("#") and "{" not in line}  # fmt: skip
            busy = values["batchserve_num_requests_running"] + values["batchserve_num_requests_waiting"]
            used = values["batchserve_kv_cache_usage_ratio"]
            if (busy == 0 and used == 0) or time.monotonic() > deadline:
                return busy, used
            time.sleep(0.5)


def sampler(target: str, stop: threading.Event, samples: list[tuple[dict, list[int]]]) -> None:
    """Greedy and seeded streams through the failover client while the faults go on."""
    rng = random.Random(7)
    client = Client(target, timeout=300)
    while not stop.is_set():
        kwargs = {"max_new_tokens": 64, "ignore_eos": True}
        if rng.random() < 0.5:
            kwargs |= {"temperature": 0.8, "seed": rng.randrange(1 << 31)}
        prompt = rng.choice(SAMPLE_PROMPTS)
        try:
            tokens = [t for m in client.stream(prompt, **kwargs) for t in m.token_ids]
        except grpc.RpcError as e:
            tokens = [-1, e.code().value[0]]  # a failure: it will not match
        samples.append(({"prompt": prompt, **kwargs}, tokens))
    client.close()


def faults(replicas: list[Replica], every: float, end: float, log: list[tuple[float, int]]) -> None:
    """SIGKILL one replica (in turn) at every `every` seconds of the run, restarting it at once."""
    start, i = time.time(), 0
    while start + (i + 1) * every < end:
        time.sleep(max(0.0, start + (i + 1) * every - time.time()))
        r = replicas[i % len(replicas)]
        log.append((time.time(), r.index))
        print(f"{time.strftime('%H:%M:%S')} SIGKILL replica {r.index}", flush=True)
        r.kill()
        r.start()
        r.wait_healthy()
        print(f"{time.strftime('%H:%M:%S')} replica {r.index} serving again", flush=True)
        i += 1


def report(out: Path, replicas: list[Replica], kills: list[tuple[float, int]], samples: list, cmd: str) -> bool:
    rows = list(csv.reader(open(out / "requests.csv", encoding="utf-8")))
    in_window = [lambda t, k=k: k <= t <= k + WINDOW_S for k, _ in kills]
    lines = [f"command: {cmd}", f"kills: {len(kills)} (replicas {[i for _, i in kills]})"]
    ok = True
    for name in sorted({r[2] for r in rows}):
        calls = [r for r in rows if r[2] == name]
        failed = sum(r[3] != "True" for r in calls)
        through_client = name in ("Generate", "StreamGenerate", "StreamGenerate TTFT")
        ok &= failed == 0 or not through_client
        lines.append(f"{name}: {len(calls)} sent, {len(calls) - failed} completed, {failed} failed"
                     + ("" if through_client else " (a plain stub: no failover)"))  # fmt: skip
    for label, pick in (("in fault windows", True), ("outside them", False)):
        ms = sorted(float(r[1]) for r in rows if r[2] == "StreamGenerate" and r[3] == "True"
                    and any(w(float(r[0])) for w in in_window) == pick)  # fmt: skip
        if ms:
            p99 = ms[min(len(ms) - 1, int(0.99 * len(ms)))]
            lines.append(f"StreamGenerate {label}: p50 {statistics.median(ms):.0f} ms, p99 {p99:.0f} ms ({len(ms)})")
    failovers = (out / "failovers.txt").read_text().strip() if (out / "failovers.txt").exists() else "?"
    lines.append(f"failovers (calls sent again, streams resumed) by the load's clients: {failovers}")
    reference = Client(f"127.0.0.1:{replicas[0].port}", timeout=300)
    same = sum(tokens == [t for m in reference.stream(s.pop("prompt"), **s) for t in m.token_ids]
               for s, tokens in ((dict(s), t) for s, t in samples))  # fmt: skip
    reference.close()
    ok &= same == len(samples)
    lines.append(f"sample: {same} of {len(samples)} streams sent during the faults equal the same request on an "
                 "undisturbed replica")  # fmt: skip
    for r in replicas:
        busy, used = r.idle()
        ok &= busy == 0 and used == 0
        lines.append(f"replica {r.index}: started {r.starts} times, {r.rss_mb():.0f} MB, idle: {busy:.0f} "
                     f"requests, KV pool {used:.1%} used")  # fmt: skip
    text = "\n".join(lines) + f"\nresult: {'PASS' if ok else 'FAIL'}\n"
    (out / "report.txt").write_text(text, encoding="utf-8")
    print(text)
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600)
    parser.add_argument("--users", type=int, default=32)
    parser.add_argument("--every", type=float, default=120)
    parser.add_argument("--out", default="soak_faults_out")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "requests.csv").write_text("", encoding="utf-8")
    replicas = [Replica(i, out) for i in range(3)]
    for r in replicas:
        r.start()
    try:
        for r in replicas:
            r.wait_healthy()
        target = "ipv4:" + ",".join(f"127.0.0.1:{r.port}" for r in replicas)
        env = os.environ | {"BATCHSERVE_FAILOVER": "1", "BATCHSERVE_REQUEST_LOG": str(out / "requests.csv"),
                            "BATCHSERVE_FAILOVER_LOG": str(out / "failovers.txt")}  # fmt: skip
        locust = subprocess.Popen(
            [PY, "-m", "locust", "-f", "load_tests/locustfile.py", "--headless", "--users", str(args.users),
             "--spawn-rate", "4", "--run-time", f"{int(args.duration)}s", "--stop-timeout", "120", "--host", target,
             "--csv", str(out / "locust"), "--only-summary", "--exit-code-on-error", "0"],
            cwd=ROOT, env=env, stdout=open(out / "locust.log", "w"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        end = time.time() + args.duration
        stop, samples, kills = threading.Event(), [], []
        sampling = threading.Thread(target=sampler, args=(target, stop, samples))
        sampling.start()
        faults(replicas, args.every, end, kills)
        locust.wait(timeout=args.duration + 600)
        stop.set()
        sampling.join(timeout=600)
        cmd = f"load_tests/soak_faults.py --duration {args.duration:.0f} --users {args.users} --every {args.every:.0f}"
        return 0 if report(out, replicas, kills, samples, cmd) else 1
    finally:
        for r in replicas:
            r.stop()


if __name__ == "__main__":
    sys.exit(main())
