"""The operator's Prometheus metrics: request verbs, API errors counted through the client, scrape-time state."""

from __future__ import annotations

import pytest
from kubernetes import client
from prometheus_client import generate_latest

from lorajob_operator.metrics import CountingRESTClient, Metrics, request_verb


@pytest.mark.parametrize("method, url, verb", [
    ("GET", "https://k/apis/lorajob.dev/v1alpha1/namespaces/a/lorajobs?watch=true&resourceVersion=5", "watch"),
    ("GET", "https://k/apis/lorajob.dev/v1alpha1/namespaces/a/lorajobs", "list"),
    ("GET", "https://k/apis/lorajob.dev/v1alpha1/lorajobpolicies", "list"),
    ("GET", "https://k/apis/jobset.x-k8s.io/v1alpha2/namespaces/a/jobsets/x", "get"),
    ("GET", "https://k/api/v1/namespaces", "list"),
    ("GET", "https://k/api/v1/namespaces/a", "get"),
    ("GET", "https://k/api/v1/namespaces/a/pods?labelSelector=x", "list"),
    ("GET", "https://k/api/v1/namespaces/a/pods/p/log?tailLines=100", "get"),
    ("PATCH", "https://k/apis/lorajob.dev/v1alpha1/namespaces/a/lorajobs/x/status", "patch"),
    ("POST", "https://k/api/v1/namespaces/a/events", "create"),
    ("DELETE", "https://k/apis/jobset.x-k8s.io/v1alpha2/namespaces/a/jobsets/x", "delete"),
])
def test_request_verbs(method, url, verb):
    assert request_verb(method, url) == verb


def test_requests_and_failures_are_counted_by_verb_and_the_state_is_read_at_scrape_time():
    metrics = Metrics()
    configuration = client.Configuration()
    configuration.host = "http://127.0.0.1:9"  # nothing listens: the request fails without an answer
    configuration.retries = 0
    api_client = client.ApiClient(configuration)
    api_client.rest_client = CountingRESTClient(configuration, metrics)
    with pytest.raises(Exception):  # noqa: B017 - whatever the transport raises: no server is there
        client.CoreV1Api(api_client).list_namespace()
    metrics.describe_state(lambda: {"lorajobs": {"Training": 2, "Succeeded": 5}, "work_queue_depth": {"": 3},
                                    "cache_objects": {"jobsets": 1}})
    text = generate_latest(metrics.registry).decode()
    assert 'lorajob_operator_api_requests_total{verb="list"} 1.0' in text
    assert 'lorajob_operator_api_errors_total{code="none",verb="list"} 1.0' in text
    assert 'lorajob_operator_lorajobs{phase="Succeeded"} 5.0' in text
    assert "lorajob_operator_work_queue_depth 3.0" in text
    assert 'lorajob_operator_cache_objects{resource="jobsets"} 1.0' in text

