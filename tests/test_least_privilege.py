"""Least privilege at every database boundary (issue 41, point 2; docs/operations.md, "Roles
and Secrets"). On a real PostgreSQL, roles of our own are granted by the shipped grant
path (OperatorStore.grant_roles, what `sidecar migrate --worker-role --scaler-role
--caller-role --web-role` runs) and each is connected as in turn: every direct write the
role should not make is refused (rows of the queue's tables, its journals, the idle list,
the flow tables, the outbox, the sweeps, the ledgers, the fence_* tables, TRUNCATE, and
the functions that are not its own), and every documented path of the role still works
through the code that runs it (sidecar.client, the stores). The kind of fault: a check
in a function that a direct write goes around, so where a function checks what is
written, the roles not trusted with the rows (callers, the web view) get EXECUTE on a
SECURITY DEFINER function and no write on its tables."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import asyncpg
import orjson
import pytest
from test_roles import _as

from kit import job_row, journal_details, query, run, scalar
from sidecar.client import Client
from sidecar.ops.retention import RETENTION
from sidecar.protocol.model import RawJson
from sidecar.storage import schema
from sidecar.storage.caller_store import CallerStore
from sidecar.storage.db import init_connection
from sidecar.storage.operator_store import OperatorStore
from sidecar.storage.worker_store import WorkerStore

pytestmark = pytest.mark.database

KINDS = ("worker", "scaler", "caller", "web")
TABLES = ("tool_jobs", "tool_job_events", "tool_job_outbox", "tool_idle_sidecars",
          "tool_flow", "tool_flow_keys", "tool_flow_events", "tool_sweeps", "tool_sessions",
          "tool_dedupe", "tool_interests", "tool_approvals")

# Direct writes, each with the roles (besides the owner) that may make it. $1 is an
# existing job's id. A statement is run only as a role that must be refused it.
WRITES: dict[str, set[str]] = {
    "INSERT INTO tool_jobs (id, tool, idempotency_key, payload) "
    "VALUES (gen_random_uuid(), 'pt', 'direct', '{}')":
        {"worker"},  # next stages; the lease protocol is the workers'
    "INSERT INTO tool_jobs (id, tool, idempotency_key, payload, state, owner_id, "
    "lease_until) VALUES (gen_random_uuid(), 'pt', 'claimed', '{}', 'running', 'me', "
    "now() + interval '1 hour')": {"worker"},
    "UPDATE tool_jobs SET state = 'cancelled' WHERE id = $1": {"worker"},
    "UPDATE tool_jobs SET lease_until = now() + interval '1 hour', owner_id = 'me'":
        {"worker"},
    "DELETE FROM tool_jobs WHERE id = $1": {"worker"},  # the retention
    "INSERT INTO tool_job_events (job_id, fencing_token, event, details) "
    "VALUES ($1, 0, 'forged', '{}')": {"worker"},
    "UPDATE tool_job_events SET details = '{}' WHERE job_id = $1": set(),
    "DELETE FROM tool_job_events WHERE job_id = $1": {"worker"},
    "INSERT INTO tool_job_outbox (job_id, tool, url, idempotency_key, fencing_token, body) "
    "VALUES ($1, 'pt', 'http://127.0.0.1:9/', 'k', 0, '{}')": {"worker"},
    "UPDATE tool_job_outbox SET attempts = 0": {"worker"},
    "DELETE FROM tool_job_outbox": {"worker"},
    "INSERT INTO tool_idle_sidecars (owner_id, tool, channel) VALUES ('me', 'pt', 'c')":
        {"worker"},
    "UPDATE tool_idle_sidecars SET seen_at = now()": {"worker"},
    "DELETE FROM tool_idle_sidecars": {"worker"},
    "INSERT INTO tool_flow (tool, updated_by) VALUES ('pt', 'me')": {"worker"},
    "UPDATE tool_flow SET paused_at = NULL": {"worker"},
    "DELETE FROM tool_flow": set(),
    "INSERT INTO tool_flow_keys (tool, concurrency_key, tokens, tokens_at) "
    "VALUES ('pt', 'k', 1, now())": {"worker"},
    "UPDATE tool_flow_keys SET tokens = 9": {"worker"},
    "DELETE FROM tool_flow_keys": {"worker"},
    "INSERT INTO tool_flow_events (tool, event) VALUES ('pt', 'forged')": {"worker"},
    "UPDATE tool_flow_events SET details = '{}'": set(),
    "DELETE FROM tool_flow_events": {"worker"},
    "INSERT INTO tool_sweeps (tool) VALUES ('forged')": {"worker"},
    "UPDATE tool_sweeps SET swept_at = now()": {"worker"},
    "DELETE FROM tool_sweeps": {"worker"},  # the retention's sweeps kind
    # a tool's default dedupe policy (migration 027): its sidecars' profile
    "INSERT INTO tool_dedupe (tool, set_by) VALUES ('forged', 'me')": {"worker"},
    "UPDATE tool_dedupe SET key_frees_after = NULL": {"worker"},
    "DELETE FROM tool_dedupe": set(),
    "SELECT tool_job_free_key('k')": {"worker"},
    # callers' interests (migration 029): only through the checked functions
    "INSERT INTO tool_interests (interest_key, state, expires_at) "
    "VALUES ('forged', 'live', now() + interval '1 day')": set(),
    "UPDATE tool_interests SET expires_at = now() + interval '1 year'": set(),
    "DELETE FROM tool_interests": {"worker"},  # the retention's interests kind
    "SELECT * FROM tool_job_interest_hold('k', interval '30 seconds', NULL)":
        {"worker", "caller"},
    "SELECT * FROM tool_job_interest_lapse('k')": {"worker", "caller"},
    # approvals (migration 030): an answer only through the function that binds it to the
    # attempt that asked
    "UPDATE tool_approvals SET state = 'approved'": {"worker"},
    "DELETE FROM tool_approvals": {"worker"},
    "SELECT tool_job_approval_answer($1, 1, 1, true, NULL, 'me')":
        {"worker", "caller", "web"},
    **{f"TRUNCATE {table}": set() for table in TABLES},
    "INSERT INTO sidecar_schema_migrations (version, name) VALUES (999, 'x')": set(),
    "DELETE FROM sidecar_schema_repeatables": set(),
    # the MCP gateway's sessions (migration 024): the caller's own rows
    "SELECT * FROM sidecar_mcp_sessions": {"caller"},
    "DELETE FROM sidecar_mcp_sessions": {"caller"},
    # the web view's logins (migration 025): its own rows, nobody else's
    "SELECT * FROM sidecar_web_sessions": {"web"},
    "DELETE FROM sidecar_web_sessions": {"web"},
    "INSERT INTO sidecar_web_login_failures (scope, subject, failures) "
    "VALUES ('source', 'x', 1)":
        {"web"},
    "DELETE FROM sidecar_web_login_failures": {"web"},
    "INSERT INTO fence_entities DEFAULT VALUES": set(),
    "SELECT * FROM fence_effects": set(),
    "ALTER TABLE tool_jobs ADD COLUMN x int": set(),
    "CREATE TABLE public.mine (x int)": set(),
    # functions: who may call each (PUBLIC may call none of these)
    "SELECT tool_job_wake('pt', 1)": {"worker"},
    "SELECT sidecar_enqueue('pt', '{}')": {"worker", "caller"},
    "SELECT * FROM tool_job_enqueue('pt', '{}', NULL, NULL, NULL, NULL, NULL, NULL, NULL, "
    "NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL)": {"worker", "caller"},
    "SELECT * FROM tool_job_cancel($1, NULL, NULL)": {"worker", "caller", "web"},
    "SELECT * FROM tool_job_retry($1, NULL, NULL, NULL, NULL)": {"worker", "web"},
    "SELECT * FROM tool_flow_pause('pt', NULL, NULL)": {"worker", "web"},
    "SELECT * FROM tool_flow_resume('pt', NULL)": {"worker", "web"},
    "SELECT tool_job_demand('pt')": {"scaler"},
    # a read settles a job past its expiry (issue 41, point 13)
    "SELECT * FROM tool_job_expire(NULL, 1)": {"worker", "caller", "web"},
    # why a waited job waits (issue 41, point 4)
    "SELECT * FROM tool_job_wait_reasons('[]', true)": {"worker", "caller"},
    "SELECT * FROM tool_job_claim_flow('pt', 'me', 60, 60, 3)": {"worker"},
}

# What each role may read (SELECT on the whole table); the rest are refused.
READS = {
    "worker": set(TABLES),
    "scaler": set(),
    "caller": {"tool_jobs", "tool_approvals"},
    "web": {"tool_jobs", "tool_job_events", "tool_job_outbox", "tool_flow",
            "tool_idle_sidecars", "tool_sessions", "tool_interests", "tool_approvals"},
}

# The SECURITY DEFINER functions, the only writes the callers and the web view make.
DEFINERS = {"tool_job_enqueue", "tool_job_wake", "tool_job_cancel", "tool_job_retry",
            "tool_job_interest_hold", "tool_job_interest_lapse", "tool_job_approval_answer",
            "tool_flow_pause", "tool_flow_resume", "tool_job_demand", "tool_job_expire",
            "tool_job_wait_reasons"}


@pytest.fixture
def roles(dsn):
    """A login role of our own per kind (roles are the cluster's: unique names), granted by
    the shipped grant path run as the schema owner, dropped afterwards. Yields
    ``{kind: DSN connecting as that role}``."""
    suffix = uuid.uuid4().hex[:10]
    names = {kind: f"sidecar_lp_{kind}_{suffix}" for kind in KINDS}
    for name in names.values():
        query(dsn, f'CREATE ROLE "{name}" LOGIN')
    query(dsn, "REVOKE CREATE ON SCHEMA public FROM PUBLIC")  # PostgreSQL < 15

    async def grant():
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=1)
        try:
            return await OperatorStore(pool, 10).grant_roles(
                names["worker"], names["scaler"], names["caller"], names["web"])
        finally:
            await pool.close()

    try:
        assert run(grant())
        yield {kind: _as(dsn, name) for kind, name in names.items()}
    finally:
        for name in names.values():
            query(dsn, f'DROP OWNED BY "{name}"')
            query(dsn, f'DROP ROLE "{name}"')


def _refusals(as_role: str, kind: str, job: uuid.UUID) -> list[str]:
    """Every statement of WRITES and READS that ``kind`` must be refused and was not."""
    async def go():
        conn = await asyncpg.connect(as_role)
        allowed: list[str] = []
        try:
            statements = [sql for sql, who in WRITES.items() if kind not in who]
            statements += [f"SELECT * FROM {t}" for t in TABLES if t not in READS[kind]]
            for sql in statements:
                attempt = conn.transaction()
                await attempt.start()
                try:
                    await conn.execute(sql, *((job,) if "$1" in sql else ()))
                    allowed.append(sql)
                except asyncpg.InsufficientPrivilegeError:
                    pass
                except asyncpg.PostgresError as exc:  # past the privilege check
                    allowed.append(f"{sql} ({type(exc).__name__})")
                finally:
                    await attempt.rollback()  # nothing a test statement does is kept
        finally:
            await conn.close()
        return allowed

    return run(go())


async def _pool(dsn: str) -> asyncpg.Pool:
    return await asyncpg.create_pool(dsn, min_size=1, max_size=2, init=init_connection)


def _queued(dsn: str, tool: str = "pt", **fields) -> uuid.UUID:
    """A job enqueued as the owner; ``fields`` then set on its row (a failed one, say)."""
    job = scalar(dsn, "SELECT sidecar_enqueue($1, '{}')", tool)
    for column, value in fields.items():
        query(dsn, f"UPDATE tool_jobs SET {column} = $2 WHERE id = $1", job, value)
    return job


def test_a_caller_writes_only_through_the_checked_functions(dsn, roles):
    """A caller (sidecar.client, the MCP gateway, `sidecar enqueue`, sidecar_enqueue) may
    no longer insert a job or a journal row around tool_job_enqueue's checks (issue 29's
    grants allowed both), nor take sidecars off the idle list or write a flow row: and
    enqueue (keyed, tagged, in its own transaction), wait, get, list, count and cancel
    still work as the caller."""
    job = _queued(dsn)
    as_caller = roles["caller"]
    assert _refusals(as_caller, "caller", job) == []
    query(dsn, "INSERT INTO tool_idle_sidecars (owner_id, tool, channel) "
               "VALUES ('w1', 'pt', 'sidecar_wake_w1')")

    async def main():
        async with Client(as_caller) as client:
            ref = await client.enqueue("pt", {"n": 1}, concurrency_key="tenant-1",
                                       tags={"run": "r1"})
            again = await client.enqueue("pt", {"n": 2}, idempotency_key="k-1")
            same = await client.enqueue("pt", {"n": 2}, idempotency_key="k-1")
            assert (same.id, same.created) == (again.id, False)
            assert (await client.get(ref)).state == "queued"
            assert await client.count_unfinished({"run": "r1"}) == 1
            assert [j["id"] for j in await client.jobs(tags={"run": "r1"})] == [ref.id]
            assert await client.cancel(tag={"run": "r1"}) == {ref.id: "queued"}
            end = await client.wait(ref, timeout=10)
            assert end.state == "cancelled"
            assert await client.cancel(again) == {again.id: "queued"}
            # sidecar_enqueue in the caller's own transaction: rolled back, nothing
            own = await asyncpg.connect(as_caller)
            try:
                async with own.transaction():
                    kept = await own.fetchval("SELECT sidecar_enqueue('pt', '{\"n\": 3}')")
                try:
                    async with own.transaction():
                        await own.fetchval("SELECT sidecar_enqueue('pt', '{\"n\": 4}')")
                        raise RuntimeError("roll back")
                except RuntimeError:
                    pass
                # the functions still check what the caller gives, naming the field
                with pytest.raises(asyncpg.InvalidParameterValueError, match="tool"):
                    await own.fetchval("SELECT sidecar_enqueue('no tool!', '{}')")
                with pytest.raises(asyncpg.InvalidParameterValueError, match="details"):
                    await own.fetch(
                        "SELECT * FROM tool_job_enqueue('pt', '{}', NULL, NULL, NULL, NULL, "
                        "NULL, NULL, NULL, NULL, NULL, NULL, $1::jsonb, NULL, NULL, NULL, "
                        "NULL)",
                        '{"by": "' + "x" * 5000 + '"}')
                with pytest.raises(asyncpg.InvalidParameterValueError, match="by"):
                    await own.fetch("SELECT * FROM tool_job_cancel($1, NULL, $2)",
                                    kept, "x" * 600)
                # the expiry a read settles: 1,000 ids at most, as an array; a positive limit
                many = orjson.dumps([str(uuid.uuid4()) for _ in range(1001)]).decode()
                for ids, limit, field in ((many, None, "ids"), ('{"a": 1}', None, "ids"),
                                          (None, -1, "limit"), (None, 0, "limit")):
                    with pytest.raises(asyncpg.InvalidParameterValueError, match=field):
                        await own.fetch("SELECT * FROM tool_job_expire($1::text::jsonb, $2)",
                                        ids, limit)
            finally:
                await own.close()
            return ref.id, kept

    keyed, kept = run(main())
    assert job_row(dsn, keyed)["concurrency_key"] == "tenant-1"
    assert scalar(dsn, "SELECT count(*) FROM tool_flow WHERE tool = 'pt'") == 1  # the trigger
    assert job_row(dsn, kept)["state"] == "queued"
    assert scalar(dsn, "SELECT count(*) FROM tool_jobs WHERE payload = '{\"n\": 4}'") == 0
    assert journal_details(dsn, kept, "job_enqueued")[0]["by"] == "sidecar_enqueue"
    # the enqueue woke the idle sidecar through tool_job_wake, with the owner's rights
    assert scalar(dsn, "SELECT count(*) FROM tool_idle_sidecars") == 0


def test_the_web_role_reads_and_acts_only_through_the_functions(dsn, roles):
    """`sidecar migrate --web-role`: the web view's role reads every page of `sidecar web`
    (the statements web.py runs, found in its source) and cancels, retries, pauses and
    resumes through the definer functions, journaled with who; every direct write is
    refused, and the functions refuse bad input."""
    job = _queued(dsn)
    failed = _queued(dsn, state="failed")
    as_web = roles["web"]
    assert _refusals(as_web, "web", job) == []
    source = (Path(__file__).parents[1] / "sidecar" / "ops" / "web.py").read_text()
    reads = set(re.findall(r'web_read\(\s*"(\w+)"', source))
    calls = set(re.findall(r"store\.(\w+)\(", source)) - {"web_read"}

    async def main():
        pool = await _pool(as_web)
        store = OperatorStore(pool, 10)
        try:
            await schema.require_current(store)
            args = {"web_tools": (101,), "web_running": (None, 100),
                    "web_jobs_page": (None, None, None, None, None, 51),
                    "web_job": (job,), "web_job_content": (job, "payload", 1000),
                    "web_job_events": (job, 200), "web_job_event_count": (job,),
                    "web_session_of_job": (job,), "web_sessions": (None, 100),
                    "web_open_approval": (job,)}
            assert reads == set(args), "a read of web.py this test does not run"
            for name, values in args.items():
                await store.web_read(name, *values)
            done = {"get_job", "outbox_of_job", "children", "cancel",
                    "retry_when_acknowledged", "pause", "resume", "web_session",
                    "web_session_create", "web_session_delete", "web_login_lock",
                    "web_login_failed", "known_tools", "open_approval", "answer_approval"}
            assert calls == done, "a call of web.py this test does not make"
            await store.get_job(job)
            # an approval's answer, through its definer function (issue 44)
            assert await store.open_approval(job) is None
            assert await store.answer_approval(job, 1, 1, True, None,
                                               "sidecar web (alice)") == "no_request"
            await store.outbox_of_job(job)
            await store.children(job)
            assert (await store.known_tools("pt", 20))[0] is True  # a pause checks it
            # its logins (migration 025): sessions and failed-login windows are its rows
            digest = bytes(32)
            await store.web_session_create(digest, "alice", "c" * 32, 60, 20, 1000)
            assert (await store.web_session(digest))["principal"] == "alice"
            await store.web_session_delete(digest)
            assert await store.web_session(digest) is None
            assert [r["scope"] for r in await store.web_login_failed(
                "127.0.0.1", "ab" * 32, 300, 1, 60, 100)] in (["source", "token"],
                                                              ["token", "source"])
            assert (await store.web_login_lock("127.0.0.1", None))["scope"] == "source"
            assert await store.cancel(job, by="sidecar web (alice)") == {job: "queued"}
            rows, _ = await store.retry_when_acknowledged(failed, None, None,
                                                          "sidecar web (alice)")
            assert [r["id"] for r in rows] == [failed]
            assert (await store.pause("pt", "maintenance", "sidecar web (alice)"))[
                "was_paused"] is False
            assert await store.resume("pt", "sidecar web (alice)") is True
            for bad, field in ((lambda: store.retry(None, None, None, "x"), "retry"),
                               (lambda: store.retry(None, "queued", "pt", "x"), "state"),
                               (lambda: store.pause("no tool!", None, "x"), "tool"),
                               (lambda: store.pause("pt", "\x07", "x"), "reason"),
                               (lambda: store.resume("pt", ""), "by")):
                with pytest.raises(asyncpg.InvalidParameterValueError, match=field):
                    await bad()
        finally:
            await pool.close()

    run(main())
    assert job_row(dsn, job)["state"] == "cancelled"
    assert job_row(dsn, failed)["state"] == "queued"
    assert journal_details(dsn, failed, "job_retried")[0]["by"] == "sidecar web (alice)"
    events = query(dsn, "SELECT event, details->>'by' FROM tool_flow_events ORDER BY id")
    assert [tuple(e) for e in events] == [("tool_paused", "sidecar web (alice)"),
                                          ("tool_resumed", "sidecar web (alice)")]


def test_a_worker_keeps_its_lease_path_but_may_not_rewrite_the_journals(dsn, roles):
    """The worker role: claim, heartbeat, progress, journal, fenced finish, idle
    registration, the retention's deletes, flow limits and the operator's
    commands still work; it may no longer rewrite a journal row (tool_job_events,
    tool_flow_events), delete a flow row or a sweep's turn, and never had TRUNCATE, DDL,
    the fence_* tables or the demand."""
    job = _queued(dsn)
    as_worker = roles["worker"]
    assert _refusals(as_worker, "worker", job) == []

    async def main():
        pool = await _pool(as_worker)
        worker = WorkerStore(pool, 10)
        operator = OperatorStore(pool, 10)
        try:
            claimed = await worker.claim("pt", "w1", 60)
            assert claimed.id == job
            conn = await asyncpg.connect(as_worker)
            await init_connection(conn)
            try:
                renewed = await WorkerStore.extend_leases_if_owner(
                    conn, "w1", [(job, claimed.fencing_token)], 60, 5)
            finally:
                await conn.close()
            assert (job, claimed.fencing_token) in renewed
            assert await worker.report_progress_if_owner(
                claimed, "w1", {"value": 0.5, "message": "half"}, {}, True)
            await worker.record_event(job, claimed.fencing_token, "tool_request_started", {})
            assert await worker.finish_if_owner(claimed, "w1", "failed", None,
                                                {"kind": "exit_code"}, "job_failed", {})
            await worker.register_idle("w1", "pt", "sidecar_wake_w1")
            await operator.set_limits("pt", {"max_running": 2}, "sidecar limit (ops)")
            rows, _ = await operator.retry_when_acknowledged(job, None, None, "sidecar retry")
            assert [r["id"] for r in rows] == [job]
            await operator.pause("pt", None, "sidecar pause")
            assert await operator.resume("pt", "sidecar resume")
            assert await operator.cancel(job, by="sidecar cancel") == {job: "queued"}
            owner = await asyncpg.connect(dsn)  # as if cancelled a day ago
            try:
                await owner.execute("UPDATE tool_jobs SET finished_at = now() - "
                                    "interval '1 day' WHERE id = $1", job)
            finally:
                await owner.close()
            pruned = await worker.prune_finished("cancelled", 60, 100, 4242)
            assert pruned["jobs"] == 1
            # every other kind of the retention's one list, as the worker's pruner runs it
            for kind in RETENTION:
                if kind.statement is not None:
                    await worker.prune_rows(kind.statement, *((0,) if kind.aged else ()))
        finally:
            await pool.close()

    run(main())
    assert scalar(dsn, "SELECT count(*) FROM tool_jobs WHERE id = $1", job) == 0
    assert scalar(dsn, "SELECT count(*) FROM tool_flow_events") == 0


def test_definer_functions_are_the_owners_pinned_and_not_public(dsn, roles):
    """Every SECURITY DEFINER function of the schema is the schema owner's, pins its
    search_path and may not be called by PUBLIC; they are exactly the writes the callers
    and the web view make (and the scaler's demand). The owner runs every one of them; the
    scaler may call the demand and nothing else."""
    owner = scalar(dsn, "SELECT current_user")
    rows = query(dsn, """
        SELECT p.proname, pg_get_userbyid(p.proowner) AS owner,
               coalesce(array_to_string(p.proconfig, ','), '') AS config,
               has_function_privilege('public', p.oid, 'EXECUTE') AS public
        FROM pg_proc p
        WHERE p.pronamespace = current_schema()::regnamespace AND p.prosecdef""")
    assert {r["proname"] for r in rows} == DEFINERS
    for r in rows:
        assert r["owner"] == owner and r["config"].startswith("search_path=") \
            and not r["public"], dict(r)
    job = _queued(dsn)
    scaler = roles["scaler"]
    assert _refusals(scaler, "scaler", job) == []
    assert scalar(scaler, "SELECT tool_job_demand('pt')") == 1

    async def main():  # the owner: the same functions, through the stores
        pool = await _pool(dsn)
        try:
            caller, operator = CallerStore(pool, 10), OperatorStore(pool, 10)
            other, _ = await caller.enqueue("pt", RawJson("{}"), None, None, {"by": "test"})
            assert await operator.cancel(other, by="owner") == {other: "queued"}
            assert [r["id"] for r in await operator.retry(other, None, None, "owner")] == \
                [other]
            assert (await operator.pause("pt", "why", "owner"))["pause_reason"] == "why"
            assert await operator.resume("pt", "owner")
        finally:
            await pool.close()

    run(main())


# What `sidecar migrate --caller-role` and `--worker-role` granted before issue 41, which
# granting again with this release takes back.
EARLIER_CALLER_GRANTS = (
    'GRANT SELECT, INSERT (id, tool, idempotency_key, payload, max_attempts, priority, '
    'run_after, expires_at, tags, traceparent, tracestate, concurrency_key) '
    'ON tool_jobs TO "{r}"',
    'GRANT INSERT (job_id, fencing_token, event, details) ON tool_job_events TO "{r}"',
    'GRANT USAGE ON SEQUENCE tool_job_events_id_seq TO "{r}"',
    'GRANT SELECT, UPDATE (seen_at), DELETE ON tool_idle_sidecars TO "{r}"',
    'GRANT SELECT (tool), INSERT (tool, updated_by) ON tool_flow TO "{r}"',
    'GRANT EXECUTE ON FUNCTION tool_job_wake(text, bigint), tool_job_new_id() TO "{r}"',
)
EARLIER_WORKER_GRANTS = (
    'GRANT SELECT, INSERT, UPDATE, DELETE ON ' + ", ".join(TABLES) + ' TO "{r}"',
)
PRIVILEGES = """
SELECT has_any_column_privilege($1, 'tool_jobs', 'INSERT') AS insert_job,
       has_table_privilege($1, 'tool_jobs', 'UPDATE') AS update_job,
       has_any_column_privilege($1, 'tool_job_events', 'INSERT') AS insert_event,
       has_table_privilege($1, 'tool_job_events', 'UPDATE') AS update_event,
       has_table_privilege($1, 'tool_flow_events', 'UPDATE') AS update_flow_event,
       has_any_column_privilege($1, 'tool_idle_sidecars', 'UPDATE') AS update_idle,
       has_table_privilege($1, 'tool_idle_sidecars', 'DELETE') AS delete_idle,
       has_any_column_privilege($1, 'tool_flow', 'INSERT') AS insert_flow,
       has_table_privilege($1, 'tool_flow', 'DELETE') AS delete_flow,
       has_table_privilege($1, 'tool_sweeps', 'DELETE') AS delete_sweep,
       has_sequence_privilege($1, 'tool_job_events_id_seq', 'USAGE') AS events_sequence,
       has_function_privilege($1, 'tool_job_wake(text, bigint)', 'EXECUTE') AS wake,
       has_function_privilege($1, 'tool_job_cancel(uuid, jsonb, text)', 'EXECUTE')
           AS cancel
"""


def test_granting_again_takes_back_what_earlier_releases_granted(dsn):
    """Roles granted by an earlier release (the callers' direct INSERTs, the idle list and
    the flow row; the workers' UPDATE of the journals) keep none of that once the
    migration Job of this release grants them again; a role named both worker and caller
    keeps the rights of both (every revoke runs before any grant)."""
    suffix = uuid.uuid4().hex[:10]
    caller, worker, both = (f"sidecar_lp_{k}_{suffix}" for k in ("c", "w", "b"))
    for name in (caller, worker, both):
        query(dsn, f'CREATE ROLE "{name}" LOGIN')
        query(dsn, f'GRANT USAGE ON SCHEMA public TO "{name}"')
    for sql in EARLIER_CALLER_GRANTS:
        query(dsn, sql.format(r=caller))
    for sql in EARLIER_WORKER_GRANTS:
        query(dsn, sql.format(r=worker))

    async def grant(*names):
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=1)
        try:
            await OperatorStore(pool, 10).grant_roles(*names)
        finally:
            await pool.close()

    try:
        run(grant(worker, None, caller))
        run(grant(both, None, both, both))
        got = {name: dict(query(dsn, PRIVILEGES, name)[0]) for name in (caller, worker, both)}
    finally:
        for name in (caller, worker, both):
            query(dsn, f'DROP OWNED BY "{name}"')
            query(dsn, f'DROP ROLE "{name}"')
    assert got[caller] == dict.fromkeys(got[caller], False) | {"cancel": True}
    assert got[worker] == dict.fromkeys(got[worker], True) | {
        "update_event": False, "update_flow_event": False, "delete_flow": False}
    assert got[both] == got[worker]


def test_a_caller_cannot_lift_the_databases_payload_ceiling(dsn, roles):
    """tool_job_enqueue's payload limit was its caller's argument (0: none) and
    sidecar_enqueue's a session setting any session may SET: a caller could store a
    payload of any size (a 1.8 KB request of exponents read back as 26 MB). The database's
    own sidecar.max_payload_bytes (ALTER DATABASE, the owner's) now caps both; a caller
    may only lower it."""
    name = query(dsn, "SELECT current_database()")[0][0]
    query(dsn, f'ALTER DATABASE "{name}" SET sidecar.max_payload_bytes = 1000')
    big = orjson.dumps({"blob": "x" * 2000}).decode()
    bomb = "[" + ",".join(["1e2000"] * 5) + "]"  # 7 chars each sent, 2001 digits stored

    async def main():
        conn = await asyncpg.connect(roles["caller"])
        try:
            refused = []
            for sql, payload in (
                    ("SELECT * FROM tool_job_enqueue('pt', $1::text::jsonb, NULL, NULL, NULL, "
                     "NULL, NULL, NULL, NULL, NULL, NULL, 0, NULL, NULL, NULL, NULL, NULL)",
                     big),
                    ("SELECT * FROM tool_job_enqueue('pt', $1::text::jsonb, NULL, NULL, NULL, "
                     "NULL, NULL, NULL, NULL, NULL, NULL, 999999999, NULL, NULL, NULL, NULL, "
                     "NULL)",
                     bomb),
                    ("SELECT sidecar_enqueue('pt', $1::text::jsonb)", big)):
                await conn.execute("SET sidecar.max_payload_bytes = '0'")
                with pytest.raises(asyncpg.InvalidParameterValueError,
                                   match="more than the limit of 1000 bytes") as caught:
                    await conn.fetch(sql, payload)
                refused.append(caught.value)
            await conn.execute("SET sidecar.max_payload_bytes = '100'")  # lowering holds
            with pytest.raises(asyncpg.InvalidParameterValueError, match="limit of 100 "):
                await conn.fetchval("SELECT sidecar_enqueue('pt', $1::text::jsonb)",
                                    orjson.dumps({"blob": "x" * 200}).decode())
            await conn.execute("RESET sidecar.max_payload_bytes")
            return len(refused), await conn.fetchval(
                "SELECT sidecar_enqueue('pt', '{\"small\": 1}')")
        finally:
            await conn.close()

    count, small = run(main())
    assert count == 3
    assert scalar(dsn, "SELECT count(*) FROM tool_jobs") == 1
    assert job_row(dsn, small)["payload"] == {"small": 1}
