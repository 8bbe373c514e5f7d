"""CRDs and webhook configurations of JobSet and Kueue, read from their Go module downloads.

Nothing is copied into the repository: the YAML comes from ``$(go env GOMODCACHE)/sigs.k8s.io/<m>@<v>/config``
and is rewritten so the apiserver calls the controllers on loopback (``url`` + ``caBundle`` instead of a
Service), as controller-runtime's envtest does.
"""

from __future__ import annotations

import base64
import copy
from pathlib import Path

from .documents import load_document, load_documents

WEBHOOK_KINDS = ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration")
# Kueue integrations enabled by the dev cluster; webhooks for other API groups are left out, so e.g.
# every pod create does not pass through Kueue.
KUEUE_WEBHOOK_GROUPS = frozenset({"kueue.x-k8s.io", "batch", "jobset.x-k8s.io"})


def loopback_client_config(port: int, path: str, ca_pem: bytes) -> dict:
    return {"url": f"https://127.0.0.1:{port}{path}", "caBundle": base64.b64encode(ca_pem).decode()}


def point_webhooks_at_loopback(configuration: dict, port: int, ca_pem: bytes, name_prefix: str) -> dict:
    rewritten = copy.deepcopy(configuration)
    rewritten["metadata"] = {"name": f"{name_prefix}-{configuration['metadata']['name']}"}
    for webhook in rewritten["webhooks"]:
        path = webhook["clientConfig"]["service"]["path"]
        webhook["clientConfig"] = loopback_client_config(port, path, ca_pem)
    return rewritten


def _kustomize_json6902_replace(document: dict, operations: list[dict]) -> None:
    """Apply the `replace` operations of a kustomize JSON6902 patch (all JobSet's webhook patches use)."""
    for operation in operations:
        if operation["op"] != "replace":
            raise ValueError(f"unsupported JSON patch operation {operation['op']!r}")
        *parents, last = [int(p) if p.isdigit() else p for p in operation["path"].strip("/").split("/")]
        target = document
        for part in parents:
            target = target[part]
        target[last] = operation["value"]


def jobset_crds(module_dir: Path) -> list[dict]:
    # Single served version (v1alpha2): installed without the kustomize conversion patch.
    return load_documents(module_dir / "config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml")


def jobset_webhooks(module_dir: Path, port: int, ca_pem: bytes) -> list[dict]:
    """JobSet's webhook manifests with its kustomize patches (pod webhooks scoped to JobSet pods)."""
    webhook_dir = module_dir / "config/components/webhook"
    configurations = {d["kind"]: d for d in load_documents(webhook_dir / "manifests.yaml") if d["kind"] in WEBHOOK_KINDS}
    kustomization = load_document(webhook_dir / "kustomization.yaml")
    for patch in kustomization.get("patches", []):
        target = configurations[patch["target"]["kind"]]
        _kustomize_json6902_replace(target, load_document(webhook_dir / patch["path"]))
    return [point_webhooks_at_loopback(c, port, ca_pem, "jobset") for c in configurations.values()]


def _kueue_conversion_patched_crds(module_dir: Path) -> set[str]:
    """Names of the CRDs whose conversion webhook patch Kueue's own kustomization enables."""
    crd_dir = module_dir / "config/components/crd"
    kustomization = load_document(crd_dir / "kustomization.yaml")
    names = set()
    for patch in kustomization.get("patches", []):
        document = load_document(crd_dir / patch["path"])
        if document.get("spec", {}).get("conversion", {}).get("strategy") == "Webhook":
            names.add(document["metadata"]["name"])
    return names


def kueue_crds(module_dir: Path, port: int, ca_pem: bytes) -> list[dict]:
    """Kueue's CRDs; those with two served versions convert through Kueue's loopback webhook."""
    crd_dir = module_dir / "config/components/crd"
    kustomization = load_document(crd_dir / "kustomization.yaml")
    converted = _kueue_conversion_patched_crds(module_dir)
    crds = [doc for resource in kustomization["resources"] for doc in load_documents(crd_dir / resource)]
    for crd in crds:
        if crd["metadata"]["name"] in converted:
            crd["spec"]["conversion"] = {
                "strategy": "Webhook",
                "webhook": {"clientConfig": loopback_client_config(port, "/convert", ca_pem), "conversionReviewVersions": ["v1"]},
            }
    return crds


KUEUE_VISIBILITY_API_SERVICE = "v1beta2.visibility.kueue.x-k8s.io"


def kueue_visibility_api(module_dir: Path, namespace: str, service: str, ip: str, port: int) -> list[dict]:
    """Kueue's APIService for its visibility API, and a Service without selector whose one endpoint is
    Kueue's visibility server at `ip`:`port` (kube-apiserver routes to endpoints, not to ClusterIPs)."""
    api_service = load_document(module_dir / "config/components/visibility/apiservice_v1beta2.yaml")
    assert api_service["metadata"]["name"] == KUEUE_VISIBILITY_API_SERVICE
    api_service["spec"]["service"] |= {"namespace": namespace, "name": service, "port": 443}
    metadata = {"name": service, "namespace": namespace}
    return [
        {"apiVersion": "v1", "kind": "Service", "metadata": metadata,
         "spec": {"ports": [{"name": "https", "port": 443, "protocol": "TCP", "targetPort": port}]}},
        {"apiVersion": "v1", "kind": "Endpoints", "metadata": metadata,
         "subsets": [{"addresses": [{"ip": ip}], "ports": [{"name": "https", "port": port, "protocol": "TCP"}]}]},
        api_service,
    ]


def _webhook_groups(webhook: dict) -> set[str]:
    return {group for rule in webhook.get("rules", []) for group in rule.get("apiGroups", [])}


def kueue_webhooks(module_dir: Path, port: int, ca_pem: bytes) -> list[dict]:
    manifests = load_documents(module_dir / "config/components/webhook/manifests.yaml")
    configurations = []
    for configuration in manifests:
        if configuration["kind"] not in WEBHOOK_KINDS:
            continue
        kept = dict(configuration)
        kept["webhooks"] = [w for w in configuration["webhooks"] if _webhook_groups(w) <= KUEUE_WEBHOOK_GROUPS]
        configurations.append(point_webhooks_at_loopback(kept, port, ca_pem, "kueue"))
    return configurations
