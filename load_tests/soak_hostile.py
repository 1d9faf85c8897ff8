"""The hostile-tenant soak (`make soak-hostile`): the same well-behaved load twice, each time on a
fresh server, alone and then beside a hostile tenant (load_tests/hostile.py: grammar and resume
floods, echo + logprobs on long prompts, huge bodies, slow readers, cancels, key rotation, a seat
hog, idle sockets, trickled bodies, health streams, a preparation flood and key revocation).

    .venv/bin/python load_tests/soak_hostile.py [--duration 120] [--users 8] [--hostile 2] [--burst 4]
        [--no-keys] [--out soak_hostile_out] [--report load_tests/results/hostile-report.md] [-- SERVER_ARGS...]

By default the server has API keys, one a tenant, as a server shared by tenants should: key
rotation's tenant strings are then ignored, and key revocation removes keys of the hostile user's
own from the file (SIGHUP) under its running streams. `--no-keys` takes tenants from a header,
where a client may claim as many as it likes (docs/serving.md: what holds without keys).

Reports (OUT/report.md and --report) the well-behaved users' TTFT and TPOT p50/p99 both ways,
their failed calls and tokens a step on repeated greedy prompts (their tenant's drafter state),
the hostile calls' outcomes by kind, which attacks were in flight while streams waited or
decoded, and the server's RSS; exits 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import math
import os
import re
import secrets
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = os.environ.get("PYTHON", str(ROOT / ".venv" / "bin" / "python"))
FIELDS = ("start", "role", "proto", "kind", "outcome", "ok", "ms", "ttft_ms", "tpot_ms", "tokens", "tps", "key")
STREAM_KINDS = ("stream", "repeat")  # the well-behaved calls whose TTFT and TPOT are measured
SLOWDOWN = 1.25  # p99 TTFT and TPOT beside the hostile tenant, at most this times alone
TPS_RATIO = 0.90  # tokens a step on repeated prompts beside it, at least this times alone (noise)
RSS_GROWTH = 0.10  # the server's peak RSS beside it, at most this above alone
REVOKED_S = 5.0  # a stream under a key removed from the file (SIGHUP) ends within this
_REVOKED = re.compile(r"ended UNAUTHENTICATED after ([0-9.]+) s; a new call UNAUTHENTICATED")
RSS_EVERY_S = 2.0
UNFINISHED = "unfinished when the run ended"  # cut by Locust's stop: neither a success nor a failure


@dataclass(frozen=True, slots=True)
class Call:
    """One call as the load's users logged it (load_tests/hostile.py's log_call)."""

    start: float  # wall clock, seconds
    role: str  # "good" (a well-behaved user) or "hostile"
    proto: str  # "grpc" or "http"
    kind: str  # stream, repeat, generate, cancel; or the attack (grammar-distinct, resume, echo, ...)
    outcome: str  # "ok", an error (well-behaved); "http 413", "grpc INVALID_ARGUMENT", ... (hostile)
    ok: bool
    ms: float
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    tokens: int = 0
    tps: float | None = None  # the response's tokens a step
    key: str = ""  # which repeated prompt

    @classmethod
    def from_row(cls, r: dict[str, str]) -> Call:
        num = {k: float(r[k]) if r.get(k) else None for k in ("ttft_ms", "tpot_ms", "tps")}
        return cls(float(r["start"]), r["role"], r["proto"], r["kind"], r["outcome"], r["ok"] == "1", float(r["ms"]),
                   num["ttft_ms"], num["tpot_ms"], int(r["tokens"] or 0), num["tps"], r["key"] or "")  # fmt: skip


def read_calls(path: Path) -> list[Call]:
    """The calls of a log (no header: the users append rows as they finish)."""
    with open(path, encoding="utf-8", newline="") as f:
        return [Call.from_row(row) for row in csv.DictReader(f, fieldnames=FIELDS) if row.get("role")]


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank `q` quantile (0 < q <= 1); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def ratio(new: float | None, base: float | None) -> float | None:
    return None if new is None or not base else new / base


def latency(calls: Sequence[Call]) -> dict[str, float | None]:
    """The well-behaved streams' TTFT and TPOT p50 and p99 (ms), and how many streams."""
    streams = [c for c in calls if c.role == "good" and c.ok and c.kind in STREAM_KINDS and c.ttft_ms is not None]
    ttft = [c.ttft_ms for c in streams if c.ttft_ms is not None]
    tpot = [c.tpot_ms for c in streams if c.tpot_ms is not None]
    return {
        "ttft_p50": percentile(ttft, 0.5), "ttft_p99": percentile(ttft, 0.99),
        "tpot_p50": percentile(tpot, 0.5), "tpot_p99": percentile(tpot, 0.99), "streams": float(len(streams)),
    }  # fmt: skip


def tokens_a_step(calls: Sequence[Call], kind: str = "repeat") -> tuple[float | None, int]:
    """(mean tokens a step, calls counted) of the well-behaved repeated prompts: "repeat", during
    the load, each prompt's first call left out (the drafter has learnt nothing of it then);
    "probe", each prompt once more after the load, on the idle server (no batch shares the draft
    budget): what the tenant's drafter state kept."""
    seen: set[str] = set()
    values = []
    for c in sorted(calls, key=lambda c: c.start):
        if c.role == "good" and c.kind == kind and c.ok and c.tps is not None:
            if c.key in seen or kind != "repeat":
                values.append(c.tps)
            seen.add(c.key)
    return (statistics.fmean(values) if values else None), len(values)


def failures(calls: Sequence[Call]) -> list[Call]:
    return [c for c in calls if c.role == "good" and not c.ok and c.outcome != UNFINISHED]


def rss_summary(samples: Sequence[tuple[float, int]]) -> dict[str, float]:
    """Start, peak and end RSS in MB of (seconds, KiB) samples, and the growth from start to end."""
    if not samples:
        return {}
    start, end, peak = samples[0][1] / 1024, samples[-1][1] / 1024, max(kb for _, kb in samples) / 1024
    return {"start": start, "peak": peak, "end": end, "growth": end / start - 1 if start else 0.0}


def outcomes(calls: Sequence[Call]) -> dict[str, Counter[str]]:
    """The hostile calls' outcomes by "kind/proto"."""
    table: dict[str, Counter[str]] = {}
    for c in calls:
        if c.role == "hostile":
            table.setdefault(f"{c.kind}/{c.proto}", Counter())[c.outcome] += 1
    return dict(sorted(table.items()))


def overlaps(calls: Sequence[Call], tpot: bool = False) -> dict[str, tuple[int, float | None]]:
    """For each attack kind, the well-behaved streams whose wait for a first token (`tpot`: whose
    decoding, from the first token to the end) overlapped one of its calls: (how many, their TTFT
    p99, or TPOT p99); "none" for those that overlapped no hostile call."""
    metric = "tpot_ms" if tpot else "ttft_ms"
    streams = [
        c for c in calls if c.role == "good" and c.ok and c.kind in STREAM_KINDS and getattr(c, metric) is not None
    ]
    attacks = [c for c in calls if c.role == "hostile"]
    by_kind: dict[str, list[float]] = {}
    for s in streams:
        first = s.start + (s.ttft_ms or 0) / 1000
        begin, end = (first, s.start + s.ms / 1000) if tpot else (s.start, first)
        kinds = {a.kind for a in attacks if a.start < end and begin < a.start + a.ms / 1000}
        for kind in kinds or {"none"}:
            by_kind.setdefault(kind, []).append(getattr(s, metric) or 0)
    return {k: (len(v), percentile(v, 0.99)) for k, v in sorted(by_kind.items())}


@dataclass
class Phase:
    """One run of the load on a fresh server: its calls, the server's RSS (seconds, KiB), the
    machine's 1-minute load average over the run, how the server ended if it did."""

    name: str
    calls: list[Call] = field(default_factory=list)
    rss: list[tuple[float, int]] = field(default_factory=list)
    load: list[float] = field(default_factory=list)
    died: str | None = None


def targets(alone: Phase, hostile: Phase) -> list[tuple[str, bool, str]]:
    """(target, met, measured) for each of issue 79's targets."""
    la, lh = latency(alone.calls), latency(hostile.calls)
    checks = []
    for m in ("ttft_p99", "tpot_p99"):
        r = ratio(lh[m], la[m])
        checks.append((f"well-behaved {m} hostile/alone <= {SLOWDOWN}", r is not None and r <= SLOWDOWN, _x(r)))
    for phase in (alone, hostile):
        failed = len(failures(phase.calls))
        checks.append((f"well-behaved calls failed ({phase.name}) == 0", failed == 0, str(failed)))
        protos = sorted({c.proto for c in phase.calls if c.role == "good"})
        checks.append((f"well-behaved users called over gRPC and HTTP ({phase.name})", protos == ["grpc", "http"],
                       ", ".join(protos) or "none"))  # fmt: skip
    r = ratio(tokens_a_step(hostile.calls, "probe")[0], tokens_a_step(alone.calls, "probe")[0])
    checks.append((f"tokens a step (repeated prompts, idle probe) hostile/alone >= {TPS_RATIO}",
                   r is not None and r >= TPS_RATIO, _x(r)))  # fmt: skip
    peak_a, peak_h = rss_summary(alone.rss).get("peak"), rss_summary(hostile.rss).get("peak")
    growth = None if (r := ratio(peak_h, peak_a)) is None else r - 1
    checks.append((f"server peak RSS hostile vs alone < +{RSS_GROWTH:.0%}", growth is not None and growth < RSS_GROWTH,
                   "?" if growth is None else f"{growth:+.1%}"))  # fmt: skip
    sent = sum(1 for c in hostile.calls if c.role == "hostile")
    checks.append(("the hostile users sent calls", sent > 0, str(sent)))  # else the rest measured nothing
    revoked = [c for c in hostile.calls if c.kind == "key-revocation" and c.outcome != UNFINISHED]
    if revoked:  # keys on: each stream ends within REVOKED_S of the signal, and its key is refused
        seconds = [float(m.group(1)) if (m := _REVOKED.fullmatch(c.outcome)) else math.inf for c in revoked]
        checks.append((f"a removed key's stream ends within {REVOKED_S:.0f} s and the key is refused",
                       max(seconds) <= REVOKED_S, f"{len(revoked)} removed, slowest {max(seconds):.1f} s"))  # fmt: skip
    died = [f"{p.name}: {p.died}" for p in (alone, hostile) if p.died]
    checks.append(("server alive through both runs", not died, "; ".join(died) or "yes"))
    return checks


def _x(r: float | None) -> str:
    return "?" if r is None else f"{r:.2f}x"


def _ms(v: float | None, spec: str = ".0f") -> str:
    return "-" if v is None else format(v, spec)


def _well_behaved(alone: Phase, hostile: Phase) -> list[str]:
    la, lh = latency(alone.calls), latency(hostile.calls)
    lines = ["## Well-behaved users", "", "| | alone | beside the hostile tenant | ratio |", "|---|---|---|---|"]
    for m in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99"):
        lines.append(f"| {m.replace('_', ' ').upper()} ms | {_ms(la[m])} | {_ms(lh[m])} | {_x(ratio(lh[m], la[m]))} |")
    lines.append(f"| streams measured | {la['streams']:.0f} | {lh['streams']:.0f} | |")
    for kind, label in (("repeat", "during the load"), ("probe", "idle, after the load")):
        (ta, na), (th, nh) = tokens_a_step(alone.calls, kind), tokens_a_step(hostile.calls, kind)
        tps = f"{_ms(ta, '.2f')} ({na}) | {_ms(th, '.2f')} ({nh}) | {_x(ratio(th, ta))}"
        lines.append(f"| tokens a step, repeated prompts, {label} (calls) | {tps} |")
    kinds = [Counter(c.kind if c.outcome != UNFINISHED else "unfinished" for c in p.calls if c.role == "good")
             for p in (alone, hostile)]  # fmt: skip
    lines.append("| calls | " + " | ".join(", ".join(f"{k} {n}" for k, n in sorted(c.items())) for c in kinds) + " | |")
    lines += [f"- FAILED ({p.name}) {c.proto} {c.kind}: {c.outcome[:200]}" for p in (alone, hostile)
              for c in failures(p.calls)[:10]]  # fmt: skip
    return lines


def render(alone: Phase, hostile: Phase, header: Sequence[str]) -> tuple[str, bool]:
    """The report (markdown) and whether every target was met."""
    lines = [*header, "", *_well_behaved(alone, hostile)]
    lines += ["", "## Hostile calls (refused or limited is the expected outcome)", ""]
    for kind, counts in outcomes(hostile.calls).items():
        ms = percentile([c.ms for c in hostile.calls if c.role == "hostile" and f"{c.kind}/{c.proto}" == kind], 0.5)
        seen = ", ".join(f"{o} x{n}" for o, n in counts.most_common())
        lines.append(f"- {kind}: {sum(counts.values())} sent (p50 {_ms(ms)} ms): {seen}")
    lines += ["", "## Attacks in flight while a well-behaved stream waited for its first token, or decoded", ""]
    lines += ["| attack | streams waiting | TTFT p99 ms | streams decoding | TPOT p99 ms |", "|---|---|---|---|---|"]
    waiting, decoding = overlaps(hostile.calls), overlaps(hostile.calls, tpot=True)
    for k in sorted(waiting.keys() | decoding.keys()):
        (n, ttft), (m, tpot) = waiting.get(k, (0, None)), decoding.get(k, (0, None))
        lines.append(f"| {k} | {n} | {_ms(ttft)} | {m} | {_ms(tpot)} |")
    lines += ["", "## Server memory (RSS, MB) and the machine's load", ""]
    lines += ["| | start | peak | end | end/start | load average (1 min), mean |", "|---|---|---|---|---|---|"]
    for p in (alone, hostile):
        if r := rss_summary(p.rss):
            load = _ms(statistics.fmean(p.load) if p.load else None, ".1f")
            mb = " | ".join(f"{r[k]:.0f}" for k in ("start", "peak", "end"))
            lines.append(f"| {p.name} | {mb} | {r['growth']:+.1%} | {load} |")
    checks = targets(alone, hostile)
    lines += ["", "## Targets", ""]
    lines += [f"- {'PASS' if met else 'MISS'} {name}: {measured}" for name, met, measured in checks]
    ok = all(met for _, met, _ in checks)
    lines += ["", f"result: {'PASS' if ok else 'FAIL'}", ""]
    return "\n".join(lines), ok


class Server:
    """One `batchserve serve` process: gRPC on `port`, metrics on port + 1, HTTP on port + 2."""

    def __init__(self, port: int, out: Path, extra: Sequence[str], warm_key: str = "") -> None:
        self.port, self.out, self.warm_key = port, out, warm_key
        args = [PY, "-m", "batchserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                "--metrics-port", str(port + 1), "--http-port", str(port + 2), *extra]  # fmt: skip
        log = open(out / "server.log", "w", encoding="utf-8")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)

    def wait_ready(self, timeout: float = 600) -> None:
        """Until one short generation succeeds: the server is up, and one-time work (the drafter's
        native code built on its first use, the kernels' first calls) lands in neither run."""
        import grpc  # the report's functions above stay importable without it

        from batchserve.server.client import build_request
        from batchserve.v1 import generation_pb2_grpc as pb_grpc

        stub = pb_grpc.TextGenerationStub(grpc.insecure_channel(f"127.0.0.1:{self.port}"))
        request, deadline = build_request("def fibonacci(n):", max_new_tokens=32), time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            try:
                auth = (("authorization", f"Bearer {self.warm_key}"),) if self.warm_key else ()
                stub.Generate(request, timeout=300, metadata=(("x-batchserve-tenant", "warm-up"), *auth))
                return
            except grpc.RpcError:
                time.sleep(0.5)  # not listening yet (loading the model)
        raise SystemExit(f"the server is not ready (exit code {self.proc.poll()}); see {self.out / 'server.log'}")

    def rss_kb(self) -> int | None:
        with contextlib.suppress(OSError), open(f"/proc/{self.proc.pid}/status") as status:
            return next((int(line.split()[1]) for line in status if line.startswith("VmRSS:")), None)
        return None  # gone

    def stop(self) -> None:
        self.proc.terminate()  # a no-op once it has exited; else it drains (its grace period) and stops
        try:
            self.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def sample(self, stop: threading.Event, phase: Phase) -> None:
        """Its RSS and the machine's load every RSS_EVERY_S seconds into `phase`."""
        start = time.monotonic()
        while not stop.is_set():
            if (kb := self.rss_kb()) is not None:
                phase.rss.append((time.monotonic() - start, kb))
                phase.load.append(os.getloadavg()[0])
            stop.wait(RSS_EVERY_S)


def run_phase(name: str, hostile_users: int, args: argparse.Namespace, out: Path, port: int) -> Phase:
    """The well-behaved users, and `hostile_users` beside them, on a fresh server at `port`."""
    out, phase = out / name, Phase(name)
    out.mkdir(parents=True, exist_ok=True)
    (log := out / "calls.csv").write_text("", encoding="utf-8")
    keys = {who: secrets.token_hex(16) for who in ("good", "hostile", "warm-up")} if args.keys else {}
    extra = list(args.server_args)
    if keys:  # the key names the tenant; key revocation edits this file and signals the server
        (out / "keys").write_text("".join(f"{who} {key}\n" for who, key in keys.items()))
        (out / "keys").chmod(0o600)
        extra += ["--api-key-file", str(out / "keys")]
    server = Server(port, out, extra, keys.get("warm-up", ""))
    try:
        server.wait_ready()
        stop = threading.Event()
        threading.Thread(target=server.sample, args=(stop, phase), daemon=True).start()
        env = os.environ | {
            "BATCHSERVE_GRPC_HOST": f"127.0.0.1:{port}", "BATCHSERVE_METRICS_HOST": f"127.0.0.1:{port + 1}",
            "BATCHSERVE_HTTP_HOST": f"http://127.0.0.1:{port + 2}",
            "BATCHSERVE_CALL_LOG": str(log), "BATCHSERVE_GOOD_USERS": str(args.users),
            "BATCHSERVE_HOSTILE_USERS": str(hostile_users), "BATCHSERVE_HOSTILE_BURST": str(args.burst),
        }  # fmt: skip
        if keys:
            env |= {"BATCHSERVE_GOOD_KEY": keys["good"], "BATCHSERVE_HOSTILE_KEY": keys["hostile"],
                    "BATCHSERVE_KEY_FILE": str(out / "keys"),
                    "BATCHSERVE_SERVER_PID": str(server.proc.pid)}  # fmt: skip
        print(f"{time.strftime('%H:%M:%S')} {name}: {args.users} well-behaved users, {hostile_users} hostile, "
              f"{args.duration:.0f} s", flush=True)  # fmt: skip
        # Each tenant is its own client: the hostile users get a Locust process of their own, so
        # that their blocking calls never hold up the well-behaved users' sending (one gevent hub).
        runs = [("good", args.users, env | {"BATCHSERVE_HOSTILE_USERS": "0"})]
        if hostile_users:
            runs.append(("hostile", hostile_users, env | {"BATCHSERVE_GOOD_USERS": "0"}))
        procs = []
        for who, users, run_env in runs:
            cmd = [PY, "-m", "locust", "-f", "load_tests/locust_hostile.py", "--headless", "--users", str(users),
                   "--spawn-rate", str(users), "--run-time", f"{int(args.duration)}s", "--stop-timeout", "120",
                   "--csv", str(out / f"locust-{who}"), "--only-summary", "--exit-code-on-error", "0"]  # fmt: skip
            log_file = open(out / f"locust-{who}.log", "w", encoding="utf-8")
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=run_env, stdout=log_file, stderr=subprocess.STDOUT))
        for proc in procs:
            proc.wait(timeout=args.duration + 300)
        if (code := server.proc.poll()) is not None:
            phase.died = f"exited with {code} during the run (see {out / 'server.log'})"
        stop.set()
    finally:
        server.stop()
    phase.calls = read_calls(log)
    return phase


def _header(args: argparse.Namespace) -> list[str]:
    cpu = next((x.split(":")[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")), "?")
    flags = f"--duration {args.duration:.0f} --users {args.users} --hostile {args.hostile} --burst {args.burst}"
    flags += "" if args.keys else " --no-keys"
    extra = " ".join(args.server_args)
    return [
        f"# make soak-hostile, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
        f"{os.cpu_count()} cores of {cpu}; one server, default model{' (' + extra + ')' if extra else ''}; "
        f"{args.duration:.0f} s per run; {args.users} well-behaved users (tenant `good`, half gRPC, half HTTP), "
        f"{'each tenant with its API key' if args.keys else 'tenants by header (no keys)'}, "
        f"then the same beside {args.hostile} hostile users (tenant `hostile`, bursts of {args.burst}).", "",
        f"command: `load_tests/soak_hostile.py {flags}{' -- ' + extra if extra else ''}`",
    ]  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--duration", type=float, default=120, help="seconds of load in each run")
    parser.add_argument("--users", type=int, default=8, help="well-behaved users (half gRPC, half HTTP)")
    parser.add_argument("--hostile", type=int, default=2, help="hostile users in the second run")
    parser.add_argument("--burst", type=int, default=4, help="concurrent calls in a hostile flood")
    parser.add_argument("--port", type=int, default=50371, help="gRPC port (metrics, HTTP: +1, +2; 2nd run: +3)")
    parser.add_argument("--keys", action=argparse.BooleanOptionalAction, default=True,
                        help="API keys (each tenant its key; key revocation among the attacks); "
                        "--no-keys: tenants by header, as a keyless server takes them")  # fmt: skip
    parser.add_argument("--out", default="soak_hostile_out")
    parser.add_argument("--report", default=str(ROOT / "load_tests" / "results" / "hostile-report.md"))
    parser.add_argument("server_args", nargs=argparse.REMAINDER, help="after --: flags for `batchserve serve`")
    args = parser.parse_args(argv)
    args.server_args = [a for a in args.server_args if a != "--"]
    out = Path(args.out).resolve()
    alone = run_phase("alone", 0, args, out, args.port)
    hostile = run_phase("hostile", args.hostile, args, out, args.port + 3)  # the first's may be in TIME_WAIT
    text, ok = render(alone, hostile, _header(args))
    for path in (out / "report.md", Path(args.report)):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
