"""Prometheus metrics (`batchserve_*`), modelled on vLLM's and SGLang's names."""

from __future__ import annotations

import logging
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

from batchserve.async_engine import AsyncEngine
from batchserve.records import SchedulerOutput, StepPhases
from batchserve.request import RequestOutput


class _ThreadingServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # a scrape a few seconds: not a log line each
        pass


request_log = logging.getLogger("batchserve.server")  # the front ends' log, one line a request
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 12, 16, 32, 64)
DECODING_LENGTH_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128)
PHASE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
STEP_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


class Metrics:
    """The server's Prometheus registry: engine gauges, per-request and per-step histograms."""

    def __init__(self, engine: AsyncEngine, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self._engine = engine
        self._http: WSGIServer | None = None
        self._seen: dict[Counter, int] = {}  # engine totals already added to each counter
        for name, doc, attr in (
            ("batchserve_num_requests_running", "Requests in the running batch", "num_running"),
            ("batchserve_num_requests_waiting", "Requests waiting for admission", "num_waiting"),
            ("batchserve_kv_cache_usage_ratio", "Fraction of KV blocks in use", "kv_usage"),
            ("batchserve_kv_cache_free_blocks", "Free KV blocks", "num_free_kv_blocks"),
        ):
            Gauge(name, doc, registry=r).set_function(lambda attr=attr: getattr(engine.load(), attr))
        Gauge("batchserve_engine_steps", "Model steps run since start", registry=r).set_function(
            lambda: engine.num_steps
        )
        profile = engine.cost_profile
        if profile is not None:
            Gauge(
                "batchserve_critical_decoding_length",
                "Tokens per step whose forward costs within 10% of a one-token step (from the cost profile)",
                registry=r,
            ).set(profile.critical_decoding_length())
        self._request_metrics()
        self._step_metrics()
        engine.step_listeners.append(self.observe_step)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...], labels: tuple[str, ...] = ()) -> Histogram:
        return Histogram(name, doc, list(labels), registry=self.registry, buckets=buckets)

    def _request_metrics(self) -> None:
        r, h = self.registry, self._histogram
        self.ttft = h("batchserve_time_to_first_token_seconds", "Time to first token", LATENCY_BUCKETS)
        self.itl = h("batchserve_inter_token_latency_seconds", "Time per output token after the first", LATENCY_BUCKETS)
        self.e2e = h("batchserve_e2e_request_latency_seconds", "Request latency", LATENCY_BUCKETS)
        self.queue = h("batchserve_request_queue_time_seconds", "Time waiting before the first step", LATENCY_BUCKETS)
        self.prompt_tokens = Counter("batchserve_prompt_tokens", "Prompt tokens processed", registry=r)
        self.prompt_tokens_cached = Counter(
            "batchserve_prompt_tokens_cached", "Prompt tokens whose KV came from the prefix cache", registry=r
        )
        self.resumed_tokens = Counter(
            "batchserve_resumed_tokens", "Tokens carried in resume_token_ids (input, not generated)", registry=r
        )
        self.generation_tokens = Counter("batchserve_generation_tokens", "Tokens generated", registry=r)
        self.draft_proposed = Counter("batchserve_draft_tokens_proposed", "Draft tokens verified", registry=r)
        self.draft_accepted = Counter("batchserve_draft_tokens_accepted", "Draft tokens accepted", registry=r)
        self.request_steps = Counter("batchserve_request_steps", "Per-request steps that emitted tokens", registry=r)
        Gauge(
            "batchserve_mean_accepted_tokens_per_step",
            "Accepted draft tokens per request step, since start",
            registry=r,
        ).set_function(lambda: self.draft_accepted._value.get() / max(1.0, self.request_steps._value.get()))
        self.tokens_per_step = h(
            "batchserve_request_tokens_per_step", "Per finished request: output tokens / steps", TOKEN_BUCKETS
        )
        self.finished = Counter("batchserve_requests_finished", "Finished requests", ["finish_reason"], registry=r)
        self.rejected = Counter("batchserve_requests_rejected", "Requests refused before running", ["code"], registry=r)

    def _step_metrics(self) -> None:
        h = self._histogram
        self.decoding_length = h(
            "batchserve_draft_decoding_length",
            "Draft tokens chosen per request per step (0 = decoded without a draft)",
            DECODING_LENGTH_BUCKETS,
        )
        self.step_tokens = h(
            "batchserve_step_tokens", "Tokens in one forward (prompt chunks + roots + drafts)", STEP_TOKEN_BUCKETS
        )
        self.step_phase = h(
            "batchserve_step_phase_seconds",
            "Time of one engine step in each phase (schedule, prepare, forward, verify, commit)",
            PHASE_BUCKETS,
            labels=("phase",),
        )
        self.preemptions = Counter(
            "batchserve_num_preemptions",
            "Requests preempted (their K/V dropped, recomputed later)",
            registry=self.registry,
        )
        self.prefix_queries = Counter(
            "batchserve_prefix_cache_queries",
            "Tokens of requests that looked up a cached prefix at admission",
            registry=self.registry,
        )
        self.prefix_hits = Counter(
            "batchserve_prefix_cache_hits", "Of those, tokens whose KV was reused", registry=self.registry
        )

    def observe_step(self, out: SchedulerOutput, phases: StepPhases) -> None:
        load = self._engine.load()
        seen = self._seen
        for counter, total in (
            (self.preemptions, load.num_preemptions),
            (self.prefix_queries, load.prefix_cache_queried_tokens),
            (self.prefix_hits, load.prefix_cache_hit_tokens),
        ):
            if total > seen.get(counter, 0):
                counter.inc(total - seen.get(counter, 0))
                seen[counter] = total
        if not out.requests:
            return
        for name, seconds in phases.items():
            self.step_phase.labels(name).observe(seconds)
        self.step_tokens.observe(out.num_tokens)
        for item in out.requests:
            if item.sample:
                self.decoding_length.observe(len(item.draft) if item.draft is not None else 0)

    def serve(self, port: int, host: str = "127.0.0.1", healthy: Callable[[], bool] = lambda: True) -> int:
        """Start the HTTP endpoint (port 0: any free port) and return the port it listens on:
        `/metrics`, and `/health` as the API's (200, or 503 once `healthy()` is False). Plaintext
        whatever the API's TLS, so that probes that present no client certificate (the kubelet's)
        can reach a replica that requires one."""
        self.close()
        metrics = make_wsgi_app(self.registry)

        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            if environ.get("PATH_INFO") == "/health":
                ok = healthy()
                start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "application/json")])
                return [b'{"status":"ok"}' if ok else b'{"status":"unavailable"}']
            return metrics(environ, start_response)

        family = socket.AF_INET6 if ":" in host else socket.AF_INET  # make_server's class fixes it
        server = type("MetricsServer", (_ThreadingServer,), {"address_family": family})
        self._http = make_server(host, port, app, server, handler_class=_Quiet)
        threading.Thread(target=self._http.serve_forever, daemon=True, name="batchserve-metrics").start()
        return self._http.server_port

    def close(self) -> None:
        """Stop the HTTP endpoint, if serving, and release its port."""
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

    def track(self) -> RequestTracker:
        return RequestTracker(self)


@dataclass(slots=True)
class RequestTracker:
    """Per-request timing, fed every output of one request."""

    metrics: Metrics
    start: float = field(default_factory=time.monotonic)
    last: float | None = None
    num_tokens: int = 0

    def observe(self, out: RequestOutput) -> None:
        now = time.monotonic()
        n = len(out.new_token_ids)
        if n:
            if self.last is None:
                self.metrics.ttft.observe(now - self.start)
                if out.stats.queue_seconds is not None:
                    self.metrics.queue.observe(out.stats.queue_seconds)
            else:
                per_token = (now - self.last) / n
                for _ in range(n):
                    self.metrics.itl.observe(per_token)
            self.last = now
            self.num_tokens += n
            self.metrics.generation_tokens.inc(n)
        if out.finished:
            m = self.metrics
            m.e2e.observe(now - self.start)
            m.prompt_tokens.inc(out.num_prompt_tokens)
            m.prompt_tokens_cached.inc(out.stats.cached_prompt_tokens)
            m.resumed_tokens.inc(out.stats.resumed_tokens)
            m.draft_proposed.inc(out.stats.draft_tokens_proposed)
            m.draft_accepted.inc(out.stats.draft_tokens_accepted)
            m.request_steps.inc(out.stats.steps)
            if out.stats.steps:
                m.tokens_per_step.observe(out.tokens_per_step)
            m.finished.labels(out.finish_reason.value if out.finish_reason else "unknown").inc()


def log_end(metrics: Metrics, request_id: str, last: RequestOutput | None, seconds: float) -> None:
    """Count a call its client left as cancelled, and log how each request ended."""
    if last is None or not last.finished:
        metrics.finished.labels("cancelled").inc()
        request_log.info("request %s cancelled by the client after %.2fs", request_id, seconds)
    else:
        request_log.info(
            "request %s finished: %d prompt + %d resumed + %d generated tokens, %s, %.2fs, %.2f tokens/step",
            request_id,
            last.num_prompt_tokens,
            last.stats.resumed_tokens,
            last.num_output_tokens - last.stats.resumed_tokens,
            last.finish_reason.value if last.finish_reason else "?",
            seconds,
            last.tokens_per_step,
        )
