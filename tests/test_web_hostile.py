"""`sidecar web` (issue 30) against a hostile user and an unlucky operator: rows written
by SQL the way a tool or a caller could shape them (progress, error and journal details
of any JSON type, hostile text), login "next" values a browser turns into another site,
over-long bearer tokens, keyset cursors that overflow, and a database that stops
answering. Every answer is one page or one line of text with the security headers, never
a 500 or a hang.

One database, one real `sidecar web` (with an admin token) and one TCP proxy in front of
the database for the whole module; plain HTTP (urllib), no browser.
"""

from __future__ import annotations

import html
import re
import socket
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass

import asyncpg
import pytest
from netproxy import BlackholeProxy, through, upstream_of

import kit
from sidecar.storage.db import with_database

pytestmark = pytest.mark.e2e

ALICE = "alice-" + "7" * 40
# A token as long as a form field may be: a bearer token longer than it, whose first
# MAX_PARAM_CHARS characters are this one, must not log in as bob.
BOB = "b" * 300
MARK = "<b id=hostile>"


@dataclass
class World:
    """The module's database (reached directly and through ``proxy``), the server, and
    job ids by what is hostile in them."""

    dsn: str
    url: str
    proxy: BlackholeProxy
    jobs: dict[str, str]


def _db(server_dsn: str, sql: str) -> None:
    async def go():
        conn = await asyncpg.connect(server_dsn)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    kit.run(go())


@pytest.fixture(scope="module")
def world(server_dsn, tmp_path_factory):
    """Jobs whose rows were rewritten by SQL: ``progress`` (a running job whose progress
    has a value and no message), ``shapes`` (error, progress and journal details that are
    not objects), ``kinds`` (an error that is a list); a `sidecar web` on a proxy to the
    database."""
    tmp = tmp_path_factory.mktemp("web-hostile")
    name = f"sidecar_webh_{uuid.uuid4().hex[:12]}"
    _db(server_dsn, f'CREATE DATABASE "{name}"')
    dsn = with_database(server_dsn, name)
    try:
        assert kit.cli(dsn, "migrate").returncode == 0
        jobs = {k: kit.enqueue(dsn, "web-hostile", {"k": k}) for k in
                ("progress", "shapes", "kinds")}
        kit.query(dsn, "UPDATE tool_jobs SET state = 'running', owner_id = $2, "
                       "lease_until = now() + interval '1 hour', claimed_at = now(), "
                       "heartbeat_at = now(), fencing_token = 1, attempt = 1, "
                       "progress = '{\"value\": 3}' WHERE id = $1::uuid",
                  jobs["progress"], MARK)
        kit.query(dsn, "UPDATE tool_jobs SET state = 'failed', finished_at = now(), "
                       "error = '{\"kind\": \"x\", \"stderr_tail\": [\"<i>\"]}', "
                       "progress = '\"<b>text progress</b>\"' WHERE id = $1::uuid",
                  jobs["shapes"])
        kit.query(dsn, "INSERT INTO tool_job_events (job_id, fencing_token, event, details) "
                       "VALUES ($1::uuid, 1, '<script>x</script>', '[1, \"<i>\"]'), "
                       "($1::uuid, 1, 'job_progress', '\"<b>text</b>\"'), "
                       "($1::uuid, 1, 'job_failed', 'null')", jobs["shapes"])
        kit.query(dsn, "UPDATE tool_jobs SET state = 'failed', finished_at = now(), "
                       "error = '[\"<i>not an object</i>\"]' WHERE id = $1::uuid",
                  jobs["kinds"])
        jobs["big"] = kit.enqueue(dsn, "web-hostile", {"k": "big"})
        kit.query(dsn, "UPDATE tool_jobs SET state = 'succeeded', finished_at = now(), "
                       "result = jsonb_build_object('s', repeat('<', 8 * 1024 * 1024)) "
                       "WHERE id = $1::uuid", jobs["big"])
        kit.query(dsn, "INSERT INTO tool_job_events (job_id, fencing_token, event, details) "
                       "SELECT $1::uuid, 1, 'job_progress', jsonb_build_object('n', n, "
                       "'<k>', repeat('<', 200)) FROM generate_series(1, 100000) n",
                  jobs["big"])
        kit.query(dsn, "INSERT INTO tool_job_events (job_id, fencing_token, event, details) "
                       "VALUES ($1::uuid, 1, 'job_progress', jsonb_build_object('m', "
                       "repeat('<', 1024 * 1024), 'n', repeat('x', 5000)))", jobs["big"])
        proxy = BlackholeProxy(upstream_of(dsn))
        proxy.start()
        token_file = tmp / "tokens"
        token_file.write_text(f"alice {ALICE}\nbob {BOB}\n")
        web_port = kit.free_port()
        log = tmp / "web.log"
        env = kit.base_env(through(dsn, proxy.port), SIDECAR_WEB_TOKEN_FILE=str(token_file),
                           SIDECAR_DB_TIMEOUT_SECONDS="2")
        with open(log, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "sidecar", "web", "--listen",
                                     f"127.0.0.1:{web_port}"], env=env, stdout=out,
                                    stderr=out)
        try:
            kit.wait_until(lambda: proc.poll() is not None
                           or "web listening on" in log.read_text(errors="replace"), 30,
                           what="sidecar web's ready line")
            assert proc.poll() is None, log.read_text()
            yield World(dsn, f"http://127.0.0.1:{web_port}", proxy, jobs)
            assert "Traceback" not in log.read_text(errors="replace"), log.read_text()
        finally:
            kit.stop_process(proc)
            proxy.stop()
    finally:
        _db(server_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _get(url: str, headers: dict | None = None) -> tuple[int, str, dict]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode(), dict(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(), dict(exc.headers)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


def _post(url: str, fields: dict, headers: dict | None = None) -> tuple[int, str, dict]:
    data = urllib.parse.urlencode(fields).encode()
    request = urllib.request.Request(url, data=data, method="POST", headers={
        "Content-Type": "application/x-www-form-urlencoded", **(headers or {})})
    try:
        with urllib.request.build_opener(_NoRedirect).open(request, timeout=30) as response:
            return response.status, response.read().decode(), dict(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(), dict(exc.headers)


def _raw(url: str, request_line: str) -> bytes:
    """The raw answer to one request whose target is given as is (no client quoting)."""
    parts = urllib.parse.urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall(f"{request_line}\r\nHost: {parts.netloc}\r\nConnection: close\r\n\r\n"
                     .encode("latin-1"))
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _raw_host(url: str, host: str) -> bytes:
    """The raw answer to GET /tools sent with ``host`` as the Host header."""
    parts = urllib.parse.urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall(f"GET /tools HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
                     .encode("latin-1"))
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _browser_target(location: str) -> str:
    """What a browser makes of a Location header: the URL parser drops ASCII tab and
    newline and reads a backslash as a slash (WHATWG URL)."""
    return location.replace("\t", "").replace("\n", "").replace("\r", "") \
        .replace("\\", "/").strip()


# --- tests ----------------------------------------------------------------------------------

def test_rows_of_any_json_shape_render_escaped(world):
    """Progress with a value and no message, a string progress, an error that is a list,
    journal details that are a list, a string or null, an event name with markup: each
    page renders (escaped), none is a 500."""
    auth = {"Authorization": f"Bearer {ALICE}"}
    for path in ("/running", "/running?fragment=rows", f"/jobs/{world.jobs['progress']}",
                 f"/jobs/{world.jobs['shapes']}", f"/jobs/{world.jobs['kinds']}",
                 "/jobs", "/jobs?state=failed", "/tools"):
        status, body, headers = _get(world.url + path, auth)
        assert status == 200, (path, status, body[:300])
        assert "<i>" not in body and "<b>" not in body and MARK not in body, path
        assert "<script>x" not in body, path
        assert "Content-Security-Policy" in headers, path
    status, body, _ = _get(world.url + f"/jobs/{world.jobs['shapes']}", auth)
    assert "&lt;script&gt;x&lt;/script&gt;" in body
    assert "&lt;b&gt;text&lt;/b&gt;" in body
    status, body, _ = _get(world.url + "/running", auth)
    assert "&lt;b id=hostile&gt;" in body


@pytest.mark.parametrize("nxt", ["/\t/evil.example/", "/\n/evil.example/",
                                 "/\r\n/evil.example/", "/ /evil.example/",
                                 "/%09/evil.example/", "/\\evil.example/"])
def test_login_never_sends_the_browser_to_another_site(world, nxt):
    """A "next" that a browser's URL parser turns into ``//host`` (tab, newline, a
    backslash) goes to /tools instead; the login page never echoes it either."""
    status, body, headers = _post(world.url + "/login", {"token": ALICE, "next": nxt})
    assert status == 303, (status, body)
    target = _browser_target(headers["Location"])
    assert target.startswith("/") and not target.startswith("//"), headers["Location"]
    assert urllib.parse.urlsplit(urllib.parse.urljoin(world.url, target)).netloc \
        == urllib.parse.urlsplit(world.url).netloc
    status, body, _ = _get(world.url + "/login?" + urllib.parse.urlencode({"next": nxt}))
    assert status == 200
    shown = re.search(r'name="next" value="([^"]*)"', body)[1]
    target = _browser_target(html.unescape(shown))
    assert target.startswith("/") and not target.startswith("//"), shown


def test_a_bearer_token_is_compared_whole_never_truncated(world):
    """BOB's token followed by more characters is not BOB's token: 401, nothing done."""
    status, body, _ = _post(world.url + "/tools/web-hostile/pause", {},
                            {"Authorization": f"Bearer {BOB}x"})
    assert status == 401, (status, body)
    assert kit.scalar(world.dsn, "SELECT count(*) FROM tool_flow WHERE tool = 'web-hostile' "
                                 "AND paused_at IS NOT NULL") in (0, None)
    status, body, _ = _get(world.url + "/jobs/" + world.jobs["shapes"] + "?show=payload",
                           {"Authorization": f"Bearer {BOB}"})
    assert status == 200, body[:300]


@pytest.mark.parametrize("after", ["0001-01-01T00:00:00+01:00,{id}",
                                   "9999-12-31T23:59:59-01:00,{id}", "{id}x", "-1",
                                   "00000000-0000-0000-0000-000000000000",
                                   "ffffffff-ffff-ffff-ffff-ffffffffffff"])
def test_a_cursor_that_is_no_job_id_is_one_line(world, after):
    """A keyset cursor that is no job id (a time, the old TIME,ID form, junk) is a 400
    naming ``after``; the smallest and largest ids are an empty or a whole page, never a
    500."""
    query = urllib.parse.urlencode({"after": after.format(id=uuid.uuid4())})
    status, body, headers = _get(world.url + "/jobs?" + query)
    assert status in (200, 400), (status, body[:300])
    if status == 400:
        assert body.startswith("query parameter after:") and body.count("\n") == 1, body
    else:
        assert "-0000-0000-" in after or "ffff-ffff" in after
    assert "Content-Security-Policy" in headers


def test_a_tag_filter_the_database_cannot_hold_is_400(world):
    """A tag value with NUL or another control character is the caller's mistake (400
    naming tag), not "database unavailable"."""
    for value in ("a\x00b", "a\x1bb"):
        target = "/jobs?tag=" + urllib.parse.quote(f"k={value}", errors="surrogatepass")
        status, body, _ = _get(world.url + target)
        assert status == 400, (value, status, body)
        assert body.startswith("query parameter tag:"), body


def test_an_unexpected_fault_is_a_500_line_with_the_security_headers(world):
    """A request aiohttp itself refuses inside the app still carries the headers; a
    malformed percent-encoding of the path is one line, not a traceback."""
    raw = _raw(world.url, "GET /jobs/%ff%fe HTTP/1.1")
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"Content-Security-Policy" in head, raw[:500]
    assert b"Traceback" not in body


def test_a_database_that_stops_answering_is_a_bounded_503(world):
    """The proxy blackholes the database: every page answers 503 in one line within the
    database timeout (2 s) plus slack, then answers again once the database is back."""
    auth = {"Authorization": f"Bearer {ALICE}"}
    world.proxy.blackhole()
    try:
        for path in ("/tools", "/running", "/jobs", f"/jobs/{world.jobs['shapes']}",
                     f"/jobs/{world.jobs['shapes']}/retry"):
            status, body, headers = _get(world.url + path, auth)
            assert status == 503, (path, status, body[:300])
            assert body.startswith("database unavailable") and body.count("\n") == 1, body
            assert "Content-Security-Policy" in headers
        status, body, _ = _post(world.url + f"/jobs/{world.jobs['shapes']}/retry", {},
                                auth)
        assert status == 503, (status, body)
    finally:
        world.proxy.restore()
    kit.wait_until(lambda: _get(world.url + "/tools")[0] == 200, 30,
                   what="the web view answering again")


def test_a_huge_result_and_journal_make_a_bounded_page(world):
    """An 8 MiB result shown on request and 100,000 journal events, the newest with a
    megabyte of details: the page holds the first MAX_CONTENT_CHARS of the content and the
    newest MAX_TIMELINE_EVENTS events, each cut to MAX_EVENT_CHARS, escaped, and says
    so."""
    from sidecar.ops.web import MAX_CONTENT_CHARS, MAX_EVENT_CHARS, MAX_TIMELINE_EVENTS

    status, body, _ = _get(world.url + f"/jobs/{world.jobs['big']}?show=result",
                           {"Authorization": f"Bearer {ALICE}"})
    assert status == 200, body[:300]
    assert f"The newest {MAX_TIMELINE_EVENTS} of 100002 events." in body
    assert f"the first {MAX_CONTENT_CHARS} of" in body
    assert "<<" not in body and "<k>" not in body
    assert "… (1048576 characters)" in body  # the megabyte detail, cut
    # 2000 events of at most MAX_EVENT_CHARS each, escaped, and the content
    assert len(body) < MAX_TIMELINE_EVENTS * (MAX_EVENT_CHARS * 5 + 400) \
        + MAX_CONTENT_CHARS * 5 + 100_000, len(body)


def test_posts_from_another_site_are_refused_even_with_a_null_origin(world):
    """A form another site (or another port of this host: the same site to a cookie)
    makes the browser POST says so in Sec-Fetch-Site even where Origin is "null" (a
    no-referrer page): refused, so no login can be forced on a browser (login CSRF) and
    no action taken from there; this server's own forms (same-origin) pass."""
    for site in ("cross-site", "same-site"):
        status, body, _ = _post(world.url + "/login", {"token": ALICE, "next": "/tools"},
                                {"Origin": "null", "Sec-Fetch-Site": site})
        assert status == 403, (site, status, body)
        assert "Set-Cookie" not in _, site
        status, body, _ = _post(world.url + "/tools/web-hostile/pause", {},
                                {"Authorization": f"Bearer {ALICE}", "Origin": "null",
                                 "Sec-Fetch-Site": site})
        assert status == 403, (site, status, body)
    status, _, headers = _post(world.url + "/login", {"token": ALICE, "next": "/tools"},
                               {"Origin": "null", "Sec-Fetch-Site": "same-origin"})
    assert status == 303 and "sidecar_web_session" in headers.get("Set-Cookie", "")


def test_odd_methods_hosts_and_paths_are_one_line_with_the_headers(world):
    """GET on a POST-only route, a Host with a port that is not a number or a trailing
    dot, a static path that climbs, a job id that is not a UUID: each one line of text
    (405, 403, 404, 400) with the security headers."""
    for path, status_wanted in (("/logout", 405), ("/static/..%2Fweb.py", 404),
                                ("/static/%2e%2e/web.py", 404), ("/jobs/..%2Fetc", 400),
                                ("/jobs/1%20OR%201=1", 400)):
        status, body, headers = _get(world.url + path)
        assert status == status_wanted, (path, status, body[:200])
        assert "Content-Security-Policy" in headers, path
        assert "<" not in body, path
    for host in ("localhost.:80", "127.0.0.1.evil.example", "evil.example:80@127.0.0.1"):
        raw = _raw_host(world.url, host)
        assert raw.startswith(b"HTTP/1.1 403"), (host, raw[:200])


def test_the_tools_page_is_bounded_however_many_tool_names_there_are(world):
    """Callers can make any number of tool names (and SQL any length of one): /tools
    lists the first MAX_TOOLS by name and says so; a long name is cut, escaped. Runs last:
    it leaves 601 tools behind."""
    from sidecar.ops.web import MAX_TOOLS

    kit.query(world.dsn, "INSERT INTO tool_jobs (id, tool, max_attempts, idempotency_key, "
                         "payload) SELECT gen_random_uuid(), 'many-' || lpad(n::text, 4, "
                         "'0'), 1, 'many-' || n, '{}' FROM generate_series(1, 600) n")
    kit.query(world.dsn, "INSERT INTO tool_jobs (id, tool, max_attempts, idempotency_key, "
                         "payload) VALUES (gen_random_uuid(), 'a' || repeat('<', 100000), "
                         "1, 'long-tool', '{}')")
    status, body, _ = _get(world.url + "/tools")
    assert status == 200, body[:300]
    assert body.count("<tr data-tool=") == MAX_TOOLS
    assert 'id="more-tools"' in body
    assert "<<" not in body and "… (100001 characters)" in body
    assert len(body) < 2_000_000, len(body)


@pytest.mark.parametrize("listen", ["0.0.0.0:0", "[::]:0", "example.org:0"])
def test_listening_beyond_loopback_needs_the_token_file(world, tmp_path, listen):
    """A read-only server shows payloads and results to whoever reaches it (a client
    sends any Host it likes): `sidecar web --listen` beyond loopback without
    SIDECAR_WEB_TOKEN_FILE is refused at start, one line naming --listen and the fix,
    exit 2, before anything listens. With the token file the same check passes."""
    env = kit.base_env(world.dsn)
    env.pop("SIDECAR_WEB_TOKEN_FILE", None)
    done = subprocess.run([sys.executable, "-m", "sidecar", "web", "--listen", listen],
                          env=env, capture_output=True, timeout=60)
    err = done.stderr.decode()
    assert done.returncode == 2, err
    assert err.count("\n") == 1 and "--listen" in err and "SIDECAR_WEB_TOKEN_FILE" in err, err
    from sidecar.ops.web import check_exposure

    check_exposure(listen.rpartition(":")[0].strip("[]"), {"alice": ALICE})  # no raise
    for loopback in ("127.0.0.1", "127.3.4.5", "::1", "localhost"):
        check_exposure(loopback, None)


def test_a_pause_of_a_tool_never_seen_is_refused_in_one_line(world):
    """Issue 41, point 13, the web view's sibling of `sidecar pause`: a typed URL naming a
    tool with no job, limit or sidecar (a typo) pauses nothing: a 400 that names the tool
    and `sidecar pause --new`."""
    status, body, _ = _post(world.url + "/tools/web-hostlie/pause", {},
                            {"Authorization": f"Bearer {ALICE}"})
    assert status == 400, (status, body)
    assert "web-hostlie" in body and "--new" in body and body.count("\n") <= 1, body
    assert kit.scalar(world.dsn, "SELECT count(*) FROM tool_flow "
                                 "WHERE tool = 'web-hostlie'") == 0
