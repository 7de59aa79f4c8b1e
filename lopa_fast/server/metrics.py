"""`GET /metrics`: the server's counters in Prometheus' text exposition format (version 0.0.4), written here
(no prometheus_client dependency): every family has its # HELP and # TYPE line, label values are escaped, histograms
have cumulative `_bucket{le=...}` series ending in `+Inf`, `_sum` and `_count`.

    lopa_fast_requests_total{endpoint, status}      requests answered, by endpoint and HTTP status
    lopa_fast_request_seconds{endpoint}             latency of answered requests (histogram; 200s and errors)
    lopa_fast_forwards_total                        model forwards of served requests
    lopa_fast_generated_tokens_total                completion tokens of served requests (stats["generated_tokens"])
    lopa_fast_tpf                                   tokens per forward of served requests (histogram)
    lopa_fast_requests_pending / _running           queued or running / decoding now (gauges)
    lopa_fast_batch_rounds_total, lopa_fast_batch_size_max   the batch engine's shared rounds and largest batch
    lopa_fast_memory_reserved_bytes / _budget_bytes  running requests' memory estimates against the budget
"""
from __future__ import annotations

import math
import threading

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TPF_BUCKETS = (1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0)


def _escape(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items())) + "}"


def _num(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x))


class _Histogram:
    def __init__(self, buckets):
        self.buckets, self.counts, self.sum, self.n = tuple(buckets), [0] * len(buckets), 0.0, 0

    def observe(self, v: float) -> None:
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1
        self.sum += v
        self.n += 1

    def lines(self, name: str, labels: dict) -> list[str]:
        out = [f"{name}_bucket{_labels({**labels, 'le': _num(b)})} {c}" for b, c in zip(self.buckets, self.counts)]
        out.append(f"{name}_bucket{_labels({**labels, 'le': '+Inf'})} {self.n}")
        out += [f"{name}_sum{_labels(labels)} {_num(self.sum)}", f"{name}_count{_labels(labels)} {self.n}"]
        return out


class Metrics:
    """Counters updated by the routes (`request`) and read by `render` (thread-safe)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}
        self.latency: dict[str, _Histogram] = {}
        self.forwards = 0
        self.tokens = 0
        self.tpf = _Histogram(TPF_BUCKETS)

    def request(self, endpoint: str, status: int, seconds: float, stats: dict | None = None) -> None:
        with self._lock:
            self.requests[(endpoint, int(status))] = self.requests.get((endpoint, int(status)), 0) + 1
            self.latency.setdefault(endpoint, _Histogram(LATENCY_BUCKETS)).observe(max(0.0, seconds))
            if stats:
                self.forwards += int(stats.get("forwards", 0) or 0)
                self.tokens += int(stats.get("generated_tokens", 0) or 0)
                if stats.get("tpf") is not None:
                    self.tpf.observe(float(stats["tpf"]))

    def render(self, worker=None) -> str:
        out: list[str] = []

        def family(name, kind, help_, lines):
            out.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *lines])

        with self._lock:
            family("lopa_fast_requests_total", "counter", "Requests answered, by endpoint and HTTP status.",
                   [f"lopa_fast_requests_total{_labels({'endpoint': e, 'status': str(s)})} {n}"
                    for (e, s), n in sorted(self.requests.items())])  # fmt: skip
            family("lopa_fast_request_seconds", "histogram", "Seconds from request to its answer.",
                   [ln for e, h in sorted(self.latency.items()) for ln in h.lines("lopa_fast_request_seconds",
                                                                                  {"endpoint": e})])  # fmt: skip
            family("lopa_fast_forwards_total", "counter", "Model forwards of served requests.",
                   [f"lopa_fast_forwards_total {self.forwards}"])
            family("lopa_fast_generated_tokens_total", "counter", "Generated positions of served requests.",
                   [f"lopa_fast_generated_tokens_total {self.tokens}"])
            family("lopa_fast_tpf", "histogram", "Tokens per forward of served requests.",
                   self.tpf.lines("lopa_fast_tpf", {}))
        if worker is not None:
            counts = dict(worker.counts)
            family("lopa_fast_requests_pending", "gauge", "Requests queued or running.",
                   [f"lopa_fast_requests_pending {counts.get('pending', 0)}"])
            family("lopa_fast_requests_running", "gauge", "Requests decoding now.",
                   [f"lopa_fast_requests_running {counts.get('running', 0)}"])
            eng = getattr(worker, "engine", None)
            if eng is not None:
                family("lopa_fast_batch_rounds_total", "counter", "Rounds the batch engine ran (one forward each).",
                       [f"lopa_fast_batch_rounds_total {eng.rounds}"])
                family("lopa_fast_batch_size_max", "gauge", "The most requests seen in one batched round.",
                       [f"lopa_fast_batch_size_max {eng.max_live}"])
            mem = getattr(worker, "memory", None)
            if mem is not None and mem.budget is not None:
                family("lopa_fast_memory_reserved_bytes", "gauge", "Memory estimates of the running requests.",
                       [f"lopa_fast_memory_reserved_bytes {mem.used}"])
                family("lopa_fast_memory_budget_bytes", "gauge", "The budget running requests' estimates share.",
                       [f"lopa_fast_memory_budget_bytes {mem.budget}"])
        return "\n".join(out) + "\n"
