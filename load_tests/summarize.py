"""Summarize a headless Locust run. Exit 1 if any request failed other than by deliberate
RESOURCE_EXHAUSTED load shedding, if the KV pool is not back to full once the server is idle,
or if the server's memory grew by more than 5% from minute 2 to the end (runs of 4 minutes
or more).

    python load_tests/summarize.py PREFIX [RSS_CSV METRICS_HOST:PORT[,HOST:PORT...]]
"""

from __future__ import annotations

import csv
import sys
import time
import urllib.request
from pathlib import Path

MAX_RSS_GROWTH = 0.05  # from minute 2 (warm: tries, allocator pools) to the end
WARM_S = 120  # seconds before memory counts as warm
IDLE_WAIT_S = 15.0


def requests_report(prefix: str) -> bool:
    stats = list(csv.DictReader(open(f"{prefix}_stats.csv", encoding="utf-8")))
    failures = list(csv.DictReader(open(f"{prefix}_failures.csv", encoding="utf-8")))
    print(f"{'name':28} {'requests':>9} {'failures':>9} {'p50 ms':>9} {'p99 ms':>9} {'avg tokens':>11}")
    for row in stats:
        print(
            f"{row['Name']:28} {row['Request Count']:>9} {row['Failure Count']:>9} {row['50%']:>9} "
            f"{row['99%']:>9} {float(row['Average Content Size']):>11.1f}"
        )
    shed = sum(int(f["Occurrences"]) for f in failures if "RESOURCE_EXHAUSTED:" in f["Error"])
    real = [f for f in failures if "RESOURCE_EXHAUSTED:" not in f["Error"]]
    total = next((int(r["Request Count"]) for r in stats if r["Name"] == "Aggregated"), 0)
    print(f"shed by RESOURCE_EXHAUSTED: {shed}")
    for f in real:
        print(f"FAILED {f['Name']}: {f['Error']} x{f['Occurrences']}")
    if total == 0:
        print("no request completed")
        return False
    return not real


def memory_gate(samples: list[tuple[int, int]]) -> tuple[bool, str]:
    """(passed, what to print) for RSS samples (seconds since start, KiB). Growth is measured
    from the first sample at minute 2 or later (warm: tries, allocator pools) to the last one;
    warm samples spanning less than 2 minutes (a run shorter than 4, or a sampler that stalled)
    are too little to judge: the gate passes, saying so."""
    if not samples:
        return True, "memory: no samples"
    warm = [(t, kb) for t, kb in samples if t >= WARM_S]
    if not warm or warm[-1][0] - warm[0][0] < WARM_S:
        span = warm[-1][0] - warm[0][0] if warm else 0
        return True, (
            f"memory: {samples[-1][1] / 1024:.0f} MB at the end (run too short for the growth check: "
            f"warm samples span {span} s, {WARM_S} s needed)"
        )
    growth = samples[-1][1] / warm[0][1] - 1
    return growth <= MAX_RSS_GROWTH, (
        f"memory: {warm[0][1] / 1024:.0f} MB at minute 2, {samples[-1][1] / 1024:.0f} MB at the end "
        f"({growth:+.1%}; at most {MAX_RSS_GROWTH:.0%}), peak {max(kb for _, kb in samples) / 1024:.0f} MB"
    )


def memory_report(rss_csv: str) -> bool:
    samples = [(int(t), int(kb)) for t, kb in csv.reader(open(rss_csv, encoding="utf-8")) if kb.strip()]
    passed, line = memory_gate(samples)
    print(line)
    return passed


def _metric(body: str, name: str) -> float:
    for line in body.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def _finished(body: str) -> float:
    """Requests the replica finished, every finish reason."""
    prefix = "batchserve_requests_finished_total{"
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines() if line.startswith(prefix))


def idle_report(metrics: str) -> bool:
    """Once nothing runs or waits, every KV block is free again. `metrics`: host:port, or
    several, comma-separated (one per replica; each reports how many requests it finished)."""
    hosts = metrics.split(",")
    if len(hosts) > 1:
        return all([_idle(h, f"replica {h}: ") for h in hosts])
    return _idle(metrics, "")


def _idle(metrics: str, label: str) -> bool:
    deadline = time.monotonic() + IDLE_WAIT_S
    while True:
        body = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5).read().decode()
        busy = _metric(body, "batchserve_num_requests_running") + _metric(body, "batchserve_num_requests_waiting")
        usage = _metric(body, "batchserve_kv_cache_usage_ratio")
        if (busy == 0 and usage == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if label:
        print(f"{label}{_finished(body):.0f} requests finished")
    print(f"{label}idle: {busy:.0f} requests running or waiting, KV pool {usage:.1%} used (0% expected)")
    return busy == 0 and usage == 0


def main(argv: list[str]) -> int:
    prefix = argv[0] if argv else str(Path("load_out") / "locust")
    ok = requests_report(prefix)
    if len(argv) >= 3:
        ok = memory_report(argv[1]) and ok
        ok = idle_report(argv[2]) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
