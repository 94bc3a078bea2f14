#!/usr/bin/env python3
"""Recipe: one headless Chromium serving many jobs, as a warm sidecar tool (profile
PROCESS=warm, docs/child-process.md "Warm mode"; tool name chromium-warm, profile
chromium_warm.env).

Payload: {"url": "https://..."}; result: {"url": URL, "dom": SERIALIZED_DOM,
"browser_pid": PID}, where PID is the browser process that served the job (the same for
every job of one warm process; as this process sees it, so inside the sandbox's pid
namespace when there is one).

The process starts ONE browser in Chromium's pipe mode (--remote-debugging-pipe: the
browser reads DevTools protocol commands on its fd 3 and writes replies and events on its
fd 4, each a JSON object ended by a NUL byte) and keeps it for all its jobs. Each job gets
a FRESH browser context (an incognito-like profile: no cookies, storage or cache of an
earlier job), a page in it, the load of its URL, the page's DOM, and the context disposed.
Chromium's profile directory is $HOME/chromium, the warm process's private HOME.

Session mode: a request line that carries "session": "<key>" (beside "payload") is served
in ONE browser context kept for the whole process: made at its first such request, never
disposed, so cookies and storage set by one call are seen by the next. A warm process in
session mode belongs to that one session: a later request naming another session, or
none, is answered with an error (exit_code 75, EX_TEMPFAIL) and never sees the session's
context. Each call gets a new page in the context, closed after it.

The URL rules are those of chromium_dump_dom.py (recipe_input.py, which must sit in the
same directory): http and https; file only under CHROMIUM_FILE_ROOT; other schemes only
as CHROMIUM_EXTRA_SCHEMES names them. A payload of the wrong shape or a URL not allowed
is answered {"job_id", "error": {"message": "bad payload: ...", "exit_code": 65}} (not
retried) and the process keeps serving; an unusable CHROMIUM_FILE_ROOT is answered with
exit_code 78. A page whose load fails (navigation error, crashed page) is answered with
exit_code 1 (retried). A page that never settles is never answered: the sidecar kills the
whole process tree at the stage deadline and the next job gets a fresh process.

If the browser dies (its fd 4 ends, it exits), this process exits non-zero at once (the
browser's exit code, 128+N for signal N): the sidecar fails the job it was serving and
starts a fresh process for the next. A DevTools message over 64 MiB is skipped and fails
its job; the DOM a job may return is bounded by the profile's MAX_RESULT_BYTES. Logs (and
Chromium's own) go to stderr only; stdout carries answers only.

Started without SIDECAR_PROCESS_ID (the variable the sidecar gives a warm process), e.g.
under PROCESS=per-job, it serves exactly one job the per-job way: the payload on stdin,
the result on stdout, exit 65 with one line for bad input, as chromium_dump_dom.py.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import signal
import subprocess
import sys

# The allow rules and Chromium's flags, shared with chromium_dump_dom.py (this directory).
sys.path.insert(0, os.path.dirname(os.path.realpath(__file__)))
from recipe_input import (  # noqa: E402
    CHROMIUM,
    CHROMIUM_FLAGS,
    BadPayload,
    BadSetting,
    allowed_url,
    checked_fields,
)

EXAMPLE = '{"url": "https://example.org/"}'
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # a DevTools message, and a request line
READ_BYTES = 1024 * 1024
CLOSE_SECONDS = 3.0  # what a stop waits for the browser's own exit before killing it
# The events of a page a job waits for: its lifecycle (the load of its document) and its end.
PAGE_EVENTS = {"Page.lifecycleEvent", "Inspector.targetCrashed", "Inspector.detached"}
# The page's DOM, as --dump-dom prints it; "" when the document has no root element.
DOM_EXPRESSION = ("document.documentElement ? document.documentElement.outerHTML : ''")


def log(text: str) -> None:
    """One line on stderr (the job's log while a job runs)."""
    print(f"chromium-warm: {text}", file=sys.stderr, flush=True)


class BrowserGone(Exception):
    """The browser closed its end of the pipe or exited; ``code`` is the exit code this
    process should end with (non-zero)."""

    def __init__(self, text: str, code: int):
        super().__init__(text)
        self.code = code


class JobFailed(Exception):
    """This job cannot be served (its page failed to load, crashed, or sent a message
    too large); ``code`` is the exit code of its error answer. The browser is fine."""

    def __init__(self, text: str, code: int = 1):
        super().__init__(text)
        self.code = code


class Browser:
    """One headless Chromium in pipe mode, and the DevTools protocol over its pipes.

    ``call`` sends one command and returns its ``result`` object; events on the way are
    kept only when a page session waits for them (``PAGE_EVENTS``). Raises BrowserGone
    when the browser is gone, JobFailed for a command's error or an oversized message."""

    def __init__(self, profile_dir: str):
        """Start Chromium with its profile in ``profile_dir``. Raises OSError when it
        cannot be started."""
        _hold_low_fds()
        commands_read, self._commands = os.pipe()
        self._replies, replies_write = os.pipe()
        death_signal = _death_signal_setter()

        def in_child():  # in the forked child, before exec: its fds 3 and 4 as Chromium wants
            # Copies at 10 and above first, so neither end is overwritten by the other's dup2.
            high = [fcntl.fcntl(commands_read, fcntl.F_DUPFD, 10),
                    fcntl.fcntl(replies_write, fcntl.F_DUPFD, 10)]
            os.dup2(high[0], 3)  # inheritable; the copies are closed by close_fds
            os.dup2(high[1], 4)
            if death_signal is not None:
                death_signal()

        self.proc = subprocess.Popen(
            [CHROMIUM, *CHROMIUM_FLAGS, "--remote-debugging-pipe",
             f"--user-data-dir={profile_dir}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=sys.stderr.fileno(), pass_fds=(3, 4),
            preexec_fn=in_child)
        os.close(commands_read)
        os.close(replies_write)
        self.pid = self.proc.pid
        self._buffer = bytearray()
        self._skipping = False  # inside a message over MAX_MESSAGE_BYTES
        self._next_id = 0
        self._waiting: set[str] = set()  # page sessions whose events are kept
        self.events: list[tuple[str, str, dict]] = []  # (sessionId, method, params)

    @property
    def fd(self) -> int:
        """The read end of the browser's fd 4: readable when a message (or EOF) comes."""
        return self._replies

    def call(self, method: str, params: dict | None = None, session: str | None = None
             ) -> dict:
        """Send ``method`` with ``params`` (to the page ``session`` when given) and wait
        for its reply: its ``result`` (a dict). An ``error`` reply raises JobFailed."""
        self._next_id += 1
        number = self._next_id
        message = {"id": number, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        data = json.dumps(message).encode() + b"\0"
        try:
            while data:
                data = data[os.write(self._commands, data):]
        except OSError as exc:  # EPIPE: the browser's end is closed
            raise self._gone(f"the browser stopped reading commands ({exc})") from None
        while True:
            reply = self.next_message()
            if reply.get("id") == number:
                if "error" in reply:
                    error = reply["error"]
                    raise JobFailed(f"{method}: {error.get('message')} ({error.get('code')})")
                return reply.get("result") or {}

    def wait_event(self, session: str, wanted) -> tuple[str, dict]:
        """Wait for the first event of the page ``session`` (watched: ``watch``) for which
        ``wanted(method, params)`` is true, kept since ``watch``; return (method, params)."""
        while True:
            for n, (where, method, params) in enumerate(self.events):
                if where == session and wanted(method, params):
                    del self.events[: n + 1]
                    return method, params
            self.next_message()

    def watch(self, session: str | None) -> None:
        """Keep the ``PAGE_EVENTS`` of ``session`` from now on (None: of no session)."""
        self._waiting = {session} if session else set()
        self.events.clear()

    def next_message(self) -> dict:
        """The next message, read to its NUL (blocking); events are noted or dropped
        on the way by the caller. A message over MAX_MESSAGE_BYTES is read past and
        raises JobFailed; the end of the pipe raises BrowserGone."""
        while True:
            end = self._buffer.find(b"\0")
            if end >= 0:
                raw = bytes(self._buffer[:end])
                del self._buffer[: end + 1]
                if self._skipping:
                    self._skipping = False
                    raise JobFailed(f"a DevTools message over {MAX_MESSAGE_BYTES} bytes "
                                    "(a DOM that large?) was skipped")
                message = json.loads(raw)
                self._note(message)
                return message
            if len(self._buffer) > MAX_MESSAGE_BYTES:
                self._skipping = True
                self._buffer.clear()
            self._fill()

    def drain(self) -> None:
        """Read what the browser sent while no job ran (events of nobody), without
        blocking; raises BrowserGone when it ended."""
        while select.select([self._replies], [], [], 0)[0]:
            self._fill()
            while (end := self._buffer.find(b"\0")) >= 0:
                del self._buffer[: end + 1]
                self._skipping = False
            if len(self._buffer) > MAX_MESSAGE_BYTES:
                self._skipping = True
                self._buffer.clear()

    def _fill(self) -> None:
        data = os.read(self._replies, READ_BYTES)
        if not data:
            raise self._gone("the browser closed its DevTools pipe")
        self._buffer += data

    def _note(self, message: dict) -> None:
        method, session = message.get("method"), message.get("sessionId")
        params = message.get("params") or {}
        if method in PAGE_EVENTS and session in self._waiting:
            self.events.append((session, method, params))
        elif method == "Target.detachedFromTarget" and params.get("sessionId") in self._waiting:
            self.events.append((params["sessionId"], "Inspector.detached", params))

    def _gone(self, why: str) -> BrowserGone:
        try:
            code = self.proc.wait(CLOSE_SECONDS)
        except subprocess.TimeoutExpired:  # the pipe ended but it runs: not trusted
            self.proc.kill()
            code = self.proc.wait()
        return BrowserGone(f"{why}; chromium exited with {code}",
                           code if code > 0 else (128 - code if code < 0 else 1))

    def close(self) -> None:
        """Ask the browser to close (Browser.close), wait CLOSE_SECONDS for its exit,
        then kill it; never raises."""
        with contextlib.suppress(OSError):
            os.write(self._commands, json.dumps({"id": 0, "method": "Browser.close"}).encode()
                     + b"\0")
        try:
            self.proc.wait(CLOSE_SECONDS)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _hold_low_fds() -> None:
    """Have fds 0 to 4 open (on /dev/null where they were not): subprocess needs the fds
    it keeps for the child (3 and 4) to exist here, and a pipe made later must not take
    0, 1 or 2."""
    null = None
    for fd in range(5):
        try:
            os.fstat(fd)
        except OSError:
            if null is None:
                null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd, inheritable=False)


def _death_signal_setter():
    """A function for the forked child that has the kernel SIGKILL it when this process
    dies (prctl PR_SET_PDEATHSIG), or None where that is not available. Prepared here,
    before the fork: nothing is loaded in the child."""
    try:
        import ctypes
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (ImportError, OSError, AttributeError):
        return None
    parent = os.getpid()

    def set_it():
        prctl(1, signal.SIGKILL, 0, 0, 0)  # 1: PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the prctl
            os._exit(1)

    return set_it


def no_lone_surrogates(text: str) -> str:
    """``text`` with each unpaired UTF-16 surrogate (a JavaScript string may hold one)
    replaced by U+FFFD, so that it encodes as UTF-8."""
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


class Server:
    """The jobs of one process over one Browser: a fresh context per job, or the one
    context of a session (module docstring)."""

    def __init__(self, browser: Browser):
        self.browser = browser
        self.session_key: str | None = None
        self.session_context: str | None = None

    def serve(self, request: dict) -> dict:
        """The answer to ``request`` (a decoded request line) without its job_id:
        ``{"result": {...}}`` or ``{"error": {"message", "exit_code"}}``. Raises
        BrowserGone only."""
        try:
            payload = checked_fields(request.get("payload"), {"url": (str, True)})
            url = payload["url"]
            load = allowed_url(url)
            session = request.get("session")
            if session is not None and (not isinstance(session, str) or not session):
                raise BadPayload(f"'session' must be a non-empty str, not "
                                 f"{json.dumps(session)[:40]}")
            if self.session_key is not None and session != self.session_key:
                asked = f"session {session!r}" if session is not None else "no session"
                return _error(f"this browser serves session {self.session_key!r} only, not "
                              f"{asked}: a warm process in session mode belongs to one "
                              "session", 75)
            dom = self._load(load, session)
        except BadPayload as exc:
            return _error(f"bad payload: {exc}; expected e.g. {EXAMPLE}", 65)
        except BadSetting as exc:
            return _error(str(exc), 78)
        except JobFailed as exc:
            return _error(str(exc), exc.code)
        return {"result": {"url": url, "dom": dom, "browser_pid": self.browser.pid}}

    def _load(self, url: str, session: str | None) -> str:
        browser = self.browser
        if session is None:
            context = browser.call("Target.createBrowserContext")["browserContextId"]
        else:
            if self.session_context is None:
                made = browser.call("Target.createBrowserContext")["browserContextId"]
                self.session_context, self.session_key = made, session
            context = self.session_context
        try:
            target = browser.call("Target.createTarget",
                                  {"url": "about:blank", "browserContextId": context})
            target_id = target["targetId"]
            try:
                return self._page(target_id, url)
            finally:
                if session is not None:  # the context stays: only its page goes
                    browser.call("Target.closeTarget", {"targetId": target_id})
        finally:
            if session is None:
                browser.watch(None)
                browser.call("Target.disposeBrowserContext", {"browserContextId": context})

    def _page(self, target_id: str, url: str) -> str:
        browser = self.browser
        page = browser.call("Target.attachToTarget",
                            {"targetId": target_id, "flatten": True})["sessionId"]
        browser.watch(page)
        browser.call("Page.enable", session=page)
        browser.call("Page.setLifecycleEventsEnabled", {"enabled": True}, session=page)
        navigated = browser.call("Page.navigate", {"url": url}, session=page)
        if navigated.get("errorText"):
            raise JobFailed(f"chromium could not load the URL: {navigated['errorText']}")
        loader = navigated.get("loaderId")

        def loaded_or_ended(method: str, params: dict) -> bool:
            # The load of the document this navigation made (not of about:blank before it).
            return method != "Page.lifecycleEvent" or (
                params.get("name") == "load" and params.get("loaderId") == loader)

        ended, _ = browser.wait_event(page, loaded_or_ended)
        if ended != "Page.lifecycleEvent":
            raise JobFailed("the page crashed or was closed while it loaded")
        value = browser.call("Runtime.evaluate", {"expression": DOM_EXPRESSION,
                                                  "returnByValue": True}, session=page)
        if "exceptionDetails" in value:
            raise JobFailed("chromium could not serialize the DOM: "
                            f"{value['exceptionDetails'].get('text')}")
        dom = (value.get("result") or {}).get("value")
        if not isinstance(dom, str) or not dom.strip():
            raise JobFailed("chromium gave no DOM (crashed renderer?)")
        browser.watch(None)
        return no_lone_surrogates(dom)


def _error(message: str, code: int) -> dict:
    return {"error": {"message": message, "exit_code": code}}


def _write_line(answer: dict) -> None:
    """One answer line on stdout, sent now (UTF-8; an unpaired surrogate becomes '?')."""
    sys.stdout.buffer.write(json.dumps(answer, ensure_ascii=False).encode("utf-8", "replace")
                            + b"\n")
    sys.stdout.buffer.flush()


def _requests(browser: Browser):
    """Request lines from stdin (decoded), read while the browser is watched: yields
    each; returns at stdin's end; raises BrowserGone when the browser ends first."""
    pending = bytearray()
    while True:
        while (end := pending.find(b"\n")) >= 0:
            line = bytes(pending[:end])
            del pending[: end + 1]
            if line.strip():
                try:
                    yield json.loads(line)
                except ValueError:
                    yield None  # not JSON: no job to answer
        if len(pending) > MAX_MESSAGE_BYTES:
            log(f"a request line over {MAX_MESSAGE_BYTES} bytes")
            sys.exit(70)
        browser.drain()
        ready = select.select([0, browser.fd], [], [])[0]
        if browser.fd in ready:
            browser.drain()
        if 0 in ready:
            data = os.read(0, READ_BYTES)
            if not data:
                return
            pending += data


def warm() -> int:
    """Serve request lines until stdin ends (exit 0, the browser closed) or the browser
    dies (its exit code, non-zero)."""
    home = os.environ.get("HOME") or os.getcwd()
    try:
        browser = Browser(os.path.join(home, "chromium"))
    except OSError as exc:
        log(f"cannot start {CHROMIUM}: {exc}")
        return 69
    server = Server(browser)
    log(f"browser started, pid {browser.pid}")
    try:
        for request in _requests(browser):
            job = request.get("job_id") if isinstance(request, dict) else None
            if not isinstance(job, str):
                log("a request without a job_id: nothing can answer it")
                browser.close()
                return 70
            answer = server.serve(request)
            if "error" in answer:
                log(answer["error"]["message"])
            _write_line({"job_id": job, **answer})
    except BrowserGone as exc:
        log(str(exc))
        return exc.code
    browser.close()
    return 0


def per_job() -> int:
    """One job the per-job way: payload on stdin, result on stdout; exit 65 with one
    line on stderr for bad input, before Chromium starts."""
    try:
        payload = json.load(sys.stdin)
    except ValueError as exc:
        payload = None
        why = f"not JSON ({exc})"
    else:
        why = None
    try:
        if why is not None:
            raise BadPayload(why)
        url = checked_fields(payload, {"url": (str, True)})["url"]
        allowed_url(url)
    except BadPayload as exc:
        print(f"bad payload: {exc}; expected e.g. {EXAMPLE}", file=sys.stderr)
        return 65
    except BadSetting as exc:
        print(exc, file=sys.stderr)
        return 78
    home = os.environ.get("HOME") or os.environ.get("SIDECAR_JOB_DIR") or os.getcwd()
    try:
        browser = Browser(os.path.join(home, "chromium"))
    except OSError as exc:
        print(f"cannot start {CHROMIUM}: {exc}", file=sys.stderr)
        return 69
    try:
        answer = Server(browser).serve({"payload": payload})
    except BrowserGone as exc:
        print(exc, file=sys.stderr)
        return exc.code
    browser.close()
    if "error" in answer:
        print(answer["error"]["message"], file=sys.stderr)
        return answer["error"]["exit_code"]
    sys.stdout.buffer.write(json.dumps(answer["result"], ensure_ascii=False).encode() + b"\n")
    return 0


if __name__ == "__main__":
    sys.exit(warm() if os.environ.get("SIDECAR_PROCESS_ID") else per_job())
