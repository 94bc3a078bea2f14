"""The warm Chromium recipe (issue 43, point 2; examples/recipes/chromium_warm.py): one
headless Chromium, driven over its DevTools pipe, serves consecutive jobs of a slot, each
in a fresh browser context. Through real `sidecar run` processes with the recipe's
profile (chromium_warm.env) and a local HTTP server, plus the recipe driven directly for
its session mode and for a browser that dies. Browser pids are the ones the recipe
reports in its results; after every run none of them, nor any process of their warm
processes, is left."""

from __future__ import annotations

import contextlib
import html
import http.server
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from kit import base_env, enqueue, job_row, journal_details, pid_alive, wait_until

pytestmark = pytest.mark.e2e

RECIPES = Path(__file__).resolve().parent.parent / "examples" / "recipes"
RECIPE = RECIPES / "chromium_warm.py"
TOOL = "chromium-warm"
# The recipes' lease profiles, with a lease wide enough for their kill graces.
LEASE = {"SIDECAR_LEASE_SECONDS": "30", "SIDECAR_HEARTBEAT_SECONDS": "3"}
COOKIE = "jar=crumb-4711"
PASSWORD = "s3cret-pw-4711"


def _need_chromium() -> None:
    if shutil.which("chromium") is None:
        pytest.fail("chromium is not installed: apt-get install -y chromium "
                    "(.ci/run installs every real tool these tests run)")


def _recipe_env(dsn: str, **extra: str) -> dict[str, str]:
    """base_env plus examples/recipes/chromium_warm.env, as a user would load it."""
    env = base_env(dsn, **LEASE)
    for line in (RECIPES / "chromium_warm.env").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip()
    env.update(extra)
    return env


# --- a local web server ------------------------------------------------------------------------


class _Site(http.server.ThreadingHTTPServer):
    """Pages by path: /page/<name> (a paragraph naming it), /set-cookie (sends COOKIE),
    /echo-cookie (the request's Cookie header in the page), /big (about 20 KB), /hang
    (accepted, never answered until the server ends). ``seen``: (path, Cookie header)
    of every request."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.release = threading.Event()
        self.seen: list[tuple[str, str | None]] = []


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Site

    def do_GET(self):  # noqa: N802 - the name http.server calls
        self.server.seen.append((self.path, self.headers.get("Cookie")))
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # a page gone
            self._answer()

    def _answer(self):
        headers = {}
        if self.path.startswith("/page/"):
            body = f'<p id="name">page {html.escape(self.path[6:])}</p>'
        elif self.path == "/set-cookie":
            headers["Set-Cookie"] = f"{COOKIE}; Path=/"
            body = '<p id="set">cookie sent</p>'
        elif self.path == "/echo-cookie":
            body = f'<pre id="cookie">[{html.escape(self.headers.get("Cookie") or "")}]</pre>'
        elif self.path == "/big":
            body = "<p>" + "x" * 20_000 + "</p>"
        elif self.path == "/hang":
            self.server.release.wait(300)  # never answered while the test runs
            return
        else:
            self.send_error(404)
            return
        data = f"<html><body>{body}</body></html>".encode()
        self.send_response(200)
        for name, value in {"Content-Type": "text/html; charset=utf-8",
                            "Content-Length": str(len(data)), **headers}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def _site():
    site = _Site()
    thread = threading.Thread(target=site.serve_forever, daemon=True)
    thread.start()
    try:
        yield site, f"http://127.0.0.1:{site.server_address[1]}"
    finally:
        site.release.set()
        site.shutdown()
        site.server_close()
        thread.join(5)


# --- what a run leaves -------------------------------------------------------------------------


def _processes_of(process_ids: set[str]) -> list[int]:
    """Live processes of these warm processes' trees: their environment carries
    SIDECAR_PROCESS_ID (Chromium's helpers inherit it). Zombies count as gone."""
    found = []
    for proc in psutil.process_iter():
        try:
            if (proc.environ().get("SIDECAR_PROCESS_ID") in process_ids
                    and proc.status() != psutil.STATUS_ZOMBIE):
                found.append(proc.pid)
        except (psutil.Error, OSError):
            continue
    return found


def _warm_process(dsn: str, job: str) -> dict:
    """The ``warm`` detail of the job's tool_request_started: process_id, jobs_before,
    fresh."""
    return journal_details(dsn, job, "tool_request_started")[0]["warm"]


def _nothing_left(dsn: str, jobs: list[str], browser_pids: set[int]) -> None:
    """After the sidecar ended: no browser the recipe reported, and no process of a warm
    process that ran these jobs, is left."""
    process_ids = {_warm_process(dsn, job)["process_id"] for job in jobs}
    wait_until(lambda: not [p for p in browser_pids if pid_alive(p)], 10,
               what=f"browsers {browser_pids} gone")
    wait_until(lambda: not _processes_of(process_ids), 10,
               what=f"no process of warm processes {process_ids} left")


def _drain(dsn: str, sidecars, env: dict, payloads: list[dict], events: list | None = None
           ) -> list[dict]:
    """Enqueue one job per payload (one attempt each), drain them with one slot (in order)
    through the recipe, and return the jobs' rows, each with its ``id``; afterwards
    nothing of the browsers is left. ``events``: extended with the sidecar's log events."""
    jobs = [enqueue(dsn, TOOL, payload, "--max-attempts", "1", env=env)
            for payload in payloads]
    sc = sidecars(dsn, [str(RECIPE)], "--tool", TOOL, "--drain", env=env)
    assert sc.wait(180) == 0, sc.stderr_text()[-3000:]
    if events is not None:
        events.extend(sc.events())
    rows = [{**job_row(dsn, job), "id": job} for job in jobs]
    _nothing_left(dsn, jobs, {r["result"]["browser_pid"] for r in rows
                              if r["state"] == "succeeded"})
    return rows


def _refused_at_once(row: dict) -> None:
    """Failed at its first attempt by the recipe's answer: exit_code 65 and one line
    naming the 'url' in the job's error; the secret's content appears nowhere in the
    row."""
    assert row["state"] == "failed" and row["attempt"] == 1, row
    error = row["error"]
    assert (error["kind"], error.get("exit_code")) == ("exit_code", 65), error
    message = error["message"]  # the sidecar's words around the recipe's
    assert "exit code 65): bad payload: 'url'" in message and "\n" not in message, message
    assert "Traceback" not in json.dumps(row, default=str)
    assert PASSWORD not in json.dumps(row, default=str)


# --- through the sidecar -------------------------------------------------------------------


def test_one_browser_serves_three_jobs_each_with_its_own_dom(dsn, sidecars):
    """Three jobs, one warm process, one browser: the same browser pid answers each, with
    that job's page; the sidecar stopped (SIGTERM), the browser and every process of its
    warm process are gone."""
    _need_chromium()
    env = _recipe_env(dsn)
    with _site() as (site, base):
        jobs = [enqueue(dsn, TOOL, {"url": f"{base}/page/{name}"}, env=env)
                for name in ("one", "two", "three")]
        sc = sidecars(dsn, [str(RECIPE)], "--tool", TOOL, env=env)
        rows = wait_until(
            lambda: ([job_row(dsn, j) for j in jobs]
                     if all(job_row(dsn, j)["state"] in ("succeeded", "failed") for j in jobs)
                     else None), 120, interval=0.2, what="the three jobs")
        assert [r["state"] for r in rows] == ["succeeded"] * 3, [r["error"] for r in rows]
        for name, row in zip(("one", "two", "three"), rows, strict=True):
            assert row["result"]["url"] == f"{base}/page/{name}"
            assert f'<p id="name">page {name}</p>' in row["result"]["dom"]
        pids = {row["result"]["browser_pid"] for row in rows}
        assert len(pids) == 1 and pid_alive(next(iter(pids)))
        warm = [_warm_process(dsn, job) for job in jobs]
        assert len({w["process_id"] for w in warm}) == 1
        assert [w["fresh"] for w in warm] == [True, False, False]
        sc.stop()
    assert sc.proc.returncode == 0, sc.stderr_text()[-3000:]
    _nothing_left(dsn, jobs, pids)


def test_each_job_gets_a_fresh_browser_context_without_the_cookies_of_the_last(
        dsn, sidecars):
    """Job 1 loads a page that sets a cookie; job 2, in the same browser, loads a page of
    the same site that shows the request's Cookie header: no cookie was sent."""
    _need_chromium()
    env = _recipe_env(dsn)
    with _site() as (site, base):
        first, second = _drain(dsn, sidecars, env, [{"url": f"{base}/set-cookie"},
                                                    {"url": f"{base}/echo-cookie"}])
        seen = list(site.seen)
    assert (first["state"], second["state"]) == ("succeeded", "succeeded"), \
        (first["error"], second["error"])
    assert first["result"]["browser_pid"] == second["result"]["browser_pid"]
    assert '<p id="set">cookie sent</p>' in first["result"]["dom"]
    assert '<pre id="cookie">[]</pre>' in second["result"]["dom"], second["result"]["dom"]
    assert [cookie for path, cookie in seen if path == "/echo-cookie"] == [None]


def test_a_page_that_never_answers_is_killed_at_the_stage_deadline_and_the_next_job_gets_a_fresh_browser(  # noqa: E501
        dsn, sidecars):
    """The server accepts the page's request and never answers: the job fails
    stage_timeout, the browser that served the job before it (same warm process) is
    gone, and the next job succeeds in a fresh process with another browser."""
    _need_chromium()
    env = _recipe_env(dsn, SIDECAR_PROFILE_CHROMIUM_WARM_STAGE_TIMEOUT_SECONDS="5")
    events: list[dict] = []
    with _site() as (site, base):
        before, hung, after = _drain(dsn, sidecars, env, [
            {"url": f"{base}/page/before"}, {"url": f"{base}/hang"},
            {"url": f"{base}/page/after"}], events)
    assert before["state"] == "succeeded", before["error"]
    assert (hung["state"], hung["error"]["kind"]) == ("failed", "stage_timeout"), hung["error"]
    assert after["state"] == "succeeded", after["error"]
    assert _warm_process(dsn, hung["id"])["process_id"] == \
        _warm_process(dsn, before["id"])["process_id"]
    assert _warm_process(dsn, after["id"])["fresh"]
    assert journal_details(dsn, hung["id"], "child_killed")[0]["reason"] == "stage_timeout"
    assert [e["reason"] for e in events if e["event"] == "warm_process_stopped"] == \
        ["stage_timeout", "shutdown"]
    first_browser = before["result"]["browser_pid"]
    assert after["result"]["browser_pid"] != first_browser
    assert not pid_alive(first_browser)
    assert '<p id="name">page after</p>' in after["result"]["dom"]


def test_a_file_url_of_the_secret_is_refused_at_once_and_the_browser_keeps_serving(
        dsn, sidecars, tmp_path):
    """Issue 25's case against the warm recipe: file URLs of the mounted database Secret
    (directly, through a link under CHROMIUM_FILE_ROOT, by .. out of it, through
    view-source:, as a Chromium switch) are answered exit_code 65 at their first attempt,
    and the same browser serves the job after them; a page under the root is loaded."""
    _need_chromium()
    secret = tmp_path / "etc" / "sidecar" / "db" / "url"
    secret.parent.mkdir(parents=True)
    secret.write_text(f"postgresql://sidecar_worker:{PASSWORD}@postgres:5432/jobs\n")
    pages = tmp_path / "pages"
    pages.mkdir()
    (pages / "link.html").symlink_to(secret)
    (pages / "local.html").write_text('<html><body><p id="local">from the root</p></body></html>')
    refused = [secret.as_uri(), (pages / "link.html").as_uri(),
               pages.as_uri() + "/../etc/sidecar/db/url", "view-source:" + secret.as_uri(),
               "--renderer-cmd-prefix=cat", "/etc/sidecar/db/url"]
    default, rooted = _recipe_env(dsn), _recipe_env(dsn, CHROMIUM_FILE_ROOT=str(pages))
    for env, served in ((default, []), (rooted, [(pages / "local.html").as_uri()])):
        with _site() as (site, base):
            rows = _drain(dsn, sidecars, env, [{"url": f"{base}/page/first"},
                                               *({"url": url} for url in refused),
                                               *({"url": url} for url in served),
                                               {"url": f"{base}/page/last"}])
        for row in rows[1:len(refused) + 1]:
            _refused_at_once(row)
        allowed = [rows[0], *rows[len(refused) + 1:]]
        assert [r["state"] for r in allowed] == ["succeeded"] * len(allowed), \
            [r["error"] for r in allowed]
        assert len({r["result"]["browser_pid"] for r in allowed}) == 1
        assert len({_warm_process(dsn, row["id"])["process_id"] for row in rows}) == 1
    # Under the root, a file page is loaded by the same browser as the http pages.
    assert '<p id="local">from the root</p>' in rows[-2]["result"]["dom"]


def test_a_dom_over_max_result_bytes_fails_its_job_and_the_next_gets_a_fresh_browser(
        dsn, sidecars):
    """The DOM is bounded by the profile's MAX_RESULT_BYTES: a 20 KB page under a 4 KiB
    bound fails result_too_large, that browser is gone, the next job gets another."""
    _need_chromium()
    env = _recipe_env(dsn, SIDECAR_PROFILE_CHROMIUM_WARM_MAX_RESULT_BYTES="4096")
    with _site() as (site, base):
        before, big, after = _drain(dsn, sidecars, env, [
            {"url": f"{base}/page/before"}, {"url": f"{base}/big"},
            {"url": f"{base}/page/after"}])
    assert (before["state"], after["state"]) == ("succeeded", "succeeded"), \
        (before["error"], after["error"])
    assert (big["state"], big["error"]["kind"]) == ("failed", "result_too_large"), big["error"]
    assert after["result"]["browser_pid"] != before["result"]["browser_pid"]
    assert not pid_alive(before["result"]["browser_pid"])


# --- the recipe driven directly ---------------------------------------------------------------


class _Recipe:
    """chromium_warm.py started as a warm process (SIDECAR_PROCESS_ID set) with a private
    HOME, driven over its stdin and stdout as the sidecar does; its stderr to a file."""

    def __init__(self, tmp_path: Path):
        home = tmp_path / "home"
        home.mkdir()
        self.err_path = tmp_path / "recipe.err"
        with open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(RECIPE)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=err, env={"PATH": os.environ["PATH"], "HOME": str(home),
                                 "SIDECAR_PROCESS_ID": "test-warm-chromium"})
        self._pending = b""
        self._n = 0
        self.browsers: set[int] = set()

    def ask(self, payload: dict, timeout: float = 60, **extra) -> dict:
        """Write one request line; return the answer line (decoded). A recipe that gives
        no line within ``timeout`` seconds fails the test (a hang guard)."""
        self._n += 1
        job = f"job-{self._n}"
        request = {"job_id": job, "tool": TOOL, "attempt": 1, "fencing_token": 1,
                   "idempotency_key": f"tool-job:{job}", "payload": payload,
                   "checkpoint": None, **extra}
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._pending:
            ready, _, _ = select.select([fd], [], [], timeout)
            assert ready, f"no answer in {timeout} s; stderr: {self.stderr()[-2000:]}"
            data = os.read(fd, 1 << 20)
            assert data, f"the recipe ended: {self.proc.wait()}; {self.stderr()[-2000:]}"
            self._pending += data
        line, _, self._pending = self._pending.partition(b"\n")
        answer = json.loads(line)
        assert answer["job_id"] == job, answer
        if "result" in answer:
            self.browsers.add(answer["result"]["browser_pid"])
        return answer

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def close(self) -> int:
        """Close stdin (the cue to stop) and return the exit status; then no browser it
        reported is left. A recipe that does not end is killed (the pid started here)."""
        with contextlib.suppress(BrokenPipeError):
            self.proc.stdin.close()
        try:
            code = self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.proc.stdout.close()
        wait_until(lambda: not [p for p in self.browsers if pid_alive(p)], 10,
                   what=f"browsers {self.browsers} gone")
        return code


@pytest.fixture
def recipe(tmp_path):
    _need_chromium()
    started = _Recipe(tmp_path)
    yield started
    if started.proc.poll() is None:
        started.close()
    for pid in started.browsers:  # recorded from its answers: never left behind
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_in_session_mode_one_context_keeps_the_cookies_of_every_call(recipe):
    """Requests that carry "session": "s1" share one browser context: call 1 sets the
    cookie, call 2 (another URL) sends it. A request of no session or of another session
    is refused (exit_code 75) and sees nothing of it; stdin's end stops the recipe and
    its browser."""
    with _site() as (site, base):
        set_it = recipe.ask({"url": f"{base}/set-cookie"}, session="s1")
        echoed = recipe.ask({"url": f"{base}/echo-cookie"}, session="s1")
        other = recipe.ask({"url": f"{base}/echo-cookie"}, session="s2")
        none = recipe.ask({"url": f"{base}/echo-cookie"})
        again = recipe.ask({"url": f"{base}/echo-cookie"}, session="s1")
        seen = list(site.seen)
    assert '<p id="set">cookie sent</p>' in set_it["result"]["dom"], set_it
    assert f'<pre id="cookie">[{COOKIE}]</pre>' in echoed["result"]["dom"], echoed
    assert f'<pre id="cookie">[{COOKIE}]</pre>' in again["result"]["dom"], again
    for refused in (other, none):
        assert refused["error"]["exit_code"] == 75 and "'s1'" in refused["error"]["message"]
    assert [cookie for path, cookie in seen if path == "/echo-cookie"] == [COOKIE, COOKIE]
    assert len(recipe.browsers) == 1
    assert recipe.close() == 0, recipe.stderr()[-2000:]


def test_a_bad_payload_is_answered_65_and_the_recipe_keeps_serving(recipe):
    """Payloads of the wrong shape and URLs not allowed are answered with exit_code 65
    and a 'bad payload' message; the same browser serves the job after them."""
    with _site() as (site, base):
        answers = [recipe.ask(payload) for payload in (
            {"url": f"{base}/page/a"}, {}, {"url": 5}, {"url": "file:///etc/passwd"},
            {"url": "chrome://settings"}, {"url": f"{base}/page/b"})]
    assert [sorted(a) for a in answers] == \
        [["job_id", "result"]] + [["error", "job_id"]] * 4 + [["job_id", "result"]]
    for answer in answers[1:-1]:
        error = answer["error"]
        assert error["exit_code"] == 65 and error["message"].startswith("bad payload: "), error
    assert answers[0]["result"]["browser_pid"] == answers[-1]["result"]["browser_pid"]
    assert recipe.close() == 0, recipe.stderr()[-2000:]


def test_a_browser_that_dies_ends_the_recipe_non_zero(recipe):
    """The browser killed while the recipe waits for its next request: the recipe sees
    its DevTools pipe end and exits with the browser's status (128 + SIGKILL), at once,
    without a request."""
    with _site() as (site, base):
        answer = recipe.ask({"url": f"{base}/page/a"})
    browser = answer["result"]["browser_pid"]
    os.kill(browser, signal.SIGKILL)  # the pid the recipe reported
    assert recipe.proc.wait(30) == 128 + signal.SIGKILL, recipe.stderr()[-2000:]
    assert "chromium exited" in recipe.stderr()
    assert not pid_alive(browser)


# --- agent sessions through the sidecar (issue 43, points 3 and 4) ----------------------------


def _session_call(dsn: str, env: dict, session: str, url: str, attempts: str = "1") -> str:
    return enqueue(dsn, TOOL, {"url": url}, "--max-attempts", attempts, "--session", session,
                   env=env)


def _ended_row(dsn: str, job: str, timeout: float = 90) -> dict:
    wait_until(lambda: job_row(dsn, job)["state"] in ("succeeded", "failed", "cancelled"),
               timeout, what=f"job {job} to end")
    return {**job_row(dsn, job), "id": job}


def test_a_session_of_three_calls_keeps_its_cookie_in_one_browser(dsn, sidecars):
    """Real Chromium, a session of three calls: call 1 sets a cookie, call 2 loads another
    page, call 3 reads the cookie back from the server; one browser served all three.
    Meanwhile a second session, on the same sidecar, never sees that cookie and runs in
    another browser: two sessions never share a process."""
    _need_chromium()
    with _site() as (site, base):
        env = _recipe_env(dsn)
        sidecars(dsn, [str(RECIPE)], "--tool", TOOL, "--concurrency", "2", env=env)
        calls = [_ended_row(dsn, _session_call(dsn, env, "agent-1", f"{base}{path}"))
                 for path in ("/set-cookie", "/page/two", "/echo-cookie")]
        other = _ended_row(dsn, _session_call(dsn, env, "agent-2", f"{base}/echo-cookie"))
        assert [c["state"] for c in calls] == ["succeeded"] * 3, [c["error"] for c in calls]
        assert len({c["result"]["browser_pid"] for c in calls}) == 1
        assert f"[{COOKIE}]" in calls[2]["result"]["dom"]
        assert other["state"] == "succeeded", other["error"]
        assert "[]" in other["result"]["dom"] and COOKIE not in other["result"]["dom"]
        processes = {_warm_process(dsn, c["id"])["process_id"] for c in calls}
        assert len(processes) == 1
        assert _warm_process(dsn, other["id"])["process_id"] not in processes
        assert [cookie for path, cookie in site.seen if path == "/echo-cookie"] == \
            [COOKIE, None]


def test_a_hung_call_kills_the_sessions_browser_and_the_next_call_fails_session_lost(
        dsn, sidecars):
    """Call 1 of the session sets its cookie; call 2 loads a page that never answers and
    is killed at the stage deadline with its browser; call 3 fails session_lost at once
    (no page of it is ever requested) instead of running in a fresh browser without the
    cookie."""
    _need_chromium()
    with _site() as (site, base):
        env = _recipe_env(dsn, SIDECAR_PROFILE_CHROMIUM_WARM_STAGE_TIMEOUT_SECONDS="8")
        sidecars(dsn, [str(RECIPE)], "--tool", TOOL, env=env)
        first = _ended_row(dsn, _session_call(dsn, env, "agent-h", f"{base}/set-cookie"))
        assert first["state"] == "succeeded", first["error"]
        browser = first["result"]["browser_pid"]
        process_id = _warm_process(dsn, first["id"])["process_id"]
        hung = _ended_row(dsn, _session_call(dsn, env, "agent-h", f"{base}/hang"))
        assert hung["error"]["kind"] == "stage_timeout", hung["error"]
        wait_until(lambda: not pid_alive(browser) and not _processes_of({process_id}), 15,
                   what="the session's browser gone")
        requests = len(site.seen)
        third = _ended_row(dsn, _session_call(dsn, env, "agent-h", f"{base}/echo-cookie"))
        assert third["state"] == "failed" and third["error"]["kind"] == "session_lost", third
        assert len(site.seen) == requests, "the call after the loss reached the site"


def test_a_sidecar_killed_mid_call_leaves_no_browser_and_the_call_is_not_run_twice(
        dsn, sidecars):
    """Sidecar A runs a session's call on a page that never answers and is SIGKILLed. Its
    guardian kills the session's warm process and browser. Sidecar B takes the call over
    when A's lease ends: the session died with A, so the call fails session_lost and the
    page is requested once, never again in a fresh browser."""
    _need_chromium()
    with _site() as (site, base):
        env = _recipe_env(dsn, SIDECAR_LEASE_SECONDS="6", SIDECAR_HEARTBEAT_SECONDS="1",
                          SIDECAR_PROFILE_CHROMIUM_WARM_KILL_GRACE_SECONDS="1")
        a = sidecars(dsn, [str(RECIPE)], "--tool", TOOL, env=env)
        first = _ended_row(dsn, _session_call(dsn, env, "agent-k", f"{base}/page/one"))
        assert first["state"] == "succeeded", first["error"]
        process_id = _warm_process(dsn, first["id"])["process_id"]
        job = _session_call(dsn, env, "agent-k", f"{base}/hang", attempts="3")
        wait_until(lambda: ("/hang", None) in site.seen, 30, what="the page to be asked for")
        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait(10)
        wait_until(lambda: not pid_alive(first["result"]["browser_pid"])
                   and not _processes_of({process_id}), 30,
                   what="no browser or process of the session left")
        b = sidecars(dsn, [str(RECIPE)], "--tool", TOOL, env=env)
        row = _ended_row(dsn, job, 90)
        assert row["state"] == "failed" and row["error"]["kind"] == "session_lost", row
        assert [path for path, _ in site.seen].count("/hang") == 1
        assert b.wait_event("session_lost", 5)["session"] == "agent-k"
