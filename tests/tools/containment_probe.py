#!/usr/bin/env python3
"""Test tool: a hostile tool that tries to reach what lies outside its own attempt
(tests/test_containment.py, docs/isolation.md "What a tool can reach").

Payload ``{"mode": "hold"}``: write this attempt's guard token to ``token.txt`` in its
work directory, then wait until a file ``release`` appears there (at most 30 s): the
other running attempt a probe goes after.

Payload ``{"mode": "probe", "secrets": [PATH...], "sidecar_pid": N, "guardian_pid": N,
"other_dir": PATH}``: try, from inside, each of the checks below and print one JSON
object ``{check: "reached" | "blocked: <why>"}``. Nothing here harms what it reaches:
signals are signal 0 (a permission check, nothing is delivered), a write into the other
attempt's directory is one new file ``planted.txt``, and no mount is made (the
capability that would allow one is checked instead). It also leaves a symlink to the
first secret in its own work directory, for the sidecar's removal to not follow.

Checks: ``secret:<path>`` (read the file), ``sidecar_<what>`` and ``guardian_<what>``
for environ, cmdline, mem and fd (read /proc/<pid>/<what>, the pid being the host's:
only "reached" when it still is that process), ``signal_sidecar``, ``signal_guardian``,
``signal_other_attempt`` (signal 0), ``list_other_processes`` (a process of another
attempt of the same sidecar, or the sidecar, in /proc), ``other_token_by_proc`` (another
attempt's guard token in a /proc/<pid>/environ), ``other_dir_list``, ``other_token_file``,
``other_dir_write``, ``work_root_list`` (anything but its own directory in the work
root), ``mount_capability`` (CAP_SYS_ADMIN in its effective set).
"""
import errno
import json
import os
import sys
import time

payload = json.load(sys.stdin)
mode = payload["mode"]
job_dir = os.environ["SIDECAR_JOB_DIR"]

if mode == "hold":
    with open(os.path.join(job_dir, "token.txt"), "w") as f:
        f.write(os.environ.get("SIDECAR_GUARD_TOKEN", ""))
    deadline = time.monotonic() + 30
    while not os.path.exists(os.path.join(job_dir, "release")) and time.monotonic() < deadline:
        time.sleep(0.05)
    print(json.dumps({"held": True}))
    sys.exit(0)


def why(exc):
    return "blocked: " + errno.errorcode.get(getattr(exc, "errno", None) or 0, type(exc).__name__)


def read(path, limit=1 << 16):
    with open(path, "rb") as f:
        return f.read(limit)


report = {}
own_token = os.environ.get("SIDECAR_GUARD_TOKEN", "")
own_job = os.environ["SIDECAR_JOB_ID"]
own_owner = os.environ["SIDECAR_OWNER_ID"]

for path in payload.get("secrets", []):
    try:
        report[f"secret:{path}"] = "reached" if read(path) else "blocked: empty"
    except OSError as exc:
        report[f"secret:{path}"] = why(exc)


def is_process(pid, marker):
    """True when /proc/<pid> is visible and is the process meant (its cmdline holds
    ``marker``): inside a PID namespace the host's pid names nothing, or another one."""
    try:
        return marker in read(f"/proc/{pid}/cmdline")
    except OSError:
        return False


for name, marker in (("sidecar", b"sidecar"), ("guardian", b"sidecar.worker.guardian")):
    pid = payload[f"{name}_pid"]
    visible = is_process(pid, marker)
    for what in ("environ", "cmdline", "mem", "fd"):
        key = f"{name}_{what}"
        if not visible:
            report[key] = "blocked: not visible"
            continue
        try:
            if what == "mem":
                with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb") as mem:
                    start = int(maps.readline().split("-")[0], 16)
                    mem.seek(start)
                    mem.read(16)
            elif what == "fd":
                names = os.listdir(f"/proc/{pid}/fd")
                [os.readlink(f"/proc/{pid}/fd/{n}") for n in names[:3]]
            else:
                read(f"/proc/{pid}/{what}")
            report[key] = "reached"
        except OSError as exc:
            report[key] = why(exc)
    if not visible:
        report[f"signal_{name}"] = "blocked: not visible"
    else:
        try:
            os.kill(pid, 0)
            report[f"signal_{name}"] = "reached"
        except OSError as exc:
            report[f"signal_{name}"] = why(exc)

others, other_tokens = [], []
for entry in os.listdir("/proc"):
    if not entry.isdigit():
        continue
    pid = int(entry)
    try:
        cmdline = read(f"/proc/{pid}/cmdline")
    except OSError:
        continue
    try:
        env = dict(item.split("=", 1) for item in
                   read(f"/proc/{pid}/environ", 1 << 20).decode(errors="replace").split("\0")
                   if "=" in item)
    except OSError:
        env = {}
    # Processes of the same sidecar's other attempts (the host may run other sidecars).
    # PID 1 is never one: in the sandbox it is the attempt's own namespace init, started
    # (ahead of the job, issue 42) with the attempt's environment but not the job's.
    if env.get("SIDECAR_OWNER_ID") == own_owner and env.get("SIDECAR_JOB_ID") != own_job \
            and pid != 1:
        others.append(pid)
    token = env.get("SIDECAR_GUARD_TOKEN")
    if token and token != own_token:
        other_tokens.append(pid)
report["list_other_processes"] = "reached" if others or is_process(
    payload["sidecar_pid"], b"sidecar") else "blocked: none visible"
report["other_token_by_proc"] = "reached" if other_tokens else "blocked: none visible"
if others:
    try:
        os.kill(others[0], 0)
        report["signal_other_attempt"] = "reached"
    except OSError as exc:
        report["signal_other_attempt"] = why(exc)
else:
    report["signal_other_attempt"] = "blocked: none visible"

other = payload["other_dir"]
try:
    os.listdir(other)
    report["other_dir_list"] = "reached"
except OSError as exc:
    report["other_dir_list"] = why(exc)
try:
    report["other_token_file"] = "reached" if read(os.path.join(other, "token.txt")) \
        else "blocked: empty"
except OSError as exc:
    report["other_token_file"] = why(exc)
try:
    with open(os.path.join(other, "planted.txt"), "x") as f:
        f.write("planted by another attempt")
    report["other_dir_write"] = "reached"
except OSError as exc:
    report["other_dir_write"] = why(exc)
try:
    root = os.path.dirname(job_dir.rstrip("/"))
    rest = [name for name in os.listdir(root) if name != os.path.basename(job_dir)]
    report["work_root_list"] = "reached" if rest else "blocked: only its own directory"
except OSError as exc:
    report["work_root_list"] = why(exc)

with open("/proc/self/status") as f:
    cap_eff = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
report["mount_capability"] = "reached" if cap_eff & (1 << 21) else "blocked: no CAP_SYS_ADMIN"

if payload.get("secrets"):  # a link for the sidecar's removal to (not) follow
    try:
        os.symlink(payload["secrets"][0], os.path.join(job_dir, "secret-link"))
        os.symlink("/", os.path.join(job_dir, "root-link"))
    except OSError:
        pass
print(json.dumps(report))
