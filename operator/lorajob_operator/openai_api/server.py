"""`lorajob api`: the OpenAI fine-tuning API (files, jobs, events, checkpoints) over LoRAJobs.

Every request carries a Kubernetes bearer token (the client's api_key), checked with a TokenReview. The
namespace is the request's OpenAI project (the `OpenAI-Project` header), or a service account's own namespace;
it must be one the server serves, and a SubjectAccessReview must allow the caller the request's verb on
LoRAJobs there (reads: get; uploads and creates: create; cancel: patch; file deletion: delete). The server then
acts with its own service account, whose RBAC covers only the served namespaces.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from lorajob_operator import api, policy
from lorajob_operator.openai_api import jobs
from lorajob_operator.openai_api.config import ServerConfig
from lorajob_operator.openai_api.files import PURPOSE, FileStore, UploadCheck, UploadRefused, new_id, paginate
from lorajob_operator.openai_api.jobs import RequestError
from lorajob_operator.runview import Client

log = logging.getLogger(__name__)

PROJECT_HEADER = "OpenAI-Project"
SERVICE_ACCOUNT_PREFIX = "system:serviceaccount:"
JSON_BODY_MAX = 1 << 20
UPLOAD_CHUNK = 1 << 20
LIST_LIMIT_MAX = 100
REVIEW_SECONDS = 10.0
"""How long a TokenReview's or SubjectAccessReview's answer is reused."""


class ApiError(Exception):
    """An error the API answers with: its status and the API's error object."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.body = status, {"error": {"message": message, "type": kind, "param": param, "code": code}}


def not_found(what: str) -> ApiError:
    return ApiError(404, f"No such {what}", code="not_found")


@dataclass(frozen=True)
class Caller:
    user: dict[str, Any]
    """The TokenReview's user: username, uid, groups, extra."""
    namespace: str


class Cluster:
    """The server's Kubernetes calls (blocking; the handlers run them in threads)."""

    def __init__(self, review_seconds: float = REVIEW_SECONDS):
        from kubernetes import client

        self.kube = Client()
        self.custom, self.core = self.kube.custom, self.kube.core
        self.authn, self.authz = client.AuthenticationV1Api(), client.AuthorizationV1Api()
        self.models = client
        self.reviews = ReviewCache(review_seconds)

    def review_token(self, token: str) -> dict[str, Any] | None:
        key = ("token", hashlib.sha256(token.encode()).hexdigest())
        return self.reviews.get(key, lambda: self._review_token(token))

    def _review_token(self, token: str) -> dict[str, Any] | None:
        review = self.authn.create_token_review(self.models.V1TokenReview(spec=self.models.V1TokenReviewSpec(token=token)))
        if not review.status.authenticated:
            return None
        user = review.status.user
        return {"username": user.username, "uid": user.uid, "groups": user.groups, "extra": user.extra}

    def allowed(self, user: dict[str, Any], namespace: str, verb: str) -> bool:
        key = ("access", user["username"], user["uid"], tuple(user["groups"] or ()), namespace, verb)
        return self.reviews.get(key, lambda: self._allowed(user, namespace, verb))

    def _allowed(self, user: dict[str, Any], namespace: str, verb: str) -> bool:
        attributes = self.models.V1ResourceAttributes(namespace=namespace, verb=verb, group=api.GROUP, resource=api.PLURAL)
        spec = self.models.V1SubjectAccessReviewSpec(user=user["username"], uid=user["uid"], groups=user["groups"],
                                                     extra=user["extra"], resource_attributes=attributes)
        return self.authz.create_subject_access_review(self.models.V1SubjectAccessReview(spec=spec)).status.allowed

    def lorajob(self, namespace: str, name: str) -> dict | None:
        from kubernetes.client.exceptions import ApiException

        try:
            obj = self.custom.get_namespaced_custom_object(api.GROUP, api.VERSION, namespace, api.PLURAL, name)
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        return obj if jobs.JOB_LABEL in obj["metadata"].get("labels", {}) else None

    def lorajobs(self, namespace: str) -> list[dict]:
        listing = self.custom.list_namespaced_custom_object(api.GROUP, api.VERSION, namespace, api.PLURAL,
                                                           label_selector=f"{jobs.JOB_LABEL}=true")
        return listing["items"]

    def create(self, namespace: str, body: dict, dry_run: bool = False) -> dict:
        return self.custom.create_namespaced_custom_object(api.GROUP, api.VERSION, namespace, api.PLURAL, body,
                                                          **({"dry_run": "All"} if dry_run else {}))

    def patch(self, namespace: str, name: str, patch: dict) -> dict:
        return self.custom.patch_namespaced_custom_object(api.GROUP, api.VERSION, namespace, api.PLURAL, name, patch)

    def events(self, namespace: str, name: str) -> list[dict]:
        return self.kube.events(namespace, name)

    def policies_and_labels(self, namespace: str) -> tuple[list[policy.LoRAJobPolicy], dict[str, str]]:
        # From the API server's watch cache (resourceVersion 0): a consistent list would wait for that cache to
        # catch up with the last write, tens of milliseconds after a create. The operator and the admission policy
        # apply the policies again; this check only answers early.
        listing = self.custom.list_cluster_custom_object(api.GROUP, api.VERSION, policy.PLURAL, resource_version="0")
        labels = self.core.read_namespace(namespace).metadata.labels or {}
        return [policy.LoRAJobPolicy.from_object(obj) for obj in listing["items"]], labels


class ReviewCache:
    """TokenReview and SubjectAccessReview answers, kept `seconds` (as the API server's own webhook authorizer keeps
    its answers): a revoked token or role takes effect within that time. Bounded: the oldest answers go first."""

    def __init__(self, seconds: float, size: int = 10_000):
        self.seconds, self.size = seconds, size
        self.answers: OrderedDict[tuple, tuple[float, Any]] = OrderedDict()
        self.lock = threading.Lock()

    def get(self, key: tuple, ask: Callable[[], Any]) -> Any:
        now = time.monotonic()
        with self.lock:
            kept = self.answers.get(key)
        if kept is not None and kept[0] > now:
            return kept[1]
        answer = ask()
        with self.lock:
            self.answers[key] = (now + self.seconds, answer)
            self.answers.move_to_end(key)
            while len(self.answers) > self.size:
                self.answers.popitem(last=False)
        return answer


@dataclass
class RateLimits:
    """A token bucket per namespace: `per_minute` requests at once, refilled at `per_minute` a minute."""

    per_minute: int
    buckets: dict[str, tuple[float, float]] = field(default_factory=dict)

    def take(self, namespace: str, now: float) -> bool:
        tokens, then = self.buckets.get(namespace, (float(self.per_minute), now))
        tokens = min(float(self.per_minute), tokens + (now - then) * self.per_minute / 60)
        if tokens < 1:
            self.buckets[namespace] = (tokens, now)
            return False
        self.buckets[namespace] = (tokens - 1, now)
        return True


class FineTuningApi:
    def __init__(self, config: ServerConfig, cluster: Cluster):
        self.config, self.cluster = config, cluster
        self.store = FileStore(config.storage)
        self.limits = RateLimits(config.limits.requests_per_minute)
        for name, offer in config.models.items():  # a template that is no LoRAJob spec stops the server here
            log.info("model %s: %s on %d accelerators", name, offer.spec.model.name, offer.accelerators)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=JSON_BODY_MAX, middlewares=[self._errors])
        app.add_routes([
            web.get("/healthz", self.healthz),
            web.get("/v1/models", self.list_models),
            web.post("/v1/files", self.upload_file),
            web.get("/v1/files", self.list_files),
            web.get("/v1/files/{file_id}", self.retrieve_file),
            web.delete("/v1/files/{file_id}", self.delete_file),
            web.post("/v1/fine_tuning/jobs", self.create_job),
            web.get("/v1/fine_tuning/jobs", self.list_jobs),
            web.get("/v1/fine_tuning/jobs/{job_id}", self.retrieve_job),
            web.post("/v1/fine_tuning/jobs/{job_id}/cancel", self.cancel_job),
            web.post("/v1/fine_tuning/jobs/{job_id}/pause", self.pause_job),
            web.post("/v1/fine_tuning/jobs/{job_id}/resume", self.resume_job),
            web.get("/v1/fine_tuning/jobs/{job_id}/events", self.list_events),
            web.get("/v1/fine_tuning/jobs/{job_id}/checkpoints", self.list_checkpoints),
        ])
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except ApiError as error:
            return web.json_response(error.body, status=error.status)
        except RequestError as error:
            return web.json_response(ApiError(400, error.message, param=error.param, code=error.code).body, status=400)
        except web.HTTPException as error:
            if error.status == 413:
                message = f"the request body is larger than this API's limit of {JSON_BODY_MAX} bytes"
            else:
                message = error.reason
            return web.json_response(ApiError(error.status, message).body, status=error.status)
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            return web.json_response(ApiError(500, "internal error (see the server's log)", kind="server_error").body,
                                     status=500)

    # ---------------------------------------------------------------------------------------- access

    async def _caller(self, request: web.Request, verb: str) -> Caller:
        header = request.headers.get("Authorization", "")
        if not header.startswith("Bearer ") or not header[7:].strip():
            raise ApiError(401, "no API key: send a Kubernetes bearer token as the API key", code="invalid_api_key")
        user = await asyncio.to_thread(self.cluster.review_token, header[7:].strip())
        if user is None:
            raise ApiError(401, "the API key is not a valid Kubernetes token", code="invalid_api_key")
        namespace = request.headers.get(PROJECT_HEADER) or _service_account_namespace(user["username"])
        if not namespace:
            raise ApiError(400, "no project: set the client's project to the namespace to work in", param="project",
                           code="missing_project")
        if namespace not in self.config.namespaces:
            raise ApiError(403, f"project {namespace!r} is not served by this API", code="project_not_served")
        if not self.limits.take(namespace, time.monotonic()):
            raise ApiError(429, f"project {namespace!r} is over its limit of {self.config.limits.requests_per_minute} "
                           "requests a minute", kind="requests", code="rate_limit_exceeded")
        if not await asyncio.to_thread(self.cluster.allowed, user, namespace, verb):
            raise ApiError(403, f"{user['username']} may not {verb} LoRAJobs in namespace {namespace!r}",
                           code="permission_denied")
        return Caller(user, namespace)

    # ---------------------------------------------------------------------------------------- models

    async def healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def list_models(self, request: web.Request) -> web.Response:
        await self._caller(request, "get")
        data = [{"id": name, "object": "model", "created": 0, "owned_by": offer.owned_by}
                for name, offer in self.config.models.items()]
        return web.json_response({"object": "list", "data": data})

    # ---------------------------------------------------------------------------------------- files

    async def upload_file(self, request: web.Request) -> web.Response:
        caller = await self._caller(request, "create")
        limits = self.config.limits
        if request.content_length and request.content_length > limits.file_bytes + JSON_BODY_MAX:
            raise ApiError(413, f"the file is larger than this API's limit of {limits.file_bytes} bytes",
                           param="file", code="file_too_large")
        if await asyncio.to_thread(self.store.count, caller.namespace) >= limits.files_per_namespace:
            raise ApiError(400, f"project {caller.namespace!r} holds {limits.files_per_namespace} files, this API's "
                           "limit: delete some first", code="too_many_files")
        if not request.content_type.startswith("multipart/"):
            raise ApiError(400, "upload the file as multipart/form-data with fields purpose and file", param="file")
        purpose = filename = None
        with tempfile.NamedTemporaryFile(prefix="upload-", suffix=".jsonl") as spool:
            check = UploadCheck(spool, max_bytes=limits.file_bytes, max_lines=limits.file_lines,
                                errors_listed=limits.line_errors)
            reader = await request.multipart()
            while (part := await reader.next()) is not None:
                if part.name == "purpose":
                    purpose = (await part.text()).strip()
                elif part.name == "file":
                    filename = part.filename or "file.jsonl"
                    try:
                        while chunk := await part.read_chunk(UPLOAD_CHUNK):
                            await asyncio.to_thread(check.feed, chunk)
                        await asyncio.to_thread(check.finish)
                    except UploadRefused as refused:
                        raise ApiError(400, str(refused), param="file", code="invalid_file") from None
                else:
                    raise ApiError(400, f"form field {part.name!r} is not supported", param=part.name,
                                   code="unsupported_parameter")
            if purpose != PURPOSE:
                raise ApiError(400, f"purpose must be {PURPOSE!r} (this API stores training files only); got {purpose!r}",
                               param="purpose", code="invalid_purpose")
            if filename is None:
                raise ApiError(400, "no file field in the upload", param="file")
            spool.flush()
            stored = await asyncio.to_thread(self.store.put, caller.namespace, spool.name, filename, check)
        log.info("%s uploaded %s (%d lines) to %s", caller.user["username"], stored.id, stored.lines, caller.namespace)
        return web.json_response(stored.to_api())

    async def list_files(self, request: web.Request) -> web.Response:
        caller = await self._caller(request, "get")
        files = [f.to_api() for f in await asyncio.to_thread(self.store.list, caller.namespace)]
        purpose = request.query.get("purpose")
        if purpose is not None and purpose != PURPOSE:
            files = []
        return self._page(request, files, default_limit=10_000, max_limit=10_000)

    async def _file(self, request: web.Request, verb: str):
        caller = await self._caller(request, verb)
        stored = await asyncio.to_thread(self.store.get, caller.namespace, request.match_info["file_id"])
        if stored is None:
            raise not_found("file")
        return caller, stored

    async def retrieve_file(self, request: web.Request) -> web.Response:
        _, stored = await self._file(request, "get")
        return web.json_response(stored.to_api())

    async def delete_file(self, request: web.Request) -> web.Response:
        caller, stored = await self._file(request, "delete")
        await asyncio.to_thread(self.store.delete, caller.namespace, stored.id)
        return web.json_response({"id": stored.id, "object": "file", "deleted": True})

    # ---------------------------------------------------------------------------------------- jobs

    async def create_job(self, request: web.Request) -> web.Response:
        caller = await self._caller(request, "create")
        try:
            body = await request.json()
        except ValueError:
            raise ApiError(400, "the body is not JSON") from None
        try:
            create = jobs.CreateJob.model_validate(body)
        except ValidationError as error:
            raise jobs.describe_validation_error(error) from None
        offer = self.config.models.get(create.model)
        if offer is None:
            raise ApiError(400, f"model {create.model!r} is not offered here; the models are "
                           f"{', '.join(sorted(self.config.models))}", param="model", code="model_not_found")
        files = {}
        for param in ("training_file", "validation_file"):
            file_id = getattr(create, param)
            if file_id is not None:
                files[param] = await asyncio.to_thread(self.store.get, caller.namespace, file_id)
                if files[param] is None:
                    raise ApiError(400, f"{param} {file_id!r}: no such file in project {caller.namespace!r}",
                                   param=param, code="file_not_found")
        job_id = new_id(jobs.JOB_ID_PREFIX, jobs.JOB_ID_RANDOM)
        folder = self.store.job_folder(caller.namespace, job_id)
        body = jobs.build_lorajob(create, offer, job_id=job_id, namespace=caller.namespace,
                                  user=caller.user["username"], training=files["training_file"],
                                  validation=files.get("validation_file"),
                                  dataset_folder=self.store.url(f"{folder}/data"),
                                  outputs=self.store.url(f"{folder}/runs"))
        await self._admissible(caller.namespace, body)
        await asyncio.to_thread(self._write_dataset, caller.namespace, folder, files)
        try:
            created = await asyncio.to_thread(self._create, caller.namespace, body)
        except BaseException:
            await asyncio.to_thread(self.store.remove_job_folder, folder)
            raise
        log.info("%s created LoRAJob %s/%s", caller.user["username"], caller.namespace, job_id)
        return web.json_response(jobs.job_object(created))

    async def _admissible(self, namespace: str, body: dict) -> None:
        """The LoRAJob passes the namespace's LoRAJobPolicies and the API server's own rules (a dry run: the CRD's
        rules and any admission policy), or the request is refused with their messages before anything is written."""
        spec = api.LoRAJobSpec.model_validate(body["spec"])
        policies, labels = await asyncio.to_thread(self.cluster.policies_and_labels, namespace)
        violations = policy.violations(policies, labels, spec)
        if violations:
            raise ApiError(400, "refused by policy: " + "; ".join(f"{v.policy}: {v.message}" for v in violations),
                           code="policy_violation")
        await asyncio.to_thread(self._create, namespace, body, True)

    def _write_dataset(self, namespace: str, folder: str, files: dict) -> None:
        for param, split in (("training_file", "train"), ("validation_file", "test")):
            if files.get(param) is not None:
                self.store.copy_to(namespace, files[param].id, f"{folder}/data/{split}.jsonl")

    def _create(self, namespace: str, body: dict, dry_run: bool = False) -> dict:
        from kubernetes.client.exceptions import ApiException

        try:
            return self.cluster.create(namespace, body, dry_run)
        except ApiException as error:
            if error.status in (400, 403, 422):  # admission: the CRD's rules, a ValidatingAdmissionPolicy, quota
                message = json.loads(error.body or "{}").get("message", error.reason)
                raise ApiError(400, f"the cluster refused the job's LoRAJob: {message}", code="invalid_job") from None
            raise

    async def _job(self, request: web.Request, verb: str) -> tuple[Caller, dict]:
        caller = await self._caller(request, verb)
        job_id = request.match_info["job_id"]
        obj = None
        if jobs.is_job_id(job_id):
            obj = await asyncio.to_thread(self.cluster.lorajob, caller.namespace, job_id)
        if obj is None:
            raise not_found("fine-tuning job")
        return caller, obj

    async def list_jobs(self, request: web.Request) -> web.Response:
        caller = await self._caller(request, "list")
        items = await asyncio.to_thread(self.cluster.lorajobs, caller.namespace)
        return self._page(request, [jobs.job_object(o) for o in jobs.newest_first(items)], default_limit=20)

    async def retrieve_job(self, request: web.Request) -> web.Response:
        _, obj = await self._job(request, "get")
        return web.json_response(jobs.job_object(obj))

    async def cancel_job(self, request: web.Request) -> web.Response:
        return await self._suspend(request, "cancel", {jobs.CANCELLED_ANNOTATION: str(int(time.time()))}, True)

    async def pause_job(self, request: web.Request) -> web.Response:
        return await self._suspend(request, "pause", {}, True, only_from=("validating_files", "queued", "running"))

    async def resume_job(self, request: web.Request) -> web.Response:
        return await self._suspend(request, "resume", {}, False, only_from=("paused",))

    async def _suspend(self, request: web.Request, action: str, annotations: dict[str, str], suspend: bool,
                       only_from: tuple[str, ...] | None = None) -> web.Response:
        """Cancel and pause suspend the LoRAJob (its pods checkpoint and stop); resume lifts a pause."""
        caller, obj = await self._job(request, "patch")
        state = jobs.job_status(obj)
        if state in jobs.FINISHED or (only_from and state not in only_from):
            raise ApiError(400, f"the job is {state}: it cannot {action}", code="invalid_job_state")
        patch = {"metadata": {"annotations": annotations}, "spec": {"suspend": suspend}}
        patched = await asyncio.to_thread(self.cluster.patch, caller.namespace, obj["metadata"]["name"], patch)
        log.info("%s: %s %s/%s", caller.user["username"], action, caller.namespace, obj["metadata"]["name"])
        return web.json_response(jobs.job_object(patched))

    async def list_events(self, request: web.Request) -> web.Response:
        caller, obj = await self._job(request, "get")
        events = await asyncio.to_thread(self.cluster.events, caller.namespace, obj["metadata"]["name"])
        return self._page(request, jobs.job_events(obj, events), default_limit=20)

    async def list_checkpoints(self, request: web.Request) -> web.Response:
        _, obj = await self._job(request, "get")
        return self._page(request, jobs.job_checkpoints(obj), default_limit=10)

    @staticmethod
    def _page(request: web.Request, items: list[dict], *, default_limit: int, max_limit: int = LIST_LIMIT_MAX) -> web.Response:
        try:
            limit = int(request.query.get("limit", default_limit))
        except ValueError:
            raise ApiError(400, "limit must be an integer", param="limit") from None
        if not 1 <= limit <= max_limit:
            raise ApiError(400, f"limit must be between 1 and {max_limit}", param="limit")
        page, more = paginate(items, request.query.get("after"), limit)
        body = {"object": "list", "data": page, "has_more": more}
        if page:
            body |= {"first_id": page[0]["id"], "last_id": page[-1]["id"]}
        return web.json_response(body)


def _service_account_namespace(username: str) -> str | None:
    if username.startswith(SERVICE_ACCOUNT_PREFIX):
        return username[len(SERVICE_ACCOUNT_PREFIX):].split(":", 1)[0]
    return None


def run(config_path: Path, listen: str) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = ServerConfig.load(config_path)
    host, _, port = listen.rpartition(":")
    server = FineTuningApi(config, Cluster())
    log.info("serving the fine-tuning API for namespaces %s on %s", ", ".join(config.namespaces), listen)
    web.run_app(server.app(), host=host or "0.0.0.0", port=int(port), print=None, access_log=log)
    return 0
