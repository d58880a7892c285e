"""Prometheus metrics of a ``dsedge serve`` process: histograms (not quantile gauges), so that p99 can be aggregated
across replicas with ``histogram_quantile``. Every series carries ``model`` (the served name, unique per bundle) and,
where a variant served the request, ``variant``; each server has its own registry, so two sessions never collide.

Series:
    dsedge_request_duration_seconds{model,variant}   histogram, arrival at the server → answer
    dsedge_request_queue_seconds{model,variant}      histogram, arrival → start of the batch that served it
    dsedge_batch_size{model,variant}                 histogram, rows in that batch
    dsedge_requests_total{model,protocol,outcome,reason}  counter; outcome ok | late | rejected | error | invalid
    dsedge_inflight_requests{model}                  gauge, inside the model's session
    dsedge_queued_requests{model}                    gauge, waiting for a slot (priority queue)
    dsedge_model_ready{model}                        gauge, 1 once loaded and profiled
    dsedge_event_loop_lag_seconds                    gauge, how late the event loop wakes (CPU-bound front end)
"""
from __future__ import annotations

from typing import Any

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15,
                    0.2, 0.3, 0.5, 1.0, 2.0, 5.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class ServeMetrics:
    """The server's registry and series (needs ``prometheus-client``, extra ``serve``)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.latency = Histogram("dsedge_request_duration_seconds", "Arrival at the server to answer, seconds",
                                 ["model", "variant"], buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("dsedge_request_queue_seconds", "Arrival to start of the serving batch, seconds",
                               ["model", "variant"], buckets=_LATENCY_BUCKETS, registry=r)
        self.batch = Histogram("dsedge_batch_size", "Rows in the batch that served a request",
                               ["model", "variant"], buckets=_BATCH_BUCKETS, registry=r)
        self.requests = Counter("dsedge_requests", "Requests by outcome (ok = within budget) and reason",
                                ["model", "protocol", "outcome", "reason"], registry=r)
        self.inflight = Gauge("dsedge_inflight_requests", "Requests inside the model's session", ["model"],
                              registry=r)
        self.queued = Gauge("dsedge_queued_requests", "Requests waiting for a slot", ["model"], registry=r)
        self.ready = Gauge("dsedge_model_ready", "1 once the model is loaded and profiled", ["model"], registry=r)
        self.loop_lag = Gauge("dsedge_event_loop_lag_seconds", "How late the server's event loop wakes up, seconds "
                              "(time requests wait before their handler runs)", registry=r)

    def answered(self, model: str, protocol: str, variant: str, latency_s: float, queue_s: float, batch: int,
                 within: bool) -> None:
        self.latency.labels(model, variant).observe(latency_s)
        self.queue.labels(model, variant).observe(queue_s)
        self.batch.labels(model, variant).observe(batch)
        self.requests.labels(model, protocol, "ok" if within else "late", "").inc()

    def failed(self, model: str, protocol: str, outcome: str, reason: str) -> None:
        self.requests.labels(model, protocol, outcome, reason).inc()

    def asgi_app(self) -> Any:
        from prometheus_client import make_asgi_app

        return make_asgi_app(self.registry)
