"""Prometheus metrics of one server, in their own `CollectorRegistry` (two apps in one process don't mix).

Names follow vLLM's with a `mini_infer:` prefix, so existing dashboards need only the prefix changed.
Gauges and token counters are read at scrape time from the async engine's stats snapshot (taken by the
loop thread after each step); latency histograms and the success counter are fed by an engine observer,
which runs in the loop thread and sees every `RequestOutput`.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from mini_infer.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)


class _EngineStatsCollector:
    """Gauges and counters computed from the engine's stats snapshot at scrape time."""

    def __init__(self, model_name: str, stats: Callable[[], dict | None]) -> None:
        self.model_name = model_name
        self.stats = stats

    def describe(self):  # static description, so registration does not call collect()
        return []

    def collect(self):
        s = self.stats() or {}
        labels = ["model_name"]
        value = [self.model_name]

        def gauge(name, doc, v):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(value, float(v))
            return g

        def counter(name, doc, v):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(value, float(v))
            return c

        yield gauge("mini_infer:num_requests_running", "Sequences in the running batch.", s.get("num_running", 0))
        yield gauge("mini_infer:num_requests_waiting", "Sequences waiting to be scheduled.", s.get("num_waiting", 0))
        yield gauge("mini_infer:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).",
                    s.get("kv_cache_usage", 0.0))
        yield gauge("mini_infer:engine_dead", "1 when the engine loop has died.", 1 if s.get("dead") else 0)
        yield counter("mini_infer:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.get("prefix_cache_queries", 0))
        yield counter("mini_infer:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      s.get("prefix_cache_hits", 0))
        yield counter("mini_infer:num_preemptions", "Sequences preempted to free KV blocks.",
                      s.get("num_preemptions", 0))
        yield counter("mini_infer:prompt_tokens", "Prompt tokens of accepted requests.", s.get("prompt_tokens", 0))
        yield counter("mini_infer:generation_tokens", "Generated tokens.", s.get("generation_tokens", 0))


class ServerMetrics:
    """The server's registry; also an `EngineObserver` (add it with `engine.add_observer`)."""

    def __init__(self, model_name: str, stats: Callable[[], dict | None]) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(model_name, stats))
        labels = ["model_name"]
        self.ttft = Histogram("mini_infer:time_to_first_token_seconds", "Time from arrival to the first token.",
                              labels, registry=self.registry, buckets=_LATENCY_BUCKETS).labels(model_name)
        self.itl = Histogram("mini_infer:inter_token_latency_seconds", "Time between a request's steps.",
                             labels, registry=self.registry, buckets=_ITL_BUCKETS).labels(model_name)
        self.e2e = Histogram("mini_infer:e2e_request_latency_seconds", "Time from arrival to the last token.",
                             labels, registry=self.registry, buckets=_E2E_BUCKETS).labels(model_name)
        self.success = Counter("mini_infer:request_success", "Finished requests, by finish reason.",
                               ["model_name", "finished_reason"], registry=self.registry)
        self._last_token: dict[str, float] = {}  # loop thread only

    # --------------------------------------------------------------- EngineObserver (loop thread)
    def on_output(self, out: RequestOutput) -> None:
        m = out.metrics
        if m is not None and m.first_token_time is not None:
            prev = self._last_token.get(out.request_id)
            if prev is None:
                self.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
            elif m.last_token_time is not None and m.last_token_time > prev:
                self.itl.observe(m.last_token_time - prev)
            self._last_token[out.request_id] = m.last_token_time or m.first_token_time
        if out.finished:
            self._last_token.pop(out.request_id, None)
            if m is not None:
                end = m.finished_time or m.last_token_time or m.arrival_time
                self.e2e.observe(max(0.0, end - m.arrival_time))
            reason = next((o.finish_reason for o in out.outputs if o.finish_reason), None) or "unknown"
            self.success.labels(self.model_name, reason).inc()

    def on_abort(self, request_id: str) -> None:
        self._last_token.pop(request_id, None)
        self.success.labels(self.model_name, "abort").inc()

    # --------------------------------------------------------------- exposition
    def render(self) -> bytes:
        return generate_latest(self.registry)
