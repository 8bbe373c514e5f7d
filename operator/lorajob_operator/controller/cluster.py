"""The API server, where no cache serves: the resources the operator writes, a JobSet's pods, a trainer's log; and
the HTTP layer its writes go through, which refuses them while this replica does not lead (`LeaderOnlyRESTClient`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from urllib.parse import urlparse

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from lorajob_operator import api, caches, names
from lorajob_operator.leader import NotLeader
from lorajob_operator.metrics import READ_VERBS, CountingRESTClient, Metrics, request_verb


JOBSET = (names.JOBSET_GROUP, names.JOBSET_VERSION, names.JOBSET_PLURAL)


LORAJOB = (api.GROUP, api.VERSION, api.PLURAL)


FIELD_MANAGER = "lorajob-operator"


READ_TIMEOUT_SECONDS = 10


KUEUE_VISIBILITY = ("visibility.kueue.x-k8s.io", "v1beta2")


METADATA_LIST = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"
"""What a list asks for when only the objects' metadata is wanted."""


LIST_PAGE = 500


class LeaderOnlyRESTClient(CountingRESTClient):
    """The operator's HTTP layer (every request and failure counted, as CountingRESTClient does); it refuses
    (NotLeader, nothing sent) every write while `write_allowed()` is false: a standby writes nothing."""

    def __init__(self, configuration, metrics: Metrics, write_allowed: Callable[[], bool]):
        super().__init__(configuration, metrics)
        self.write_allowed = write_allowed

    def request(self, method, url, *args, **kwargs):
        verb = request_verb(method, url)
        if verb not in READ_VERBS and not self.write_allowed():
            raise NotLeader(f"not the leader: {verb} {urlparse(url).path} not sent")
        return super().request(method, url, *args, **kwargs)


def is_missing(error: ApiException) -> bool:
    return error.status == 404


def api_message(error: ApiException) -> str:
    try:
        return json.loads(error.body).get("message", error.reason)
    except (TypeError, ValueError):
        return str(error.reason)


class Cluster:
    """Thin typed access to the objects the operator writes, and the reads no cache holds (pods, logs)."""

    def __init__(self, api_client: client.ApiClient):
        self.custom = client.CustomObjectsApi(api_client)
        self.core = client.CoreV1Api(api_client)

    def get(self, resource: tuple[str, str, str], namespace: str, name: str) -> dict | None:
        try:
            return self.custom.get_namespaced_custom_object(*resource[:2], namespace, resource[2], name)
        except ApiException as error:
            if is_missing(error):
                return None
            raise

    def pending_workloads(self, namespace: str, local_queue: str) -> list[dict]:
        """Kueue's pending Workloads of a LocalQueue in its order (visibility API; raises 404/503 where not served)."""
        group, version = KUEUE_VISIBILITY
        path = f"/apis/{group}/{version}/namespaces/{namespace}/localqueues/{local_queue}/pendingworkloads"
        return self._get_json(path, "application/json").get("items") or []

    def uids(self, resource: caches.Resource, namespace: str | None) -> set[str]:
        """The uids of `resource`'s objects in `namespace` (None: every namespace, or a cluster-scoped resource),
        from a metadata-only list (no specs or statuses sent), page by page."""
        root = "/api/v1" if resource.group_version == "v1" else f"/apis/{resource.group_version}"
        path = f"{root}/namespaces/{namespace}/{resource.plural}" if namespace else f"{root}/{resource.plural}"
        found: set[str] = set()
        query = [("limit", LIST_PAGE)]
        while True:
            page = self._get_json(path, METADATA_LIST, query)
            found.update(item["metadata"]["uid"] for item in page.get("items") or [])
            if not (token := (page.get("metadata") or {}).get("continue")):
                return found
            query = [("limit", LIST_PAGE), ("continue", token)]

    def _get_json(self, path: str, accept: str, query: list[tuple[str, object]] | None = None) -> dict:
        api_client = self.custom.api_client
        method, url, headers, _, _ = api_client.param_serialize(
            "GET", path, query_params=query or [], header_params={"Accept": accept}, auth_settings=["BearerToken"]
        )
        response = api_client.call_api(method, url, headers, _request_timeout=READ_TIMEOUT_SECONDS)
        response.read()
        if not 200 <= response.status <= 299:
            raise ApiException(http_resp=response)
        return json.loads(response.data)

    def pods_of(self, jobset: str, namespace: str) -> list[dict]:
        pods = self.core.list_namespaced_pod(namespace, label_selector=f"{names.JOBSET_NAME_LABEL}={jobset}")
        return [self.core.api_client.sanitize_for_serialization(pod) for pod in pods.items]

    def trainer_log_tail(self, namespace: str, pod_selector: str, lines: int | None) -> str | None:
        """The last `lines` lines (None: all) of the trainer container's log in the newest pod matching
        `pod_selector` (None: no such pod yet or any more)."""
        pods = self.core.list_namespaced_pod(namespace, label_selector=pod_selector).items
        if not pods:
            return None
        pod = max(pods, key=lambda p: p.metadata.creation_timestamp)
        # Raw bytes: the client would otherwise try to decode a log that happens to be JSON as an object.
        response = self.core.read_namespaced_pod_log(
            pod.metadata.name, namespace, container=names.TRAINER_CONTAINER, tail_lines=lines,
            _preload_content=False, _request_timeout=READ_TIMEOUT_SECONDS,
        )
        return response.data.decode("utf-8", errors="replace")
