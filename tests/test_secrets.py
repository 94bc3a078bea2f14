"""The database password never leaks: real ``sidecar`` processes get a DSN carrying a
distinctive password and nothing they print (stdout, stderr, JSON and text log formats),
nothing they store (every row of every table of the schema, cast to text), nothing their
HTTP endpoints serve and nothing in the tool's environment may contain it.

Covered: ``sidecar config`` (every DSN form, ``--tool``), ``migrate``, ``enqueue``, ``run``
(a tool that fails after dumping its environment to stderr, one that succeeds returning its
environment as the result; stderr content logged), ``show``, ``events``, ``jobs``, and the
errors for a closed port, an unresolvable host and a password with characters that break
URL parsing. The test server trusts local connections (the embedded PostgreSQL is initdb'd
with ``--auth=trust``; the CI server's pg_hba uses trust too), so a made-up password still
connects: ``secret_dsn`` checks that, so the tests cannot pass without using the password.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from urllib.parse import quote, urlsplit, urlunsplit

import asyncpg
import orjson
import pytest

from kit import TOOLS, base_env, cli, enqueue, free_port, job_row, query, run, wait_until

PASSWORD = "Sup3rSecretPw_xyz"
TOOL = "print_env.py"  # tests/tools/print_env.py; the tool name is the command's basename


def with_password(dsn: str, password: str, *, host: str | None = None) -> str:
    """``dsn`` with ``password`` as its userinfo password (and ``host`` as host:port)."""
    parts = urlsplit(dsn)
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user = userinfo.split(":", 1)[0]
    return urlunsplit(parts._replace(netloc=f"{user}:{password}@{host or hostport}"))


def leaks(text: str | bytes, secret: str = PASSWORD) -> bool:
    """True when ``secret`` appears in ``text`` (bytes decoded leniently), also
    percent-encoded or JSON-escaped."""
    if isinstance(text, bytes | bytearray):
        text = bytes(text).decode("utf-8", "replace")
    forms = {secret, quote(secret, safe=""), orjson.dumps(secret).decode()[1:-1]}
    return any(form in text for form in forms)


def assert_no_leak(done: subprocess.CompletedProcess, what: str, secret: str = PASSWORD):
    out, err = done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace")
    assert not leaks(out, secret), f"{what}: the password is in stdout:\n{out}"
    assert not leaks(err, secret), f"{what}: the password is in stderr:\n{err}"
    assert "Traceback" not in err, f"{what}: {err}"


@pytest.mark.unit
def test_the_leak_check_finds_the_password():
    """The checks below can fail: the helper finds the password in every form it may take."""
    dsn = with_password("postgresql://bob@db.example:5432/app", PASSWORD)
    assert PASSWORD in dsn and "bob:" in dsn and "@db.example:5432/app" in dsn
    assert leaks(dsn)
    assert leaks(dsn.encode())
    assert leaks(f"x={quote(PASSWORD + '/', safe='')}", PASSWORD + "/")
    assert not leaks("postgresql://bob:***@db.example:5432/app")


@pytest.fixture
def secret_dsn(dsn):
    """The per-test database, reached with a DSN that carries PASSWORD. The server must
    accept it (trust authentication), or the tests below would not exercise it."""
    url = with_password(dsn, PASSWORD)
    assert PASSWORD in url and url != dsn

    async def connects():
        conn = await asyncpg.connect(url)
        try:
            return await conn.fetchval("SELECT 1")
        finally:
            await conn.close()

    assert run(connects()) == 1, "the test server must accept any password (trust auth)"
    return url


def every_row_as_text(dsn: str) -> dict[str, list[str]]:
    """Every row of every table in the public schema, as ``row::text``, by table."""
    tables = [r["tablename"] for r in query(
        dsn, "SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY 1")]
    return {table: [r["t"] for r in query(dsn, f'SELECT t::text AS t FROM "{table}" t')]
            for table in tables}


def run_env(dsn: str, fmt: str, **extra: str) -> dict[str, str]:
    return base_env(dsn, SIDECAR_LOG_FORMAT=fmt, SIDECAR_LOG_LEVEL="debug",
                    SIDECAR_LOG_TOOL_STDERR="true", **extra)


def enqueue_job(dsn: str, env: dict, exit_code: int) -> str:
    done = cli(dsn, "enqueue", TOOL, "--payload", orjson.dumps({"exit": exit_code}).decode(),
               "--max-attempts", "1", env=env)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    assert_no_leak(done, "sidecar enqueue")
    return orjson.loads(done.stdout)["id"]


def http_text(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.read().decode(errors="replace")


# --- configuration --------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.parametrize("form", ["userinfo", "percent-encoded", "query"])
def test_config_masks_the_password_in_every_dsn_form(secret_dsn, form):
    if form == "userinfo":
        url, secrets = secret_dsn, [PASSWORD]
    elif form == "percent-encoded":  # "Sup3rSecretPw_xyz/#?" written as a URL must write it
        raw = PASSWORD + "/#?"
        url, secrets = with_password(secret_dsn, quote(raw, safe="")), [raw, PASSWORD]
    else:  # postgresql://user@host/db?password=...
        parts = urlsplit(secret_dsn)
        plain = urlunsplit(parts._replace(netloc=parts.netloc.replace(f":{PASSWORD}@", "@")))
        url = plain + ("&" if urlsplit(plain).query else "?") + f"password={PASSWORD}"
        secrets = [PASSWORD]
    assert PASSWORD in url
    for fmt in ("json", "text"):
        env = base_env(url, SIDECAR_LOG_FORMAT=fmt)
        for args in (("config",), ("config", "--tool", TOOL)):
            done = cli(url, *args, env=env)
            assert done.returncode == 0, done.stderr.decode(errors="replace")
            for secret in secrets:
                assert_no_leak(done, f"sidecar {' '.join(args)} ({fmt} log)", secret)
            shown = orjson.loads(done.stdout)["settings"]["database_url"]
            assert "***" in shown, shown  # the URL is shown, masked: the check looked at it


@pytest.mark.e2e
def test_config_masks_a_token_in_the_result_url(secret_dsn):
    """RESULT_URL is the other credential-bearing setting: userinfo and token parameters."""
    env = base_env(secret_dsn, SIDECAR_PROFILE_PRINT_ENV_PY_RESULT_URL=(
        f"https://hook:{PASSWORD}@hooks.example/in?token={PASSWORD}&page=1"))
    done = cli(secret_dsn, "config", env=env)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    assert_no_leak(done, "sidecar config with a RESULT_URL")
    profiles = orjson.loads(done.stdout)["profiles"]
    assert [p["result_url"] for p in profiles] == [
        "https://hook:***@hooks.example/in?token=***&page=1"]


# --- a whole job life, with the password in the DSN ----------------------------------------


@pytest.mark.e2e
def test_no_command_output_row_or_child_environment_holds_the_password(secret_dsn, sidecars):
    for fmt in ("json", "text"):
        done = cli(secret_dsn, "migrate", env=run_env(secret_dsn, fmt))
        assert done.returncode == 0, done.stderr.decode(errors="replace")
        assert_no_leak(done, f"sidecar migrate ({fmt} log)")

    # Text log: `sidecar run --drain` processes a failing and a succeeding job.
    text_env = run_env(secret_dsn, "text")
    failed_text = enqueue_job(secret_dsn, text_env, 3)
    ok_text = enqueue_job(secret_dsn, text_env, 0)
    done = cli(secret_dsn, "run", "--drain", "--", TOOL, env=text_env, timeout=90)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    assert_no_leak(done, "sidecar run (text log)")
    log_text = done.stderr.decode(errors="replace")
    # The log did show the tool's stderr (its environment dump), so a leak would be there.
    assert f"SIDECAR_JOB_ID={failed_text}" in log_text, log_text

    # JSON log: a long-running `sidecar run`, its HTTP endpoints read while it runs.
    json_env = run_env(secret_dsn, "json")
    failed_json = enqueue_job(secret_dsn, json_env, 3)
    ok_json = enqueue_job(secret_dsn, json_env, 0)
    sc = sidecars(secret_dsn, [TOOL], env=json_env)
    base = "http://" + sc.wait_event("worker_started")["http_addr"]
    wait_until(lambda: all(job_row(secret_dsn, j)["state"] in ("succeeded", "failed")
                           for j in (failed_json, ok_json)), 30, what="both jobs to end")
    for path in ("/metrics", "/livez", "/readyz"):
        assert not leaks(http_text(base + path)), path
    sc.stop()
    assert not leaks(sc.stderr_text()), sc.stderr_text()
    assert "Traceback" not in sc.stderr_text()
    assert sc.events("tool_stderr"), "no tool_stderr events: the dump was not logged"

    for failed, ok in ((failed_text, ok_text), (failed_json, ok_json)):
        # The child's environment, as it reported it: its own job id, no database URL.
        row = job_row(secret_dsn, ok)
        assert row["state"] == "succeeded", row
        child_env = row["result"]["env"]
        assert child_env["SIDECAR_JOB_ID"] == ok
        assert "SIDECAR_DATABASE_URL" not in child_env
        assert not any(leaks(k) or leaks(v) for k, v in child_env.items()), child_env
        row = job_row(secret_dsn, failed)
        assert row["state"] == "failed", row
        tail = row["error"]["stderr_tail"]
        assert f"SIDECAR_JOB_ID={failed}" in tail and "print_env: done" in tail, tail
        assert "SIDECAR_DATABASE_URL" not in tail
        assert not leaks(tail), tail

        for job_id in (failed, ok):
            for fmt in ("json", "text"):
                env = run_env(secret_dsn, fmt)
                shown = cli(secret_dsn, "show", job_id, env=env)
                assert shown.returncode == 0, shown.stderr.decode(errors="replace")
                assert_no_leak(shown, f"sidecar show ({fmt} log)")
                assert orjson.loads(shown.stdout)["id"] == job_id
                events = cli(secret_dsn, "events", job_id, env=env)
                assert events.returncode == 0, events.stderr.decode(errors="replace")
                assert_no_leak(events, f"sidecar events ({fmt} log)")
                assert b"job_claimed" in events.stdout
    done = cli(secret_dsn, "jobs", env=run_env(secret_dsn, "text"))
    assert done.returncode == 0 and done.stdout.count(b"\n") >= 4
    assert_no_leak(done, "sidecar jobs")

    rows = every_row_as_text(secret_dsn)
    assert {"tool_jobs", "tool_job_events"} <= set(rows)
    assert any(ok_json in r for r in rows["tool_jobs"])  # the scan does see the rows
    # ... the error column too: the stderr tail with the child's environment dump.
    assert any(f"SIDECAR_JOB_ID={failed_json}" in r for r in rows["tool_jobs"])
    for table, texts in rows.items():
        for text in texts:
            assert not leaks(text), f"{table}: {text}"


# --- a database that cannot be reached ------------------------------------------------------


COMMANDS = [
    ("migrate",),
    ("enqueue", TOOL, "--payload", "{}"),
    ("jobs",),
    ("show", "00000000-0000-0000-0000-000000000001"),
    ("events", "00000000-0000-0000-0000-000000000001"),
    ("cancel", "00000000-0000-0000-0000-000000000001"),
    ("run", "--drain", "--", TOOL),
]


@pytest.mark.e2e
@pytest.mark.parametrize("target", ["closed port", "unresolvable host"])
def test_errors_for_an_unreachable_database_hide_the_password(target):
    host = (f"127.0.0.1:{free_port()}" if target == "closed port"
            else "sidecar-no-such-host.invalid:5432")
    url = with_password("postgresql://postgres@localhost/sidecar", PASSWORD, host=host)
    assert PASSWORD in url
    for fmt in ("json", "text"):
        env = base_env(url, SIDECAR_LOG_FORMAT=fmt, SIDECAR_LOG_LEVEL="debug",
                       SIDECAR_DB_TIMEOUT_SECONDS="5")
        for args in COMMANDS:
            done = cli(url, *args, env=env, timeout=60)
            what = f"sidecar {args[0]} ({target}, {fmt} log)"
            assert done.returncode == 1, (what, done.stderr.decode(errors="replace"))
            assert_no_leak(done, what)
            err = done.stderr.decode(errors="replace")
            # The error names the server, password masked: the check did look at the URL.
            assert host.rsplit(":", 1)[0] in err and ":***@" in err, (what, err)
        done = cli(url, "config", env=env)
        assert done.returncode == 0, done.stderr.decode(errors="replace")
        assert_no_leak(done, f"sidecar config ({target})")


@pytest.mark.e2e
@pytest.mark.parametrize("password", [
    "Sup3r/SecretPw_xyz",   # '/' ends the authority: urlsplit sees port "Sup3r"
    "Sup3r#SecretPw_xyz",   # '#' starts the fragment
    "Sup3r?SecretPw_xyz",   # '?' starts the query
    "12/Sup3rSecretPw_xyz",  # parses "validly": host "postgres", port 12
])
def test_a_password_with_url_delimiters_is_not_echoed(password):
    """A password written into the URL without percent-encoding breaks the URL: the sidecar
    must refuse or fail to connect without printing the password (or any piece of it)."""
    url = f"postgresql://postgres:{password}@127.0.0.1:{free_port()}/sidecar"
    pieces = [p for p in password.replace("#", "/").replace("?", "/").split("/") if len(p) > 3]
    assert pieces and all(p in url for p in pieces)
    for args in (("config",), ("jobs",), ("migrate",)):
        done = cli(url, *args, env=base_env(url), timeout=60)
        what = f"sidecar {args[0]} with password {password!r}"
        for piece in pieces:
            assert_no_leak(done, what, piece)


def _peek_command() -> list[str]:
    """tests/tools/peek_secrets.py as a tool of the sidecar's own uid with no privilege: as
    root, capabilities dropped (an empty bounding set: exec then gives none), so only what
    any same-uid process may read is readable; otherwise as is."""
    peek = [sys.executable, str(TOOLS / "peek_secrets.py")]
    if os.geteuid() != 0:
        return peek
    setpriv = shutil.which("setpriv")
    assert setpriv, "setpriv (util-linux) is needed to drop root's capabilities"
    return [setpriv, "--bounding-set=-all", "--inh-caps=-all", *peek]


@pytest.mark.e2e
@pytest.mark.parametrize("source", ["SIDECAR_DATABASE_URL", "SIDECAR_DATABASE_URL_FILE"])
def test_a_tool_of_the_same_uid_finds_the_password_nowhere(secret_dsn, sidecars, tmp_path,
                                                           source):
    """The DSN once sat in /proc/<pid>/environ of the sidecar and of its guardian, where a
    tool of the same uid read it. Now the guardian never gets it, the sidecar drops it from
    its environment and makes itself non-dumpable (environ and mem closed to the tool)."""
    env = base_env(secret_dsn)
    if source == "SIDECAR_DATABASE_URL_FILE":
        secret = tmp_path / "dsn"
        secret.write_text(env.pop("SIDECAR_DATABASE_URL") + "\n")
        env[source] = str(secret)
    job = enqueue(secret_dsn, "peek", {"needle": PASSWORD}, env=env)
    sc = sidecars(secret_dsn, _peek_command(), "--tool", "peek", "--drain", env=env)
    assert sc.wait(60) == 0, sc.stderr_text()[-2000:]
    row = job_row(secret_dsn, job)
    assert row["state"] == "succeeded", row["error"]
    seen = row["result"]
    assert seen["guardian_pid"], seen  # the guardian was there to be looked at
    assert "found" not in seen.values(), seen
    assert seen["own_environ"] == "clean", seen
    # The guardian is non-dumpable too, and its environment holds nothing secret anyway.
    assert seen["guardian_environ"] in ("clean", "EACCES", "EPERM"), seen
    assert seen["sidecar_environ"] in ("EACCES", "EPERM"), seen
    assert seen["sidecar_mem"] in ("EACCES", "EPERM"), seen
