"""Prometheus metrics, one registry per ServingCore (so several cores can live in one process).

With `--workers N` every worker keeps its own registry and answers a sibling's request for it
(`serve.core.peers`); whichever worker a scrape lands on returns all of them, each series labelled `worker="i"` (sum without(worker) for the server). A
worker being restarted is left out of that scrape, and its counters start again from zero, as
Prometheus expects of a restarted target.
"""

from __future__ import annotations

import logging

from prometheus_client import (
    CONTENT_TYPE_LATEST,  # noqa: F401 - re-exported for the app
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "serve_requests", "Requests handled, by API route and HTTP status code.",
            ["route", "code"], registry=r,
        )
        self.latency = Histogram(
            "serve_request_latency_seconds", "Request latency in the server, by API route.",
            ["route"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.batch_size = Histogram(
            "serve_batch_size", "Rows per model call made by the dynamic batcher.",
            ["model"], buckets=_BATCH_BUCKETS, registry=r,
        )
        self.batch_requests = Histogram(
            "serve_batch_requests", "Requests merged into one model call.",
            ["model"], buckets=_BATCH_BUCKETS, registry=r,
        )
        self.model_latency = Histogram(
            "serve_model_call_seconds", "Duration of one model call.",
            ["model"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.queued_rows = Gauge("serve_queued_rows", "Rows waiting in the batch queues.", registry=r)
        self.model_version = Gauge(
            "serve_model_version", "Version answering requests without an explicit version.",
            ["model"], registry=r,
        )
        self.live_versions = Gauge(
            "serve_model_versions_live", "Number of loaded, warm versions.", ["model"], registry=r,
        )
        self.connection_events = Counter(
            "serve_connection_events", "Connections refused, evicted or closed by the server and client protocol "
            "errors, by port and kind (refused, evicted, idle_closed, malformed, unimplemented, enhance_your_calm...).",
            ["port", "event"], registry=r,
        )
        self.in_flight = 0
        """Requests being handled (a plain counter, read by the gauge when scraped)."""
        Gauge("serve_in_flight_requests", "Requests being handled.", registry=r).set_function(lambda: self.in_flight)
        self._children: dict[tuple[str, str], tuple] = {}

    def observe_request(self, route: str, code: str, seconds: float) -> None:
        """Count one answered request; the labelled children are cached (labels() locks and hashes)."""
        children = self._children.get((route, code))
        if children is None:
            children = self._children[(route, code)] = (
                self.requests.labels(route, code), self.latency.labels(route))
        children[0].inc()
        children[1].observe(seconds)

    def connection_event(self, port: str, event: str) -> None:
        children = self._children.get((port, event, None))
        if children is None:
            children = self._children[(port, event, None)] = (self.connection_events.labels(port, event),)
        children[0].inc()

    def observe_batch(self, model: str, rows: int, requests: int, seconds: float) -> None:
        self.batch_size.labels(model).observe(rows)
        self.batch_requests.labels(model).observe(requests)
        self.model_latency.labels(model).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Families:
    def __init__(self, families: list) -> None:
        self.families = families

    def collect(self) -> list:
        return self.families


def merge_worker_metrics(texts: dict[int, bytes]) -> bytes:
    """One exposition of several workers' texts, every sample labelled `worker`."""
    merged: dict[str, object] = {}
    for index, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text.decode()):
            target = merged.setdefault(family.name, family)
            labelled = [sample._replace(labels={**sample.labels, "worker": str(index)}) for sample in family.samples]
            if target is family:
                family.samples = labelled
            else:
                target.samples.extend(labelled)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(merged.values())))
    return generate_latest(registry)
