"""The CRD in crds/ is generated from the pydantic models and follows the API conventions."""

import subprocess
import sys
from pathlib import Path

import pytest

from lorajob_operator import crd

REPO = Path(__file__).resolve().parents[2]


def test_checked_in_crd_is_generated_from_the_models():
    checked_in = (REPO / "crds" / crd.CRD_FILE).read_text()
    assert checked_in == crd.render(), "crds/ is stale: run `make crds`"


def _walk(schema, path="spec"):
    yield path, schema
    for name, sub in schema.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{name}")
    if "items" in schema:
        yield from _walk(schema["items"], f"{path}[]")


SPEC = crd.openapi_schema()["properties"]["spec"]


@pytest.mark.parametrize("path,node", [p for p in _walk(SPEC) if not p[0].endswith("[]")], ids=lambda v: v if isinstance(v, str) else "")
def test_every_spec_field_is_documented(path, node):
    assert node.get("description"), f"{path} has no description (kubectl explain would be empty)"


@pytest.mark.parametrize("path,node", [p for p in _walk(SPEC) if p[1].get("type") in ("string", "array")], ids=lambda v: v if isinstance(v, str) else "")
def test_every_spec_string_and_list_is_bounded(path, node):
    # CEL cost estimation rejects rules over unbounded strings/lists; bounds also document intent.
    bounded = "enum" in node or "maxLength" in node or "maxItems" in node
    assert bounded, f"{path} has no maxLength/maxItems/enum"


def test_field_docs_start_with_the_json_name():
    for path, node in _walk(SPEC):
        leaf = path.split(".")[-1]
        description = node.get("description", "")
        if node.get("type") in ("string", "integer", "number", "boolean") and not leaf.endswith("]"):
            assert description.split(" ")[0].rstrip(":,").lower() == leaf.lower(), f"{path}: {description!r}"


def test_status_conditions_are_a_map_keyed_by_type():
    conditions = crd.openapi_schema()["properties"]["status"]["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]


def test_crd_names_and_columns():
    names = crd.crd()["spec"]["names"]
    assert (names["kind"], names["plural"], names["shortNames"]) == ("LoRAJob", "lorajobs", ["lj"])
    columns = [c["name"] for c in crd.crd()["spec"]["versions"][0]["additionalPrinterColumns"]]
    assert columns[:4] == ["Phase", "Progress", "Model", "Queue"] and columns[-1] == "Age"


@pytest.mark.parametrize("cwd", [REPO, REPO / "tests", REPO / "operator"], ids=["repo", "tests", "operator"])
def test_import_operator_is_the_stdlib_from_any_directory(cwd):
    code = "import operator; print(operator.__file__); operator.itemgetter(0)"
    result = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert str(REPO) not in result.stdout


def test_import_operator_is_the_stdlib_under_pytest():
    import operator

    assert str(REPO) not in str(operator.__file__) and hasattr(operator, "itemgetter")


def test_operator_folder_is_not_a_package():
    assert not (REPO / "operator" / "__init__.py").exists()
