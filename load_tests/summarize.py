"""Summarize a headless Locust run's CSVs; exit 1 if any request failed other than by
deliberate RESOURCE_EXHAUSTED load shedding."""

from __future__ import annotations

import csv
import sys
from pathlib import Path


def main(prefix: str) -> int:
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
        return 1
    return 1 if real else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else str(Path("load_out") / "locust")))
