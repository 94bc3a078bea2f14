"""The relocatable bundle (PyInstaller --onedir, packaging/build_bundle.py): built once
here, copied with `sidecar install DEST` as an init container would, then run from DEST
with no Python on PATH against the test database. Also: the tool gets the environment it
would get without the bundle (no LD_LIBRARY_PATH into the bundle), and the frozen guardian
(`sidecar _guardian`) still kills the tool's descendants after a SIGKILL of the sidecar."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import orjson
import psutil
import pytest

from kit import base_env, cli, enqueue, pid_alive, query, read_pids, wait_until

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(600),
]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    """dist/sidecar of a fresh build: the directory holding the ``sidecar`` executable."""
    try:
        import PyInstaller  # noqa: F401
    except ImportError:
        pytest.fail("PyInstaller is not installed: pip install -e '.[test]' (it is in the "
                    "test extra); the bundle test needs it")
    out = tmp_path_factory.mktemp("bundle")
    done = subprocess.run(
        [sys.executable, str(ROOT / "packaging" / "build_bundle.py"), "--dist",
         str(out / "dist"), "--work", str(out / "work")],
        capture_output=True, timeout=540)
    assert done.returncode == 0, (done.stdout + done.stderr).decode(errors="replace")[-4000:]
    executable = out / "dist" / "sidecar" / "sidecar"
    assert os.access(executable, os.X_OK)
    shutil.rmtree(out / "work", ignore_errors=True)
    return executable.parent


@pytest.fixture
def no_python_path(tmp_path) -> str:
    """A PATH with sh, cat and sleep, and no python."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("sh", "cat", "sleep"):
        (bin_dir / name).symlink_to(shutil.which(name))
    for name in ("python", "python3", f"python3.{sys.version_info.minor}"):
        assert shutil.which(name, path=str(bin_dir)) is None
    return str(bin_dir)


def bundle_env(dsn: str, path: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in base_env(dsn, **extra).items()
           if not k.startswith(("PYTHON", "VIRTUAL_ENV", "LD_"))}
    env["PATH"] = path
    return env


def write_tool(directory: str, name: str, body: str) -> None:
    tool = Path(directory) / name
    tool.write_text("#!/bin/sh\n" + body)
    tool.chmod(0o755)


def install(bundle: Path, dest: Path, env: dict) -> Path:
    done = subprocess.run([str(bundle / "sidecar"), "install", str(dest)], env=env,
                          capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    out = orjson.loads(done.stdout)
    assert out["installed"] == str(dest / "sidecar")
    return dest / "sidecar"


def test_installed_bundle_runs_jobs_without_python_on_path(bundle, dsn, tmp_path,
                                                           no_python_path):
    env = bundle_env(dsn, no_python_path)
    # The init container: copy the bundle into the shared volume (which already exists).
    shared = tmp_path / "shared"
    shared.mkdir()
    sidecar = install(bundle, shared, env)
    assert (shared / "_internal").is_dir()

    # The tool echoes its payload and reports what it inherited from the sidecar.
    write_tool(no_python_path, "echo-env",
               'cat > "$SIDECAR_JOB_ID.in"\n'
               'printf \'{"payload": %s, "ld": "%s", "pyi": "%s"}\' '
               '"$(cat "$SIDECAR_JOB_ID.in")" "${LD_LIBRARY_PATH:-}" '
               '"${_PYI_ARCHIVE_FILE:-}"\n')
    ids = [enqueue(dsn, "echo-env", {"n": n}) for n in range(3)]
    done = subprocess.run([str(sidecar), "run", "--drain", "--", "echo-env"], env=env,
                          capture_output=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-3000:]
    rows = query(dsn, "SELECT id::text AS id, state, result FROM tool_jobs")
    assert {r["id"] for r in rows} == set(ids)
    for row in rows:
        assert row["state"] == "succeeded", row
        assert row["result"]["payload"]["n"] in range(3)
        assert row["result"]["ld"] == "" and row["result"]["pyi"] == "", row["result"]

    # The other commands work from the bundle too (named SQL and migrations are inside).
    shown = subprocess.run([str(sidecar), "events", ids[0]], env=env, capture_output=True,
                           timeout=60)
    assert shown.returncode == 0, shown.stderr.decode(errors="replace")
    assert "job_succeeded" in shown.stdout.decode()


def test_frozen_guardian_kills_descendants_after_sigkill(bundle, dsn, tmp_path,
                                                         no_python_path):
    env = bundle_env(dsn, no_python_path)
    pids = tmp_path / "pids"
    write_tool(no_python_path, "hang-tree",
               f'sleep 300 &\necho $! >> {pids}\necho $$ >> {pids}\nexec sleep 300\n')
    job_id = enqueue(dsn, "hang-tree", {})
    proc = subprocess.Popen([str(bundle / "sidecar"), "run", "--", "hang-tree"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        grandchild, child = read_pids(pids, 2)

        def guardian():
            for p in psutil.process_iter(["cmdline"]):
                cmd = p.info["cmdline"] or []
                if cmd[1:2] == ["_guardian"] and cmd[0] == str(bundle / "sidecar"):
                    return p
            return None

        keeper = wait_until(guardian, 10, what="the frozen guardian process")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        wait_until(lambda: not pid_alive(grandchild) and not pid_alive(child), 10,
                   what="the tool's tree to die after the sidecar's SIGKILL")
        wait_until(lambda: not pid_alive(keeper.pid), 10, what="the guardian to exit")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for pid in _leftovers(pids):
            os.kill(pid, signal.SIGKILL)
    [row] = query(dsn, "SELECT state FROM tool_jobs WHERE id = $1::uuid", job_id)
    assert row["state"] == "running"  # until its lease expires; nothing was written


def _leftovers(pids: Path) -> list[int]:
    try:
        return [int(p) for p in pids.read_text().split() if pid_alive(int(p))]
    except (OSError, ValueError):
        return []


def test_install_refuses_outside_a_bundle(dsn, tmp_path):
    done = cli(dsn, "install", str(tmp_path / "dest"))
    assert done.returncode == 2
    err = done.stderr.decode().strip()
    assert len(err.splitlines()) == 1 and "bundle" in err, err
    assert not (tmp_path / "dest").exists()


def test_install_refuses_a_destination_inside_the_bundle(bundle, tmp_path):
    done = subprocess.run([str(bundle / "sidecar"), "install", str(bundle / "again")],
                          capture_output=True, timeout=60, env={"PATH": "/nonexistent"})
    assert done.returncode == 2, done.stderr
    assert "inside" in done.stderr.decode()
    assert not (bundle / "again").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory of another user needs root")
def test_install_into_an_existing_directory_of_another_user_succeeds(bundle, tmp_path):
    """An init container (uid 65534) installing into an emptyDir that belongs to root
    (mode 0777): every file is copied, the directory's own mode and times cannot be, and
    that must not fail the install (it did, with EPERM, so the pod never started)."""
    public = Path(tempfile.mkdtemp(prefix="sidecar-bundle-"))
    try:
        public.chmod(0o755)
        copy = public / "bundle"
        shutil.copytree(bundle, copy, symlinks=True)
        subprocess.run(["chmod", "-R", "a+rX", str(copy)], check=True)
        dest = public / "emptydir"
        dest.mkdir()
        dest.chmod(0o777)  # root's, writable by all, as Kubernetes makes an emptyDir
        done = subprocess.run([str(copy / "sidecar"), "install", str(dest)],
                              capture_output=True, timeout=60, user=65534, group=65534,
                              env={"PATH": "/usr/bin:/bin"})
        assert done.returncode == 0, done.stderr.decode(errors="replace")
        assert orjson.loads(done.stdout)["installed"] == str(dest / "sidecar")
        assert dest.stat().st_uid == 0 and (dest / "sidecar").stat().st_uid == 65534
        assert os.access(dest / "sidecar", os.X_OK)
        version = subprocess.run([str(dest / "sidecar"), "--version"], capture_output=True,
                                 timeout=60, env={"PATH": "/nonexistent"})
        assert version.returncode == 0 and b"sidecar" in version.stdout
    finally:
        shutil.rmtree(public, ignore_errors=True)


def test_the_bundle_carries_bwrap_with_its_own_libraries(bundle):
    """The sandbox needs bwrap, which a tool image (the browser overlay's) may not have:
    the bundle carries it, and every library it needs beyond glibc resolves inside the
    bundle (its own run path), so it starts with an empty environment. In an image
    without bubblewrap the bundled sidecar uses it (packaging/image_check.py)."""
    bwrap = bundle / "bwrap" / "bwrap"
    done = subprocess.run([str(bwrap), "--version"], env={}, capture_output=True)
    assert done.returncode == 0 and done.stdout.startswith(b"bubblewrap"), done
    resolved = subprocess.run(["ldd", str(bwrap)], capture_output=True, text=True,
                              check=True).stdout
    for line in resolved.splitlines():
        name, _, path = line.strip().partition(" => ")
        if path and not name.startswith(("libc.so", "ld-linux")):
            assert path.startswith(str(bundle / "bwrap")), line
