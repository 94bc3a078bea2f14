"""The `sidecar` command line, run as real processes against a real PostgreSQL:
enqueue (idempotency, payload input, validation), show, jobs, cancel, migrate, and
what an unreachable or wrong database looks like to the user."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

import orjson
import pytest

from kit import admin, base_env, cli, enqueue, one_line_error, query, scalar
from sidecar.storage.db import with_database
from sidecar.storage.queries import migrations, repeatables

pytestmark = pytest.mark.e2e

ALL_VERSIONS = [m.version for m in migrations()]
LATEST = ALL_VERSIONS[-1]
ALL_DEFINITIONS = [r.name for r in repeatables()]

UNREACHABLE = "postgresql://bob:s3cretpw@127.0.0.1:1/nope"


def out_json(done: subprocess.CompletedProcess):
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    return orjson.loads(done.stdout)


def job_count(dsn: str) -> int:
    return scalar(dsn, "SELECT count(*) FROM tool_jobs")


def lines_of(done: subprocess.CompletedProcess) -> list[str]:
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    return [line for line in done.stdout.decode().splitlines() if line.strip()]


# --- enqueue: idempotency -----------------------------------------------------------


def test_enqueue_prints_id_and_created_true(dsn):
    done = cli(dsn, "enqueue", "ocr", "--payload", '{"path": "/etc/hosts"}')
    out = out_json(done)
    assert set(out) == {"id", "created"}
    assert out["created"] is True
    job_id = uuid.UUID(out["id"])
    row = query(dsn, "SELECT tool, state, payload FROM tool_jobs WHERE id = $1", job_id)
    assert len(row) == 1
    assert row[0]["tool"] == "ocr" and row[0]["state"] == "queued"
    assert row[0]["payload"] == {"path": "/etc/hosts"}


def test_enqueue_without_key_creates_a_new_job_each_time(dsn):
    first = out_json(cli(dsn, "enqueue", "ocr", "--payload", "{}"))
    second = out_json(cli(dsn, "enqueue", "ocr", "--payload", "{}"))
    assert first["id"] != second["id"]
    assert first["created"] is True and second["created"] is True
    assert job_count(dsn) == 2


def test_same_idempotency_key_returns_existing_job(dsn):
    args = ("enqueue", "ocr", "--payload", '{"a": 1, "b": [1, 2]}', "--idempotency-key", "k-1")
    first = out_json(cli(dsn, *args))
    second = out_json(cli(dsn, *args))
    assert first["created"] is True
    assert second == {"id": first["id"], "created": False}
    assert job_count(dsn) == 1
    assert scalar(dsn, "SELECT count(*) FROM tool_job_events WHERE event = 'job_enqueued'") == 1


def test_same_key_same_payload_with_other_key_order_is_the_same_job(dsn):
    first = out_json(cli(dsn, "enqueue", "ocr", "--payload", '{"a": 1, "b": 2}',
                         "--idempotency-key", "k-order"))
    second = out_json(cli(dsn, "enqueue", "ocr", "--payload", '{"b": 2, "a": 1}',
                          "--idempotency-key", "k-order"))
    assert second == {"id": first["id"], "created": False}
    assert job_count(dsn) == 1


def test_same_key_with_different_payload_is_refused(dsn):
    first = out_json(cli(dsn, "enqueue", "ocr", "--payload", '{"a": 1}',
                         "--idempotency-key", "k-2"))
    done = cli(dsn, "enqueue", "ocr", "--payload", '{"a": 2}', "--idempotency-key", "k-2")
    assert done.returncode == 2
    assert done.stdout == b""
    line = one_line_error(done)
    assert "k-2" in line
    assert job_count(dsn) == 1
    assert scalar(dsn, "SELECT payload FROM tool_jobs") == {"a": 1}
    assert scalar(dsn, "SELECT id FROM tool_jobs") == uuid.UUID(first["id"])


def test_same_key_with_different_tool_is_refused(dsn):
    out_json(cli(dsn, "enqueue", "ocr", "--payload", '{"a": 1}', "--idempotency-key", "k-3"))
    done = cli(dsn, "enqueue", "pdf", "--payload", '{"a": 1}', "--idempotency-key", "k-3")
    assert done.returncode == 2
    one_line_error(done)
    assert job_count(dsn) == 1
    assert scalar(dsn, "SELECT tool FROM tool_jobs") == "ocr"


def run_at_once(argv: list[str], env: dict, count: int) -> list[tuple[int, bytes, bytes]]:
    """Start ``count`` copies of ``argv`` together; their (exit code, stdout, stderr)."""
    procs = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for _ in range(count)]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=120)
            results.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def test_twenty_concurrent_enqueues_with_one_key_make_one_job(dsn):
    argv = [sys.executable, "-m", "sidecar", "enqueue", "ocr", "--payload", '{"page": 7}',
            "--idempotency-key", "same-key-for-all"]
    env = base_env(dsn)
    results = run_at_once(argv, env, 20)
    for code, _out, err in results:
        assert code == 0, err.decode(errors="replace")
    outputs = [orjson.loads(out) for _, out, _ in results]
    ids = {o["id"] for o in outputs}
    assert len(ids) == 1, outputs
    assert sum(1 for o in outputs if o["created"] is True) == 1, outputs
    assert sum(1 for o in outputs if o["created"] is False) == 19, outputs
    assert job_count(dsn) == 1
    assert scalar(dsn, "SELECT id FROM tool_jobs") == uuid.UUID(ids.pop())
    assert scalar(dsn, "SELECT count(*) FROM tool_job_events") == 1


def test_empty_idempotency_key_is_refused(dsn):
    done = cli(dsn, "enqueue", "ocr", "--idempotency-key", "   ")
    assert done.returncode == 2
    one_line_error(done)
    assert job_count(dsn) == 0


# --- enqueue: payload input -----------------------------------------------------------


@pytest.mark.parametrize("bad", ["{not json", "{'a': 1}", "", "[1, 2", "NaN"])
def test_invalid_json_payload_exits_2_and_inserts_nothing(dsn, bad):
    done = cli(dsn, "enqueue", "ocr", "--payload", bad)
    assert done.returncode == 2
    assert done.stdout == b""
    line = one_line_error(done)
    assert "--payload" in line
    assert job_count(dsn) == 0


def test_payload_with_bytes_that_are_not_utf8_exits_2_without_traceback(dsn):
    """An argv that is not UTF-8 is invalid JSON like any other: one line, exit 2."""
    done = subprocess.run(
        [sys.executable.encode(), b"-m", b"sidecar", b"enqueue", b"ocr", b"--payload",
         b'{"a": "\xff"}'],
        env=base_env(dsn), capture_output=True, timeout=60)
    assert "Traceback" not in done.stderr.decode(errors="replace"), done.stderr.decode(
        errors="replace")
    assert done.returncode == 2
    line = one_line_error(done)
    assert "--payload" in line
    assert job_count(dsn) == 0


def test_payload_jsonb_cannot_store_is_bad_input_not_a_database_outage(dsn):
    """A NUL character is valid JSON but not storable in jsonb: that is the caller's input,
    so exit 2 (bad input), not exit 1 (environment problem) with a 'database error'."""
    done = cli(dsn, "enqueue", "ocr", "--payload", '{"text": "a\\u0000b"}')
    assert done.returncode == 2, done.stderr.decode(errors="replace")
    line = one_line_error(done)
    assert "database error" not in line
    assert job_count(dsn) == 0


def test_json_null_payload_is_accepted_or_refused_as_input_never_a_database_error(dsn):
    """`null` is one JSON value; it must either be queued or refused as bad input (exit 2),
    not reach the database and come back as an exit-1 'database error'."""
    done = cli(dsn, "enqueue", "ocr", "--payload", "null")
    err = done.stderr.decode(errors="replace")
    assert done.returncode in (0, 2), err
    assert "database error" not in err
    if done.returncode == 0:
        job_id = orjson.loads(done.stdout)["id"]
        assert out_json(cli(dsn, "show", job_id))["payload"] is None
    else:
        one_line_error(done)
        assert job_count(dsn) == 0


def test_payload_file_missing_exits_2_and_inserts_nothing(dsn, tmp_path):
    missing = tmp_path / "does-not-exist.json"
    done = cli(dsn, "enqueue", "ocr", "--payload-file", str(missing))
    assert done.returncode == 2
    assert done.stdout == b""
    line = one_line_error(done)
    assert "--payload-file" in line and str(missing) in line
    assert job_count(dsn) == 0


def test_payload_file_that_is_a_directory_exits_2(dsn, tmp_path):
    done = cli(dsn, "enqueue", "ocr", "--payload-file", str(tmp_path))
    assert done.returncode == 2
    one_line_error(done)
    assert job_count(dsn) == 0


def test_payload_file_with_invalid_json_exits_2(dsn, tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"a": ')
    done = cli(dsn, "enqueue", "ocr", "--payload-file", str(path))
    assert done.returncode == 2
    line = one_line_error(done)
    assert "--payload-file" in line
    assert job_count(dsn) == 0


def test_payload_file_with_valid_json_is_used(dsn, tmp_path):
    path = tmp_path / "payload.json"
    path.write_bytes(orjson.dumps({"pages": [1, 2, 3], "lang": "de"}))
    out = out_json(cli(dsn, "enqueue", "ocr", "--payload-file", str(path)))
    assert out["created"] is True
    assert scalar(dsn, "SELECT payload FROM tool_jobs WHERE id = $1", uuid.UUID(out["id"])) == \
        {"pages": [1, 2, 3], "lang": "de"}


def test_payload_file_dash_reads_stdin(dsn):
    out = out_json(cli(dsn, "enqueue", "ocr", "--payload-file", "-",
                       input=b'{"from": "stdin", "n": 42}'))
    assert scalar(dsn, "SELECT payload FROM tool_jobs WHERE id = $1", uuid.UUID(out["id"])) == \
        {"from": "stdin", "n": 42}


def test_payload_file_dash_with_invalid_stdin_exits_2(dsn):
    done = cli(dsn, "enqueue", "ocr", "--payload-file", "-", input=b"not json at all")
    assert done.returncode == 2
    one_line_error(done)
    assert job_count(dsn) == 0


def test_payload_and_payload_file_together_are_refused(dsn, tmp_path):
    path = tmp_path / "p.json"
    path.write_text("{}")
    done = cli(dsn, "enqueue", "ocr", "--payload", "{}", "--payload-file", str(path))
    assert done.returncode == 2
    one_line_error(done)
    assert job_count(dsn) == 0


def test_no_payload_means_empty_object(dsn):
    out = out_json(cli(dsn, "enqueue", "ocr"))
    assert scalar(dsn, "SELECT payload FROM tool_jobs WHERE id = $1", uuid.UUID(out["id"])) == {}


# --- enqueue: max attempts and tool names -------------------------------------------------


@pytest.mark.parametrize("value", ["0", "-1"])
def test_max_attempts_below_one_exits_2(dsn, value):
    done = cli(dsn, "enqueue", "ocr", "--max-attempts", value)
    assert done.returncode == 2
    line = one_line_error(done)
    assert "--max-attempts" in line
    assert job_count(dsn) == 0


def test_max_attempts_beyond_the_column_range_is_bad_input(dsn):
    done = cli(dsn, "enqueue", "ocr", "--max-attempts", "2147483648")
    assert done.returncode == 2, done.stderr.decode(errors="replace")
    one_line_error(done)
    assert job_count(dsn) == 0


def test_explicit_max_attempts_is_stored(dsn):
    job_id = enqueue(dsn, "ocr", {}, "--max-attempts", "9")
    assert scalar(dsn, "SELECT max_attempts FROM tool_jobs WHERE id = $1",
                  uuid.UUID(job_id)) == 9


def test_max_attempts_not_given_is_left_to_the_claiming_profile(dsn):
    """Issue 26: a job enqueued without --max-attempts keeps NULL until a sidecar claims
    it; a value given at enqueue is stored as given."""
    job_id = enqueue(dsn, "ocr", {})
    explicit = enqueue(dsn, "ocr", {"x": 1}, "--max-attempts", "2")
    assert scalar(dsn, "SELECT max_attempts FROM tool_jobs WHERE id = $1",
                  uuid.UUID(job_id)) is None
    assert scalar(dsn, "SELECT max_attempts FROM tool_jobs WHERE id = $1",
                  uuid.UUID(explicit)) == 2


def test_default_max_attempts_comes_from_global_and_tool_profile(dsn):
    """The claiming sidecar's profile decides: its tool's, else the global one; a value
    given at enqueue wins over both."""
    env = base_env(dsn, SIDECAR_MAX_ATTEMPTS="7", SIDECAR_PROFILE_OCR_MAX_ATTEMPTS="5",
                   SIDECAR_PROFILE_OCR_FAST_MAX_ATTEMPTS="4")
    ocr = enqueue(dsn, "ocr", {})
    pdf = enqueue(dsn, "pdf", {})
    ocr_fast = enqueue(dsn, "ocr-fast", {})
    explicit = enqueue(dsn, "ocr", {"x": 1}, "--max-attempts", "2")
    for tool in ("ocr", "pdf", "ocr-fast"):
        done = cli(dsn, "run", "--tool", tool, "--drain", "--", "cat", env=env, timeout=90)
        assert done.returncode == 0, done.stderr.decode()[-2000:]
    got = {str(r["id"]): r["max_attempts"]
           for r in query(dsn, "SELECT id, max_attempts FROM tool_jobs")}
    assert got == {ocr: 5, pdf: 7, ocr_fast: 4, explicit: 2}


@pytest.mark.parametrize("tool", ["a b", "x;drop", "", "a" * 100, "_under", ".dot", "ocr/x",
                                  "ünïcode", "a" * 64])
def test_invalid_tool_names_exit_2(dsn, tool):
    done = cli(dsn, "enqueue", tool)
    assert done.returncode == 2
    assert done.stdout == b""
    line = one_line_error(done)
    assert "tool" in line
    assert job_count(dsn) == 0


def test_tool_name_with_trailing_newline_is_invalid(dsn):
    """The allowed characters are letters, digits, '.', '_' and '-'; a newline is not one."""
    done = cli(dsn, "enqueue", "ocr\n")
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    one_line_error(done)
    assert job_count(dsn) == 0


@pytest.mark.parametrize("tool", ["a", "ocr", "OCR-fast_v2.1", "9tool", "a" * 63])
def test_valid_tool_names_are_accepted(dsn, tool):
    job_id = enqueue(dsn, tool, {})
    assert scalar(dsn, "SELECT tool FROM tool_jobs WHERE id = $1", uuid.UUID(job_id)) == tool


# --- show -----------------------------------------------------------------------------


def test_show_prints_the_job_with_its_events(dsn):
    job_id = enqueue(dsn, "ocr", {"path": "/tmp/x.png"}, "--idempotency-key", "show-1")
    done = cli(dsn, "show", job_id)
    job = out_json(done)
    assert len(done.stdout.decode().strip().splitlines()) == 1
    assert isinstance(job, dict)
    assert job["id"] == job_id
    assert job["tool"] == "ocr"
    assert job["state"] == "queued"
    assert job["payload"] == {"path": "/tmp/x.png"}
    assert job["idempotency_key"] == "show-1"
    assert job["attempt"] == 0 and job["max_attempts"] is None  # the claim's profile decides
    assert isinstance(job["events"], list) and job["events"]
    assert job["events"][0]["event"] == "job_enqueued"


def test_show_after_cancel_lists_both_events_in_order(dsn):
    job_id = enqueue(dsn, "ocr", {})
    out_json(cli(dsn, "cancel", job_id))
    job = out_json(cli(dsn, "show", job_id))
    assert job["state"] == "cancelled"
    assert [e["event"] for e in job["events"]] == ["job_enqueued", "job_cancelled"]


def test_show_unknown_job_exits_1(dsn):
    unknown = str(uuid.uuid4())
    done = cli(dsn, "show", unknown)
    assert done.returncode == 1
    assert done.stdout == b""
    line = one_line_error(done)
    assert unknown in line


def test_show_non_uuid_exits_2(dsn):
    done = cli(dsn, "show", "not-a-uuid")
    assert done.returncode == 2
    line = one_line_error(done)
    assert "not-a-uuid" in line


# --- jobs -----------------------------------------------------------------------------


def test_jobs_prints_one_line_per_job_and_filters(dsn):
    ocr1 = enqueue(dsn, "ocr", {"n": 1})
    pdf = enqueue(dsn, "pdf", {"n": 2})
    ocr2 = enqueue(dsn, "ocr", {"n": 3})
    out_json(cli(dsn, "cancel", ocr1))

    every = lines_of(cli(dsn, "jobs"))
    assert len(every) == 3
    for job_id in (ocr1, pdf, ocr2):
        assert sum(1 for line in every if job_id in line) == 1
    # newest first
    assert every[0].startswith(ocr2) and every[2].startswith(ocr1)
    line_of = {job_id: next(line for line in every if job_id in line)
               for job_id in (ocr1, pdf, ocr2)}
    assert "cancelled" in line_of[ocr1] and "ocr" in line_of[ocr1]
    assert "queued" in line_of[pdf] and "pdf" in line_of[pdf]

    cancelled = lines_of(cli(dsn, "jobs", "--state", "cancelled"))
    assert len(cancelled) == 1 and cancelled[0].startswith(ocr1)

    queued = lines_of(cli(dsn, "jobs", "--state", "queued"))
    assert sorted(line.split()[0] for line in queued) == sorted([pdf, ocr2])

    pdf_only = lines_of(cli(dsn, "jobs", "--tool", "pdf"))
    assert len(pdf_only) == 1 and pdf_only[0].startswith(pdf)

    both = lines_of(cli(dsn, "jobs", "--tool", "ocr", "--state", "queued"))
    assert len(both) == 1 and both[0].startswith(ocr2)

    none = lines_of(cli(dsn, "jobs", "--tool", "nope"))
    assert none == []

    limited = lines_of(cli(dsn, "jobs", "--limit", "2"))
    assert len(limited) == 2
    assert limited[0].startswith(ocr2) and limited[1].startswith(pdf)


def test_jobs_on_empty_queue_prints_nothing(dsn):
    done = cli(dsn, "jobs")
    assert done.returncode == 0
    assert done.stdout.strip() == b""


def test_jobs_limit_zero_exits_2(dsn):
    done = cli(dsn, "jobs", "--limit", "0")
    assert done.returncode == 2
    line = one_line_error(done)
    assert "--limit" in line


# --- cancel ---------------------------------------------------------------------------


def test_cancel_queued_job_then_again(dsn):
    job_id = enqueue(dsn, "ocr", {})
    out = out_json(cli(dsn, "cancel", job_id))
    assert out["cancelled"] is True
    assert out["previous_state"] == "queued"
    assert out["id"] == job_id
    row = query(dsn, "SELECT state, finished_at FROM tool_jobs WHERE id = $1",
                uuid.UUID(job_id))[0]
    assert row["state"] == "cancelled" and row["finished_at"] is not None
    events = [r["event"] for r in query(
        dsn, "SELECT event FROM tool_job_events WHERE job_id = $1 ORDER BY id",
        uuid.UUID(job_id))]
    assert events == ["job_enqueued", "job_cancelled"]

    again = cli(dsn, "cancel", job_id)
    assert again.returncode != 0
    assert again.stdout == b""
    line = one_line_error(again)
    assert "already cancelled" in line
    assert scalar(dsn, "SELECT count(*) FROM tool_job_events WHERE event = 'job_cancelled'") == 1


def test_cancel_unknown_job_exits_1(dsn):
    unknown = str(uuid.uuid4())
    done = cli(dsn, "cancel", unknown)
    assert done.returncode == 1
    assert unknown in one_line_error(done)


def test_cancel_non_uuid_exits_2(dsn):
    done = cli(dsn, "cancel", "12345")
    assert done.returncode == 2
    one_line_error(done)


# --- migrate --------------------------------------------------------------------------


def test_migrate_twice_applies_nothing_the_second_time(dsn):
    # the dsn fixture already migrated once
    out = out_json(cli(dsn, "migrate"))
    assert out["applied"] == []
    assert out["version"] == LATEST
    assert out_json(cli(dsn, "migrate"))["applied"] == []
    assert scalar(dsn, "SELECT count(*) FROM sidecar_schema_migrations") == len(ALL_VERSIONS)



@pytest.fixture
def fresh_database(server_dsn):
    """An empty database (never migrated); dropped afterwards."""
    name = f"sidecar_fresh_{uuid.uuid4().hex[:12]}"
    admin(server_dsn, f'CREATE DATABASE "{name}"')
    try:
        yield with_database(server_dsn, name)
    finally:
        admin(server_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_first_migrate_on_empty_database(fresh_database):
    out = out_json(cli(fresh_database, "migrate"))
    assert out == {"applied": ALL_VERSIONS, "definitions": ALL_DEFINITIONS, "version": LATEST}
    tables = {r["t"] for r in query(
        fresh_database,
        "SELECT tablename AS t FROM pg_tables WHERE schemaname = 'public'")}
    assert {"tool_jobs", "tool_job_events", "sidecar_schema_migrations"} <= tables


def test_two_concurrent_migrates_on_a_fresh_database(fresh_database):
    argv = [sys.executable, "-m", "sidecar", "migrate"]
    env = base_env(fresh_database)
    results = run_at_once(argv, env, 2)
    for code, _, err in results:
        assert code == 0, err.decode(errors="replace")
    outputs = [orjson.loads(out) for _, out, _ in results]
    assert sorted(v for o in outputs for v in o["applied"]) == ALL_VERSIONS, outputs
    assert all(o["version"] == LATEST for o in outputs), outputs
    assert scalar(fresh_database, "SELECT max(version) FROM sidecar_schema_migrations") == LATEST
    applied = scalar(fresh_database, "SELECT count(*) FROM sidecar_schema_migrations")
    assert applied == len(ALL_VERSIONS)
    # the schema works
    job_id = enqueue(fresh_database, "ocr", {"ok": True})
    assert scalar(fresh_database, "SELECT count(*) FROM tool_jobs WHERE id = $1",
                  uuid.UUID(job_id)) == 1


def test_enqueue_on_an_unmigrated_database_refuses_and_creates_nothing(fresh_database):
    """Only `sidecar migrate` and `sidecar run` change the schema (issue 40): enqueue on
    an empty database says so in one line (exit 1) and creates no table; after `sidecar
    migrate` it works. tests/test_schema_front_door.py covers every other entry point."""
    done = cli(fresh_database, "enqueue", "ocr")
    assert done.returncode == 1
    assert one_line_error(done, no_stdout=True) == (
        f"sidecar: error: the database has no sidecar schema, this sidecar needs {LATEST}: "
        "run 'sidecar migrate' first")
    assert scalar(fresh_database, "SELECT count(*) FROM pg_tables WHERE schemaname = "
                                  "'public'") == 0
    assert cli(fresh_database, "migrate").returncode == 0
    job_id = enqueue(fresh_database, "ocr", {})
    assert scalar(fresh_database, "SELECT count(*) FROM tool_jobs WHERE id = $1",
                  uuid.UUID(job_id)) == 1


# --- an unreachable or wrong database ------------------------------------------------------


@pytest.mark.parametrize("args", [
    ("enqueue", "ocr", "--payload", "{}"),
    ("migrate",),
    ("jobs",),
    ("show", "00000000-0000-0000-0000-000000000001"),
    ("cancel", "00000000-0000-0000-0000-000000000001"),
])
def test_unreachable_database_is_one_line_with_host_and_masked_password(args):
    done = cli(UNREACHABLE, *args, env=base_env(UNREACHABLE), timeout=60)
    assert done.returncode == 1
    assert done.stdout == b""
    line = one_line_error(done)
    assert "127.0.0.1:1" in line
    assert "s3cretpw" not in done.stderr.decode(errors="replace")
    assert "SIDECAR_DATABASE_URL" in line  # the fix


def test_password_in_the_url_query_is_masked_too():
    url = "postgresql://bob@127.0.0.1:1/nope?password=s3cretpw"
    done = cli(url, "enqueue", "ocr", env=base_env(url), timeout=60)
    assert done.returncode == 1
    line = one_line_error(done)
    assert "127.0.0.1:1" in line
    assert "s3cretpw" not in done.stderr.decode(errors="replace"), line


def test_wrong_database_name_is_one_line(server_dsn):
    name = f"sidecar_missing_{uuid.uuid4().hex[:8]}"
    url = with_database(server_dsn, name)
    done = cli(url, "enqueue", "ocr", env=base_env(url), timeout=60)
    assert done.returncode == 1
    assert done.stdout == b""
    line = one_line_error(done)
    assert name in line
    assert "SIDECAR_DATABASE_URL" in line


def test_database_url_with_wrong_scheme_is_a_usage_error():
    url = "mysql://bob:s3cretpw@127.0.0.1/nope"
    done = cli(url, "jobs", env=base_env(url))
    assert done.returncode == 2
    line = one_line_error(done)
    assert "SIDECAR_DATABASE_URL" in line
    assert "s3cretpw" not in line


def test_payload_numbers_are_kept_exactly(dsn):
    """jsonb keeps a big integer or a long decimal as given; the tool receives the same text."""
    raw = '{"n": 123456789012345678901234567890, "d": 0.10000000000000000000001}'
    job_id = enqueue_raw(dsn, raw)
    text = scalar(dsn, "SELECT payload::text FROM tool_jobs WHERE id = $1", uuid.UUID(job_id))
    assert "123456789012345678901234567890" in text and "0.10000000000000000000001" in text
    # The same key with the same numbers is the same job; a rounded number is not.
    again = cli(dsn, "enqueue", "nums", "--payload", raw, "--idempotency-key", "nums-1")
    assert again.returncode == 0 and orjson.loads(again.stdout)["id"] == job_id
    rounded = cli(dsn, "enqueue", "nums", "--payload", '{"n": 1.2345678901234568e+29, '
                  '"d": 0.1}', "--idempotency-key", "nums-1")
    assert rounded.returncode == 2


def enqueue_raw(dsn, raw: str) -> str:
    done = cli(dsn, "enqueue", "nums", "--payload", raw, "--idempotency-key", "nums-1")
    assert done.returncode == 0, done.stderr.decode()
    return orjson.loads(done.stdout)["id"]


@pytest.mark.parametrize("url, fragment", [
    ("postgresql://u:pw@127.0.0.1:abc/x", "malformed"),
    ("postgresql://postgres@[::1/x", "malformed"),
])
def test_a_malformed_database_url_is_one_line_exit_2(dsn, url, fragment):
    done = cli(dsn, "jobs", env=base_env(dsn, SIDECAR_DATABASE_URL=url))
    assert done.returncode == 2
    err = done.stderr.decode()
    assert len(err.strip().splitlines()) == 1 and fragment in err and "Traceback" not in err
    assert "pw@" not in err


def test_show_writes_a_1_mib_job_whole_through_a_slow_pipe_or_fails(dsn, tmp_path):
    """`sidecar show` used to stop at the pipe's 64 KiB and exit 0 (uvloop leaves the pipe
    non-blocking; PYTHONUNBUFFERED makes every write a raw one). Now the output is whole,
    and a reader that goes away early makes the command fail."""
    payload = {"blob": "x" * (1 << 20)}
    (tmp_path / "payload.json").write_bytes(orjson.dumps(payload))
    done = cli(dsn, "enqueue", "big", "--payload-file", str(tmp_path / "payload.json"))
    assert done.returncode == 0, done.stderr
    job = orjson.loads(done.stdout)["id"]
    env = base_env(dsn, PYTHONUNBUFFERED="1")
    argv = [sys.executable, "-m", "sidecar", "show", job]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(1.0)  # the reader is late: the pipe fills up first
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert orjson.loads(out)["payload"] == payload
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.read(10)
    proc.stdout.close()  # the reader goes away
    err = proc.stderr.read().decode()
    assert proc.wait(60) == 1 and "incomplete" in err and len(err.splitlines()) == 1, err


def test_retry_requeues_a_failed_job_with_fresh_attempts_and_a_higher_token(dsn):
    """A typo'd tool failed the job for good; after the fix, `sidecar retry JOB_ID` puts
    it back in the queue (attempt 0, journaled) and the next claim's token is higher."""
    job = enqueue(dsn, "typo", {}, "--max-attempts", "1")
    done = cli(dsn, "run", "--tool", "typo", "--drain", "--", "sh", "-c", "exit 64")
    assert done.returncode == 0, done.stderr.decode()
    assert scalar(dsn, "SELECT state FROM tool_jobs WHERE id = $1", job) == "failed"

    retried = cli(dsn, "retry", job)
    assert retried.returncode == 0, retried.stderr.decode()
    assert orjson.loads(retried.stdout) == {"retried": [job], "count": 1,
                                            "previous_states": {"failed": 1}}
    row = query(dsn, "SELECT state, attempt, error, fencing_token FROM tool_jobs "
                     "WHERE id = $1", job)[0]
    assert (row["state"], row["attempt"], row["error"], row["fencing_token"]) == \
        ("queued", 0, None, 1)
    [event] = query(dsn, "SELECT details FROM tool_job_events WHERE job_id = $1 "
                         "AND event = 'job_retried'", job)
    assert event["details"]["previous_error"] == "exit_code"

    done = cli(dsn, "run", "--tool", "typo", "--drain", "--", "sh", "-c", "echo '{}'")
    assert done.returncode == 0, done.stderr.decode()
    row = query(dsn, "SELECT state, attempt, fencing_token FROM tool_jobs WHERE id = $1",
                job)[0]
    assert (row["state"], row["attempt"], row["fencing_token"]) == ("succeeded", 1, 2)


def test_retry_of_a_tool_takes_only_its_failed_or_cancelled_jobs(dsn):
    failed = [enqueue(dsn, "batch", {"n": n}, "--max-attempts", "1") for n in range(3)]
    other = enqueue(dsn, "other", {}, "--max-attempts", "1")
    for tool in ("batch", "other"):
        done = cli(dsn, "run", "--tool", tool, "--drain", "--", "sh", "-c", "exit 64")
        assert done.returncode == 0, done.stderr.decode()
    succeeded = enqueue(dsn, "batch", {"n": "ok"})
    done = cli(dsn, "run", "--tool", "batch", "--drain", "--", "sh", "-c", "echo '{}'")
    cancelled = enqueue(dsn, "batch", {"n": "cancel"})
    assert cli(dsn, "cancel", cancelled).returncode == 0

    only_failed = orjson.loads(cli(dsn, "retry", "--tool", "batch", "--state", "failed").stdout)
    assert sorted(only_failed["retried"]) == sorted(failed)
    states = {r["id"]: r["state"] for r in query(dsn, "SELECT id::text, state FROM tool_jobs")}
    assert [states[j] for j in failed] == ["queued"] * 3
    assert (states[other], states[succeeded], states[cancelled]) == \
        ("failed", "succeeded", "cancelled")
    rest = orjson.loads(cli(dsn, "retry", "--tool", "batch").stdout)
    assert rest["retried"] == [cancelled] and rest["previous_states"] == {"cancelled": 1}


def test_retry_refuses_what_it_cannot_retry_in_one_line(dsn):
    job = enqueue(dsn, "waiting", {})
    for args, code, words in (((job,), 1, "is queued"),
                              ((str(uuid.uuid4()),), 1, "no job"),
                              ((), 2, "JOB_ID"),
                              ((job, "--tool", "waiting"), 2, "JOB_ID"),
                              ((job, "--state", "failed"), 2, "--state")):
        done = cli(dsn, "retry", *args)
        assert done.returncode == code, (args, done.stderr)
        assert words in one_line_error(done), (args, done.stderr)


def test_run_with_an_interpreter_and_no_tool_name_is_refused(dsn):
    """`run -- python3 script.py` used to serve jobs of a tool named "python3"."""
    for command in (["python3", "script.py"], ["sh", "-c", "true"], ["/usr/bin/env", "x"]):
        done = cli(dsn, "run", "--drain", "--", *command)
        assert done.returncode == 2, (command, done.stderr)
        assert "--tool" in one_line_error(done), done.stderr
    done = cli(dsn, "run", "--tool", "shell-ok", "--drain", "--", "sh", "-c", "echo '{}'")
    assert done.returncode == 0, done.stderr


def test_bytes_that_are_not_utf8_in_a_tag_or_tool_name_are_one_line_exit_2(dsn):
    """A new user's trial (issue 26): ``--tag k=a\\xffb`` gave a traceback at enqueue and a
    raw database error for jobs/wait/cancel/retry; ``jobs --tool`` a DataError. Now each
    is one line naming the option, exit 2, and nothing is written."""
    bad = b"a\xffb".decode("utf-8", "surrogateescape")
    before = scalar(dsn, "SELECT count(*) FROM tool_jobs")
    for args in (["enqueue", "t", "--payload", "{}", "--tag", f"k={bad}"],
                 ["jobs", "--tag", f"k={bad}"], ["wait", "--tag", f"k={bad}"],
                 ["cancel", "--tag", f"k={bad}"], ["retry", "--tag", f"k={bad}"],
                 ["jobs", "--tool", bad]):
        done = cli(dsn, *args)
        err = done.stderr.decode(errors="replace")
        assert done.returncode == 2 and len(err.strip().splitlines()) == 1, (args, err)
        assert "Traceback" not in err and ("--tag" in err or "tool name" in err), (args, err)
    assert scalar(dsn, "SELECT count(*) FROM tool_jobs") == before
