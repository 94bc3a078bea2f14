"""Build the Dockerfile with podman and run what it built, against a real PostgreSQL
(issue 16, point 6; .ci/run calls it as root):

1. a local base image made from Debian's packages (debootstrap: Debian 12 with python3,
   its venv module and shared library, and this machine's CA certificates), since no
   container registry is reachable here; a second one without Python, for the bundle;
2. ``podman build`` of the Dockerfile on that base;
3. ``sidecar config`` in the image (exit 0, the DSN masked);
4. one real job: queued from the host, run by ``sidecar run --drain`` in the image with
   the database URL from a mounted file (as k8s/ mounts its Secret), its result read back;
5. the init-container pattern of k8s/overlays/browser: the image's bundle installed into
   a volume by ``/opt/sidecar/sidecar install`` as the image's non-root user, then run as
   PID 1 of the Python-less image with a read-only root, for one more job, whose tool
   reports its parent's pid (1); then once more with ``SANDBOX=required`` and an
   unmasked /proc, the tool sandboxed by the bwrap the bundle carries (that image has no
   bubblewrap) and the Secret's directory hidden from it;
6. the OCR tool image of k8s/overlays/ocr built FROM it, with a read-only root, reading
   the text of a real PNG with tesseract;
7. the hostile-tool suite (issue 25; tests/containment_suite.py, the driver
   tests/test_containment.py uses on the host) in the image, with a read-only root and
   the runtime's default seccomp profile, as the image's user 10001 and as root: with the
   /proc a pod's ``procMount: Unmasked`` gives, ``SANDBOX=required`` starts and the
   probe reaches nothing outside its attempt; with the runtime's masked /proc, ``auto``
   warns ``sandbox_unavailable`` naming the fix and still runs the job, and
   ``required`` refuses to start (exit 2, one line).

Usage: python packaging/image_check.py --dsn postgresql://USER@HOST:PORT/DB
Exit 0 when every step passed; 1 with the step and its output otherwise. Images are kept
in podman's storage (``localhost/sidecar-base:bookworm`` and friends) for the next run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from containment_suite import TOOL as PROBE_TOOL  # noqa: E402
from containment_suite import probe_beside_held, reached  # noqa: E402
from otlp_receiver import OtlpReceiver  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SUITE, MIRROR = "bookworm", "http://deb.debian.org/debian"
BASE = f"localhost/sidecar-base:{SUITE}"          # Debian + python3 (for the Dockerfile)
NO_PYTHON = f"localhost/debian-minbase:{SUITE}"   # Debian without Python (for the bundle)
IMAGE = "localhost/sidecar:check"
OCR_IMAGE = "localhost/ocr-with-sidecar:check"
WITH_PYTHON = "python3,python3-venv,libpython3.11,ca-certificates"


# Prints the sha256 of every .py file of the importable sidecar package, by relative path.
SOURCE_DIGEST = """
import hashlib, pathlib, sidecar
root = pathlib.Path(sidecar.__file__).parent
h = hashlib.sha256()
for f in sorted(root.rglob("*.py")):
    h.update(str(f.relative_to(root)).encode() + b"\\0" + f.read_bytes())
print(h.hexdigest())
"""


class CheckFailed(RuntimeError):
    """One step failed; the message says which and why."""


def step(title: str) -> None:
    print(f"== image check: {title}", flush=True)


def sh(argv: list[str], *, timeout: float = 900, input: bytes | None = None,
       env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, timeout=timeout, input=input,
                          env={**os.environ, **(env or {})})
    if check and done.returncode != 0:
        raise CheckFailed(f"{' '.join(argv[:6])}... exited {done.returncode}:\n"
                          f"{done.stdout.decode(errors='replace')[-3000:]}\n"
                          f"{done.stderr.decode(errors='replace')[-3000:]}")
    return done


def containers_conf(tmp: Path) -> dict[str, str]:
    """podman's settings for this machine: runc (crun refuses this host's hybrid cgroup
    layout) and container rlimits no higher than ours (raising them needs
    CAP_SYS_RESOURCE, which a sandbox may not grant)."""
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)
    cap = 32768  # podman's own default for root, lowered further to ours
    procs = [min(cap, v) if v != resource.RLIM_INFINITY else cap for v in nproc]
    files = [v if v != resource.RLIM_INFINITY else 1048576 for v in nofile]
    conf = tmp / "containers.conf"
    runtime = "runc" if shutil.which("runc") else "crun"
    conf.write_text("[containers]\n"
                    f'default_ulimits = ["nofile={files[0]}:{files[1]}", '
                    f'"nproc={procs[0]}:{procs[1]}"]\n'
                    f'[engine]\nruntime = "{runtime}"\n')
    return {"CONTAINERS_CONF": str(conf)}


def image_exists(name: str, env: dict) -> bool:
    return sh(["podman", "image", "exists", name], env=env, check=False).returncode == 0


def debian_image(name: str, include: str, tmp: Path, env: dict) -> None:
    """``name`` from debootstrap's minimal Debian (plus ``include``) with this machine's
    CA certificates, so pip and apt inside trust what this machine trusts."""
    if image_exists(name, env):
        print(f"   {name}: kept from an earlier run", flush=True)
        return
    root = tmp / name.replace("/", "_").replace(":", "_")
    args = ["debootstrap", "--variant=minbase"] + ([f"--include={include}"] if include else [])
    sh([*args, SUITE, str(root), MIRROR], timeout=1200)
    extra = Path("/usr/local/share/ca-certificates")
    if include and extra.is_dir() and any(extra.glob("*.crt")):
        for cert in extra.glob("*.crt"):
            shutil.copy(cert, root / "usr/local/share/ca-certificates" / cert.name)
        sh(["chroot", str(root), "update-ca-certificates"])
    shutil.rmtree(root / "var/cache/apt/archives", ignore_errors=True)
    (root / "var/cache/apt/archives/partial").mkdir(parents=True, exist_ok=True)
    tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
    changes = ["--change", 'CMD ["/bin/sh"]']
    if include:
        changes += ["--change", "ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt",
                    "--change", "ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt"]
    done = subprocess.run(["podman", "import", *changes, "-", name], stdin=tar.stdout,
                          capture_output=True, env={**os.environ, **env}, timeout=600)
    tar.wait()
    if done.returncode != 0 or tar.returncode != 0:
        raise CheckFailed(f"podman import {name}: {done.stderr.decode(errors='replace')}")
    shutil.rmtree(root, ignore_errors=True)


async def _db(dsn: str, sql: str, *args):
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetch(sql, *args)
    finally:
        await conn.close()


def db(dsn: str, sql: str, *args):
    return asyncio.run(_db(dsn, sql, *args))


def host_sidecar(dsn: str, *args: str) -> dict:
    done = sh([sys.executable, "-m", "sidecar", *args],
              env={"SIDECAR_DATABASE_URL": dsn, "SIDECAR_HTTP_ADDR": "off"})
    return json.loads(done.stdout)


def run_check(server_dsn: str, tmp: Path) -> None:
    env = containers_conf(tmp)
    name = f"sidecar_image_{uuid.uuid4().hex[:10]}"
    db(server_dsn, f'CREATE DATABASE "{name}"')
    dsn = server_dsn.rsplit("/", 1)[0] + "/" + name
    volume = f"sidecar-bundle-{uuid.uuid4().hex[:8]}"
    try:
        step("base images from Debian's packages (debootstrap)")
        debian_image(BASE, WITH_PYTHON, tmp, env)
        debian_image(NO_PYTHON, "", tmp, env)
        absent = sh(["podman", "run", "--rm", "--network", "none", NO_PYTHON, "sh", "-c",
                     "command -v python3 || echo none"], env=env)
        if absent.stdout.decode().strip() != "none":
            raise CheckFailed(f"{NO_PYTHON} has a python3: {absent.stdout.decode()}")

        step("podman build of the Dockerfile")
        started = time.monotonic()
        sh(["podman", "build", "--network", "host", "--build-arg", f"PYTHON_IMAGE={BASE}",
            "-t", IMAGE, str(ROOT)], env=env, timeout=1800)
        print(f"   built {IMAGE} in {time.monotonic() - started:.0f} s", flush=True)
        # The image must run this checkout's code, not a layer cached from an earlier one.
        inside = sh(["podman", "run", "--rm", "--network", "none", "--entrypoint",
                     "/opt/sidecar-venv/bin/python", IMAGE, "-c", SOURCE_DIGEST],
                    env=env).stdout.decode().strip()
        here = sh([sys.executable, "-c", SOURCE_DIGEST]).stdout.decode().strip()
        if inside != here:
            raise CheckFailed(f"the image's sidecar package ({inside[:12]}) is not this "
                              f"checkout's ({here[:12]}): a stale build layer")
        user = sh(["podman", "image", "inspect", "--format", "{{.Config.User}}", IMAGE],
                  env=env).stdout.decode().strip()
        if user != "10001:10001":
            raise CheckFailed(f"the image runs as {user!r}, expected 10001:10001")

        secret = tmp / "db-url"
        secret.write_text(dsn)
        secret.chmod(0o444)  # the container's user 10001 reads it, as from a Secret
        mount = ["-v", f"{secret}:/etc/sidecar/db/url:ro",
                 "-e", "SIDECAR_DATABASE_URL_FILE=/etc/sidecar/db/url"]
        base_run = ["podman", "run", "--rm", "--network", "host",
                    "-e", "SIDECAR_HTTP_ADDR=off", *mount]

        step("sidecar config in the image")
        config = json.loads(sh([*base_run, IMAGE, "config"], env=env).stdout)
        shown = config["settings"]["database_url"] or ""
        if name not in shown or config["settings"]["database_url_file"] == "":
            raise CheckFailed(f"config did not read the mounted URL: {config['settings']}")

        step("one real job run by the image's sidecar (tini as PID 1), traced over OTLP "
             "(the [otel] extra) to a receiver on the host")
        migrate = sh([*base_run, IMAGE, "migrate"], env=env)
        print(f"   {migrate.stdout.decode().strip()[:200]}", flush=True)
        job = host_sidecar(dsn, "enqueue", "image-cat", "--payload", '{"hello": "image"}')
        receiver = OtlpReceiver()
        endpoint = receiver.start()
        try:
            sh([*base_run, "-e", "OTEL_TRACES_EXPORTER=otlp",
                "-e", f"OTEL_EXPORTER_OTLP_ENDPOINT={endpoint}", IMAGE, "run", "--drain",
                "--tool", "image-cat", "--", "/bin/cat"], env=env, timeout=300)
            spans = [span for span in receiver.spans()
                     if span.attributes.get("sidecar.job.id") == job["id"]]
        finally:
            receiver.stop()
        row = db(dsn, "SELECT state, result FROM tool_jobs WHERE id = $1",
                 uuid.UUID(job["id"]))[0]
        if row["state"] != "succeeded" or json.loads(row["result"]) != {"hello": "image"}:
            raise CheckFailed(f"the job in the image ended {dict(row)}")
        if not any(span.name == "execute_tool image-cat" for span in spans):
            raise CheckFailed(f"no attempt span of the job reached the receiver: {spans}")

        step("sidecar mcp in the image (the [mcp] extra): /livez, a token, tools/list")
        check_gateway(base_run, env, tmp)

        step("the bundle, installed by an init container, as PID 1 of an image "
             "without Python with a read-only root")
        sh(["podman", "volume", "create", volume], env=env)
        sh(["podman", "run", "--rm", "--network", "none", "-v", f"{volume}:/sidecar",
            "--entrypoint", "/opt/sidecar/sidecar", IMAGE, "install", "/sidecar"], env=env)
        job = host_sidecar(dsn, "enqueue", "bundle-ppid", "--payload", "{}")
        tool = 'cat >/dev/null; printf \'{"ppid": %s}\\n\' "$PPID"'
        sh(["podman", "run", "--rm", "--network", "host", "--read-only",
            "--user", "10001:10001", "-e", "HOME=/tmp", "-e", "SIDECAR_HTTP_ADDR=off", *mount,
            "-v", f"{volume}:/sidecar:ro", "--entrypoint", "/sidecar/sidecar", NO_PYTHON,
            "run", "--drain", "--tool", "bundle-ppid", "--", "/bin/sh", "-c", tool],
           env=env, timeout=300)
        row = db(dsn, "SELECT state, result FROM tool_jobs WHERE id = $1",
                 uuid.UUID(job["id"]))[0]
        result = json.loads(row["result"]) if row["result"] else None
        if row["state"] != "succeeded" or result != {"ppid": 1}:
            raise CheckFailed(f"the bundle's job ended {dict(row)} (ppid 1 expected: the "
                              "bundle is PID 1 and spawns the tool itself)")
        step("the same bundle sandboxes its tool with the bwrap it carries (the image "
             "has no bubblewrap)")
        job = host_sidecar(dsn, "enqueue", "bundle-sandboxed", "--payload", "{}")
        tool = ('cat >/dev/null; if [ -e /etc/sidecar/db/url ]; then s=visible; '
                'else s=hidden; fi; printf \'{"secret": "%s"}\\n\' "$s"')
        sh(["podman", "run", "--rm", "--network", "host", "--read-only", *UNMASKED_PROC,
            "--user", "10001:10001", "-e", "HOME=/tmp", "-e", "SIDECAR_HTTP_ADDR=off", *mount,
            "-e", "SIDECAR_SANDBOX=required", "-v", f"{volume}:/sidecar:ro",
            "--entrypoint", "/sidecar/sidecar", NO_PYTHON,
            "run", "--drain", "--tool", "bundle-sandboxed", "--", "/bin/sh", "-c", tool],
           env=env, timeout=300)
        row = db(dsn, "SELECT state, result FROM tool_jobs WHERE id = $1",
                 uuid.UUID(job["id"]))[0]
        result = json.loads(row["result"]) if row["result"] else None
        if row["state"] != "succeeded" or result != {"secret": "hidden"}:
            raise CheckFailed(f"the bundle's sandboxed job ended {dict(row)}")

        step("the OCR tool image of k8s/overlays/ocr, built on it, reads a real image")
        sh(["podman", "build", "--network", "host", "--build-arg", f"SIDECAR_IMAGE={IMAGE}",
            "-f", str(ROOT / "k8s/overlays/ocr/Dockerfile"), "-t", OCR_IMAGE, str(ROOT)],
           env=env, timeout=1800)
        picture = tmp / "text.png"
        sh(["convert-im6.q16", "-size", "900x160", "xc:white", "-font", "DejaVu-Sans",
            "-pointsize", "48", "-fill", "black", "-annotate", "+20+100", "SIDECAR OCR 2026",
            str(picture)])
        picture.chmod(0o444)
        job = host_sidecar(dsn, "enqueue", "ocr", "--payload",
                           json.dumps({"image": "/data/text.png"}))
        # The recipe reads only under OCR_ROOT, passed through as the overlay's profile does.
        sh([*base_run, "--read-only", "-v", f"{picture}:/data/text.png:ro",
            "-e", "OCR_ROOT=/data",
            "-e", "SIDECAR_PROFILE_OCR_ENV_PASSTHROUGH=PATH,HOME,LANG,LC_ALL,LC_CTYPE,TZ,OCR_ROOT",
            OCR_IMAGE,
            "run", "--drain", "--tool", "ocr", "--", "/usr/local/bin/ocr"],
           env=env, timeout=300)
        row = db(dsn, "SELECT state, result FROM tool_jobs WHERE id = $1",
                 uuid.UUID(job["id"]))[0]
        text = json.loads(row["result"])["text"] if row["result"] else ""
        if row["state"] != "succeeded" or "SIDECAR OCR 2026" not in text:
            raise CheckFailed(f"the OCR job ended {dict(row)}")

        for user in ("10001:10001", "0:0"):
            step(f"the hostile-tool suite in the image as {user.split(':')[0]} "
                 "(read-only root, default seccomp)")
            hostile_suite(dsn, tmp, env, [*base_run, "--read-only", "--tmpfs", "/tmp"], user)
        print("   every step passed", flush=True)
    finally:
        sh(["podman", "volume", "rm", "-f", volume], env=env, check=False)
        # The tagged images stay for the next run; the layers a rebuild left untagged go.
        sh(["podman", "image", "prune", "-f"], env=env, check=False)
        db(server_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


PROBE = ROOT / "tests" / "tools" / "containment_probe.py"
UNMASKED_PROC = ["--security-opt", "unmask=/proc/*"]  # what procMount: Unmasked gives


def _container_pids(name: str, env: dict) -> tuple[int, int]:
    """(sidecar pid, guardian pid) in the container's PID namespace, from ``podman top``."""
    table = sh(["podman", "top", name, "pid", "args"], env=env).stdout.decode().splitlines()
    sidecar = guardian = 0
    for line in table[1:]:
        pid, _, args = line.strip().partition(" ")
        if "sidecar.worker.guardian" in args:
            guardian = int(pid)
        elif " run " in f" {args} " and "tini" not in args:
            sidecar = int(pid)
    if not sidecar or not guardian:
        raise CheckFailed(f"no sidecar and guardian in the container:\n{table}")
    return sidecar, guardian


def hostile_suite(dsn: str, tmp: Path, env: dict, run: list[str], user: str) -> None:
    """The containment probe beside a held attempt in the image as ``user``: sandboxed
    (unmasked /proc, SANDBOX=required) it reaches nothing; under the runtime's masked /proc
    ``auto`` falls back with the warning and ``required`` refuses to start."""
    uid = int(user.split(":")[0])
    work = tmp / f"work-{uid}"
    work.mkdir()
    os.chown(work, uid, uid)
    tool = ["/usr/bin/python3", "/probe/containment_probe.py"]
    mounts = ["-v", f"{PROBE}:/probe/containment_probe.py:ro", "-v", f"{work}:/work",
              "-e", "SIDECAR_WORK_DIR=/work", "-e", "SIDECAR_KILL_GRACE_SECONDS=0.5"]
    name = f"sidecar-hostile-{uuid.uuid4().hex[:8]}"
    sh([*run, "-d", "--name", name, "--user", user, *UNMASKED_PROC, *mounts,
        "-e", "SIDECAR_SANDBOX=required", IMAGE, "run", "--tool", PROBE_TOOL,
        "--concurrency", "2", "--", *tool], env=env)
    try:
        try:
            report, other = probe_beside_held(
                dsn, work, ["/etc/sidecar/db/url"], lambda: _container_pids(name, env),
                lambda path: "/work/" + path.relative_to(work).as_posix())
        except AssertionError as exc:
            logs = sh(["podman", "logs", name], env=env, check=False)
            raise CheckFailed(f"{exc}\n{logs.stderr.decode(errors='replace')[-3000:]}"
                              ) from None
        if reached(report) or (other / "planted.txt").exists():
            raise CheckFailed(f"the sandboxed probe as {user} reached "
                              f"{sorted(reached(report))}: {report}")
        print(f"   sandboxed as {user}: {len(report)} checks, none reached", flush=True)
    finally:
        sh(["podman", "stop", "-t", "10", name], env=env, check=False)
        sh(["podman", "rm", "-f", name], env=env, check=False)

    # The runtime's own masked /proc: auto falls back (one warning naming the fix) ...
    job = host_sidecar(dsn, "enqueue", PROBE_TOOL, "--payload", '{"mode": "hold"}')
    fallback = sh([*run, "--user", user, *mounts, "-e", "SIDECAR_SANDBOX=auto",
                   IMAGE, "run", "--drain",
                   "--tool", PROBE_TOOL, "--", "/bin/sh", "-c",
                   'cat >/dev/null; echo \'{"held": true}\''], env=env, timeout=300)
    row = db(dsn, "SELECT state FROM tool_jobs WHERE id = $1", uuid.UUID(job["id"]))[0]
    said = fallback.stderr.decode(errors="replace")
    if row["state"] != "succeeded" or "sandbox_unavailable" not in said \
            or "procMount: Unmasked" not in said:
        raise CheckFailed(f"auto under a masked /proc: job {row['state']}, stderr:\n"
                          f"{said[-2000:]}")
    # ... and required refuses to start, one line, exit 2.
    refused = sh([*run, "--user", user, *mounts, "-e", "SIDECAR_SANDBOX=required",
                  IMAGE, "run", "--drain", "--tool", PROBE_TOOL, "--", *tool],
                 env=env, check=False, timeout=120)
    lines = refused.stderr.decode(errors="replace").strip().splitlines()
    if refused.returncode != 2 or len(lines) != 1 or "SANDBOX=required" not in lines[0]:
        raise CheckFailed(f"required under a masked /proc exited {refused.returncode}: "
                          f"{lines}")
    print(f"   masked /proc as {user}: auto fell back with the warning, required "
          "refused (exit 2)", flush=True)


def check_gateway(base_run: list[str], env: dict[str, str], tmp: Path) -> None:
    """The image's ``sidecar mcp`` on a free loopback port (host network): ``/livez``
    answers, ``/mcp`` refuses a request without a token (401) and, with one, the SDK's
    client lists exactly the tool it was given. CheckFailed otherwise."""
    import socket
    import urllib.error
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    token = uuid.uuid4().hex + uuid.uuid4().hex
    tokens = tmp / "mcp-tokens"
    tokens.write_text(f"image-check {token}\n")
    tokens.chmod(0o444)
    name = f"sidecar-mcp-check-{uuid.uuid4().hex[:8]}"
    sh([*base_run[:3], "-d", "--name", name, *base_run[3:],
        "-v", f"{tokens}:/etc/sidecar/mcp/tokens:ro",
        "-e", "SIDECAR_MCP_TOKEN_FILE=/etc/sidecar/mcp/tokens",
        "-e", "SIDECAR_PROFILE_IMAGE_CAT_MCP_DESCRIPTION=Echoes its arguments.",
        IMAGE, "mcp", "--listen", f"127.0.0.1:{port}", "--tool", "image-cat"], env=env)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/livez",
                                            timeout=2) as answer:
                    if answer.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                logs = subprocess.run(["podman", "logs", name], env=env,
                                      capture_output=True).stderr.decode()[-800:]
                raise CheckFailed(f"sidecar mcp in the image never served /livez: {logs}")
            time.sleep(0.5)
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/mcp", method="POST", data=b"{}",
            headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(request, timeout=5)
            raise CheckFailed("sidecar mcp in the image answered /mcp without a token")
        except urllib.error.HTTPError as exc:
            if exc.code != 401:
                raise CheckFailed(f"/mcp without a token: {exc.code}, expected 401") from None

        async def listed() -> list[str]:
            from mcp import Client
            from mcp.client.streamable_http import streamable_http_client
            from mcp.shared._httpx_utils import create_mcp_http_client

            http = create_mcp_http_client(headers={"Authorization": f"Bearer {token}"})
            async with Client(streamable_http_client(f"http://127.0.0.1:{port}/mcp",
                                                     http_client=http)) as client:
                return [tool.name for tool in (await client.list_tools()).tools]

        names = asyncio.run(listed())
        if names != ["image-cat"]:
            raise CheckFailed(f"sidecar mcp in the image lists {names}, not ['image-cat']")
    finally:
        subprocess.run(["podman", "rm", "-f", name], env=env, capture_output=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", required=True,
                        help="a PostgreSQL server the containers reach on the host network")
    args = parser.parse_args(argv)
    missing = [tool for tool in ("podman", "debootstrap", "convert-im6.q16")
               if shutil.which(tool) is None]
    if missing:
        print(f"image check: {', '.join(missing)} not installed (apt-get install podman "
              "runc debootstrap imagemagick)", file=sys.stderr)
        return 1
    tmp = Path(tempfile.mkdtemp(prefix="sidecar-image-", dir="/var/tmp"))
    try:
        run_check(args.dsn, tmp)
    except (CheckFailed, AssertionError, subprocess.TimeoutExpired) as exc:
        print(f"image check failed: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
