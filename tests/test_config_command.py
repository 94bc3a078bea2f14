"""`sidecar config` (effective settings and profiles, secrets masked, exit 2 when invalid:
a pre-deploy check) and `sidecar events JOB_ID` (the journal, one line per event), run as
real processes against a real PostgreSQL."""

from __future__ import annotations

import re
import subprocess
import uuid
from urllib.parse import urlsplit, urlunsplit

import orjson
import pytest

from kit import base_env, cli, enqueue, one_line_error, query

pytestmark = pytest.mark.e2e

PASSWORD = "Pw-do-not-print-7f3a"
TOKEN = "tok-do-not-print-91c2"
SECRETS = (PASSWORD, TOKEN, "basic-user-secret")


def with_password(dsn: str, password: str = PASSWORD) -> str:
    """The DSN with a password in its userinfo (trust auth ignores it)."""
    parts = urlsplit(dsn)
    user = parts.username or "postgres"
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit(parts._replace(netloc=f"{user}:{password}@{host}"))


def assert_no_secret(done: subprocess.CompletedProcess) -> None:
    text = done.stdout.decode(errors="replace") + done.stderr.decode(errors="replace")
    for secret in SECRETS:
        assert secret not in text, f"{secret!r} printed:\n{text}"


# --- sidecar config ---------------------------------------------------------------


def test_config_prints_settings_and_every_overridden_profile_masked(dsn):
    env = base_env(
        with_password(dsn),
        SIDECAR_PROFILE_OCR_FAST_LEASE_SECONDS="120",
        SIDECAR_PROFILE_OCR_FAST_RESULT_URL=f"https://hook:{PASSWORD}@results.example/in"
                                            f"?token={TOKEN}&tenant=a",
        SIDECAR_PROFILE_BROWSER_RESULT_URL="https://basic-user-secret@results.example/b",
        SIDECAR_PROFILE_BROWSER_STAGE_TIMEOUT_SECONDS="60",
        SIDECAR_DATABASE_POOLER="transaction",
    )
    done = cli(dsn, "config", env=env)
    assert done.returncode == 0, done.stderr.decode()
    assert_no_secret(done)
    out = orjson.loads(done.stdout)
    settings = out["settings"]
    assert settings["database_url"] == with_password(dsn, "***")
    assert settings["database_pooler"] == "transaction"
    assert settings["poll_seconds"] == 0.2 and settings["db_timeout_seconds"] == 2
    assert out["defaults"]["lease_seconds"] == 3  # the suite's SIDECAR_LEASE_SECONDS
    assert out["defaults"]["set_by"]["lease_seconds"] == "SIDECAR_LEASE_SECONDS"
    profiles = {p["env_key"]: p for p in out["profiles"]}
    assert set(profiles) == {"OCR_FAST", "BROWSER"}
    ocr = profiles["OCR_FAST"]
    assert ocr["lease_seconds"] == 120 and ocr["heartbeat_seconds"] == 0.5
    assert ocr["set_by"]["lease_seconds"] == "SIDECAR_PROFILE_OCR_FAST_LEASE_SECONDS"
    assert ocr["set_by"]["heartbeat_seconds"] == "SIDECAR_HEARTBEAT_SECONDS"
    assert ocr["result_url"] == \
        "https://hook:***@results.example/in?token=***&tenant=a"
    assert profiles["BROWSER"]["result_url"] == "https://***@results.example/b"
    assert profiles["BROWSER"]["stage_timeout_seconds"] == 60


def test_config_for_one_tool(dsn):
    env = base_env(with_password(dsn), SIDECAR_PROFILE_OCR_LEASE_SECONDS="30",
                   SIDECAR_PROFILE_OTHER_LEASE_SECONDS="40")
    out = orjson.loads(cli(dsn, "config", "--tool", "ocr", env=env).stdout)
    assert [p["tool"] for p in out["profiles"]] == ["ocr"]
    assert out["profiles"][0]["lease_seconds"] == 30
    assert "defaults" not in out
    # A tool with no overrides: the defaults, named for it.
    plain = orjson.loads(cli(dsn, "config", "--tool", "plain-tool", env=env).stdout)
    [profile] = plain["profiles"]
    assert profile["env_key"] == "PLAIN_TOOL" and profile["lease_seconds"] == 3
    assert "lease_seconds" not in {k for k, v in profile["set_by"].items()
                                   if v.startswith("SIDECAR_PROFILE_")}


def test_config_exits_2_with_one_line_for_any_invalid_profile(dsn):
    # Another tool's profile breaks P10: the check still fails (pre-deploy).
    env = base_env(with_password(dsn), SIDECAR_PROFILE_BROKEN_LEASE_SECONDS="1")
    for args in (("config",), ("config", "--tool", "ocr")):
        done = cli(dsn, *args, env=env)
        assert done.returncode == 2
        line = one_line_error(done, no_stdout=True)
        assert "SIDECAR_PROFILE_BROKEN_LEASE_SECONDS" in line and "P10" in line
        assert_no_secret(done)


def test_config_exits_2_for_unknown_variable_bad_pooler_and_bad_url(dsn):
    cases = [
        ({"SIDECAR_LEASE_SECOND": "90"}, "SIDECAR_LEASE_SECOND"),
        ({"SIDECAR_DATABASE_POOLER": "session"}, "SIDECAR_DATABASE_POOLER"),
        ({"SIDECAR_DATABASE_URL": f"mysql://app:{PASSWORD}@db/x"}, "SIDECAR_DATABASE_URL"),
        ({"SIDECAR_PROFILE_OCR_RESULT_URL": "ftp://x"}, "SIDECAR_PROFILE_OCR_RESULT_URL"),
    ]
    for extra, variable in cases:
        done = cli(dsn, "config", env=base_env(with_password(dsn), **extra))
        assert done.returncode == 2, (extra, done.stderr)
        assert variable in one_line_error(done, no_stdout=True)
        assert_no_secret(done)
    done = cli(dsn, "config", "--tool", "no spaces", env=base_env(dsn))
    assert done.returncode == 2 and "tool name" in one_line_error(done, no_stdout=True)


def test_config_shows_the_listen_url_masked_and_refuses_a_bad_one(dsn):
    listen = with_password(dsn, TOKEN)  # not the database URL: that one is the pooler
    env = base_env(with_password(dsn), SIDECAR_LISTEN_DATABASE_URL=listen,
                   SIDECAR_DATABASE_POOLER="transaction")
    done = cli(dsn, "config", env=env)
    assert done.returncode == 0, done.stderr.decode()
    assert_no_secret(done)
    settings = orjson.loads(done.stdout)["settings"]
    assert settings["listen_database_url"] == with_password(dsn, "***")
    env["SIDECAR_LISTEN_DATABASE_URL"] = f"mysql://app:{PASSWORD}@db/x"
    done = cli(dsn, "config", env=env)
    assert done.returncode == 2
    assert "SIDECAR_LISTEN_DATABASE_URL" in one_line_error(done, no_stdout=True)
    assert_no_secret(done)


def test_config_connects_to_nothing(dsn):
    env = base_env("postgresql://app:" + PASSWORD + "@127.0.0.1:1/nope")
    done = cli(dsn, "config", env=env)
    assert done.returncode == 0, done.stderr.decode()
    assert_no_secret(done)


# --- sidecar events ---------------------------------------------------------------

LINE = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z)  (\w+) +token (\d+) *(.*)$")


def test_events_prints_one_line_per_journal_row(dsn):
    env = base_env(with_password(dsn))
    job_id = enqueue(dsn, "flaky", {"note": TOKEN}, env=env)
    # Fails with exit 3 on the first attempt, echoes the payload on the second.
    done = cli(dsn, "run", "--tool", "flaky", "--drain", "--", "sh", "-c",
               'test "$SIDECAR_ATTEMPT" -gt 1 || exit 3; cat', env=env, timeout=60)
    assert done.returncode == 0, done.stderr.decode()[-2000:]

    done = cli(dsn, "events", job_id, env=env)
    assert done.returncode == 0, done.stderr.decode()
    assert_no_secret(done)  # the payload is journaled as sha256 and size only (P23)
    lines = done.stdout.decode().splitlines()
    rows = query(dsn, "SELECT event, fencing_token FROM tool_job_events WHERE job_id = $1 "
                      "ORDER BY id", uuid.UUID(job_id))
    assert len(lines) == len(rows)
    parsed = [LINE.match(line) for line in lines]
    assert all(parsed), lines
    assert [(m[2], int(m[3])) for m in parsed] == [(r["event"], r["fencing_token"])
                                                   for r in rows]
    events = [m[2] for m in parsed]
    assert events[0] == "job_enqueued" and events[-1] == "job_succeeded"
    assert events.count("job_claimed") == 2
    retry = next(m[4] for m in parsed if m[2] == "job_retry_scheduled")
    assert "kind=exit_code" in retry and "exit_code=3" in retry and "attempt=1" in retry
    claimed = [m[4] for m in parsed if m[2] == "job_claimed"]
    assert "attempt=1" in claimed[0] and "attempt=2" in claimed[1]
    assert "owner_id=" in claimed[0]


def test_events_of_unknown_job_exit_1_and_bad_id_exit_2(dsn):
    env = base_env(with_password(dsn))
    unknown = str(uuid.uuid4())
    done = cli(dsn, "events", unknown, env=env)
    assert done.returncode == 1
    assert unknown in one_line_error(done, no_stdout=True)
    assert_no_secret(done)
    done = cli(dsn, "events", "not-a-uuid", env=env)
    assert done.returncode == 2
    assert "not a UUID" in one_line_error(done, no_stdout=True)
