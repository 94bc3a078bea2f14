#!/usr/bin/python3
"""Recipe: a warm LibreOffice converter (docs/child-process.md "Warm mode"; profile
libreoffice_warm.env, tool name convert-doc-warm). One soffice, started at this process's
first conversion, serves every job of the process through the UNO bridge, so a job does
not pay for an office start (libreoffice_convert.py starts one per job).

Debian's /usr/bin/python3 with python3-uno runs it (the `uno` module is not on PyPI).
Per job, one request line on stdin and one answer line on stdout:

- payload {"input": PATH, "output_dir": DIR, "format": "pdf"}, both paths under
  CONVERT_DOC_ROOT with symlinks resolved (recipe_paths.py, shared with the per-job
  recipe); format one of FILTERS' keys (Writer's export filters);
- result {"output": DIR/<input's stem>.<format>, "bytes": N, "soffice_pid": PID}, PID
  the soffice launcher this process started (the same for every job it serves);
- bad input: error {"message": "bad payload: ...", "exit_code": 65} (never retried);
  a document soffice cannot load or store: error exit_code 1; the process keeps serving.

soffice gone or the bridge broken: one line on stderr and exit 75, so the sidecar starts a
fresh process for the next job (a job that was running fails, retryable). A document that
keeps soffice busy past the stage deadline is the sidecar's to end: it kills this
process's whole tree, soffice included. stdin at its end: soffice is told to terminate,
killed if it has not within STOP_SECONDS, and the process exits 0. CONVERT_DOC_ROOT unset
or relative: exit 78 at start. stdout carries answers only: file descriptor 1 is pointed
at stderr once the answer channel is kept aside, and soffice inherits that.
"""
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.realpath(__file__)))  # recipe_paths, beside us
from recipe_paths import (  # noqa: E402
    BadPayload,
    NotConfigured,
    check_fields,
    root,
    under_root,
)

EXAMPLE = '{"input": "/data/a.docx", "output_dir": "/data/out", "format": "pdf"}'
# Output format (the file extension) -> the Writer export filter storeToURL uses.
FILTERS = {"pdf": "writer_pdf_Export", "odt": "writer8", "docx": "MS Word 2007 XML",
           "doc": "MS Word 97", "rtf": "Rich Text Format", "txt": "Text",
           "html": "HTML (StarWriter)", "fodt": "OpenDocument Text Flat XML", "epub": "EPUB"}
START_SECONDS = 60.0   # how long soffice may take to answer on its pipe (s)
STOP_SECONDS = 5.0     # how long soffice may take to exit once told to (s); under KILL_GRACE
BROKEN = 75            # exit status when soffice or the bridge is gone (EX_TEMPFAIL)

try:
    import uno
    from com.sun.star.beans import PropertyValue
    from com.sun.star.lang import DisposedException
    from com.sun.star.uno import Exception as UnoException
except ImportError as exc:
    print(f"the UNO bridge is missing ({exc}): apt-get install python3-uno, and run this "
          "recipe with Debian's /usr/bin/python3", file=sys.stderr)
    sys.exit(69)  # EX_UNAVAILABLE


class Broken(Exception):
    """soffice exited or its bridge no longer answers: this process serves no further job.
    ``str()`` is one line saying what happened."""


class Failed(Exception):
    """soffice could not convert this document but still answers: the job fails (exit
    code 1, retryable) and the process keeps serving. ``str()`` is one line."""


def _prop(name: str, value) -> PropertyValue:
    prop = PropertyValue()
    prop.Name, prop.Value = name, value
    return prop


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:500] or type(exc).__name__


class Office:
    """One soffice child of this process and the UNO bridge to it.

    ``start()`` launches it (its own session, so ``stop`` can kill its launcher and
    soffice.bin together) with a user profile under $HOME and a pipe name of its own, and
    connects within START_SECONDS; ``convert`` runs one job; ``stop`` ends it. A thread
    waits for soffice: if it exits while this process has not asked it to, the process
    exits BROKEN at once (while idle too, so the sidecar replaces it before its next
    job). ``lock`` is held while an answer is written, so that exit never cuts a line."""

    def __init__(self, lock: threading.Lock):
        self.lock = lock
        self.proc: subprocess.Popen | None = None
        self.pid = 0
        self.desktop = None
        self.stopping = False
        self.gone = threading.Event()

    def start(self) -> None:
        """Launch soffice and connect to it. Raises Broken when soffice is missing, exits,
        or does not answer within START_SECONDS."""
        home = os.environ.get("HOME", "")
        if not os.path.isabs(home):
            raise Broken(f"HOME must be an absolute directory for soffice's profile, "
                         f"not {home!r}")
        pipe = f"sidecar-lo-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        argv = ["soffice", "--headless", "--invisible", "--nologo", "--norestore",
                "--nodefault", "--nolockcheck",
                f"-env:UserInstallation={uno.systemPathToFileUrl(home)}/lo-profile",
                f"--accept=pipe,name={pipe};urp;"]
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=2,
                                         start_new_session=True)
        except OSError as exc:
            raise Broken(f"cannot start soffice: {exc}") from exc
        self.pid = self.proc.pid
        threading.Thread(target=self._watch, name="soffice-watch", daemon=True).start()
        local = uno.getComponentContext()
        resolver = local.ServiceManager.createInstanceWithContext(
            "com.sun.star.bridge.UnoUrlResolver", local)
        deadline = time.monotonic() + START_SECONDS
        while True:
            try:
                context = resolver.resolve(f"uno:pipe,name={pipe};urp;"
                                           "StarOffice.ComponentContext")
                break
            except UnoException as exc:  # NoConnectException until soffice listens
                if self.gone.is_set():
                    raise Broken(f"soffice (pid {self.pid}) exited with "
                                 f"{self.proc.returncode} before it answered") from exc
                if time.monotonic() > deadline:
                    raise Broken(f"soffice (pid {self.pid}) did not answer on its pipe "
                                 f"within {START_SECONDS:g} s") from exc
                time.sleep(0.1)
        self.desktop = context.ServiceManager.createInstanceWithContext(
            "com.sun.star.frame.Desktop", context)
        print(f"soffice (pid {self.pid}) answers on pipe {pipe}", file=sys.stderr, flush=True)

    def _watch(self) -> None:
        code = self.proc.wait()
        self.gone.set()
        if not self.stopping:
            with self.lock:  # never in the middle of an answer line
                print(f"soffice (pid {self.pid}) exited with {code}: this process serves no "
                      "further job", file=sys.stderr, flush=True)
                os._exit(BROKEN)

    def answers(self) -> bool:
        """True while soffice runs and a call over the bridge returns."""
        if self.gone.is_set():
            return False
        try:
            self.desktop.getFrames().getCount()
        except UnoException:
            return False
        return True

    def convert(self, source: str, output: str, fmt: str) -> int:
        """Load ``source`` (hidden, read-only, no macro run, no link updated), store it at
        ``output`` with FILTERS[fmt], close it; returns the output's size (bytes). Raises
        Failed (soffice still answers: this document could not be converted) or Broken."""
        load = (_prop("Hidden", True), _prop("ReadOnly", True),
                _prop("MacroExecutionMode", 0),  # document.MacroExecMode.NEVER_EXECUTE
                _prop("UpdateDocMode", 0))  # document.UpdateDocMode.NO_UPDATE
        doc = None
        try:
            doc = self.desktop.loadComponentFromURL(uno.systemPathToFileUrl(source),
                                                    "_blank", 0, load)
            if doc is None:
                raise Failed(f"soffice could not load {source}")
            doc.storeToURL(uno.systemPathToFileUrl(output),
                           (_prop("FilterName", FILTERS[fmt]),))
        except DisposedException as exc:
            raise Broken(f"the bridge to soffice (pid {self.pid}) is gone: "
                         f"{_one_line(exc)}") from exc
        except UnoException as exc:
            if not self.answers():
                raise Broken(f"soffice (pid {self.pid}) no longer answers after "
                             f"{type(exc).__name__}: {_one_line(exc)}") from exc
            raise Failed(f"{type(exc).__name__}: {_one_line(exc)}") from exc
        finally:
            if doc is not None:
                self._close(doc)
        try:
            size = os.path.getsize(output)
        except OSError:
            size = 0
        if size == 0:
            raise Failed(f"soffice wrote no {output}")
        return size

    def _close(self, doc) -> None:
        try:
            doc.close(True)
        except DisposedException:
            pass  # the next call finds the bridge gone
        except UnoException:
            with contextlib.suppress(UnoException):
                doc.dispose()

    def stop(self, ask: bool = True) -> None:
        """End soffice: unless ``ask`` is false (the bridge is already broken), ask it to
        terminate, in a thread of its own so a call that never returns cannot hold this
        up; once STOP_SECONDS have passed without its exit, kill its session (launcher and
        soffice.bin) by the pid recorded at start. Never raises."""
        if self.proc is None:
            return
        self.stopping = True
        if ask and self.desktop is not None and not self.gone.is_set():
            threading.Thread(target=self._terminate, name="soffice-terminate",
                             daemon=True).start()
            if self.gone.wait(STOP_SECONDS):
                return
            print(f"soffice (pid {self.pid}) did not exit within {STOP_SECONDS:g} s: killed",
                  file=sys.stderr, flush=True)
        with contextlib.suppress(OSError):
            os.killpg(self.pid, signal.SIGKILL)
        self.gone.wait(STOP_SECONDS)

    def _terminate(self) -> None:
        with contextlib.suppress(UnoException):  # the bridge closes as soffice exits
            self.desktop.terminate()


def job_of(payload) -> tuple[str, str, str]:
    """The payload checked: (input, output path, format), real paths under
    CONVERT_DOC_ROOT. Raises BadPayload."""
    check_fields(payload, {"input": (str, True), "output_dir": (str, True),
                           "format": (str, False)})
    fmt = payload.get("format", "pdf")
    if fmt not in FILTERS:
        raise BadPayload(f"'format' must be one of {', '.join(FILTERS)}, "
                         f"not {json.dumps(fmt)[:40]}")
    source = under_root(payload["input"], "input", "CONVERT_DOC_ROOT")
    output_dir = under_root(payload["output_dir"], "output_dir", "CONVERT_DOC_ROOT")
    stem = os.path.splitext(os.path.basename(source))[0]
    return source, os.path.join(output_dir, f"{stem}.{fmt}"), fmt


def main() -> int:
    """Serve requests until stdin ends; returns the exit status (0 after a clean stop)."""
    try:
        root("CONVERT_DOC_ROOT")
    except NotConfigured as exc:
        print(exc, file=sys.stderr)
        return 78
    # The answer channel is a private copy of stdout; descriptor 1 becomes stderr, so
    # nothing else (the UNO runtime, soffice) can write a line the sidecar would read.
    answers = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    lock = threading.Lock()
    office = Office(lock)

    def answer(job_id, **fields) -> None:
        with lock:
            answers.write(json.dumps({"job_id": job_id, **fields}) + "\n")
            answers.flush()

    broken = False
    try:
        for line in sys.stdin.buffer:  # one request per line, UTF-8 JSON
            try:
                request = json.loads(line)
                job_id = request["job_id"]
            except (ValueError, TypeError, KeyError) as exc:
                print(f"not a request line ({_one_line(exc)}): the sidecar and this tool "
                      "are out of step", file=sys.stderr)
                return 70  # EX_SOFTWARE
            try:
                source, output, fmt = job_of(request.get("payload"))
            except BadPayload as exc:
                answer(job_id, error={"message": f"bad payload: {exc}; expected e.g. "
                                                 f"{EXAMPLE}", "exit_code": 65})
                continue
            try:
                if office.proc is None:
                    office.start()
                size = office.convert(source, output, fmt)
            except Failed as exc:
                print(f"job {job_id}: {exc}", file=sys.stderr, flush=True)
                answer(job_id, error={"message": str(exc), "exit_code": 1})
                continue
            except Broken as exc:
                print(f"job {job_id}: {exc}", file=sys.stderr, flush=True)
                broken = True
                return BROKEN
            answer(job_id, result={"output": output, "bytes": size,
                                   "soffice_pid": office.pid})
    finally:
        office.stop(ask=not broken)
    return 0


if __name__ == "__main__":
    sys.exit(main())
