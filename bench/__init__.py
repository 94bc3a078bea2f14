"""The sidecar benchmark (issue 6): ``python -m bench [--quick | --medium] [--dsn DSN]``.

It measures real ``sidecar run`` processes (and, for the event-loop lag, an in-process
``sidecar.worker.claim_loop.Worker``) from the outside: SQL on the job table, ``pg_stat_*`` views,
``psutil``, pidfds and the sidecar's own JSON log. Every figure sits beside a baseline
measured in the same run (a bare asyncpg loop running the sidecar's own statements, a bare
spawn-and-reap loop, PgQueuer, Procrastinate and DBOS doing the same work), and the table says
which targets of the issue are met. Nothing is asserted: it is a benchmark, not a test.
"""
