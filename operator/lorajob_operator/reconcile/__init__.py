"""The reconcile decision: what exists -> what the LoRAJob's status is and what to do next (pure).

Rooms: `observed` (what exists), `kueue` (reading Kueue's Workloads), `trainer_output` (what the trainer printed,
lifted into status), `status_text` (the English of status), `decide` (the decision), `conditions` (reading
conditions and timestamps).

Level-based: every pass recomputes the phase from the child JobSets that exist, their conditions
and the Kueue Workloads that own their quota, so a restarted operator picks up where the last one
stopped. `observe_*` turn API objects (dicts) into small frozen values; `decide` turns those into
a `Decision` that `controller.reconciler` carries out (creations, then status, deletions and events).

Mechanisms, in one place:

* Steps run in order; a step's JobSet is created only when every earlier step's JobSet is Completed.
  Children are never given a TTL: a completed child is the record that its step is done.
* Kueue is never fought: a JobSet is created with its queue label and then only read (suspend and
  pod templates belong to Kueue). Its Workload (label kueue.x-k8s.io/job-uid) says whether the step
  is queued, admitted or evicted. A queued step's message gives its place among the pending Workloads of
  its ClusterQueue: Kueue's own (its visibility API, controller.kueue_visibility) or, where the cluster does not
  serve it, worked out in Kueue's order from the watched Workloads (`caches.queue_positions`), and
  what it waits for (the resources Kueue's pending message names, with the Workload's requests of them).
* Retries: a failed try N of a step (label lorajob.dev/attempt) is deleted once its backoff has
  passed and `status.restarts` records try N+1; the next pass, seeing no child, creates try N+1
  under the same name. Failures are classed (`failure_kind`): a user error (the trainer's documented
  exit codes, lorajob_trainer.contract.exit_codes) fails the LoRAJob at once with the trainer's message; an
  infrastructure failure (a pod disrupted: evicted, preempted, node lost; a container killed by a
  signal; the trainer stopped by SIGTERM) is retried up to `scheduling.infrastructureRetryLimit`
  times, counted in `status.infrastructureRestarts`; anything else up to `scheduling.retryLimit`.
* Stall watchdog (opt-in, `scheduling.progressDeadlineSeconds`): a running train step whose step has not
  changed for that long, counted from status.progress.advancedTime (when it started running or its step
  last changed), is restarted at once as an infrastructure failure with reason Stalled.
* suspend: the running step's JobSet is deleted (foreground, so its pods are gone before a new one
  can take its name) and recreated on resume; training restarts from its latest checkpoint.
* activeDeadlineSeconds counts from the later of startTime and the last resume.
* ttlSecondsAfterFinished deletes the LoRAJob; its children follow through their ownerReferences.
* Succeeded and Failed are final.
* LoRAJobPolicy: the policies governing the namespace are checked until the first step's JobSet exists
  (status.startTime unset); a violation fails the LoRAJob with reason PolicyViolation and creates
  nothing. A policy changed later does not stop a running LoRAJob (as admission would not): its
  steps keep going. The policies' defaults (queue, images, CPU node pool, MLflow server) are resolved on every pass
  into an in-memory copy of the spec (`effective_spec`) that the steps are rendered from, and
  recorded in status.resolved; the object's spec is never written.
* Training progress: the trainer's lead process prints a progress line per step to stdout; the tail
  of its pod's log (read by controller/trainer_logs.py while the train step runs, and once after it finished) is lifted
  into status.progress. Best effort: it never changes the phase, and a log that is missing or holds
  no readable line keeps the progress already recorded.
* Data and plan figures: the data check and the fit check (the check step, or first in the convert step) print
  one data line and (TPU backends) one plan line; the completed step's pod log is read once (on a resync
  pass, while status.data is unset) and the lines lifted into status.data and status.plan.
* Experiment tracking (spec.tracking): the trainer's progress records carry its tracker runs' addresses and how
  tracking goes; they are lifted into status.tracking and the TrackingDegraded condition (never the phase), and the
  addresses into the LoRAJob's Argo CD link annotations (`Decision.annotations`, a metadata patch made only when one
  is missing or changed: the one write outside status).
* Evaluation (spec.evaluation): the train step evaluates base and adapter after its last step (progress state
  evaluating, which is not final, so the log is read again after the step ends) and prints one evaluation line,
  lifted into status.evaluation. The export gate is the export step's: it exits NoImprovement (a user error, so
  the LoRAJob fails with the trainer's message, both scores in it) before writing anything.
"""
