"""Every rendered JobSet passes the real JobSet and Kueue admission webhooks (server-side dry run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from lorajob_operator import jobsets, names, rules, validation
from lorajob_operator.settings import RenderSettings

pytestmark = pytest.mark.cluster
EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


def _longest_names(body: dict) -> dict:
    """The example renamed to the longest run name its backend and steps allow."""
    spec, errors = validation.parse_spec(body)
    assert spec is not None, errors
    limit = rules.run_name_limit(spec).limit
    return {**body, "metadata": {"name": "l" * limit}}


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda path: path.stem)
@pytest.mark.parametrize("longest", [False, True], ids=["example-name", "longest-name"])
def test_rendered_jobsets_pass_the_jobset_and_kueue_webhooks(sim_cluster, example, longest):
    namespace = "render-dry-run"
    body = yaml.safe_load(example.read_text())
    if longest:
        body = _longest_names(body)
    spec, _ = validation.parse_spec(body)
    queue = spec.scheduling.queue_name
    sim_cluster.create_namespace_with_queue(namespace, queue or "lorajob")
    owner = jobsets.Owner(body["metadata"]["name"], namespace, "6f1b0c1e-0000-4000-8000-000000000000")
    rendered = jobsets.render_all(spec, owner, RenderSettings())
    result = sim_cluster.kubectl(
        "apply", "--dry-run=server", "-o", "json", "-f", "-", input=yaml.safe_dump_all(rendered), check=False
    )
    assert result.returncode == 0, result.stderr
    admitted = json.loads(result.stdout)
    items = admitted["items"] if admitted.get("kind") == "List" else [admitted]
    assert [item["metadata"]["name"] for item in items] == [js["metadata"]["name"] for js in rendered]
    if queue:
        # Kueue's webhook took the JobSets: it suspends them until their Workload is admitted.
        assert all(item["spec"]["suspend"] is True for item in items)


def test_the_webhook_check_can_fail_a_name_past_the_pathways_limit(sim_cluster):
    """The same dry run rejects what the CRD's name rule exists for (the coordinator label over 63)."""
    namespace = "render-dry-run"
    sim_cluster.create_namespace_with_queue(namespace)
    body = yaml.safe_load((EXAMPLES[-1]).read_text())
    spec, _ = validation.parse_spec(body)
    name = "x" * (names.PATHWAYS_NAME_MAX + 1)
    jobset = jobsets.render_phase("train", spec, jobsets.Owner(name, namespace, "6f1b0c1e-0000-4000-8000-000000000000"), RenderSettings())
    result = sim_cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump(jobset), check=False)
    assert result.returncode != 0
    assert "coordinator" in result.stderr.lower(), result.stderr
