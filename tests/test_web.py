"""`sidecar web` (issue 30, part 1): the operator's pages in a real headless Chromium
(Debian's chromium and chromium-driver, driven by selenium) against one database whose jobs
were made by real sidecars running small tools: succeeded, failed (exit code, and killed
at its stage deadline), running with progress, queued, cancelled; hostile text in a tag,
a result and a tool's stderr. Plain HTTP for the refusals: a read-only server, CSRF, other
hosts and origins, bad query parameters. EXPLAIN shows that each filter of the jobs list
reads an index in page order.

One database, one set of sidecars, two servers (admin and read-only) and one browser for
the whole module. A screenshot of a job's page goes to $TEST_ARTIFACTS_DIR (default
/tmp/sidecar-test-artifacts).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import orjson
import pytest
from test_roles import _as

import kit
from sidecar.storage.db import with_database
from sidecar.storage.queries import Q

ALICE = "alice-" + "7" * 40
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
HOSTILE_TAG = "<script>alert('tag')</script>"
HOSTILE_RESULT = '{"html": "<img src=x onerror=alert(1)>"}'
HOSTILE_STDERR = "<script>alert('stderr')</script>\n"
ARTIFACTS = Path(os.environ.get("TEST_ARTIFACTS_DIR", "/tmp/sidecar-test-artifacts"))


@dataclass
class World:
    """The module's database and what is in it: job ids by what they show."""

    dsn: str
    jobs: dict[str, str]
    gofile: Path


@dataclass
class Server:
    """A running `sidecar web`: its base URL."""

    url: str
    proc: subprocess.Popen
    log: Path


def _create_database(server_dsn: str) -> tuple[str, str]:
    name = f"sidecar_web_{uuid.uuid4().hex[:12]}"

    async def create():
        conn = await asyncpg.connect(server_dsn)
        try:
            await conn.execute(f'CREATE DATABASE "{name}"')
        finally:
            await conn.close()

    kit.run(create())
    return name, with_database(server_dsn, name)


def _drop_database(server_dsn: str, name: str) -> None:
    async def drop():
        conn = await asyncpg.connect(server_dsn)
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()

    kit.run(drop())


def _state(dsn: str, job_id: str) -> str:
    return kit.scalar(dsn, "SELECT state FROM tool_jobs WHERE id = $1::uuid", job_id)


@pytest.fixture(scope="module")
def world(server_dsn, tmp_path_factory):
    """Jobs in every state, made by real sidecars: ``succeeded`` (a result with an HTML
    payload), ``failed`` (exit 64, hostile stderr and tag), ``killed`` (its tool ignored
    SIGTERM past a 1 s stage deadline), ``running`` (reported progress, waits for
    ``gofile``), ``queued`` and ``to_cancel`` (a tool no sidecar runs), ``cancelled``."""
    tmp = tmp_path_factory.mktemp("web")
    name, dsn = _create_database(server_dsn)
    migrate = kit.cli(dsn, "migrate")
    assert migrate.returncode == 0, migrate.stderr.decode()
    # web-slow's job lives through the whole module: a lease of 20 s keeps a loaded CI
    # machine's stall from handing it out again (its attempt would then be 2).
    env = kit.base_env(dsn, SIDECAR_PROFILE_WEB_HANG_STAGE_TIMEOUT_SECONDS="1",
                       SIDECAR_PROFILE_WEB_SLOW_LEASE_SECONDS="20")
    py = sys.executable
    started = [
        kit.SidecarProcess(dsn, [py, str(kit.TOOLS / "hostile.py")], "--tool", "web-emit",
                           "--concurrency", "2", env=env, tmp=tmp),
        kit.SidecarProcess(dsn, [py, str(kit.TOOLS / "hang_tree.py")], "--tool", "web-hang",
                           env=env, tmp=tmp),
        kit.SidecarProcess(dsn, [py, str(kit.TOOLS / "progress_tool.py")], "--tool",
                           "web-slow", env=env, tmp=tmp),
    ]
    gofile = tmp / "go"
    jobs = {
        "succeeded": kit.enqueue(dsn, "web-emit", {
            "mode": "emit", "stdout": HOSTILE_RESULT.encode().hex(), "code": 0}),
        "failed": kit.enqueue(dsn, "web-emit", {
            "mode": "emit", "stderr": HOSTILE_STDERR.encode().hex(), "code": 64},
            "--max-attempts", "1", "--tag", f"note={HOSTILE_TAG}"),
        "killed": kit.enqueue(dsn, "web-hang", {"pidfile": str(tmp / "hang.pids")},
                              "--max-attempts", "1"),
        "running": kit.enqueue(dsn, "web-slow", {"steps": [
            {"http": {"progress": 0.5, "message": "halfway <i>there</i>"}},
            {"wait_for": str(gofile)}]}),
        "queued": kit.enqueue(dsn, "web-idle", {"n": 1}, "--tag", "batch=7"),
        "to_cancel": kit.enqueue(dsn, "web-idle", {"n": 2}),
        "cancelled": kit.enqueue(dsn, "web-idle", {"n": 3}),
    }
    done = kit.cli(dsn, "cancel", jobs["cancelled"])
    assert done.returncode == 0, done.stderr.decode()
    try:
        for key, want in (("succeeded", "succeeded"), ("failed", "failed"),
                          ("killed", "failed")):
            kit.wait_until(lambda k=key, w=want: _state(dsn, jobs[k]) == w, 30,
                           what=f"the {key} job to be {want}")
        kit.wait_until(lambda: kit.job_row(dsn, jobs["running"])["progress"], 30,
                       what="the running job's progress")
        yield World(dsn, jobs, gofile)
    finally:
        gofile.touch()
        for proc in started:
            proc.stop()
        _drop_database(server_dsn, name)


def _start_server(dsn: str, tmp: Path, token_file: Path | None) -> Server:
    port = kit.free_port()
    extra = {"SIDECAR_WEB_TOKEN_FILE": str(token_file)} if token_file else {}
    log = tmp / f"web-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "sidecar", "web", "--listen",
                                 f"127.0.0.1:{port}"], env=kit.base_env(dsn, **extra),
                                stdout=out, stderr=out)
    kit.wait_until(lambda: proc.poll() is not None
                   or "web listening on" in log.read_text(errors="replace"), 30,
                   what="sidecar web's ready line")
    assert proc.poll() is None, log.read_text()
    return Server(f"http://127.0.0.1:{port}", proc, log)


@pytest.fixture(scope="module")
def server(world, tmp_path_factory):
    """`sidecar web` with ALICE's admin token, connected as the web view's own role
    (`sidecar migrate --web-role`, issue 41: reads, and its actions through definer
    functions only; a login role of our own, dropped afterwards)."""
    tmp = tmp_path_factory.mktemp("web-server")
    token_file = tmp / "tokens"
    token_file.write_text(f"# the operators\nalice {ALICE}\n")
    role = f"sidecar_web_{uuid.uuid4().hex[:10]}"
    kit.query(world.dsn, f'CREATE ROLE "{role}" LOGIN')
    try:
        granted = kit.cli(world.dsn, "migrate", "--web-role", role)
        assert granted.returncode == 0, granted.stderr.decode()
        started = _start_server(_as(world.dsn, role), tmp, token_file)
        try:
            yield started
        finally:
            kit.stop_process(started.proc)
            assert "permission denied" not in started.log.read_text(errors="replace")
    finally:
        kit.query(world.dsn, f'DROP OWNED BY "{role}"')
        kit.query(world.dsn, f'DROP ROLE "{role}"')


@pytest.fixture(scope="module")
def readonly(world, tmp_path_factory):
    """`sidecar web` without SIDECAR_WEB_TOKEN_FILE: read-only."""
    started = _start_server(world.dsn, tmp_path_factory.mktemp("web-ro"), None)
    yield started
    kit.stop_process(started.proc)


@pytest.fixture(scope="module")
def browser():
    """A headless Chromium (Debian's) driven through Debian's chromedriver."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not os.access(path, os.X_OK):
            pytest.fail(f"{path} is missing: apt-get install -y {package} (.ci/run does)")
    profile = tempfile.mkdtemp(prefix="sidecar-web-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--user-data-dir={profile}", "--window-size=1400,1100",
                "--no-first-run", "--disable-extensions"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER, log_output=subprocess.DEVNULL),
                              options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


# --- helpers --------------------------------------------------------------------------------

def _get(url: str, headers: dict | None = None) -> tuple[int, str, dict]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            return response.status, response.read().decode(), dict(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(), dict(exc.headers)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


def _post(url: str, fields: dict | None = None, headers: dict | None = None
          ) -> tuple[int, str, dict]:
    data = urllib.parse.urlencode(fields or {}).encode()
    request = urllib.request.Request(url, data=data, method="POST", headers={
        "Content-Type": "application/x-www-form-urlencoded", **(headers or {})})
    opener = urllib.request.build_opener(_NoRedirect)
    try:
        with opener.open(request, timeout=30) as response:
            return response.status, response.read().decode(), dict(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(), dict(exc.headers)


def _text(driver, selector: str) -> str:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, selector).text


def _row(driver, selector: str) -> list[str]:
    """The text of each cell of the row ``selector``, read at once (a row the page
    refreshes meanwhile is never half read)."""
    cells = driver.execute_script(
        "const row = document.querySelector(arguments[0]);"
        "return row ? Array.from(row.cells).map(c => c.innerText.trim()) : null;", selector)
    assert cells is not None, f"no {selector} on {driver.current_url}"
    return cells


def _no_alert(driver) -> None:
    """No script of the page ran an alert (hostile text stayed text)."""
    from selenium.common.exceptions import NoAlertPresentException

    with pytest.raises(NoAlertPresentException):
        driver.switch_to.alert.text  # noqa: B018 - raises when there is none


def _login(driver, server: Server) -> None:
    from selenium.webdriver.common.by import By

    driver.get(server.url + "/login?next=/tools")
    driver.find_element(By.ID, "token").send_keys(ALICE)
    driver.find_element(By.ID, "login").click()
    # Read in one script on the page the login led to: an earlier test's session may show
    # #principal on the login page itself, which goes away as the next page loads.
    shown = ("const e = document.getElementById('principal');"
             "return e && location.pathname !== '/login' ? e.innerText.trim() : null;")
    kit.wait_until(lambda: driver.execute_script(shown), 10, what="the page after logging in")
    assert driver.execute_script(shown) == "alice"


# --- the pages in a browser -----------------------------------------------------------------

@pytest.mark.e2e
def test_tools_page_shows_queues_failures_and_sidecars(world, server, browser):
    browser.get(server.url + "/tools")
    assert browser.title == "Tools · sidecar web"
    emit = _row(browser, 'tr[data-tool="web-emit"]')
    # tool, queued, running, failed (last hour), oldest queued, paused, limits, sidecars seen
    assert emit[0] == "web-emit" and emit[1] == "0" and emit[3] == "1"
    assert int(emit[7]) == 1  # its sidecar, idle and registered
    idle = _row(browser, 'tr[data-tool="web-idle"]')
    assert idle[1] == "2" and idle[2] == "0" and idle[7] == "0"  # no sidecar runs it
    assert idle[4].endswith((" s", " min"))  # the oldest due job's wait
    slow = _row(browser, 'tr[data-tool="web-slow"]')
    assert slow[2] == "1" and slow[5] == "no"
    assert _row(browser, 'tr[data-tool="web-hang"]')[3] == "1"
    assert "read-only" not in browser.page_source  # this server has admin tokens


@pytest.mark.e2e
def test_running_page_shows_lease_slack_stage_time_and_progress_live(world, server,
                                                                     browser):
    from selenium.webdriver.common.by import By

    browser.get(server.url + "/running")
    selector = f'tr[data-job="{world.jobs["running"]}"]'
    cells = _row(browser, selector)
    job = kit.job_row(world.dsn, world.jobs["running"])
    # job, tool, owner, attempt, token, lease slack, since renewal, stage/deadline, progress
    assert cells[1] == "web-slow" and cells[2] == job["owner_id"]
    assert cells[3] == f"{job['attempt']}/{job['max_attempts']}"
    assert cells[4] == str(job["fencing_token"])
    slack = float(cells[5].split()[0])
    assert 0 < slack <= 20.0  # web-slow's lease is 20 s (above), renewed every 0.5 s
    assert cells[7].endswith("/ 10.0 min")  # STAGE_TIMEOUT_SECONDS' default, 600 s
    assert cells[8] == "0.5 halfway <i>there</i>"  # as text: no <i> element
    assert not browser.find_elements(By.CSS_SELECTOR, f"{selector} i")
    # The rows refresh in place (a fragment every 2 s): the time in stage moves on.
    before = cells[7]
    kit.wait_until(lambda: _row(browser, selector)[7] != before, 15,
                   what="the running rows to refresh")
    assert browser.find_elements(By.CSS_SELECTOR, "h1")[0].text == "Running jobs"


@pytest.mark.e2e
def test_jobs_page_filters_by_state_tool_tag_and_kind(world, server, browser):
    def listed(query: str) -> set[str]:
        from selenium.webdriver.common.by import By

        browser.get(f"{server.url}/jobs?{query}")
        return {row.get_attribute("data-job")
                for row in browser.find_elements(By.CSS_SELECTOR, "tr[data-job]")}

    j = world.jobs
    assert listed("state=failed") == {j["failed"], j["killed"]}
    assert listed("kind=stage_timeout") == {j["killed"]}
    assert listed("kind=exit_code&tool=web-emit") == {j["failed"]}
    assert listed("tool=web-idle&state=queued") == {j["queued"], j["to_cancel"]}
    assert listed("tag=batch%3D7") == {j["queued"]}
    assert listed("tag=" + urllib.parse.quote(f"note={HOSTILE_TAG}")) == {j["failed"]}
    assert HOSTILE_TAG in _text(browser, f'tr[data-job="{j["failed"]}"]')
    _no_alert(browser)


@pytest.mark.e2e
def test_jobs_pages_follow_the_keyset_to_the_end(world, server):
    """Every job once, newest first, in pages of 2 by the "older" link (no OFFSET)."""
    want = [str(r["id"]) for r in kit.query(
        world.dsn, "SELECT id FROM tool_jobs ORDER BY id DESC")]
    seen, url = [], f"{server.url}/jobs?limit=2"
    while url:
        status, body, _ = _get(url)
        assert status == 200, body
        seen += re.findall(r'<tr data-job="([0-9a-f-]{36})"', body)
        older = re.search(r'<a href="(/jobs\?[^"]+)" id="older">', body)
        url = server.url + older.group(1).replace("&amp;", "&") if older else None
    assert seen == want


@pytest.mark.e2e
def test_job_page_tells_a_killed_jobs_story(world, server, browser):
    from selenium.webdriver.common.by import By

    browser.get(f"{server.url}/jobs/{world.jobs['killed']}")
    assert _text(browser, "#state") == "failed"
    events = [row.get_attribute("data-event")
              for row in browser.find_elements(By.CSS_SELECTOR, "#timeline tr[data-event]")]
    assert events[:3] == ["job_enqueued", "job_claimed", "tool_request_started"]
    assert "child_killed" in events and events[-1] == "job_failed"
    killed = _text(browser, '#timeline tr[data-event="child_killed"]')
    # its tool ignores SIGTERM: the kill grace passes and SIGKILL ends it
    assert "reason=stage_timeout" in killed and "signal=SIGKILL" in killed
    assert "survivors=0" in killed
    assert "kind=stage_timeout" in _text(browser, '#timeline tr[data-event="job_failed"]')
    assert "kind stage_timeout" in _text(browser, "#error")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    height = browser.execute_script("return document.documentElement.scrollHeight")
    browser.set_window_size(1400, min(max(height + 120, 900), 2400))  # the whole timeline
    assert browser.save_screenshot(str(ARTIFACTS / "web-job.png"))
    browser.set_window_size(1400, 1100)


@pytest.mark.e2e
def test_job_page_escapes_hostile_output_and_shows_content_on_request(world, server,
                                                                      browser):
    from selenium.webdriver.common.by import By

    browser.get(f"{server.url}/jobs/{world.jobs['failed']}")
    assert HOSTILE_STDERR.strip() in _text(browser, "#error pre")
    assert HOSTILE_TAG in _text(browser, "#facts")
    assert not browser.find_elements(By.CSS_SELECTOR, "main script")
    _no_alert(browser)
    # The result's digest is shown to anyone; its content to a logged-in principal only.
    job = world.jobs["succeeded"]
    browser.get(f"{server.url}/jobs/{job}")
    journal = kit.journal_details(world.dsn, job, "job_succeeded")[0]
    assert "job_succeeded" in _text(browser, "#timeline")
    assert journal["result"]["sha256"] in _text(browser, "#timeline")
    stored = kit.scalar(world.dsn, "SELECT encode(sha256(convert_to(result::text, 'UTF8')),"
                                   " 'hex') FROM tool_jobs WHERE id = $1::uuid", job)
    assert stored in _text(browser, "#digests")
    status, body, _ = _get(f"{server.url}/jobs/{job}?show=result")
    assert status == 401 and "log in" in body
    _login(browser, server)
    browser.get(f"{server.url}/jobs/{job}?show=result")
    assert orjson.loads(_text(browser, "pre.content")) == orjson.loads(HOSTILE_RESULT)
    assert not browser.find_elements(By.CSS_SELECTOR, "main img")
    _no_alert(browser)


@pytest.mark.e2e
def test_cancel_through_the_page_is_journaled_with_the_principal(world, server, browser):
    from selenium.webdriver.common.by import By

    job = world.jobs["to_cancel"]
    _login(browser, server)
    browser.get(f"{server.url}/jobs/{job}")
    browser.find_element(By.ID, "cancel").click()
    heading = "const h = document.querySelector('h1'); return h ? h.innerText : '';"
    kit.wait_until(lambda: "Cancel job" in browser.execute_script(heading), 10,
                   what="the confirmation page")  # nothing done yet:
    assert _state(world.dsn, job) == "queued"
    browser.find_element(By.ID, "confirm").click()
    kit.wait_until(lambda: browser.find_elements(By.ID, "done"), 10, what="the done banner")
    assert _text(browser, "#state") == "cancelled"
    [row] = kit.journal_details(world.dsn, job, "job_cancelled")
    assert row == {"previous_state": "queued", "by": "sidecar web (alice)"}
    assert "by=sidecar web (alice)" in _text(browser, '#timeline tr[data-event="job_cancelled"]')


@pytest.mark.e2e
def test_an_approval_is_answered_through_the_page_for_the_attempt_that_asked(world, server,
                                                                             browser):
    """Issue 44: the job page shows the request a tool waits on (its text escaped), and
    its approve button answers it naming the attempt and token the page showed; a second
    answer, or one naming another attempt, is refused and journaled."""
    from selenium.webdriver.common.by import By

    job, request = str(uuid.uuid4()), str(uuid.uuid4())
    kit.query(world.dsn, "INSERT INTO tool_jobs (id, tool, idempotency_key, payload, state, "
                         "owner_id, lease_until, fencing_token, attempt) VALUES ($1, "
                         "'web-approval', $2, '{}', 'running', 'w-test', now() + "
                         "interval '1 hour', 3, 2)", uuid.UUID(job), job)
    kit.query(world.dsn, "INSERT INTO tool_approvals (id, job_id, attempt, fencing_token, "
                         "action, summary, details, deadline) VALUES ($1, $2, 2, 3, 'refund',"
                         " 'refund 40 EUR <b id=\"bold\">now</b>', '{\"amount\": 40}', "
                         "now() + interval '1 hour')", uuid.UUID(request), uuid.UUID(job))
    _login(browser, server)
    browser.get(f"{server.url}/jobs/{job}")
    assert "refund 40 EUR <b id=\"bold\">now</b>" in _text(browser, "#approval")
    assert not browser.find_elements(By.ID, "bold")
    assert "attempt 2, fencing token 3" in _text(browser, "#approval")
    browser.find_element(By.ID, "approve").click()
    kit.wait_until(lambda: browser.find_elements(By.ID, "confirm"), 10, what="the confirmation")
    browser.find_element(By.NAME, "reason").send_keys("checked")
    browser.find_element(By.ID, "confirm").click()
    kit.wait_until(lambda: browser.find_elements(By.ID, "done"), 10, what="the done banner")
    assert "approved" in _text(browser, "#done")
    [row] = kit.query(world.dsn, "SELECT state, answered_by, reason FROM tool_approvals "
                                 "WHERE id = $1", uuid.UUID(request))
    assert dict(row) == {"state": "approved", "answered_by": "sidecar web (alice)",
                         "reason": "checked"}
    bearer = {"Authorization": f"Bearer {ALICE}"}
    for fields in ({"attempt": "2", "token": "3"}, {"attempt": "1", "token": "1"}):
        status, _, headers = _post(f"{server.url}/jobs/{job}/deny", fields, headers=bearer)
        assert status == 303 and headers["Location"].endswith("done=refused"), fields
    status, body, _ = _post(f"{server.url}/jobs/{job}/approve", {"attempt": "x", "token": "3"},
                            headers=bearer)
    assert status == 400 and body.startswith("form field attempt")
    outcomes = [d["outcome"] for d in kit.journal_details(world.dsn, job, "approval_refused")]
    assert outcomes == ["already_answered", "no_request"]
    [answered] = kit.journal_details(world.dsn, job, "approval_answered")
    assert answered["by"] == "sidecar web (alice)" and answered["attempt"] == 2


# --- plain HTTP: refusals and bounds --------------------------------------------------------

@pytest.mark.e2e
def test_a_read_only_server_refuses_every_action(world, readonly):
    job = world.jobs["queued"]
    for path in (f"/jobs/{job}/cancel", f"/jobs/{job}/retry", f"/jobs/{job}/approve",
                 f"/jobs/{job}/deny", "/tools/web-idle/pause", "/login"):
        status, body, _ = _post(readonly.url + path, headers={
            "Authorization": f"Bearer {ALICE}"})
        assert status == 403 and body.startswith("read-only"), (path, status, body)
    status, body, _ = _get(f"{readonly.url}/jobs/{job}?show=payload")
    assert status == 200 and "&#34;n&#34;: 1" in body  # nothing to log in to: shown
    assert "read-only" in _get(readonly.url + "/tools")[1]
    assert _state(world.dsn, job) == "queued"


@pytest.mark.e2e
def test_actions_need_a_token_and_a_session_needs_its_csrf_token(world, server):
    job = world.jobs["queued"]
    status, body, _ = _post(f"{server.url}/jobs/{job}/cancel")
    assert status == 401 and "log in" in body
    status, _, _ = _post(f"{server.url}/jobs/{job}/cancel",
                         headers={"Authorization": "Bearer " + "x" * 40})
    assert status == 401
    status, _, _ = _post(server.url + "/login", {"token": "y" * 40})
    assert status == 401
    status, _, headers = _post(server.url + "/login", {"token": ALICE, "next": "//evil"})
    assert status == 303 and headers["Location"] == "/tools"
    cookie = headers["Set-Cookie"].split(";")[0]
    assert "HttpOnly" in headers["Set-Cookie"] and "SameSite=Strict" in headers["Set-Cookie"]
    for fields in ({}, {"csrf": "forged"}):
        status, body, _ = _post(f"{server.url}/jobs/{job}/cancel", fields,
                                headers={"Cookie": cookie})
        assert status == 403 and body.startswith("form field csrf"), body
    status, body, _ = _post(f"{server.url}/tools/web-idle/pause", {"csrf": "forged"},
                            headers={"Cookie": cookie, "Origin": "http://evil.example"})
    assert status == 403 and body.startswith("Origin")
    assert _state(world.dsn, job) == "queued"
    assert kit.journal_details(world.dsn, job, "job_cancelled") == []
    # The confirmation page's form carries the session's token: with it, the action runs.
    status, page, _ = _get(f"{server.url}/tools/web-idle/pause", headers={"Cookie": cookie})
    csrf = re.search(r'name="csrf" value="([^"]+)"', page).group(1)
    status, _, headers = _post(f"{server.url}/tools/web-idle/pause",
                               {"csrf": csrf, "reason": "<b>night</b>"},
                               headers={"Cookie": cookie})
    assert status == 303 and headers["Location"] == "/tools?done=paused"
    status, _, headers = _post(f"{server.url}/tools/web-idle/resume",
                               headers={"Authorization": f"Bearer {ALICE}"})
    assert status == 303 and headers["Location"] == "/tools?done=resumed"
    flow = kit.query(world.dsn, "SELECT event, details FROM tool_flow_events "
                                "WHERE tool = 'web-idle' ORDER BY id")
    assert [(r["event"], r["details"]["by"]) for r in flow] == [
        ("tool_paused", "sidecar web (alice)"), ("tool_resumed", "sidecar web (alice)")]
    assert flow[0]["details"]["reason"] == "<b>night</b>"


@pytest.mark.e2e
@pytest.mark.parametrize(("query", "field"), [
    ("/jobs?state=done", "query parameter state"),
    ("/jobs?tool=a%20b", "query parameter tool"),
    ("/jobs?tag=novalue", "query parameter tag"),
    ("/jobs?kind=Exit-Code", "query parameter kind"),
    ("/jobs?limit=0", "query parameter limit"),
    ("/jobs?limit=100000", "query parameter limit"),
    ("/jobs?state=failed&state=queued", "query parameter state"),
    ("/jobs?after=yesterday", "query parameter after"),
    ("/jobs?after=2026-12-01T00:00:00+00:00,01a23a5c-474a-77c9-b4a0-da106449ca68",
     "query parameter after"),
    ("/jobs?tool=" + "a" * 400, "query parameter tool"),
    ("/jobs/not-a-uuid", "job id"),
    ("/running?fragment=all", "query parameter fragment"),
])
def test_bad_query_parameters_are_one_line_naming_the_field(server, query, field):
    status, body, headers = _get(server.url + query)
    assert status == 400
    assert body.count("\n") == 1 and body.startswith(field + ":"), body
    assert headers["Content-Type"].startswith("text/plain")


@pytest.mark.e2e
def test_every_answer_has_the_security_headers_and_other_hosts_are_refused(world, server):
    status, _, headers = _get(f"{server.url}/jobs/{world.jobs['failed']}")
    assert status == 200
    assert "script-src 'self'" in headers["Content-Security-Policy"]
    assert "'unsafe-inline'" not in headers["Content-Security-Policy"]
    assert "frame-ancestors 'none'" in headers["Content-Security-Policy"]
    assert headers["X-Frame-Options"] == "DENY" and headers["Cache-Control"] == "no-store"
    status, body, _ = _get(server.url + "/tools", headers={"Host": "evil.example"})
    assert status == 403 and "--allowed-host" in body
    status, body, _ = _get(f"{server.url}/jobs/{uuid.uuid4()}")
    assert status == 404 and body.startswith("no job")


# --- the jobs list reads an index in every filter -------------------------------------------

def _plan_nodes(plan: dict) -> list[dict]:
    nodes, todo = [], [plan]
    while todo:
        node = todo.pop()
        nodes.append(node)
        todo += node.get("Plans", [])
    return nodes


@pytest.mark.database
def test_each_filter_of_the_jobs_list_reads_its_index_in_page_order(dsn):
    """On 40,000 jobs (20 tools and a rare one; as a queue holds them: mostly succeeded,
    1 % queued, 0.5 % running, 1 % failed, 0.5 % cancelled), every filter's plan of
    web_jobs_page, first page and a later one, is an index scan in id order under a
    LIMIT: no sequential scan, no sort of the matching rows, whatever the table holds."""
    kit.query(dsn, """
        INSERT INTO tool_jobs (id, tool, state, max_attempts, idempotency_key, payload,
                               error, created_at, tags, finished_at)
        SELECT tool_job_new_id(),
               CASE WHEN n % 500 = 1 THEN 'tool-rare' ELSE 'tool-' || (n % 20) END,
               state, 3, 'bulk-' || n, '{}'::jsonb,
               CASE WHEN state = 'failed' THEN jsonb_build_object(
                   'kind', (ARRAY['exit_code','stage_timeout','signal'])[1 + n % 3]) END,
               now() - n * interval '1 second',
               CASE WHEN n % 100 = 0 THEN '{"batch": "x"}'::jsonb ELSE '{}'::jsonb END,
               CASE WHEN state NOT IN ('queued', 'running') THEN now() END
        FROM (SELECT n, CASE WHEN n % 200 < 2 THEN 'queued' WHEN n % 200 < 3 THEN 'running'
                             WHEN n % 200 < 5 THEN 'failed' WHEN n % 200 < 6 THEN 'cancelled'
                             ELSE 'succeeded' END AS state
              FROM generate_series(1, 40000) n) generated""")
    kit.query(dsn, "ANALYZE tool_jobs")
    cursor = kit.query(dsn, "SELECT id FROM tool_jobs ORDER BY id DESC OFFSET 500 LIMIT 1")[0]
    cases = {
        "none": ((None, None, None, None), "tool_jobs_pkey"),
        "failed": (("failed", None, None, None), "tool_jobs_unsucceeded_id_idx"),
        "cancelled": (("cancelled", None, None, None), "tool_jobs_unsucceeded_id_idx"),
        "queued": (("queued", None, None, None), "tool_jobs_live_id_idx"),
        "running": (("running", None, None, None), "tool_jobs_live_id_idx"),
        "succeeded": (("succeeded", None, None, None), "tool_jobs_pkey"),
        "tool": ((None, "tool-rare", None, None), "tool_jobs_tool_id_idx"),
        "common tool": ((None, "tool-7", None, None), None),
        "kind": ((None, None, None, "signal"), "tool_jobs_error_kind_idx"),
        "state and tool": (("queued", "tool-5", None, None), None),
        "tag": ((None, None, {"batch": "x"}, None), None),
    }

    async def plans():
        conn = await kit._connect(dsn)  # with the JSON codecs the sidecar's pools have
        try:
            out = {}
            for name, (args, _) in cases.items():
                for after in (None, cursor["id"]):
                    async with conn.transaction():
                        await conn.execute(Q["web_custom_plans"])
                        text = await conn.fetchval("EXPLAIN (FORMAT JSON) "
                                                   + Q["web_jobs_page"], *args, after, 51)
                    found = orjson.loads(text) if isinstance(text, str) else text
                    out[name, after is not None] = found[0]["Plan"]
            return out
        finally:
            await conn.close()

    for (name, later), plan in kit.run(plans()).items():
        nodes = _plan_nodes(plan)
        kinds = [node["Node Type"] for node in nodes]
        assert plan["Node Type"] == "Limit", (name, later, kinds)
        assert "Seq Scan" not in kinds, (name, later, kinds)
        index = cases[name][1]
        if name not in ("state and tool", "tag"):  # two filters, or the GIN: may sort
            assert "Sort" not in kinds, (name, later, kinds)
        if index is not None:  # a rare value reads its own index
            assert index in {node.get("Index Name") for node in nodes}, (name, later, kinds)
