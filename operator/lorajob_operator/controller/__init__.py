"""The operator's loop and its I/O, one room per job: `cluster` (the reads no cache holds: pods, logs; the
resources it writes), `observe` (a LoRAJob's world from the caches, caches.py, which kopf's watches fill,
watches.py), `trainer_logs` (when a trainer's log is worth reading, and reading it), `writes` (carrying out
what a `reconcile.decide.Decision` says), `reconciler` (one pass: observe -> decide -> writes),
`work_queue` (the burst-first queue and the resync), `kueue_visibility` (Kueue's own queue positions) and
`loop` (`Controller`: caches, queue, workers, leadership).

`Controller` runs it all: the caches, a work queue of LoRAJob keys fed by the caches' change events and by
`Resync`, and worker threads that run `Reconciler.reconcile` (one pass over one
LoRAJob; the queue never hands the same LoRAJob to two workers at once). A pass reads the caches only,
so a pass over a LoRAJob whose world has not changed sends no request at all; its own writes are put
into the caches at once (the watch event that follows is then no change). Only the resync pass and a
pass a LoRAJob asked for (a deadline) read the lead trainer's log for progress, so each log is read
about once per resync interval however many events arrive.
"""
