"""Helpers the tests and the benchmark share (one copy of each): where the test tools are,
reading a sidecar's JSON event log, stopping a process we started, and finding what is
left of a job's process tree. Imported as ``kit`` by tests/conftest.py and bench/common.py.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import orjson
import psutil

# The small real executables tests and the benchmark run as tools.
TOOLS = Path(__file__).resolve().parent / "tools"


def read_events(log_path: Path, name: str | None = None) -> list[dict[str, Any]]:
    """The JSON events of a sidecar's log file (its stderr), oldest first; only those named
    ``name`` when given. Lines that are not JSON objects are skipped; a missing file has
    none."""
    try:
        data = log_path.read_bytes()
    except OSError:
        return []
    out = []
    for line in data.splitlines():
        if name is not None and name.encode() not in line:
            continue
        try:
            event = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(event, dict) and (name is None or event.get("event") == name):
            out.append(event)
    return out


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> int:
    """SIGTERM a process this code started (a sidecar drains on it), wait up to
    ``timeout`` seconds, then SIGKILL it; return its exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait(5)


def job_processes(job_id: str) -> list[int]:
    """Live processes carrying the job's id in their environment (SIDECAR_JOB_ID): its
    whole tree, re-parented and ``setsid`` escapees included. Zombies count as gone."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("SIDECAR_JOB_ID") == job_id and \
                    proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except (psutil.Error, OSError):
            continue
    return found


class BouncerError(RuntimeError):
    """PgBouncer is missing, exited or did not listen; the message says which."""


class PgBouncer:
    """A pgbouncer process of our own (Debian's package) in front of ``server_dsn``'s
    server: pool_mode = transaction, at most ``pool_size`` server connections per database.
    PgBouncer refuses to run as root: as root it runs as the owner of the server's socket
    directory, or as ``nobody``. Raises BouncerError."""

    def __init__(self, server_dsn: str, pool_size: int = 2):
        binary = shutil.which("pgbouncer") or next(
            (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.path.exists(p)),
            None)
        if binary is None:
            raise BouncerError("pgbouncer is not installed; install it with "
                               "'apt-get install -y pgbouncer' (.ci/run does)")
        parts = urlsplit(server_dsn)
        query_args = parse_qs(parts.query)
        host = parts.hostname or (query_args.get("host") or ["127.0.0.1"])[0]
        port = parts.port or int((query_args.get("port") or ["5432"])[0])
        self.user = unquote(parts.username or "postgres")
        password = unquote(parts.password or "")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.dir = Path(tempfile.mkdtemp(prefix="sidecar-pgbouncer-"))
        run_as = None
        if os.geteuid() == 0:
            # The embedded server's socket directory is readable by its owner only.
            owner = os.stat(host).st_uid if host.startswith("/") else 0
            run_as = pwd.getpwuid(owner).pw_name if owner != 0 else "nobody"
        server = f"host={host} port={port} user={self.user}"
        if password:
            server += f" password={password}"
        (self.dir / "userlist.txt").write_text(f'"{self.user}" ""\n')
        (self.dir / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"* = {server}\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = trust\n"
            f"auth_file = {self.dir / 'userlist.txt'}\n"
            "pool_mode = transaction\n"
            f"default_pool_size = {pool_size}\n"
            "min_pool_size = 0\n"
            "reserve_pool_size = 0\n"
            "max_client_conn = 2000\n"
            # SHOW POOLS / SHOW CLIENTS on the admin console, for post-mortems.
            f"admin_users = {self.user}\n"
            f"max_db_connections = {pool_size}\n"
            f"logfile = {self.dir / 'pgbouncer.log'}\n"
        )
        if run_as is not None:
            pw = pwd.getpwnam(run_as)
            for path in (self.dir, *self.dir.iterdir()):
                os.chown(path, pw.pw_uid, pw.pw_gid)
        argv = [binary, *(["-u", run_as] if run_as else []), str(self.dir / "pgbouncer.ini")]
        # Its stderr goes to a file, never a pipe: PgBouncer logs every connection there as
        # well, and once an unread pipe's 64 KiB fill up its single thread blocks in
        # write(2) and every client waits (seen as fleets of ~56 sidecars timing out).
        self._stderr_path = self.dir / "stderr.log"
        with open(self._stderr_path, "wb") as stderr:
            self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=stderr)
        deadline = time.monotonic() + 15
        while True:
            if self.proc.poll() is not None:
                raise BouncerError(f"pgbouncer exited with {self.proc.returncode}: "
                            f"{self._stderr_path.read_text(errors='replace')[-2000:]}"
                            f"{self.log()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise BouncerError(f"pgbouncer did not listen on {self.port}: "
                                       f"{self.log()[-2000:]}") from None
                time.sleep(0.05)

    def dsn_for(self, database_dsn: str) -> str:
        """The DSN of ``database_dsn``'s database through this pgbouncer."""
        name = urlsplit(database_dsn).path.lstrip("/")
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{name}"

    def log(self) -> str:
        try:
            return (self.dir / "pgbouncer.log").read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)


def python_for(uid: int) -> tuple[str, dict[str, str]]:
    """An interpreter user ``uid`` can run the sidecar with, and the environment it needs:
    this one when that user may execute it; else the system's ``python3.X`` of the same
    version, given this interpreter's site-packages and the project on PYTHONPATH (a
    pyenv or venv interpreter under a 0700 home, /root, is closed to other users)."""
    import sys
    import sysconfig

    probe = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    check = "import os, sys; sys.exit(not os.access(sys.executable, os.X_OK))"
    if subprocess.run([*probe, sys.executable, "-c", check], capture_output=True).returncode == 0:
        return sys.executable, {}
    system = shutil.which(f"python{sys.version_info[0]}.{sys.version_info[1]}",
                          path="/usr/local/bin:/usr/bin:/bin")
    if system is None:
        raise RuntimeError(f"no Python {sys.version_info[:2]} that uid {uid} can run")
    project = str(Path(__file__).resolve().parent.parent)
    return system, {"PYTHONPATH": os.pathsep.join([project, sysconfig.get_paths()["purelib"],
                                                   sysconfig.get_paths()["platlib"]])}
