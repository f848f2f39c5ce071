"""Prometheus metrics, one registry per app (so several apps, e.g. in tests, never collide)."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_SCORE_BUCKETS = (
    0.05,
    0.1,
    0.2,
    0.3,
    0.4,
    0.5,
    0.6,
    0.7,
    0.8,
    0.9,
    0.95,
    1.0,
    2.0,
    5.0,
    10.0,
    100.0,
)


class Metrics:
    """The service's collectors. Flag rate = ``lapguard_flagged_total / lapguard_images_total``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        http_labels = ["route", "method", "status"]
        self.requests = Counter(
            "lapguard_http_requests",
            "HTTP requests by route, method and status",
            http_labels,
            registry=r,
        )
        self.latency = self._histogram(
            "lapguard_http_request_duration_seconds",
            "HTTP request latency by route, method and status",
            _LATENCY_BUCKETS,
            http_labels,
        )
        grpc_labels = ["method", "code"]
        self.grpc_requests = Counter(
            "lapguard_grpc_requests", "gRPC calls by method and status", grpc_labels, registry=r
        )
        self.grpc_latency = self._histogram(
            "lapguard_grpc_request_duration_seconds",
            "gRPC call latency by method and status code",
            _LATENCY_BUCKETS,
            grpc_labels,
        )
        self.batch_size = self._histogram(
            "lapguard_batch_size", "images per forward pass", _BATCH_BUCKETS
        )
        self.batch_seconds = self._histogram(
            "lapguard_batch_duration_seconds", "time of one Guard call on a batch", _LATENCY_BUCKETS
        )
        self.queue_seconds = self._histogram(
            "lapguard_queue_wait_seconds",
            "time a request waited before its batch ran",
            _LATENCY_BUCKETS,
        )
        self.queue_depth = Gauge("lapguard_queue_images", "images waiting for a batch", registry=r)
        self.images = Counter("lapguard_images", "images scored", registry=r)
        self.flagged = Counter("lapguard_flagged", "images flagged as abnormal", registry=r)
        self.scores = self._histogram(
            "lapguard_score", "abnormality score (higher = more abnormal)", _SCORE_BUCKETS
        )
        self.rejected = Counter(
            "lapguard_rejected",
            "requests refused before running, by reason",
            ["reason"],
            registry=r,
        )
        self.query_attacks = Counter(
            "lapguard_query_attacks",
            "queries flagged as part of a query-based black-box attack (stateful detection)",
            registry=r,
        )
        self.query_check_seconds = self._histogram(
            "lapguard_query_check_duration_seconds",
            "time of one request's query-memory check (lookup + store)",
            _LATENCY_BUCKETS,
        )
        self.query_store_errors = Counter(
            "lapguard_query_store_errors",
            "requests served unchecked because the query store failed",
            registry=r,
        )
        self.ready = Gauge("lapguard_ready", "1 when the model is loaded and warmed up", registry=r)
        self.bundle = Info(
            "lapguard_bundle",
            "the bundle that answers: name, version, sha256 of its manifest.json",
            registry=r,
        )
        self.reloads = Counter(
            "lapguard_bundle_reloads",
            "bundle hot reloads by outcome: swapped, or refused (the previous bundle kept serving)",
            ["outcome"],
            registry=r,
        )
        for outcome in ("swapped", "refused"):
            self.reloads.labels(outcome)

    def serve_bundle(self, name: str, version: str, sha256: str | None) -> None:
        """Record which bundle answers (``lapguard_bundle_info``)."""
        self.bundle.info({"name": name, "version": version, "sha256": sha256 or "unknown"})

    def _histogram(
        self,
        name: str,
        documentation: str,
        buckets: Sequence[float],
        labels: Sequence[str] = (),
    ) -> Histogram:
        return Histogram(name, documentation, labels, buckets=buckets, registry=self.registry)
