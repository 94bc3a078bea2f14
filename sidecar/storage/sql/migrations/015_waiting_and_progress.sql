-- The caller's half of a tool call (issue 26): waiting without polling, and progress.
--
-- A job's end wakes the callers waiting for it and nobody else: the trigger
-- tool_jobs_notify_end (sidecar/sql/functions/waiting.sql).
--
-- progress: the latest report of the attempt that owns the lease ({value, message, at,
-- attempt}), written by the fenced report_progress_if_owner, which notifies on the same
-- channel ({"id", "state": "running", "progress"}). Nullable, read by nothing older.
-- compatible-from: 14
ALTER TABLE tool_jobs ADD COLUMN progress jsonb;

