"""The `lorajob` command: offline checks and previews of LoRAJob files, and a view of running LoRAJobs."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import sys
from pathlib import Path
from typing import IO

import yaml

from lorajob_operator.cli_errors import FAILED, INTERRUPTED, TRACEBACK_ENV, CliError, OneLineParser, explain


class _Yaml12Loader(yaml.SafeLoader):
    """SafeLoader that also reads YAML 1.2 floats without a dot (3e-06, as kustomize writes them)."""


_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$|^[-+]?\.(inf|Inf|INF)$|^\.(nan|NaN|NAN)$"),
    list("-+0123456789."),
)


def load_documents(text: str | IO[bytes]) -> list[dict]:
    return [doc for doc in yaml.load_all(text, Loader=_Yaml12Loader) if doc]


def _version() -> str:
    try:
        return importlib.metadata.version("lorajob")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def _documents(path: Path) -> list[dict]:
    """The objects in the YAML file at `path` (read as bytes, so that pyyaml names the file in its errors)."""
    with path.open("rb") as stream:
        documents = load_documents(stream)
    if not documents:
        raise CliError(f"{path} holds no YAML document: give a file with a LoRAJob in it")
    stray = next((doc for doc in documents if not isinstance(doc, dict)), None)
    if stray is not None:
        raise CliError(f"{path} holds a YAML document that is not an object ({stray!r:.40}): each document must be "
                       "a Kubernetes object (apiVersion, kind, metadata, spec)")
    return documents


def validate_files(paths: list[Path]) -> int:
    from lorajob_operator.validation import validate

    failed = 0
    for path in paths:
        for doc in _documents(path):
            name = doc.get("metadata", {}).get("name", "?")
            errors = validate(doc)
            if errors:
                failed += 1
                print(f"{path}: LoRAJob {name!r} is invalid:")
                for error in errors:
                    print(f"  {error}")
            else:
                print(f"{path}: LoRAJob {name!r} is valid")
    return 1 if failed else 0


class ClusterFacts:
    """What rendering needs from a cluster: its LoRAJobPolicies and its namespaces' labels (read once each)."""

    def __init__(self, kubeconfig: Path | None, context: str | None):
        from kubernetes import client, config

        from lorajob_operator import api, policy

        api_client = config.new_client_from_config(config_file=str(kubeconfig) if kubeconfig else None, context=context)
        self.policies = client.CustomObjectsApi(api_client).list_cluster_custom_object(
            api.GROUP, api.VERSION, policy.PLURAL)["items"]
        self._core = client.CoreV1Api(api_client)
        self._labels: dict[str, dict[str, str]] = {}

    def namespace_labels(self, namespace: str) -> dict[str, str]:
        from kubernetes.client.exceptions import ApiException

        if namespace not in self._labels:
            try:
                self._labels[namespace] = self._core.read_namespace(namespace).metadata.labels or {}
            except ApiException as error:
                if error.status != 404:
                    raise
                raise RenderError(f"namespace {namespace!r} does not exist in the cluster") from None
        return self._labels[namespace]


class RenderError(CliError):
    """A LoRAJob cannot be rendered (said on stderr; the others still are)."""


def render_files(paths: list[Path], namespace: str, namespace_labels: dict[str, str], policy_paths: list[Path],
                 cluster: ClusterFacts | None = None) -> int:
    """Print the JobSets the operator would create for each LoRAJob (all steps, first tries), with the defaults of
    the LoRAJobPolicies (the `cluster`'s, in `policy_paths`, or among the files) that govern its namespace applied,
    as the operator applies them. The namespace's labels are the cluster's, overridden by `namespace_labels`."""
    from lorajob_operator import api, jobsets, policy
    from lorajob_operator.reconcile.observed import effective_spec
    from lorajob_operator.settings import OperatorSettings
    from lorajob_operator.validation import parse_spec

    settings = OperatorSettings.from_env().render
    documents = [(path, doc) for path in paths for doc in _documents(path)]
    policy_documents = [doc for path in policy_paths for doc in _documents(path)] + [doc for _, doc in documents]
    policy_documents += cluster.policies if cluster else []
    policies = [policy.LoRAJobPolicy.from_object(doc) for doc in policy_documents if doc.get("kind") == policy.KIND]
    if not policies:
        where = "in the cluster" if cluster else "(give the namespace's with --policy FILE, or read the cluster's with --from-cluster)"
        print(f"no LoRAJobPolicy applied {where}", file=sys.stderr)
    manifests, failed = [], 0
    for path, doc in documents:
        if doc.get("kind") == policy.KIND:
            continue
        metadata = doc.get("metadata", {})
        spec, errors = parse_spec(doc) if doc.get("kind") == api.KIND else (None, (f"not a {api.KIND}",))
        owner_namespace = metadata.get("namespace", namespace)
        try:
            found = cluster.namespace_labels(owner_namespace) if cluster else {}
        except RenderError as error:
            print(f"{path}: cannot render {metadata.get('name', '?')!r}: {error}", file=sys.stderr)
            failed += 1
            continue
        labels = {"kubernetes.io/metadata.name": owner_namespace, **found, **namespace_labels}
        if spec is not None:
            errors = tuple(violation.message for violation in policy.violations(policies, labels, spec))
        if errors:
            failed += 1
            print(f"{path}: cannot render {metadata.get('name', '?')!r}: {'; '.join(errors)}", file=sys.stderr)
            continue
        spec = effective_spec(spec, policy.resolve_defaults(policies, labels, spec))
        owner = jobsets.Owner(metadata["name"], owner_namespace, metadata.get("uid", "<uid>"))
        manifests += jobsets.render_all(spec, owner, settings)
    print(yaml.safe_dump_all(manifests, sort_keys=False), end="")
    return 1 if failed else 0


def render_command(args) -> int:
    reads_cluster = args.from_cluster or args.kubeconfig or args.context
    cluster = ClusterFacts(args.kubeconfig, args.context) if reads_cluster else None
    return render_files(args.files, args.namespace, args.namespace_labels, args.policy, cluster)


def _labels(text: str) -> dict[str, str]:
    pairs = [item.partition("=") for item in text.split(",") if item]
    if any(not sep or not key for key, sep, _ in pairs):
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE[,KEY=VALUE...], got {text!r}")
    return {key: value for key, _, value in pairs}


NO_PLAN = 2
"""`lorajob plan`'s code for a plan that cannot be made (its 1 says a LoRAJob does not fit)."""


def plan_files(paths: list[Path], as_json: bool) -> int:
    """Print each LoRAJob's plan (lorajob_operator.planning); 0 when every one fits, 1 when one does not,
    NO_PLAN when a plan cannot be made."""
    import json

    from lorajob_operator import planning

    status, results = 0, []
    for path in paths:
        for doc in _documents(path):
            try:
                result = planning.plan_lorajob(doc)
            except planning.PlanUnavailable as error:
                print(f"{path}: {error}", file=sys.stderr)
                status = NO_PLAN
                continue
            results.append(result)
            status = max(status, 0 if result.plan.attempt.fits else 1)
            if not as_json:
                print(result.format(), flush=True)
    if as_json:
        print(json.dumps([r.to_dict() for r in results], indent=2))
    return status


VALIDATE_DESCRIPTION = """Check LoRAJob files with the rules the API server applies at `kubectl apply`: the CRD's schema
and CEL rules, evaluated offline. Needs no cluster. Exit 1 when one is invalid."""
RENDER_DESCRIPTION = """Print the JobSets the operator would create for each LoRAJob (every step), for review in a
pull request, with the defaults and rules of the LoRAJobPolicies given applied. Needs no cluster, unless
--from-cluster (or --kubeconfig, --context) reads the cluster's policies and namespace labels: then the kubernetes
package and a kubeconfig. Exit 1 when one cannot be rendered."""
PLAN_DESCRIPTION = """Compile each LoRAJob's train step with the real TPU compiler for its chips, without a TPU: HBM
per chip against the chip's, a roofline step time, and the smallest change that fits when it does not (GPU LoRAJobs:
an analytic estimate). Needs the trainer's packages and libtpu (pip install "lorajob[trainer]" "jax[tpu]"); takes
minutes per LoRAJob on a workstation. Exit 1 when one does not fit, 2 when no plan can be made."""


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = OneLineParser(prog=prog, description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.set_defaults(failure_exit_code=FAILED)
    commands = parser.add_subparsers(dest="command", required=True)
    validate = commands.add_parser("validate", help="check LoRAJob files with the same rules as the API server",
                                   description=VALIDATE_DESCRIPTION)
    validate.add_argument("files", nargs="+", type=Path, metavar="FILE",
                          help="YAML files, each holding one or more LoRAJob documents")
    validate.set_defaults(run=lambda args: validate_files(args.files))
    render = commands.add_parser("render", help="print the JobSets the operator would create, for review",
                                 description=RENDER_DESCRIPTION)
    render.add_argument("files", nargs="+", type=Path, metavar="FILE",
                        help="YAML files holding LoRAJob documents, and the LoRAJobPolicies whose defaults apply")
    render.add_argument("--namespace", default="default", help="namespace of LoRAJobs that do not set one")
    render.add_argument("--namespace-labels", type=_labels, default={}, metavar="KEY=VALUE,...",
                        help="labels of the namespace, for the policies' namespaceSelector")
    render.add_argument("--policy", type=Path, action="append", default=[], metavar="FILE",
                        help="a YAML file of LoRAJobPolicies whose defaults and rules apply (repeatable)")
    render.add_argument("--from-cluster", action="store_true",
                        help="apply the cluster's LoRAJobPolicies and use its namespaces' labels (current kubeconfig context)")
    render.add_argument("--kubeconfig", type=Path, default=None, metavar="PATH", help="the cluster's kubeconfig (implies --from-cluster)")
    render.add_argument("--context", default=None, help="kubeconfig context to use (implies --from-cluster)")
    render.set_defaults(run=render_command)
    plan = commands.add_parser(
        "plan", help="compile each LoRAJob's train step for its TPU chips (no TPU needed): does it fit, how fast",
        description=PLAN_DESCRIPTION)
    plan.add_argument("files", nargs="+", type=Path, metavar="FILE", help="YAML files holding LoRAJob documents")
    plan.add_argument("--json", action="store_true", help="print the plans as JSON")
    plan.set_defaults(run=lambda args: plan_files(args.files, args.json), failure_exit_code=NO_PLAN)
    from lorajob_operator import openai_api, runview

    runview.add_commands(commands)
    openai_api.add_command(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; any failure is said in one line on stderr (cli_errors), without a traceback."""
    # Installed twice: as `lorajob` and as the kubectl plugin `kubectl-lorajob` (run as `kubectl lorajob`).
    prog = "kubectl lorajob" if Path(sys.argv[0]).name == "kubectl-lorajob" else "lorajob"
    args = _parser(prog).parse_args(argv)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        return INTERRUPTED
    except Exception as error:
        if os.environ.get(TRACEBACK_ENV):
            raise
        print(f"{prog} {args.command}: {explain(error)}", file=sys.stderr)
        return args.failure_exit_code


if __name__ == "__main__":
    sys.exit(main())
