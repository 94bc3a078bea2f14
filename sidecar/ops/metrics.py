"""Ownership metrics (P21) with prometheus-client, in the process-wide registry.

Names follow Prometheus conventions: prefix ``sidecar_``, base units (seconds), ``_total``
counters (the client appends it), timestamps rather than ages (but the queue's age, by the
database's clock). Labels are the ``tool`` and the profile's ``provider``, plus a bounded
reason where one is named (outcome, failure kind, heartbeat result, kill reason and signal,
shortage errno); never a job id. ``start_at_zero`` creates every known label set, so a
rate() over a fresh sidecar sees zeros instead of missing series.

A name says what it counts (case F24): a job may take several attempts, so what counts
attempts says ``attempts``. No series carries the label value ``none`` (a kill that found
nothing alive has ``signal="already_exited"``), and the client's ``_created`` series (one
more series per counter, a timestamp no alert or dashboard reads) are not exported.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, disable_created_metrics

from sidecar.protocol.shortage import SHORTAGE_NAMES
from sidecar.protocol.vocabulary import (
    ConnectionRefusal,
    FailureKind,
    HeartbeatResult,
    KillSignal,
    Outcome,
    StopReason,
)

disable_created_metrics()  # before any metric exists: none gets a _created series

_TP = ("tool", "provider")
_DURATIONS = (0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 1800, 3600)
_FAST = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)

# Every label set comes from sidecar.protocol.vocabulary: a new reason gets its series at start.
OUTCOMES = tuple(Outcome)
FAILURE_KINDS = tuple(FailureKind)
HEARTBEAT_RESULTS = tuple(HeartbeatResult)
KILL_REASONS = tuple(reason for reason in StopReason if reason is not StopReason.EXITED)
KILL_SIGNALS = tuple(KillSignal)
PRUNED_TABLES = ("tool_jobs", "tool_job_events", "tool_job_outbox")
# claimed (a job), empty (none eligible), or the flow limit that held every eligible one
# back (issue 27: sidecar.protocol.flow.Held).
CLAIM_OUTCOMES = ("claimed", "empty", "paused", "max_running", "max_running_per_key", "rate",
                  "rate_per_key", "more_keys")
GUARD_REFUSALS = tuple(ConnectionRefusal)

JOBS_CLAIMED = Counter("sidecar_jobs_claimed", "Jobs claimed (P4).", _TP)
POLLS = Counter("sidecar_polls",
                "Polls of the claim loop: one statement that counts the tool's claimable "
                "jobs (and runs the fleet's sweep on this sidecar's turn), once per poll "
                "period; a claim follows only when it counted some (issue 28).", _TP)
CLAIM_ATTEMPTS = Counter("sidecar_claim_attempts",
                         "Claim statements by outcome: claimed (one job or more, one "
                         "statement for all free slots), empty (none), or the flow limit "
                         "that held the tool's jobs back.",
                         (*_TP, "outcome"))
JOBS_RECLAIMED = Counter("sidecar_jobs_reclaimed",
                         "Jobs claimed from an owner whose lease had expired.", _TP)
ATTEMPTS_FINISHED = Counter("sidecar_attempts_finished",
                            "Attempts ended, by outcome (a job may take several).",
                            (*_TP, "outcome"))
# The error.kind of each failed attempt (issue 30: a dashboard's outcomes by kind, an alert
# on one kind failing above a rate); a bounded set (sidecar.protocol.vocabulary.FailureKind).
ATTEMPT_FAILURES = Counter("sidecar_attempt_failures",
                           "Attempts that ended failed or requeued for a retry, by the "
                           "error.kind written to the job row.", (*_TP, "kind"))
ATTEMPT_DURATION = Histogram("sidecar_attempt_duration_seconds",
                             "Attempt duration, claim to end.", _TP, buckets=_DURATIONS)
HEARTBEATS = Counter("sidecar_heartbeats",
                     "Lease renewals by result: ok, lost (zero rows), error, timeout.",
                     (*_TP, "result"))
HEARTBEAT_SECONDS = Histogram("sidecar_heartbeat_duration_seconds",
                              "Round trip of one renewal statement.", _TP, buckets=_FAST)
LEASE_SLACK = Histogram("sidecar_lease_slack_seconds",
                        "lease_until - now() by the database clock just before each renewal.",
                        _TP, buckets=(0.5, 1, 2, 5, 10, 20, 30, 45, 60, 90, 120, 300, 600))
LAST_HEARTBEAT = Gauge("sidecar_last_heartbeat_timestamp_seconds",
                       "Unix time of the last successful renewal.", _TP)
LEASES_HELD = Gauge("sidecar_leases_held", "Leases this sidecar holds now.", _TP)
# Read at each scrape from the lease keeper (sidecar.worker.lease.LeaseKeeper), so an episode that
# lasts shows as long as it lasts (issue 30: the alert on ownership unknown sustained).
LEASES_UNKNOWN = Gauge("sidecar_leases_ownership_unknown",
                       "Leases this sidecar holds whose ownership is unknown now: the "
                       "database has not confirmed them since a renewal failed (P14b).", _TP)
APPROVALS_WAITING = Gauge("sidecar_approvals_waiting",
                          "Tool calls of this sidecar waiting for a person's yes now "
                          "(POST /v1/approval, issue 44).", _TP)
JOBS_WAITING_APPROVAL = Gauge("sidecar_jobs_waiting_approval",
                              "Jobs of the tool parked for a person's answer (state "
                              "waiting, APPROVAL_MODE=park; issue 44), sampled each poll.",
                              _TP)
APPROVAL_ANSWER_SECONDS = Histogram(
    "sidecar_approval_answer_seconds",
    "Seconds from a tool's approval request to its answer, by outcome (approved, denied, "
    "expired).", (*_TP, "outcome"),
    buckets=(1, 5, 15, 30, 60, 120, 300, 900, 1800, 3600, 14400, 86400))
SESSIONS_HELD = Gauge("sidecar_sessions_held",
                      "Agent sessions this sidecar holds now, each with its warm process "
                      "(issue 43), read at each scrape.", _TP)
SESSIONS_LOST = Counter("sidecar_sessions_lost",
                        "Calls that failed session_lost: their session had ended or was "
                        "lost (issue 43).", _TP)
LEASES_EXPIRED = Counter("sidecar_leases_expired",
                         "Leases lost before the job ended: zero rows or local deadline.", _TP)
OWNERSHIP_UNKNOWN = Counter("sidecar_ownership_unknown_episodes",
                            "Episodes where the database did not answer a renewal (P14b).", _TP)
CHILD_KILLS = Counter("sidecar_child_kills", "Tree kills by reason and strongest signal.",
                      (*_TP, "reason", "signal"))
# From the first signal of a tree kill to the tree gone and the child reaped (issue 30);
# kills that found the tree already gone signal nothing and are not observed.
KILL_DURATION = Histogram("sidecar_kill_duration_seconds",
                          "Tree kills that sent a signal: first signal to every process "
                          "gone.", _TP, buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30,
                                                 60))
PROCESSES_LEFT = Counter("sidecar_processes_left_after_kill",
                         "Processes still alive after a tree kill finished.", _TP)
ATTEMPT_SHORTAGES = Counter("sidecar_attempt_shortages",
                            "Attempts released unspent because the host ran short of "
                            "processes, memory, descriptors or disk at setup or spawn (F19), "
                            "by errno.", (*_TP, "errno"))
COMPLETIONS_REJECTED = Counter("sidecar_completions_rejected",
                               "Outcomes not committed because the lease was not ours (P6).",
                               _TP)
# Flow control (issue 27), sampled from the database once per poll period by each sidecar
# of the tool: its limits (absent: none), jobs running under a live lease fleet-wide, and
# whether the tool is paused.
FLOW_LIMIT = Gauge("sidecar_flow_limit", "A flow limit of the tool, fleet-wide: "
                   "max_running, max_running_per_key (jobs), rate, rate_per_key (claims per "
                   "second); absent when not set.", ("tool", "limit"))
FLOW_RUNNING = Gauge("sidecar_flow_running", "Jobs of the tool running under a live lease, "
                     "fleet-wide (sampled; only for a tool with a flow row).", ("tool",))
FLOW_PAUSED = Gauge("sidecar_flow_paused", "1 while the tool is paused fleet-wide "
                    "(sidecar pause), else 0.", ("tool",))
QUEUE_DEPTH = Gauge("sidecar_queue_depth",
                    "Jobs of the tool the claim may take now by its row rules: queued, due "
                    "and before their expiry, or under an expired lease with an attempt "
                    "left; flow limits not applied (sampled).", _TP)
# An age by the database's clock, not a timestamp: the queue's own clock decides when a
# job became due, and an empty queue has an age (0) where a timestamp has none.
QUEUE_AGE = Gauge("sidecar_queue_oldest_age_seconds",
                  "How long the oldest queued job of the tool has been due (now() - "
                  "run_after by the database's clock; jobs past their expiry not counted; 0 "
                  "when none is due; sampled).", _TP)
FORWARD_BACKLOG = Gauge("sidecar_forward_backlog",
                        "Results of the tool's jobs waiting in the outbox to be forwarded "
                        "to RESULT_URL, fleet-wide (sampled).", _TP)
# 1 from start to exit: a tool none of whose sidecars exports it has no live sidecar
# (issue 30: the alert on a tool left without one).
UP = Gauge("sidecar_up", "1 while this sidecar runs for the tool.", _TP)
LISTENING = Gauge("sidecar_listening",
                  "1 while the sidecar's LISTEN connection is up, so a NOTIFY wakes it; 0 "
                  "while it only polls (SIDECAR_POLL_SECONDS): behind a transaction pooler "
                  "without SIDECAR_LISTEN_DATABASE_URL, or while that connection is lost.",
                  _TP)
JOBS_EXPIRED = Counter("sidecar_jobs_expired",
                       "Jobs this sidecar's sweep ended failed because no attempt started "
                       "before their expiry (--expires-in), by the job's tool.", ("tool",))
PRUNED_ROWS = Counter("sidecar_pruned_rows",
                      "Rows retention deleted, by table (sidecar.ops.retention.RETENTION): "
                      "finished jobs, their journal events and outbox rows, old flow changes, "
                      "refilled rate buckets, dead idle registrations, stale sweep turns.",
                      ("table",))
FORWARD_DEAD_LETTER_KINDS = ("refused", "redirect", "max_attempts", "max_age")
FORWARD_DEAD_LETTERS = Counter("sidecar_forward_dead_letters",
                               "Forwarded results dead-lettered, by kind: refused (a 4xx), "
                               "redirect (a 3xx), max_attempts, max_age (case F21).",
                               (*_TP, "kind"))
GUARD_CONNECTIONS_REFUSED = Counter(
    "sidecar_guard_connections_refused",
    "Connections to the guard refused by reason: attempt_cap, total_cap, "
    "unauthenticated_cap (each connection), descriptor_reserve (each pause of accepting).",
    (*_TP, "reason"))
HEALTH_CONNECTIONS_REFUSED = Counter(
    "sidecar_health_connections_refused",
    "Connections to the health server (/metrics, /livez, /readyz) refused by reason: "
    "total_cap (over its 64 open at once), descriptor_reserve (each pause of accepting).",
    ("reason",))
LOOP_LAG = Histogram("sidecar_event_loop_lag_seconds", "Event-loop lag of the sidecar.",
                     buckets=_FAST)
# The periodic services (sidecar.ops.periodic), by name.
SERVICES = ("pruner", "forwarder", "leftover_sweep", "orphan_reaper", "loop_watch",
            "cancel_check")
SERVICE_RESULTS = ("ok", "error")
SERVICE_RUNS = Counter("sidecar_service_runs",
                       "Runs of the periodic background services (pruner, forwarder, "
                       "leftover_sweep, orphan_reaper, loop_watch, cancel_check) by result: ok, "
                       "or error "
                       "(logged under the service's error event).", ("service", "result"))


def start_at_zero(tool: str, provider: str) -> None:
    """Create every known label set of ``tool``/``provider`` at zero, and set
    ``sidecar_up`` of the pair to 1."""
    for metric in (JOBS_CLAIMED, POLLS, JOBS_RECLAIMED, ATTEMPT_DURATION, HEARTBEAT_SECONDS,
                   LEASE_SLACK, LAST_HEARTBEAT, LEASES_HELD, LEASES_EXPIRED, OWNERSHIP_UNKNOWN,
                   PROCESSES_LEFT, COMPLETIONS_REJECTED, QUEUE_DEPTH, LISTENING, KILL_DURATION,
                   LEASES_UNKNOWN, QUEUE_AGE, FORWARD_BACKLOG, JOBS_WAITING_APPROVAL,
                   APPROVALS_WAITING):
        metric.labels(tool, provider)
    UP.labels(tool, provider).set(1)
    for kind in FAILURE_KINDS:
        ATTEMPT_FAILURES.labels(tool, provider, kind)
    for outcome in CLAIM_OUTCOMES:
        CLAIM_ATTEMPTS.labels(tool, provider, outcome)
    for table in PRUNED_TABLES:
        PRUNED_ROWS.labels(table)
    JOBS_EXPIRED.labels(tool)
    for service in SERVICES:
        for result in SERVICE_RESULTS:
            SERVICE_RUNS.labels(service, result)
    for outcome in OUTCOMES:
        ATTEMPTS_FINISHED.labels(tool, provider, outcome)
    for kind in FORWARD_DEAD_LETTER_KINDS:
        FORWARD_DEAD_LETTERS.labels(tool, provider, kind)
    for result in HEARTBEAT_RESULTS:
        HEARTBEATS.labels(tool, provider, result)
    for reason in GUARD_REFUSALS:
        GUARD_CONNECTIONS_REFUSED.labels(tool, provider, reason)
    for name in SHORTAGE_NAMES:
        ATTEMPT_SHORTAGES.labels(tool, provider, name)
    for reason in KILL_REASONS:
        for sig in KILL_SIGNALS:
            CHILD_KILLS.labels(tool, provider, reason, sig)
