"""Secrets in rows written before scrubbing existed (issue 41, point 7): issue 25 scrubs what
the sidecar writes, but a row stored earlier (or by SQL around the sidecar) may still hold
the database password. Every reader that shows stored rows to a person or a caller scrubs
them on display with the same registry (``masking.SECRETS``, filled with the secrets the
reading process knows: its database URL and password): ``sidecar show``, ``events``,
``jobs`` (and its PAUSED line), the web view's pages and content, and sidecar.client's
``get``, ``jobs`` and ``wait`` (what the MCP gateway returns). A forwarding row's RESULT_URL
is shown masked (``mask_url``), its credentials being ones a reader rarely knows.

The rows are written here by the owner's connection, as an older release left them; the
readers reach the database with a URL that carries PASSWORD (the test server trusts local
connections, so any password connects).
"""

from __future__ import annotations

import subprocess
import sys
import urllib.error
import urllib.request

import orjson
import pytest
from test_secrets import leaks, with_password

import kit
from sidecar.client import Client
from sidecar.protocol.masking import SECRET_MARK

PASSWORD = "Sup3rSecretPw_display"
RECEIVER_PASSWORD = "RecvPw_1234567"
RESULT_URL = f"https://fwd:{RECEIVER_PASSWORD}@127.0.0.1:9/effects"
TOOL = "old-rows"


def old_job(dsn: str, url: str) -> str:
    """A failed job whose every column a reader shows holds the password (or the whole
    database URL), written around the scrubbing: payload, result, error, progress, tags,
    a journal event, a forwarding row; and its tool paused with the password as reason."""
    job = kit.enqueue(dsn, TOOL, {"k": 1})
    echoed = f"cannot open {url}: password {PASSWORD} refused"
    kit.query(dsn, "UPDATE tool_jobs SET state = 'failed', finished_at = now(), "
                   "payload = $2::text::jsonb, result = $3::text::jsonb, "
                   "error = $4::text::jsonb, progress = $5::text::jsonb, "
                   "tags = $6::text::jsonb WHERE id = $1::uuid",
              job, orjson.dumps({"dsn": url}).decode(),
              orjson.dumps({"echo": echoed, "n": 0}).decode().replace(
                  '"n":0', '"n":12345678901234567890123'),
              orjson.dumps({"kind": "exit_code", "message": echoed,
                            "stderr_tail": echoed}).decode(),
              orjson.dumps({"value": 0.5, "message": echoed}).decode(),
              orjson.dumps({"note": f"pw {PASSWORD}"}).decode())
    kit.query(dsn, "INSERT INTO tool_job_events (job_id, fencing_token, event, details) "
                   "VALUES ($1::uuid, 1, 'job_failed', $2::text::jsonb)",
              job, orjson.dumps({"stderr_tail": echoed, PASSWORD: 1}).decode())
    kit.query(dsn, "INSERT INTO tool_job_outbox (job_id, tool, url, idempotency_key, "
                   "fencing_token, body, state, last_error) VALUES ($1::uuid, $2, $3, "
                   "'old-key', 1, '{}', 'dead_lettered', $4)",
              job, TOOL, RESULT_URL, f"POST {RESULT_URL} failed; {echoed}")
    done = kit.cli(dsn, "pause", TOOL, "--reason", f"rotating {PASSWORD}")
    assert done.returncode == 0, done.stderr.decode()
    return job


def assert_scrubbed(text: str, what: str, marked: bool = True) -> None:
    assert not leaks(text, PASSWORD), f"{what}: the password is shown:\n{text[:3000]}"
    assert not leaks(text, RECEIVER_PASSWORD), f"{what}: RESULT_URL's password is shown"
    if marked:
        assert SECRET_MARK in text, f"{what}: no {SECRET_MARK} marker:\n{text[:3000]}"


@pytest.mark.e2e
def test_show_events_jobs_and_the_web_view_scrub_old_rows(dsn, tmp_path):
    url = with_password(dsn, PASSWORD)
    job = old_job(dsn, url)
    env = kit.base_env(url)

    for args in (("show", job), ("events", job), ("jobs", "--tool", TOOL)):
        done = kit.cli(url, *args, env=env)
        assert done.returncode == 0, done.stderr.decode()
        # `jobs` prints its PAUSED banner (the pause reason) on stderr, the jobs on stdout
        assert_scrubbed((done.stdout + done.stderr).decode(), f"sidecar {args[0]}")
    text = kit.cli(url, "show", job, env=env).stdout
    assert b'"n":12345678901234567890123' in text  # F11: every digit kept
    shown = orjson.loads(text)
    assert shown["forwarding"][0]["url"] == "https://fwd:***@127.0.0.1:9/effects"

    port = kit.free_port()
    log = tmp_path / "web.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "sidecar", "web", "--listen",
                                 f"127.0.0.1:{port}"], env=env, stdout=out, stderr=out)
    try:
        kit.wait_until(lambda: proc.poll() is not None
                       or "web listening on" in log.read_text(errors="replace"), 30,
                       what="sidecar web's ready line")
        assert proc.poll() is None, log.read_text()
        base = f"http://127.0.0.1:{port}"
        for path, marked in ((f"/jobs/{job}", True), (f"/jobs/{job}?show=payload", True),
                             (f"/jobs/{job}?show=result", True), (f"/jobs?tool={TOOL}", True),
                             ("/tools", True), ("/running", False)):
            try:
                with urllib.request.urlopen(base + path, timeout=30) as response:
                    page = response.read().decode()
            except urllib.error.HTTPError as exc:
                raise AssertionError(f"{path}: {exc.code} {exc.read()[:300]!r}") from None
            assert_scrubbed(page, f"the web view's {path}", marked)
    finally:
        kit.stop_process(proc)


@pytest.mark.database
def test_the_client_scrubs_old_rows(dsn):
    """What sidecar.client hands its caller (and the MCP gateway its clients: tasks/get,
    tool results, progress) from a stored row: ``get``, ``jobs``, ``wait`` and why a job
    waits (a pause's reason: also ``sidecar wait --progress`` and MCP progress)."""
    url = with_password(dsn, PASSWORD)
    job = old_job(dsn, url)

    async def go():
        async with Client(url) as client:
            got = await client.get(job)
            listed = await client.jobs(tool=TOOL)
            ended = await client.wait(job, timeout=30)
            # why a queued job of the paused tool waits: the pause's reason, as stored
            queued = await client.enqueue(TOOL, {"k": 2})
            why = await client.waiting_reason(queued.id)
            assert why is not None and why.reason == "paused", why
            return got, listed, ended, why

    got, listed, ended, why = kit.run(go())
    for what, value in (("get", got), ("jobs", listed), ("wait", ended),
                        ("waiting_reason", why)):
        assert_scrubbed(repr(value), f"Client.{what}")
    assert got.result["n"] == 12345678901234567890123
