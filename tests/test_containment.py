"""Containment (issue 25, points 1 and 2): a hostile tool (tests/tools/containment_probe.py)
tries, from inside its attempt, to read the sidecar's `*_FILE` secret, the sidecar's and
the guardian's /proc entries, to list and signal other processes, and to read and write
another running attempt's work directory and guard token.

With the bubblewrap sandbox (`SANDBOX=auto`, the default, on this host) it reaches
nothing, as root and as a non-root uid. With `SANDBOX=off` it reaches exactly what
docs/isolation.md lists (the table between the `containment-off` markers).

The secret and the work root live under /var/tmp, not /tmp: the sandbox gives every
attempt its own /tmp, which would hide them for another reason than the one tested.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import psutil
import pytest
from containment_suite import probe_beside_held, reached

from kit import (
    TOOLS,
    base_env,
    python_for,
    sandbox_extra_paths,
    short_root,
    wait_until,
)

NON_ROOT_UID = 10001  # the manifests' uid
DOCS = Path(__file__).resolve().parent.parent / "docs" / "isolation.md"

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0,
                                    reason="makes a non-root user's sidecar and files"),
]


@pytest.fixture
def var_tmp(public_dir):
    """Directories under /var/tmp (a sandboxed tool's /tmp is its own) owned by ``uid``,
    mode 0700 or ``mode``."""
    return lambda uid, mode=0o700: public_dir(mode, uid, "/var/tmp")


def _start(dsn, proxy, sidecars, var_tmp, uid: int, sandbox: str | None):
    """A sidecar of tool ``probe`` (concurrency 2) running as ``uid`` (0: root), its DSN
    in a secret file (SIDECAR_DATABASE_URL_FILE) under /var/tmp, its work root under
    /var/tmp too; ``sandbox`` None leaves SANDBOX to its default (auto). Returns
    (sidecar, secret path, work root's real path)."""
    from netproxy import through

    side_dsn = dsn if uid == 0 else through(dsn, proxy.port)
    secrets = var_tmp(uid)
    secret = secrets / "url"
    secret.write_text(side_dsn + "\n")
    os.chown(secret, uid, uid)
    secret.chmod(0o600)
    work = var_tmp(uid, 0o755) / "w"
    work.mkdir()
    os.chown(work, uid, uid)
    env = base_env(side_dsn, SIDECAR_WORK_DIR=str(short_root(work)),
                   SIDECAR_DATABASE_URL_FILE=str(secret), SIDECAR_KILL_GRACE_SECONDS="0.5",
                   SIDECAR_STAGE_TIMEOUT_SECONDS="60")
    del env["SIDECAR_DATABASE_URL"]
    env.pop("SIDECAR_SANDBOX", None)
    if sandbox is not None:
        env["SIDECAR_SANDBOX"] = sandbox
    if sandbox_extra_paths():  # a checkout under /tmp: the tool and its Python stay visible
        env["SIDECAR_EXTRA_PATHS"] = sandbox_extra_paths()
    python, launcher = sys.executable, None
    if uid != 0:
        python, python_env = python_for(uid)
        env.update(python_env, HOME=str(work.parent))
        launcher = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    tool = [python if uid != 0 else sys.executable, str(TOOLS / "containment_probe.py")]
    sc = sidecars(dsn, tool, "--tool", "probe", "--concurrency", "2", env=env,
                  launcher=launcher, python=python)
    sc.wait_event("worker_started", 30)
    return sc, secret, work.resolve()


def _probe(dsn, sc, secret: Path, work: Path) -> tuple[dict, Path]:
    """The shared driver (tests/containment_suite.py) against this host's sidecar."""
    def pids():
        sidecar = psutil.Process(sc.pid)
        guardian = next(p.pid for p in sidecar.children()
                        if "sidecar.worker.guardian" in " ".join(p.cmdline()))
        return sc.pid, guardian

    return probe_beside_held(dsn, work, [str(secret)], pids)


@pytest.mark.parametrize("uid", [0, NON_ROOT_UID], ids=["root", "non-root"])
def test_sandboxed_tool_reaches_nothing_outside_its_attempt(
        dsn, proxy, sidecars, var_tmp, uid):
    """SANDBOX=auto (the default) on a host with bubblewrap and unprivileged user
    namespaces: the hostile tool reads no secret, sees neither the sidecar nor the
    guardian nor the other attempt, cannot list the work root, and has no capability to
    mount; the other attempt's directory stays untouched, and the link the probe left in
    its own directory is not followed by the sidecar's removal."""
    sc, secret, work = _start(dsn, proxy, sidecars, var_tmp, uid, None)
    report, other = _probe(dsn, sc, secret, work)
    assert reached(report) == set(), report
    assert report[f"secret:{secret}"] != "reached"
    assert not sc.events("sandbox_unavailable")
    assert not (other / "planted.txt").exists()
    assert secret.read_text().strip()  # the link to it was removed, not followed
    wait_until(lambda: not any(os.path.lexists(entry / "secret-link")
                               for entry in work.iterdir() if entry.is_dir()),
               10, what="the probe's work directory to be removed")


def _documented_off() -> dict[str, set[str]]:
    """docs/isolation.md's table of what a tool reaches with SANDBOX=off: column ->
    the checks marked "reached" (first backticked word of each row)."""
    text = DOCS.read_text()
    table = text.split("<!-- containment-off: begin -->")[1].split(
        "<!-- containment-off: end -->")[0]
    rows = [line for line in table.strip().splitlines() if line.startswith("| `")]
    out: dict[str, set[str]] = {"root": set(), "non-root": set()}
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        check = re.match(r"`([^`]+)`", cells[0]).group(1)
        for column, cell in zip(("root", "non-root"), cells[1:3], strict=True):
            if cell.startswith("reached"):
                out[column].add(check)
    return out


@pytest.mark.parametrize("uid", [0, NON_ROOT_UID], ids=["root", "non-root"])
def test_unsandboxed_tool_reaches_what_the_docs_list(dsn, proxy, sidecars, var_tmp, uid):
    """SANDBOX=off: the same probe reaches exactly what docs/isolation.md lists for a
    sidecar (and its tool) running as root, and as one non-root uid."""
    sc, secret, work = _start(dsn, proxy, sidecars, var_tmp, uid, "off")
    report, _other = _probe(dsn, sc, secret, work)
    column = "root" if uid == 0 else "non-root"
    assert reached(report) == _documented_off()[column], report
    assert secret.read_text().strip()
