"""Control-plane chaos on the simulated cluster: LoRAJobs run their chain while the operator is SIGKILLed
and kube-apiserver, JobSet and Kueue are restarted at seeded random moments; a watch records every
JobSet and LoRAJob version ever seen, and `problems` checks what a run must keep under faults.

Used by tests/e2e/test_chaos.py (small, in CI) and bench/chaos.py (large, prints recovery times).
"""

from __future__ import annotations

import dataclasses
import random
import time

import yaml
from lorajobs import sample
from record import Record, Versions

from lorajob_devcluster import wait_for
from lorajob_operator import api, names, rules

OPERATOR = "operator"
RESTARTABLE = ("kube-apiserver", "jobset", "kueue")
"""Simulated-cluster components a chaos run restarts (SimCluster.restart names)."""
GAP = (0.3, 2.0)
"""Seconds between faults (uniform), short enough that a small run still has LoRAJobs in flight at the last one."""


@dataclasses.dataclass(frozen=True)
class Fault:
    target: str
    """OPERATOR (SIGKILL of the operator, or of the leader of its replicas, then a replacement) or one of
    RESTARTABLE (SIGKILL and restart)."""
    delay: float
    """Seconds after the previous fault recovered (or the LoRAJobs were created)."""


def plan(seed: int, operator_kills: int, restarts: tuple[str, ...] = RESTARTABLE, gap: tuple[float, float] = GAP) -> list[Fault]:
    """The faults of a run, in a seeded random order, each after a seeded random pause."""
    rng = random.Random(seed)
    targets = [OPERATOR] * operator_kills + list(restarts)
    rng.shuffle(targets)
    return [Fault(target, round(rng.uniform(*gap), 2)) for target in targets]


@dataclasses.dataclass(frozen=True)
class Injected:
    fault: Fault
    at: float
    """time.monotonic() of the kill."""
    ready: float
    """When the component served again (the operator: a new process, or a standby holding the Lease)."""
    unfinished: int
    """LoRAJobs not yet Succeeded or Failed when it struck."""


def _finished(obj: dict) -> bool:
    return (obj.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def _true_conditions(obj: dict) -> set[str]:
    return {c["type"] for c in (obj.get("status") or {}).get("conditions") or [] if c.get("status") == "True"}


def _controller(obj: dict) -> dict | None:
    return next((ref for ref in obj["metadata"].get("ownerReferences") or [] if ref.get("controller")), None)


def _key(jobset: dict) -> tuple[str, str, int]:
    labels = jobset["metadata"].get("labels") or {}
    return labels.get(names.LABEL_RUN, "?"), labels.get(names.LABEL_PHASE, "?"), int(labels.get(names.LABEL_ATTEMPT, -1))


def problems(jobset_versions: Versions, lorajob_versions: Versions, names: list[str], namespace_objects: list[dict]) -> list[str]:
    """What a chaos run broke, as sentences (empty: nothing), from every version of the JobSets and
    LoRAJobs seen (`Record.versions`, in order): every LoRAJob in `names` Succeeded with a
    consistent status; exactly one JobSet ever per step and attempt, each controlled by its LoRAJob; a
    step's JobSet created only after the one before it completed, and never again once it completed; no
    LoRAJob ever went back to an earlier step or Failed; every object in `namespace_objects` (the
    namespace's JobSets, Jobs, pods and Workloads now) controlled by an object that still exists."""
    found: list[str] = []
    lorajobs = {obj["metadata"]["name"]: obj for _, obj in lorajob_versions}
    attempts: dict[tuple[str, str], dict[str, int]] = {}
    """(LoRAJob, step) -> {JobSet uid: attempt} of every JobSet ever seen."""
    first_seen: dict[str, float] = {}
    completed_at: dict[str, float] = {}
    created: dict[str, str] = {}
    completed: dict[str, str] = {}
    """The API server's own times (seconds): a JobSet's creation, its Completed condition."""
    for at, jobset in jobset_versions:
        uid, (run, step, attempt) = jobset["metadata"]["uid"], _key(jobset)
        attempts.setdefault((run, step), {})[uid] = attempt
        first_seen.setdefault(uid, at)
        created[uid] = jobset["metadata"]["creationTimestamp"]
        if "Completed" in _true_conditions(jobset):
            completed_at.setdefault(uid, at)
            completed.setdefault(uid, next(c["lastTransitionTime"] for c in jobset["status"]["conditions"]
                                           if c["type"] == "Completed"))
        owner, lorajob = _controller(jobset), lorajobs.get(run)
        if lorajob is None or owner is None or (owner["kind"], owner["uid"]) != ("LoRAJob", lorajob["metadata"]["uid"]):
            found.append(f"JobSet {jobset['metadata']['name']} ({uid}) is not controlled by its LoRAJob: {owner}")

    def completion(run: str, step: str, times: dict = completed_at):
        """When the step's first JobSet to complete did so, by `times` (the recorder's, or the server's)."""
        done = [times[uid] for uid in attempts.get((run, step), {}) if uid in times]
        return min(done) if done else None

    for name in names:
        if name not in lorajobs:
            found.append(f"LoRAJob {name} was never seen")
            continue
        found += _status_problems(lorajobs[name])
        restarts = (lorajobs[name].get("status") or {}).get("restarts") or {}
        steps = _steps(lorajobs[name])
        for index, step in enumerate(steps):
            tries = attempts.get((name, step), {})
            for attempt in sorted(set(tries.values())):
                same = sorted(uid for uid, of in tries.items() if of == attempt)
                if len(same) > 1:
                    found.append(f"{len(same)} JobSets were created for LoRAJob {name} step {step} attempt {attempt}: {same}")
            if sorted(set(tries.values())) != list(range(restarts.get(step, 0) + 1)):
                found.append(f"LoRAJob {name} step {step}: JobSets of attempts {sorted(set(tries.values()))}, status.restarts {restarts.get(step)}")
            done = completion(name, step)
            if done is None:
                found.append(f"LoRAJob {name}: no JobSet of step {step} ever completed")
                continue
            again = sorted(uid for uid in tries if first_seen[uid] > done)
            if again:
                found.append(f"LoRAJob {name}: step {step} ran again after it completed (JobSets {again})")
            before = completion(name, steps[index - 1]) if index else None
            # Seen before the step before it was seen completed (a listing after a watch gap shows both at once:
            # not counted), or created, by the API server's clock, before that step completed.
            before_by_server = completion(name, steps[index - 1], completed) if index else None
            early = sorted(uid for uid in tries if index and (
                before is None or first_seen[uid] < before or created[uid] < (before_by_server or "")))
            if early:
                found.append(f"LoRAJob {name}: step {step} started before step {steps[index - 1]} completed ({early})")
    found += _history_problems(lorajob_versions)

    uids = {obj["metadata"]["uid"] for obj in [*namespace_objects, *lorajobs.values()]}
    for obj in namespace_objects:
        owner = _controller(obj)
        if owner is not None and owner["uid"] not in uids:
            found.append(f"orphaned {obj['kind']} {obj['metadata']['name']}: its {owner['kind']} {owner['name']} is gone")
    return found


def _steps(obj: dict) -> list[str]:
    """The steps a LoRAJob runs, in order."""
    return rules.phases(api.LoRAJobSpec.model_validate(obj["spec"]))


def _status_problems(obj: dict) -> list[str]:
    name, status, generation = obj["metadata"]["name"], obj.get("status") or {}, obj["metadata"]["generation"]
    found = []
    if status.get("phase") != "Succeeded":
        found.append(f"LoRAJob {name} ended {status.get('phase')}: {status.get('message')}")
    if _true_conditions(obj) != {"Succeeded"}:
        found.append(f"LoRAJob {name}: conditions True {sorted(_true_conditions(obj))}, want only Succeeded")
    stale = [c["type"] for c in status.get("conditions") or [] if c.get("observedGeneration") != generation]
    if status.get("observedGeneration") != generation or stale:
        found.append(f"LoRAJob {name}: observedGeneration {status.get('observedGeneration')} (conditions {stale}) != generation {generation}")
    if status.get("children") != {step: names.child_name(name, step) for step in _steps(obj)}:
        found.append(f"LoRAJob {name}: status.children {status.get('children')}")
    if not status.get("startTime") or status["startTime"] > (status.get("completionTime") or ""):
        found.append(f"LoRAJob {name}: startTime {status.get('startTime')} completionTime {status.get('completionTime')}")
    return found


def _history_problems(versions: Versions) -> list[str]:
    """A LoRAJob never Failed, never went back to an earlier step, never left Succeeded."""
    order = {phase: index for index, phase in enumerate(rules.PHASE_WHILE_RUNNING.values())}
    reached: dict[str, int] = {}
    succeeded: set[str] = set()
    found = []
    for _, obj in versions:
        name, phase = obj["metadata"]["name"], (obj.get("status") or {}).get("phase")
        if phase == "Failed":
            found.append(f"LoRAJob {name} was Failed at some point: {obj['status'].get('message')}")
        if name in succeeded and phase != "Succeeded":
            found.append(f"LoRAJob {name} left Succeeded for {phase}")
        if phase == "Succeeded":
            succeeded.add(name)
        if phase in order:
            if order[phase] < reached.get(name, -1):
                found.append(f"LoRAJob {name} went back to {phase}")
            reached[name] = max(reached.get(name, -1), order[phase])
    return list(dict.fromkeys(found))


@dataclasses.dataclass
class Outcome:
    seed: int
    names: list[str]
    injected: list[Injected]
    record: Record
    finished_at: float
    started_at: float

    def progress_resumed(self, injected: Injected) -> float | None:
        """Seconds from the fault until the first LoRAJob phase transition after the component served
        again (None: no LoRAJob changed phase after it)."""
        after = [at for at, _, _ in self.record.phase_changes() if at >= injected.ready]
        return after[0] - injected.at if after else None


def run(cluster, namespace: str, operator, seed: int, jobs: int, operator_kills: int, timeout: float,
        restarts: tuple[str, ...] = RESTARTABLE, gap: tuple[float, float] = GAP, log=print) -> Outcome:
    """Create `jobs` full-chain LoRAJobs in `namespace` (watched by the started `operator`, an
    OperatorProcess or OperatorReplicas), inject `plan(seed, operator_kills, restarts, gap)` and wait for every LoRAJob to finish;
    raise AssertionError naming the seed and every problem found. Where every LoRAJob has finished when a fault is due
    (a loaded machine restarts components slowly), one more is created just before it strikes, so that each fault
    strikes with work in flight whatever the machine's speed."""
    faults = plan(seed, operator_kills, restarts, gap)
    names: list[str] = []

    def create(count: int) -> None:
        added = [f"chaos-{index:02d}" for index in range(len(names), len(names) + count)]
        cluster.kubectl("-n", namespace, "apply", "-f", "-", input=yaml.safe_dump_all([sample(name) for name in added]))
        names.extend(added)

    def unfinished() -> int:
        return len(names) - sum(map(_finished, record.latest("lorajobs").values()))

    with Record(cluster.api_client(), namespace) as record:
        started = time.monotonic()
        create(jobs)
        injected: list[Injected] = []
        try:
            for fault in faults:
                time.sleep(fault.delay)  # the random moment itself
                if not unfinished():
                    create(1)
                    log(f"  every LoRAJob had finished: created {names[-1]} for fault {len(injected) + 1}")
                in_flight = unfinished()
                at = time.monotonic()
                if fault.target == OPERATOR:
                    ready = operator.crash()
                else:
                    cluster.restart(fault.target)
                    ready = time.monotonic()
                injected.append(Injected(fault, at, ready, in_flight))
                log(f"  fault {len(injected)}: {fault.target} down {injected[-1].ready - at:.1f} s, {in_flight} LoRAJobs unfinished")
                if not operator.healthy():
                    raise AssertionError(f"the operator died after {fault.target} restarted; log {operator.log_path}:\n{operator.log_tail()}")
            wait_for(lambda: len(record.latest("lorajobs")) == len(names) and not unfinished(),
                     timeout, f"all {len(names)} LoRAJobs finished")
            finished = time.monotonic()
            objects = [obj for kind in ("jobsets.jobset.x-k8s.io", "jobs", "pods", "workloads.kueue.x-k8s.io")
                       for obj in cluster.get_json("-n", namespace, kind)["items"]]
            found = problems(record.versions("jobsets"), record.versions("lorajobs"), names, objects)
            if found:
                raise AssertionError("\n".join(found))
        except (AssertionError, TimeoutError) as error:
            raise AssertionError(f"chaos run with seed {seed} ({len(names)} LoRAJobs, faults {[f.target for f in faults]}): {error}"
                                 f"\noperator log: {operator.log_path}") from error
    return Outcome(seed, names, injected, record, finished, started)
