"""The operator's API client: while this replica does not lead it sends no write; reads still go out, counted."""

from __future__ import annotations

import pytest
from kubernetes import client
from prometheus_client import generate_latest

from lorajob_operator.controller.cluster import LeaderOnlyRESTClient
from lorajob_operator.leader import NotLeader
from lorajob_operator.metrics import Metrics


def test_a_write_is_refused_unsent_while_this_replica_does_not_lead():
    metrics = Metrics()
    configuration = client.Configuration()
    configuration.host = "http://127.0.0.1:9"
    configuration.retries = 0
    api_client = client.ApiClient(configuration)
    api_client.rest_client = LeaderOnlyRESTClient(configuration, metrics, write_allowed=lambda: False)
    with pytest.raises(NotLeader, match="not the leader: delete /api/v1/namespaces/a not sent"):
        client.CoreV1Api(api_client).delete_namespace("a")
    with pytest.raises(Exception) as read:  # reads still go out (they fail here: nothing listens)
        client.CoreV1Api(api_client).list_namespace()
    assert not isinstance(read.value, NotLeader)
    text = generate_latest(metrics.registry).decode()
    assert 'verb="delete"' not in text and 'lorajob_operator_api_requests_total{verb="list"} 1.0' in text
