"""Prometheus metrics of the operator (served by `serve`; the Helm chart exposes the port).

Counters and histograms are updated where things happen: API requests and errors in `CountingRESTClient`
(every request the operator's client sends, watches included; controller.cluster.LeaderOnlyRESTClient puts the
leader-only write guard on top), reconciles in controller.loop.Controller. What the
caches and watches hold (objects per resource, LoRAJobs per phase, work-queue depth, watch restarts) and
whether this replica leads are read at scrape time (`STATE`). Each Controller has its own registry (several run in one test process).
"""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import parse_qs, urlparse
from wsgiref.simple_server import WSGIServer

from kubernetes.client import rest
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "lorajob_operator"


def request_verb(method: str, url: str) -> str:
    """The Kubernetes verb of a request: get, list, watch, create, patch, update, delete."""
    if method != "GET":
        return {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}.get(method, method.lower())
    parsed = urlparse(url)
    if parse_qs(parsed.query).get("watch") == ["true"]:
        return "watch"
    # A collection path ends in the plural (.../namespaces/<ns>/<plural> or .../<plural>); an object's in its name.
    parts = parsed.path.strip("/").split("/")
    core = parts[0] == "api"
    rest_parts = parts[2:] if core else parts[3:]
    if rest_parts[:1] == ["namespaces"] and len(rest_parts) >= 3:
        rest_parts = rest_parts[2:]
    return "list" if len(rest_parts) == 1 else "get"


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.api_requests = Counter(
            f"{PREFIX}_api_requests", "Requests sent to the Kubernetes API server, by verb", ["verb"], registry=self.registry
        )
        self.api_errors = Counter(
            f"{PREFIX}_api_errors", "API requests that failed (HTTP error or no answer), by verb and HTTP status",
            ["verb", "code"], registry=self.registry,
        )
        self.reconciles = Counter(
            f"{PREFIX}_reconciles", "Reconcile passes over a LoRAJob, by result (ok, error, not-leader: the Lease was lost during the pass)", ["result"], registry=self.registry
        )
        self.cache_swept = Counter(
            f"{PREFIX}_cache_swept", "Cached objects dropped because the API server no longer has them (a deletion "
            "the watches missed), by resource", ["resource"], registry=self.registry,
        )
        self.reconcile_seconds = Histogram(
            f"{PREFIX}_reconcile_duration_seconds", "Time one reconcile pass takes (its API writes included)",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=self.registry,
        )
        self._server: WSGIServer | None = None

    def describe_state(self, collect: Callable[[], dict[str, dict[str, float]]]) -> None:
        """Adds the STATE metrics, computed at scrape time: `collect()` -> {name: {label value: value}}."""
        self.registry.register(_StateCollector(collect))

    def serve(self, port: int, address: str = "0.0.0.0") -> None:
        self._server, _ = start_http_server(port, address, registry=self.registry)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


STATE = {
    "cache_objects": (GaugeMetricFamily, "Objects held in the operator's watch caches, by resource", "resource"),
    "lorajobs": (GaugeMetricFamily, "LoRAJobs by status.phase (Unknown: no status yet)", "phase"),
    "work_queue_depth": (GaugeMetricFamily, "LoRAJobs waiting for a reconcile pass", None),
    "leader": (GaugeMetricFamily, "1 while this replica holds the Lease and reconciles, 0 while it stands by", None),
    "leadership_acquired": (CounterMetricFamily, "Times this replica became the leader", None),
}


class _StateCollector:
    def __init__(self, collect: Callable[[], dict[str, dict[str, float]]]):
        self._collect = collect

    def collect(self):
        values = self._collect()
        for name, (kind, documentation, label) in STATE.items():
            family = kind(f"{PREFIX}_{name}", documentation, labels=[label] if label else [])
            for label_value, value in values.get(name, {}).items():
                family.add_metric([label_value] if label else [], value)
            yield family


READ_VERBS = frozenset({"get", "list", "watch"})


class CountingRESTClient(rest.RESTClientObject):
    """The kubernetes client's HTTP layer, counting every request and failure into `metrics`."""

    def __init__(self, configuration, metrics: Metrics):
        super().__init__(configuration)
        self.metrics = metrics

    def request(self, method, url, *args, **kwargs):
        verb = request_verb(method, url)
        self.metrics.api_requests.labels(verb).inc()
        try:
            response = super().request(method, url, *args, **kwargs)
        except Exception:
            self.metrics.api_errors.labels(verb, "none").inc()
            raise
        if not 200 <= response.status <= 299:
            self.metrics.api_errors.labels(verb, str(response.status)).inc()
        return response
