"""`sidecar web`'s sessions and logins (issue 41, point 5): a session is a row of the
database (migration 025), so a cookie made by one `sidecar web` works on another on the same
database and on the first after a restart, and logging out ends it on both; failed logins
are limited per source address and per token, on the login form and for bearer tokens,
each lockout logged (``web_login_locked``) and counted on the web view's ``/metrics``.

Real `sidecar web` processes over plain HTTP (http.client). Two sources on one machine:
the client binds its socket to another address of 127.0.0.0/8 (every one is loopback), so
the server sees another peer; X-Forwarded-For is never believed.
"""

from __future__ import annotations

import hashlib
import http.client
import re
import subprocess
import sys
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import pytest

import kit
from sidecar.ops import web
from sidecar.storage import db
from sidecar.storage.operator_store import OperatorStore

ALICE = "alice-" + "7" * 40
ALLOWED = 10  # failed logins in a window that lock (docs/web.md; web.LOGIN_FAILURES_ALLOWED)


@dataclass
class Web:
    """A running `sidecar web`: its port, process and log."""

    port: int
    proc: subprocess.Popen
    log: Path

    def stop(self) -> None:
        kit.stop_process(self.proc)


def start_web(dsn: str, tmp: Path, port: int | None = None, *extra: str) -> Web:
    token_file = tmp / "tokens"
    token_file.write_text(f"alice {ALICE}\n")
    port = port or kit.free_port()
    log = tmp / f"web-{port}-{len(list(tmp.glob('web-*.log')))}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "sidecar", "web", "--listen",
                                 f"127.0.0.1:{port}", *extra],
                                env=kit.base_env(dsn, SIDECAR_WEB_TOKEN_FILE=str(token_file)),
                                stdout=out, stderr=out)
    kit.wait_until(lambda: proc.poll() is not None
                   or "web listening on" in log.read_text(errors="replace"), 30,
                   what="sidecar web's ready line")
    assert proc.poll() is None, log.read_text()
    return Web(port, proc, log)


@pytest.fixture
def webs(dsn, tmp_path):
    """Two `sidecar web` processes on one database (replicas)."""
    started = [start_web(dsn, tmp_path), start_web(dsn, tmp_path)]
    yield started
    for one in started:
        one.stop()


def request(server: Web, method: str, path: str, *, source: str = "127.0.0.1",
            fields: dict | None = None, headers: dict | None = None
            ) -> tuple[int, str, http.client.HTTPResponse]:
    """One request to ``server`` from the local address ``source``: status, body, the
    response (its headers)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30,
                                      source_address=(source, 0))
    body = urllib.parse.urlencode(fields).encode() if fields is not None else None
    sent = dict(headers or {})
    if body is not None:
        sent["Content-Type"] = "application/x-www-form-urlencoded"
    try:
        conn.request(method, path, body=body, headers=sent)
        response = conn.getresponse()
        return response.status, response.read().decode(errors="replace"), response
    finally:
        conn.close()


def log_in(server: Web, token: str = ALICE, source: str = "127.0.0.1"
           ) -> tuple[int, str | None, str]:
    """POST /login: the status, the session cookie's value (None without one), and its
    Set-Cookie header."""
    status, _, response = request(server, "POST", "/login", source=source,
                                  fields={"token": token, "next": "/tools"})
    header = response.getheader("Set-Cookie") or ""
    found = re.search(rf"{web.SESSION_COOKIE}=([^;]+)", header)
    return status, found.group(1) if found else None, header


def who_is(server: Web, cookie: str) -> str | None:
    """The principal /tools names for ``cookie``, None when it shows none."""
    status, body, _ = request(server, "GET", "/tools",
                              headers={"Cookie": f"{web.SESSION_COOKIE}={cookie}"})
    assert status == 200, body
    found = re.search(r'id="principal">([^<]+)<', body)
    return found.group(1) if found else None


def lockouts(server: Web, scope: str) -> float | None:
    status, body, _ = request(server, "GET", "/metrics")
    assert status == 200, body
    return kit.metric_value(body, "sidecar_web_login_lockouts_total", scope=scope)


def locked_events(server: Web) -> list[dict]:
    return kit.read_events(server.log, "web_login_locked")


@pytest.mark.e2e
def test_a_session_works_on_another_replica_and_after_a_restart(dsn, webs, tmp_path):
    first, second = webs
    status, cookie, header = log_in(first)
    assert status == 303 and cookie, header
    assert "HttpOnly" in header and "SameSite=Strict" in header, header
    assert who_is(second, cookie) == "alice"
    # only the key's sha256 is stored, never the key
    rows = kit.query(dsn, "SELECT key_sha256, principal FROM sidecar_web_sessions")
    assert [(bytes(r["key_sha256"]), r["principal"]) for r in rows] == [
        (hashlib.sha256(cookie.encode()).digest(), "alice")]
    assert cookie not in str(kit.query(dsn, "SELECT t::text FROM sidecar_web_sessions t"))

    port = first.port
    first.stop()
    webs[0] = first = start_web(dsn, tmp_path, port)
    assert who_is(first, cookie) == "alice"

    # logging out on one replica ends the session on the other
    _, body, _ = request(second, "GET", "/tools",
                         headers={"Cookie": f"{web.SESSION_COOKIE}={cookie}"})
    csrf = re.search(r'name="csrf" value="([^"]+)"', body).group(1)
    status, _, _ = request(second, "POST", "/logout", fields={"csrf": csrf},
                           headers={"Cookie": f"{web.SESSION_COOKIE}={cookie}"})
    assert status == 303
    assert who_is(first, cookie) is None
    assert kit.scalar(dsn, "SELECT count(*) FROM sidecar_web_sessions") == 0


@pytest.mark.e2e
def test_failed_logins_from_one_source_lock_it_even_for_a_good_token(webs):
    first, second = webs
    attacker, other = "127.0.0.2", "127.0.0.3"
    for n in range(ALLOWED):
        status, cookie, _ = log_in(first, f"wrong-{n}", source=attacker)
        assert (status, cookie) == (401, None), n
    # the next one, with the right token, on either replica, by form or as a bearer
    status, cookie, _ = log_in(second, ALICE, source=attacker)
    assert (status, cookie) == (429, None)
    status, body, response = request(first, "GET", "/tools", source=attacker,
                                     headers={"Authorization": f"Bearer {ALICE}"})
    assert status == 429 and "too many failed logins" in body, body
    assert int(response.getheader("Retry-After")) > 0
    # X-Forwarded-For is not believed: the peer is still the locked source
    status, _, _ = request(first, "POST", "/login", source=attacker,
                           fields={"token": ALICE},
                           headers={"X-Forwarded-For": "127.0.0.9"})
    assert status == 429
    # another source is not locked
    status, cookie, _ = log_in(first, ALICE, source=other)
    assert status == 303 and cookie
    assert [(e["scope"], e["source"], e["failures"]) for e in locked_events(first)] == [
        ("source", attacker, ALLOWED)]
    assert lockouts(first, "source") == 1
    assert lockouts(first, "token") == 0


@pytest.mark.e2e
def test_one_token_failing_from_many_sources_is_locked(webs):
    first, second = webs
    guess = "guessed-token-" + "x" * 20
    sources = [f"127.0.0.{10 + n}" for n in range(ALLOWED)]
    for n, source in enumerate(sources):
        status, body, _ = request(second if n % 2 else first, "GET", "/jobs",
                                  source=source,
                                  headers={"Authorization": f"Bearer {guess}"})
        assert status == 200, (n, body)  # a wrong bearer token reads as anonymous
    status, body, _ = request(first, "GET", "/jobs", source="127.0.0.40",
                              headers={"Authorization": f"Bearer {guess}"})
    assert status == 429 and "this token" in body, body
    status, cookie, _ = log_in(first, guess, source="127.0.0.41")
    assert (status, cookie) == (429, None)
    # that source may still log in with its own token
    status, cookie, _ = log_in(first, ALICE, source="127.0.0.40")
    assert status == 303 and cookie
    events = locked_events(first) + locked_events(second)
    assert [(e["scope"], e["token_sha256"]) for e in events] == [
        ("token", hashlib.sha256(guess.encode()).hexdigest()[:16])]
    assert (lockouts(first, "token") or 0) + (lockouts(second, "token") or 0) == 1


@pytest.mark.e2e
def test_a_trusted_proxy_names_the_source_and_only_its_nearest_hop_counts(dsn, tmp_path):
    """With --trusted-proxy, the right-most X-Forwarded-For address that is not a trusted
    proxy is the source (what the proxy saw): a client cannot pick its source by writing
    addresses to the left of it."""
    proxy, client, other = "127.0.0.5", "198.51.100.7", "198.51.100.8"
    server = start_web(dsn, tmp_path, None, "--trusted-proxy", proxy)
    try:
        for n in range(ALLOWED):
            status, _, _ = request(server, "POST", "/login", source=proxy,
                                   fields={"token": f"wrong-{n}"},
                                   headers={"X-Forwarded-For": f"10.9.9.{n}, {client}"})
            assert status == 401, n
        status, _, _ = request(server, "POST", "/login", source=proxy,
                               fields={"token": ALICE},
                               headers={"X-Forwarded-For": client})
        assert status == 429
        status, _, _ = request(server, "POST", "/login", source=proxy,
                               fields={"token": ALICE},
                               headers={"X-Forwarded-For": f"{client}, {other}"})
        assert status == 303
        assert [e["source"] for e in locked_events(server)] == [client]
    finally:
        server.stop()
    done = kit.cli(dsn, "web", "--trusted-proxy", "not-an-address")
    assert done.returncode == 2
    assert kit.one_line_error(done).startswith("sidecar: error: --trusted-proxy 'not-an"), \
        done.stderr.decode()


@pytest.mark.unit
@pytest.mark.parametrize(("peer", "forwarded", "trusted", "want"), [
    ("127.0.0.2", "203.0.113.9", (), "127.0.0.2"),                 # not believed by default
    ("2001:db8:1:2:3:4:5:6", "", (), "2001:db8:1:2::/64"),          # one host's /64
    ("::ffff:192.0.2.1", "", (), "192.0.2.1"),                      # IPv4-mapped
    ("10.0.0.1", "203.0.113.9", ("10.0.0.0/8",), "203.0.113.9"),
    ("10.0.0.1", "1.1.1.1, 203.0.113.9, 10.0.0.2", ("10.0.0.0/8",), "203.0.113.9"),
    ("10.0.0.1", "junk, 203.0.113.9", ("10.0.0.0/8",), "203.0.113.9"),
    ("10.0.0.1", "203.0.113.9, junk", ("10.0.0.0/8",), "10.0.0.1"),  # no address: the peer
    ("10.0.0.1", "10.0.0.3", ("10.0.0.0/8",), "10.0.0.3"),          # proxies all the way
    ("10.0.0.1", "1.1.1.1," * 400, ("10.0.0.0/8",), "10.0.0.1"),     # over-long: the peer
    ("192.0.2.5", "203.0.113.9", ("10.0.0.0/8",), "192.0.2.5"),      # not from the proxy
    (None, "", (), "unknown"),
])
def test_the_source_of_a_login(peer, forwarded, trusted, want):
    networks = tuple(web.parse_trusted_proxy(t) for t in trusted)
    assert web.source(peer, forwarded, networks) == want


# --- the bounds of both tables (the statements, no web process) -----------------------------

@pytest.mark.database
def test_sessions_and_failures_stay_bounded(dsn):
    async def go():
        pool = await db.create_pool(dsn, 10, max_size=1)
        try:
            store = OperatorStore(pool, 10)
            for n in range(7):
                await store.web_session_create(hashlib.sha256(b"a%d" % n).digest(), "alice",
                                               "c" * 43, 3600, 5, 100)
            for n in range(4):
                await store.web_session_create(hashlib.sha256(b"b%d" % n).digest(), "bob",
                                               "c" * 43, 3600, 5, 8)
            for n in range(30):
                await store.web_login_failed(f"10.0.0.{n}", f"{n:064x}", 300, 10, 300, 12)
            return (await pool.fetch("SELECT principal, count(*) AS n FROM "
                                     "sidecar_web_sessions GROUP BY 1 ORDER BY 1"),
                    await pool.fetchval("SELECT count(*) FROM sidecar_web_login_failures"),
                    await store.web_session(hashlib.sha256(b"a6").digest()),
                    await store.web_session(hashlib.sha256(b"a0").digest()))
        finally:
            await pool.close()

    sessions, failures, newest, oldest = kit.run(go())
    assert [(r["principal"], r["n"]) for r in sessions] == [("alice", 4), ("bob", 4)]
    assert failures <= 12
    assert newest["principal"] == "alice" and oldest is None
