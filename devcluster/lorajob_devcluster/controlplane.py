"""etcd + kube-apiserver on loopback, with generated certificates and an admin kubeconfig."""

from __future__ import annotations

import dataclasses
import json
import shutil
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from collections.abc import Callable

import yaml

from . import build, pki
from .documents import as_kubectl_input, load_documents
from .process import ManagedProcess, free_loopback_port

SERVICE_CLUSTER_IP_RANGE = "10.0.0.0/24"
STARTUP_TIMEOUT_SECONDS = 120.0
CRD_ESTABLISHED_TIMEOUT = 60.0


class KubectlError(subprocess.CalledProcessError):
    def __str__(self) -> str:
        return f"{super().__str__()}\nstderr: {self.stderr}"


@dataclasses.dataclass(frozen=True)
class ControlPlaneConfig:
    state_dir: Path | None = None  # default: a fresh directory on /dev/shm (tmpfs), removed at stop
    crd_dirs: tuple[Path, ...] = ()
    keep_state: bool = False


def default_state_parent() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(tempfile.gettempdir())


def yaml_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob("*") if p.suffix in (".yaml", ".yml"))


class ControlPlane:
    """A running etcd + kube-apiserver. Use `ControlPlane.start(config)`; always `stop()` (or use `with`)."""

    def __init__(self, config: ControlPlaneConfig, bin_dir: Path, state_dir: Path, owns_state_dir: bool):
        self.config = config
        self.bin_dir = bin_dir
        self.state_dir = state_dir
        self._owns_state_dir = owns_state_dir
        self.pki = pki.generate(state_dir / "pki")
        self.etcd_port = free_loopback_port()
        self.api_port = free_loopback_port()
        self.server = f"https://127.0.0.1:{self.api_port}"
        self.kubeconfig = state_dir / "kubeconfig"
        self.processes: list[ManagedProcess] = []
        self.ready_probes: dict[str, Callable[[], bool]] = {}
        """Per component name: whether it serves again after `restart` (registered by whoever launched it)."""

    @classmethod
    def start(cls, config: ControlPlaneConfig = ControlPlaneConfig()) -> ControlPlane:
        bin_dir = build.build(("kubernetes", "etcd"))
        if config.state_dir is None:
            state_dir, owns = Path(tempfile.mkdtemp(prefix="lorajob-devcluster-", dir=default_state_parent())), True
        else:
            state_dir, owns = config.state_dir, False
            if state_dir.exists() and any(state_dir.iterdir()):
                raise ValueError(f"state directory {state_dir} is not empty; give a new or empty one (each run starts a fresh cluster)")
            state_dir.mkdir(parents=True, exist_ok=True)
        plane = cls(config, bin_dir, state_dir, owns)
        try:
            plane._start_etcd()
            plane._start_apiserver()
            plane._write_kubeconfig()
            for directory in config.crd_dirs:
                plane.apply_crds(directory)
        except BaseException:
            plane.stop()
            raise
        return plane

    def __enter__(self) -> ControlPlane:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- processes -------------------------------------------------------------------------

    def launch(self, name: str, argv: list[str]) -> ManagedProcess:
        """Start a component whose output goes to <state dir>/<name>.log; `stop()` ends it."""
        process = ManagedProcess(name, argv, self.state_dir / f"{name}.log").start()
        self.processes.append(process)
        return process

    def binary(self, name: str) -> str:
        return str(self.bin_dir / name)

    def _start_etcd(self) -> None:
        peer_port = free_loopback_port()
        client_url, peer_url = f"http://127.0.0.1:{self.etcd_port}", f"http://127.0.0.1:{peer_port}"
        etcd = self.launch(
            "etcd",
            [
                self.binary("etcd"),
                f"--data-dir={self.state_dir / 'etcd'}",
                f"--listen-client-urls={client_url}",
                f"--advertise-client-urls={client_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=default={peer_url}",
                "--unsafe-no-fsync=true",
                "--log-level=warn",
            ],
        )
        self.ready_probes[etcd.name] = lambda: b"true" in urllib.request.urlopen(f"{client_url}/health", timeout=2).read()
        etcd.wait_until(self.ready_probes[etcd.name], STARTUP_TIMEOUT_SECONDS, "healthy")

    def _start_apiserver(self) -> None:
        p = self.pki
        apiserver = self.launch(
            "kube-apiserver",
            [
                self.binary("kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={self.api_port}",
                f"--tls-cert-file={p.apiserver.cert}",
                f"--tls-private-key-file={p.apiserver.key}",
                f"--client-ca-file={p.ca.cert}",
                # The aggregation layer (Kueue's visibility API): kube-apiserver proxies as front-proxy-client,
                # to an endpoint of the APIService's Service (no kube-proxy serves ClusterIPs here).
                f"--requestheader-client-ca-file={p.ca.cert}",
                f"--requestheader-allowed-names={pki.FRONT_PROXY_CLIENT}",
                "--requestheader-username-headers=X-Remote-User",
                "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                f"--proxy-client-cert-file={p.front_proxy_client.cert}",
                f"--proxy-client-key-file={p.front_proxy_client.key}",
                "--enable-aggregator-routing=true",
                f"--service-account-issuer={self.server}",
                f"--service-account-key-file={p.service_account_pub}",
                f"--service-account-signing-key-file={p.service_account_key}",
                f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
                "--allow-privileged=true",
                "--authorization-mode=RBAC",
                # No kubelet runs pods, so tokens are never mounted; the default SA may not exist yet either.
                "--disable-admission-plugins=ServiceAccount",
                # Loopback cannot be published as the `kubernetes` Service endpoint.
                "--endpoint-reconciler-type=none",
                # Saves CPU on small test machines.
                "--enable-priority-and-fairness=false",
                "--max-requests-inflight=0",
                "--max-mutating-requests-inflight=0",
            ],
        )
        self.ready_probes[apiserver.name] = lambda: self.get("/readyz") == "ok"
        apiserver.wait_until(self.ready_probes[apiserver.name], STARTUP_TIMEOUT_SECONDS, "ready")

    def _write_kubeconfig(self) -> None:
        self.write_kubeconfig(self.kubeconfig, {"client-certificate": str(self.pki.admin.cert),
                                                "client-key": str(self.pki.admin.key)})

    def write_kubeconfig(self, path: Path, user: dict[str, str]) -> Path:
        """A kubeconfig for this API server as `user` (kubeconfig user fields: a client certificate, or a token)."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "lorajob-dev", "cluster": {"server": self.server, "certificate-authority": str(self.pki.ca.cert)}}],
            "users": [{"name": "user", "user": user}],
            "contexts": [{"name": "lorajob-dev", "context": {"cluster": "lorajob-dev", "user": "user"}}],
            "current-context": "lorajob-dev",
        }
        path.write_text(yaml.safe_dump(config))
        return path

    def restart(self, name: str, crash: bool = True) -> float:
        """Stop component `name` (SIGKILL when `crash`, else SIGTERM) and start it again with the same
        arguments, ports, state and log; return the seconds from the stop until it is ready again.
        For fault-injection tests: clients see the component vanish and come back at the same address."""
        process = next(p for p in self.processes if p.name == name)
        started = time.monotonic()
        if crash:
            process.kill()
        else:
            process.stop()
        process.start()
        process.wait_until(self.ready_probes[name], STARTUP_TIMEOUT_SECONDS, "ready after a restart")
        return time.monotonic() - started

    def stop(self) -> None:
        """Stop every component in reverse start order, then remove the state directory if we made it."""
        for process in reversed(self.processes):
            process.stop()
        self.processes.clear()
        if self._owns_state_dir and not self.config.keep_state:
            shutil.rmtree(self.state_dir, ignore_errors=True)

    # --- clients ---------------------------------------------------------------------------

    def ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.pki.ca.cert))
        context.load_cert_chain(str(self.pki.admin.cert), str(self.pki.admin.key))
        return context

    def get(self, path: str) -> str:
        """GET an apiserver path as admin and return the body (raises on HTTP errors)."""
        with urllib.request.urlopen(f"{self.server}{path}", context=self.ssl_context(), timeout=5) as response:
            return response.read().decode()

    def kubectl(self, *args: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
        command = [self.binary("kubectl"), f"--kubeconfig={self.kubeconfig}", *args]
        result = subprocess.run(command, input=input, capture_output=True, text=True)
        if check and result.returncode != 0:
            raise KubectlError(result.returncode, command, result.stdout, result.stderr)
        return result

    def api_client(self):
        from kubernetes import client

        configuration = client.Configuration()
        configuration.host = self.server
        configuration.ssl_ca_cert = str(self.pki.ca.cert)
        configuration.cert_file = str(self.pki.admin.cert)
        configuration.key_file = str(self.pki.admin.key)
        return client.ApiClient(configuration)

    # --- resources -------------------------------------------------------------------------

    def apply_documents(self, documents: list[dict]) -> None:
        if documents:
            self.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=as_kubectl_input(documents))

    def service_account_token(self, namespace: str, name: str, rules: list[dict]) -> str:
        """A ServiceAccount `name` in `namespace`, bound to a Role of its own there with `rules`: a bearer token for
        it (valid 2 hours), as a tenant of the cluster holds one."""
        meta = {"name": name, "namespace": namespace}
        self.apply_documents([
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta, "rules": rules},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta,
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
             "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]},
        ])
        return self.kubectl("-n", namespace, "create", "token", name, "--duration=2h").stdout.strip()

    def apply_crds(self, directory: Path) -> list[str]:
        """Apply every YAML file in `directory` and wait until its CRDs are Established; return their names."""
        documents = [doc for path in yaml_files(directory) for doc in load_documents(path)] if directory.is_dir() else []
        self.apply_documents(documents)
        names = [d["metadata"]["name"] for d in documents if d.get("kind") == "CustomResourceDefinition"]
        self.wait_crds_established(names)
        return names

    def wait_crds_established(self, names: list[str]) -> None:
        # Not `kubectl wait`: it errors out on a CRD whose status has no conditions yet.
        pending = set(names)

        def all_established() -> bool:
            pending.difference_update({name for name in pending if self._crd_established(name)})
            return not pending

        wait_for(all_established, CRD_ESTABLISHED_TIMEOUT, f"CRDs {sorted(pending)} Established")

    def wait_condition(self, resource: str, name: str, condition: str, namespace: str | None = None, timeout: float = 60.0) -> dict:
        """Wait until object `resource/name` has status condition `condition` True; return the object."""
        scope = ["-n", namespace] if namespace else []

        def current() -> dict | None:
            found = self.kubectl("get", resource, name, *scope, "-o", "json", "--ignore-not-found").stdout
            obj = json.loads(found) if found.strip() else {}
            return obj if condition_is_true(obj, condition) else None

        return wait_for(current, timeout, f"{resource}/{name} {condition}")

    def _crd_established(self, name: str) -> bool:
        try:
            crd = json.loads(self.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}"))
        except urllib.error.HTTPError as error:
            if error.code == 404:
                return False
            raise
        return condition_is_true(crd, "Established")


def condition_is_true(obj: dict, condition_type: str) -> bool:
    """Whether a Kubernetes object's status condition `condition_type` is "True" (absent status: no)."""
    conditions = (obj.get("status") or {}).get("conditions") or []
    return any(c.get("type") == condition_type and c.get("status") == "True" for c in conditions)


def wait_for(condition, timeout: float, what: str, interval: float = 0.5):
    """Poll `condition()` until it returns something truthy and return that; raise TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


__all__ = ["ControlPlane", "ControlPlaneConfig", "KubectlError", "condition_is_true", "wait_for"]
