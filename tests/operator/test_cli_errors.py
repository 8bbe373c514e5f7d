"""Every failure of the `lorajob` command is one line on stderr that names the problem and what to do, never a
traceback: 2 for wrong arguments, 1 for other failures (`lorajob plan`: 2, as its 1 says "does not fit")."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
LORAJOB = Path(sys.executable).parent / "lorajob"
EXAMPLE = str(REPO_ROOT / "examples" / "qwen3-gsm8k.yaml")

FILES = {
    "malformed.yaml": b"kind: LoRAJob\nmetadata: {name: x\nspec: [\n",
    "list.yaml": b"- a\n- b\n",
    "empty.yaml": b"",
    "binary.yaml": b"\x9e\x00\xff",
    "broken-kubeconfig": b"clusters: [\n",
}


def kubeconfig_of(server: str) -> str:
    return json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": server}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
    })


def environment(**extra: str) -> dict[str, str]:
    """This process's environment and `extra`, without LORAJOB_TRACEBACK (which turns the one-line errors off)."""
    return {**{name: value for name, value in os.environ.items() if name != "LORAJOB_TRACEBACK"}, **extra}


def lorajob(workdir: Path, *args: str, kubeconfig: str = "missing-kubeconfig") -> subprocess.CompletedProcess:
    """The installed command, run in `workdir` (which holds FILES) with KUBECONFIG at `kubeconfig` there."""
    for name, content in FILES.items():
        (workdir / name).write_bytes(content)
    (workdir / "a-directory").mkdir(exist_ok=True)
    return subprocess.run([str(LORAJOB), *args], capture_output=True, text=True, cwd=workdir,
                          env=environment(KUBECONFIG=str(workdir / kubeconfig)), timeout=120)


def assert_one_line(result: subprocess.CompletedProcess, code: int, prefix: str, fragment: str) -> None:
    assert result.returncode == code, (result.returncode, result.stderr)
    assert result.stderr.count("\n") == 1 and result.stderr.endswith("\n"), result.stderr
    assert result.stderr.startswith(prefix) and fragment in result.stderr, result.stderr


UNREADABLE = [
    (["validate", "missing.yaml"], 1, "missing.yaml: No such file or directory (check the path)"),
    (["validate", "malformed.yaml"], 1,
     "malformed.yaml, line 3, column 5: not valid YAML: expected ',' or '}', but got ':' while parsing a flow "
     "mapping from line 2; fix it there"),
    (["validate", "list.yaml"], 1, "list.yaml holds a YAML document that is not an object (['a', 'b'])"),
    (["validate", "empty.yaml"], 1, "empty.yaml holds no YAML document"),
    (["validate", "binary.yaml"], 1, "binary.yaml, byte 0: not YAML text"),
    (["validate", "a-directory"], 1, "a-directory: Is a directory (give the YAML files in it)"),
    (["render", "missing.yaml"], 1, "missing.yaml: No such file or directory"),
    (["render", "malformed.yaml"], 1, "malformed.yaml, line 3, column 5: not valid YAML"),
    (["plan", "missing.yaml"], 2, "missing.yaml: No such file or directory"),
    (["plan", "list.yaml"], 2, "not an object"),
]


@pytest.mark.parametrize(("args", "code", "fragment"), UNREADABLE, ids=["-".join(case[0]) for case in UNREADABLE])
def test_a_file_that_cannot_be_read_is_named_in_one_line(tmp_path, args, code, fragment):
    assert_one_line(lorajob(tmp_path, *args), code, f"lorajob {args[0]}: ", fragment)


@pytest.mark.parametrize(("args", "prefix", "fragment"), [
    ([], "lorajob: ", "the following arguments are required: command (see lorajob --help)"),
    (["bogus"], "lorajob: ", "invalid choice: 'bogus'"),
    (["validate"], "lorajob validate: ", "the following arguments are required: FILE (see lorajob validate --help)"),
    (["render", "--namespace-labels", "team", EXAMPLE], "lorajob render: ", "expected KEY=VALUE"),
    (["status", "x", "--samples", "many"], "lorajob status: ", "invalid int value: 'many' (see lorajob status --help)"),
], ids=["nothing", "unknown-command", "validate-without-file", "bad-labels", "bad-samples"])
def test_wrong_arguments_exit_2_with_one_line_pointing_at_help(tmp_path, args, prefix, fragment):
    assert_one_line(lorajob(tmp_path, *args), 2, prefix, fragment)


@pytest.mark.parametrize("args", [["status", "x"], ["logs", "x"], ["plot", "x"], ["render", "--from-cluster", EXAMPLE]],
                         ids=lambda args: args[0])
def test_no_kubeconfig_says_how_to_point_at_the_cluster(tmp_path, args):
    assert_one_line(lorajob(tmp_path, *args), 1, f"lorajob {args[0]}: ",
                    "no usable kubeconfig (Invalid kube-config file. No configuration found.): point KUBECONFIG at")


def test_a_broken_kubeconfig_is_named_where_it_breaks(tmp_path):
    assert_one_line(lorajob(tmp_path, "status", "x", kubeconfig="broken-kubeconfig"), 1, "lorajob status: ",
                    "broken-kubeconfig, line 2, column 1: not valid YAML")


def test_an_unreachable_api_server_is_named(tmp_path):
    (tmp_path / "kubeconfig").write_text(kubeconfig_of("https://127.0.0.1:1"))
    assert_one_line(lorajob(tmp_path, "status", "x", kubeconfig="kubeconfig"), 1, "lorajob status: ",
                    "cannot reach the Kubernetes API server 127.0.0.1:1 ([Errno 111] Connection refused)")


class Forbidding(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"kind": "Status", "status": "Failure", "reason": "Forbidden", "code": 403}).encode()
        self.send_response(403)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_refusing_api_server_says_what_to_check(tmp_path):
    server = http.server.HTTPServer(("127.0.0.1", 0), Forbidding)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        (tmp_path / "kubeconfig").write_text(kubeconfig_of(f"http://127.0.0.1:{server.server_port}"))
        result = lorajob(tmp_path, "render", "--from-cluster", EXAMPLE, kubeconfig="kubeconfig")
    finally:
        server.shutdown()
    assert_one_line(result, 1, "lorajob render: ", "refused: 403 Forbidden: check what your kubeconfig's user may do")


def run_main_with(tmp_path: Path, setup: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    """`cli.main(args)` in a fresh interpreter after the Python statements `setup`."""
    code = f"import sys\n{setup}\nfrom lorajob_operator import cli\nsys.exit(cli.main({list(args)!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                          env=environment(**env), timeout=120)


def test_a_missing_package_is_named_with_its_install(tmp_path):
    result = run_main_with(tmp_path, "sys.modules['kubernetes'] = None", "status", "x")
    assert_one_line(result, 1, "lorajob status: ",
                    "needs the Python package kubernetes, which is not installed here (pip install kubernetes)")


BUG = "from lorajob_operator import cli\ndef broken(paths): raise ValueError('a bug\\nover two lines')\ncli.validate_files = broken"


def test_a_bug_is_one_line_that_says_how_to_see_the_traceback(tmp_path):
    assert_one_line(run_main_with(tmp_path, BUG, "validate", "x.yaml"), 1, "lorajob validate: ",
                    "unexpected ValueError: a bug over two lines (a bug in lorajob: run again with LORAJOB_TRACEBACK=1")
    shown = run_main_with(tmp_path, BUG, "validate", "x.yaml", LORAJOB_TRACEBACK="1")
    assert shown.returncode == 1 and "Traceback (most recent call last)" in shown.stderr, shown.stderr


def test_ctrl_c_exits_130_quietly(tmp_path):
    setup = "from lorajob_operator import cli\ndef stopped(paths): raise KeyboardInterrupt\ncli.validate_files = stopped"
    result = run_main_with(tmp_path, setup, "validate", "x.yaml")
    assert (result.returncode, result.stderr) == (130, "")


def test_plan_s_deviceless_tpu_leaves_stderr_clean(tmp_path):
    """libtpu, started without a TPU, prints errors ("Failed to find host bounds", "unexpected worker hostname")
    that make a good `lorajob plan` look failed, unless told of its host first (plan.DEVICELESS_LIBTPU_ENV)."""
    without_tpu_settings = {name: value for name, value in os.environ.items() if not name.startswith("TPU_")}
    code = "from lorajob_trainer import plan; print(len(plan.topology_devices('v6e:2x2')))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                            env={**without_tpu_settings, "JAX_PLATFORMS": "cpu"}, timeout=300)
    assert (result.returncode, result.stdout, result.stderr) == (0, "4\n", "")
