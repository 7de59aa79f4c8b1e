"""`GET /metrics`: the server's counters in Prometheus' text format, through prometheus_client (one registry per
app, so several apps in one process stay apart):

    lopa_fast_requests_total{endpoint, status}      requests answered, by endpoint (a closed set: `ENDPOINTS`) and
                                                    HTTP status
    lopa_fast_request_seconds{endpoint}             latency of answered requests (histogram; 200s and errors)
    lopa_fast_forwards_total                        model forwards of served requests
    lopa_fast_generated_tokens_total                completion tokens of served requests (stats["generated_tokens"])
    lopa_fast_tpf                                   tokens per forward of served requests (histogram)
    lopa_fast_time_to_first_token_seconds{endpoint}  request to its first piece of final text (histogram; a
                                                    request without text: to its answer)
    lopa_fast_queue_seconds                         submit to the worker taking the request up (histogram)
    lopa_fast_requests_pending / _running           queued or running / decoding now (gauges, read at scrape time)
    lopa_fast_batch_rounds_total, lopa_fast_batch_size_max, lopa_fast_batch_size   the batch engine's shared rounds,
                                                    its largest batch and the histogram of requests per round
    lopa_fast_memory_reserved_bytes / _budget_bytes  running requests' memory estimates against the budget
    lopa_fast_memory_held_bytes                     what the batch engine's KV pools and compiled-batch lanes hold
                                                    beyond those estimates (counted against the budget too)
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TPF_BUCKETS = (1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# the `endpoint` label's closed set: the routes, and "other" for any other path (a label per raw path would let
# clients grow /metrics and memory without bound: issue 36, 300 random 8,000-character paths made it 43.5 MB)
ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat", "/v1/models": "models",
          "/metrics": "metrics", "/health": "health", "/tokenize": "tokenize", "/detokenize": "detokenize",
          "/version": "version"}
ENDPOINTS = frozenset(ROUTES.values()) | {"other"}


def route_label(path: str) -> str:
    """The `endpoint` label of a request path: its route's name, or "other"."""
    return ROUTES.get(path, "other")


class _WorkerCollector:
    """The worker's and the batch engine's state, read at scrape time."""

    def __init__(self):
        self.worker = None

    def collect(self):
        worker = self.worker
        if worker is None:
            return
        counts = dict(worker.counts)
        yield GaugeMetricFamily("lopa_fast_requests_pending", "Requests queued or running.", counts.get("pending", 0))
        yield GaugeMetricFamily("lopa_fast_requests_running", "Requests decoding now.", counts.get("running", 0))
        eng = getattr(worker, "engine", None)
        if eng is not None:
            yield CounterMetricFamily("lopa_fast_batch_rounds", "Rounds the batch engine ran (one forward each).",
                                      eng.rounds)
            yield GaugeMetricFamily("lopa_fast_batch_size_max", "The most requests seen in one batched round.",
                                    eng.max_live)
            sizes = dict(eng.batch_sizes)
            cum = [(str(b), sum(n for s, n in sizes.items() if s <= b)) for b in BATCH_BUCKETS]
            total = sum(sizes.values())
            yield HistogramMetricFamily("lopa_fast_batch_size", "Requests per batched round.",
                                        buckets=[*cum, ("+Inf", total)],
                                        sum_value=sum(s * n for s, n in sizes.items()))
        mem = getattr(worker, "memory", None)
        if mem is not None and mem.budget is not None:
            yield GaugeMetricFamily("lopa_fast_memory_reserved_bytes", "Memory estimates of the running requests.",
                                    mem.used)
            yield GaugeMetricFamily("lopa_fast_memory_budget_bytes", "The budget running requests' estimates share.",
                                    mem.budget)
            yield GaugeMetricFamily("lopa_fast_memory_held_bytes", "KV pools and compiled-batch lanes beyond the "
                                    "running requests' estimates.", mem.held)


class Metrics:
    """Counters updated by the routes (`request`) and read by `render` (prometheus_client is thread-safe)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("lopa_fast_requests", "Requests answered, by endpoint and HTTP status.",
                                ["endpoint", "status"], registry=r)
        self.latency = Histogram("lopa_fast_request_seconds", "Seconds from request to its answer.", ["endpoint"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.forwards = Counter("lopa_fast_forwards", "Model forwards of served requests.", registry=r)
        self.tokens = Counter("lopa_fast_generated_tokens", "Generated positions of served requests.", registry=r)
        self.tpf = Histogram("lopa_fast_tpf", "Tokens per forward of served requests.", buckets=TPF_BUCKETS, registry=r)
        self.first_token = Histogram("lopa_fast_time_to_first_token_seconds", "Seconds from request to its first "
                                     "piece of final text.", ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("lopa_fast_queue_seconds", "Seconds a request waited before decoding started.",
                               buckets=LATENCY_BUCKETS, registry=r)
        self._worker = _WorkerCollector()
        r.register(self._worker)

    def request(self, endpoint: str, status: int, seconds: float, stats: dict | None = None) -> None:
        endpoint = endpoint if endpoint in ENDPOINTS else "other"
        self.requests.labels(endpoint=endpoint, status=str(int(status))).inc()
        self.latency.labels(endpoint=endpoint).observe(max(0.0, seconds))
        if stats:
            self.forwards.inc(int(stats.get("forwards", 0) or 0))
            self.tokens.inc(int(stats.get("generated_tokens", 0) or 0))
            if stats.get("tpf") is not None:
                self.tpf.observe(float(stats["tpf"]))

    def timing(self, endpoint: str, first_token_s: float | None, queue_s: float | None) -> None:
        """A served request's time to first token and queue time (None: not known, not observed)."""
        endpoint = endpoint if endpoint in ENDPOINTS else "other"
        if first_token_s is not None:
            self.first_token.labels(endpoint=endpoint).observe(max(0.0, first_token_s))
        if queue_s is not None:
            self.queue.observe(max(0.0, queue_s))

    def render(self, worker=None) -> str:
        self._worker.worker = worker
        return generate_latest(self.registry).decode()
