"""The warm LibreOffice recipe (issue 43, point 2; examples/recipes/libreoffice_warm.py with
its libreoffice_warm.env): one soffice, driven over the UNO bridge, serves the consecutive
jobs of a warm process. Real `sidecar run` processes with the recipe's profile loaded, a
real PostgreSQL, Debian's soffice and python3-uno (`.ci/run` installs both), documents
made here. What is checked is what can be seen: job rows, journals, events, and which
processes (soffice's launcher and soffice.bin) are still alive."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import psutil
import pytest

from kit import (
    _processes_with,
    base_env,
    enqueue,
    job_row,
    journal_details,
    kill_pid,
    pid_alive,
    sandbox_extra_paths,
    wait_until,
)

pytestmark = pytest.mark.e2e

RECIPES = Path(__file__).resolve().parent.parent / "examples" / "recipes"
RECIPE = [str(RECIPES / "libreoffice_warm.py")]
TOOL = "convert-doc-warm"
# The recipe's lease profile, with a lease wide enough for its kill grace (P10), as
# tests/test_real_tools.py runs the per-job recipe.
LEASE = {"SIDECAR_LEASE_SECONDS": "30", "SIDECAR_HEARTBEAT_SECONDS": "3"}
# A stage deadline short enough for a test, long enough for a fresh soffice to start and
# convert a small document: a process's first job pays for the start (1.6-2.9 s here on
# two busy cores), so a few seconds would fail it on a loaded CI machine.
STAGE_TIMEOUT = "15"


def _need_soffice_and_uno() -> None:
    """soffice and Debian's python3 with the UNO bridge, or a failure saying what to
    install (never a skip: CI installs them)."""
    if shutil.which("soffice") is None:
        pytest.fail("soffice is not installed: apt-get install -y libreoffice-writer-nogui "
                    "(.ci/run installs every real tool these tests run)")
    done = subprocess.run(["/usr/bin/python3", "-c", "import uno"], capture_output=True,
                          timeout=30)
    if done.returncode != 0:
        pytest.fail("Debian's python3 has no UNO bridge: apt-get install -y python3-uno "
                    f"(.ci/run installs it): {done.stderr.decode()[-300:]}")


def _recipe_env(dsn: str, root: Path, **extra: str) -> dict[str, str]:
    """base_env plus examples/recipes/libreoffice_warm.env, as a user would load it, with
    CONVERT_DOC_ROOT at ``root``."""
    env = base_env(dsn, **LEASE)
    for line in (RECIPES / "libreoffice_warm.env").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip()
    env["CONVERT_DOC_ROOT"] = str(root)
    env.update(extra)
    return env


def _convert(dsn, env, source: Path, output_dir: Path, *options: str, **fields) -> str:
    return enqueue(dsn, TOOL, {"input": str(source), "output_dir": str(output_dir), **fields},
                   *options, env=env)


def _finished(dsn, job, timeout: float = 120) -> dict:
    """The job's row once it succeeded or failed for good."""
    def done():
        row = job_row(dsn, job)
        return row if row["state"] in ("succeeded", "failed") else None

    return wait_until(done, timeout, interval=0.2, what=f"job {job} to finish")


def _soffice_tree(pid: int) -> set[int]:
    """The launcher ``pid`` and every process under it (soffice.bin), while they live."""
    try:
        proc = psutil.Process(pid)
        return {pid, *(child.pid for child in proc.children(recursive=True))}
    except psutil.Error:
        return set()


def _process_ids(dsn, jobs) -> set[str]:
    """The warm processes (SIDECAR_PROCESS_ID) that ran these jobs."""
    return {journal_details(dsn, job, "tool_request_started")[0]["warm"]["process_id"]
            for job in jobs}


def _left(process_ids: set[str]) -> list[int]:
    """Live processes of these warm processes' trees (the variable is inherited by the
    recipe, soffice's launcher and soffice.bin)."""
    return [pid for process_id in process_ids
            for pid in _processes_with("SIDECAR_PROCESS_ID", process_id)]


def _pdf(row: dict) -> bytes:
    assert row["state"] == "succeeded", row["error"]
    data = Path(row["result"]["output"]).read_bytes()
    assert data[:5] == b"%PDF-" and len(data) == row["result"]["bytes"] > 1000, data[:40]
    return data


def _documents(root: Path) -> list[Path]:
    """Three small documents of three kinds soffice detects: plain text, HTML, flat ODF."""
    text = root / "notes.txt"
    text.write_text("A plain text document, converted by a warm soffice.\n" * 20)
    html = root / "page.html"
    html.write_text("<html><body><h1>Warm</h1><p>An HTML page, one soffice for all.</p>"
                    "</body></html>")
    flat = root / "letter.fodt"
    flat.write_text(
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        '<office:document xmlns:office="urn:oasis:names:tc:opendocument:xmlns:office:1.0" '
        'xmlns:text="urn:oasis:names:tc:opendocument:xmlns:text:1.0" '
        'office:version="1.3" office:mimetype="application/vnd.oasis.opendocument.text">'
        "<office:body><office:text><text:p>A flat OpenDocument letter.</text:p>"
        "</office:text></office:body></office:document>\n")
    return [text, html, flat]


def test_three_conversions_are_served_by_one_soffice_and_none_is_left_after_a_stop(
        dsn, sidecars, tmp_path):
    """Three documents of three kinds, one after another: three PDFs, one soffice (the
    same pid in every result, one warm process in the journals); soffice.bin runs under
    it and carries the process's SIDECAR_PROCESS_ID. Once the sidecar stops, nothing of
    that tree is alive, and the process was stopped for the shutdown."""
    _need_soffice_and_uno()
    env = _recipe_env(dsn, tmp_path, SIDECAR_PROFILE_CONVERT_DOC_WARM_STAGE_TIMEOUT_SECONDS=
                      STAGE_TIMEOUT)
    sc = sidecars(dsn, RECIPE, "--tool", TOOL, env=env)
    documents = _documents(tmp_path)
    rows = [_finished(dsn, _convert(dsn, env, doc, tmp_path)) for doc in documents]
    for doc, row in zip(documents, rows, strict=True):
        assert row["result"]["output"] == str(tmp_path / f"{doc.stem}.pdf")
        _pdf(row)
    [soffice] = {row["result"]["soffice_pid"] for row in rows}
    [process_id] = _process_ids(dsn, [row["id"] for row in rows])
    tree = _soffice_tree(soffice)
    assert len(tree) >= 2, tree  # the launcher and soffice.bin
    assert tree <= set(_left({process_id})), (tree, _left({process_id}))
    sc.stop()
    assert not [pid for pid in tree if pid_alive(pid)]
    assert not _left({process_id})
    assert [(e["process_id"], e["reason"], e["jobs"])
            for e in sc.events("warm_process_stopped")] == [(process_id, "shutdown", 3)]


def _huge_table(path: Path, rows: int = 30000) -> Path:
    """An HTML table soffice lays out for minutes (3000 rows take it about 13 s here)."""
    cells = "".join(f"<td>c{n}</td>" for n in range(8))
    with path.open("w") as out:
        out.write("<html><body><table border=1>")
        for _ in range(rows):
            out.write(f"<tr>{cells}</tr>")
        out.write("</table></body></html>")
    return path


def test_a_document_past_the_stage_deadline_kills_soffice_and_the_next_job_is_fresh(
        dsn, sidecars, tmp_path):
    """A document that keeps soffice busy far past the stage deadline fails its job
    ``stage_timeout``; the soffice of the earlier job (launcher and soffice.bin) is killed
    with the warm process, and the next conversion runs on a fresh soffice."""
    _need_soffice_and_uno()
    env = _recipe_env(dsn, tmp_path, SIDECAR_PROFILE_CONVERT_DOC_WARM_STAGE_TIMEOUT_SECONDS=
                      STAGE_TIMEOUT)
    text = _documents(tmp_path)[0]
    huge = _huge_table(tmp_path / "huge.html")
    sc = sidecars(dsn, RECIPE, "--tool", TOOL, env=env)
    first = _finished(dsn, _convert(dsn, env, text, tmp_path))
    _pdf(first)
    tree = _soffice_tree(first["result"]["soffice_pid"])
    assert len(tree) >= 2, tree
    hung = _finished(dsn, _convert(dsn, env, huge, tmp_path, "--max-attempts", "1"))
    assert (hung["state"], hung["error"]["kind"]) == ("failed", "stage_timeout"), hung["error"]
    assert journal_details(dsn, hung["id"], "child_killed")[0]["reason"] == "stage_timeout"
    wait_until(lambda: not [pid for pid in tree if pid_alive(pid)], 15,
               what=f"the first soffice {sorted(tree)} gone")
    assert not (tmp_path / "huge.pdf").exists()
    after = _finished(dsn, _convert(dsn, env, text, tmp_path))
    _pdf(after)
    assert after["result"]["soffice_pid"] != first["result"]["soffice_pid"]
    assert journal_details(dsn, after["id"], "tool_request_started")[0]["warm"]["fresh"]
    processes = _process_ids(dsn, [first["id"], hung["id"], after["id"]])
    assert len(processes) == 2
    sc.stop()
    assert not _left(processes)
    assert [e["reason"] for e in sc.events("warm_process_stopped")] == \
        ["stage_timeout", "shutdown"]


def test_paths_outside_the_root_are_refused_at_once_and_the_same_soffice_serves_on(
        dsn, sidecars, tmp_path):
    """Between two good conversions, payloads naming a file outside CONVERT_DOC_ROOT
    (directly, by a link in the root, by ..), an output directory outside it, a format
    that is no export filter, and a file soffice cannot load: the refusals fail at their
    first attempt with exit code 65 and one line, the load failure with exit code 1, and
    every job after them is served by the same soffice; nothing is written outside."""
    _need_soffice_and_uno()
    root = tmp_path / "docs"
    root.mkdir()
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    secret = tmp_path / "secret.txt"
    secret.write_text("postgresql://sidecar_worker:s3cret-pw-4711@postgres:5432/jobs\n")
    (root / "link.txt").symlink_to(secret)
    text = _documents(root)[0]
    env = _recipe_env(dsn, root, SIDECAR_PROFILE_CONVERT_DOC_WARM_STAGE_TIMEOUT_SECONDS=
                      STAGE_TIMEOUT)
    sc = sidecars(dsn, RECIPE, "--tool", TOOL, env=env)
    first = _finished(dsn, _convert(dsn, env, text, root))
    _pdf(first)
    refused = [(_convert(dsn, env, secret, root), "'input'"),
               (_convert(dsn, env, root / "link.txt", root), "'input'"),
               (_convert(dsn, env, f"{root}/../secret.txt", root), "'input'"),
               (_convert(dsn, env, text, outside), "'output_dir'"),
               (_convert(dsn, env, text, root, format="pdf:writer_pdf_Export"), "'format'")]
    unloadable = _convert(dsn, env, root / "missing.txt", root, "--max-attempts", "1")
    last = _convert(dsn, env, text, root, format="odt")
    for job, field in refused:
        row = _finished(dsn, job)
        assert (row["state"], row["attempt"]) == ("failed", 1), row
        error = row["error"]
        assert (error["kind"], error["exit_code"]) == ("exit_code", 65), error
        message = error["message"]
        # The sidecar's words around the tool's one line
        assert "(exit code 65): bad payload: " in message and field in message, message
        assert "\n" not in message and "s3cret" not in json.dumps(row, default=str)
    row = _finished(dsn, unloadable)
    assert (row["error"]["kind"], row["error"]["exit_code"]) == ("exit_code", 1), row["error"]
    assert "missing.txt" in row["error"]["message"]
    row = _finished(dsn, last)
    assert row["state"] == "succeeded", row["error"]
    assert Path(row["result"]["output"]).read_bytes()[:2] == b"PK"  # an ODF zip
    assert row["result"]["soffice_pid"] == first["result"]["soffice_pid"]
    jobs = [first["id"], *(job for job, _ in refused), unloadable, last]
    assert len(_process_ids(dsn, jobs)) == 1
    assert not list(outside.iterdir())
    sc.stop()
    assert not _left(_process_ids(dsn, jobs))


def _soffice_bin(launcher: int) -> int:
    """The soffice.bin under the launcher ``launcher`` (oosplash)."""
    [pid] = [child.pid for child in psutil.Process(launcher).children(recursive=True)
             if child.name() == "soffice.bin"]
    return pid


def test_soffice_killed_during_a_job_fails_that_job_and_the_next_gets_a_fresh_process(
        dsn, sidecars, tmp_path):
    """soffice.bin dies while it converts (SIGKILL to the pid recorded under the first
    job's launcher): the recipe finds the bridge gone and exits 75, so that job fails
    ``exit_code`` 75 (not the deadline's kill) and the next conversion runs in a fresh
    process with a new soffice."""
    _need_soffice_and_uno()
    env = _recipe_env(dsn, tmp_path, SIDECAR_PROFILE_CONVERT_DOC_WARM_STAGE_TIMEOUT_SECONDS=
                      "60")
    text = _documents(tmp_path)[0]
    huge = _huge_table(tmp_path / "huge.html")
    sc = sidecars(dsn, RECIPE, "--tool", TOOL, env=env)
    first = _finished(dsn, _convert(dsn, env, text, tmp_path))
    _pdf(first)
    victim = _soffice_bin(first["result"]["soffice_pid"])
    busy = _convert(dsn, env, huge, tmp_path, "--max-attempts", "1")
    wait_until(lambda: journal_details(dsn, busy, "tool_request_started"), 30,
               what="the huge document handed to soffice")
    kill_pid(victim)
    row = _finished(dsn, busy)
    assert (row["state"], row["error"]["kind"], row["error"]["exit_code"]) == \
        ("failed", "exit_code", 75), row["error"]
    wait_until(lambda: not pid_alive(first["result"]["soffice_pid"]), 15,
               what="the first soffice's launcher gone")
    after = _finished(dsn, _convert(dsn, env, text, tmp_path))
    _pdf(after)
    assert after["result"]["soffice_pid"] != first["result"]["soffice_pid"]
    assert journal_details(dsn, after["id"], "tool_request_started")[0]["warm"]["fresh"]
    sc.stop()
    assert [e["reason"] for e in sc.events("warm_process_stopped")] == ["exited", "shutdown"]


def _serve(root: Path, home: Path) -> subprocess.Popen:
    """The recipe alone, as the sidecar starts a warm process: request lines on its
    stdin, answers on its stdout."""
    return subprocess.Popen(RECIPE, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            env={"PATH": os.environ["PATH"], "HOME": str(home),
                                 "CONVERT_DOC_ROOT": str(root)})


def _ask(proc: subprocess.Popen, job_id: str, payload: dict) -> dict:
    proc.stdin.write(json.dumps({"job_id": job_id, "payload": payload}).encode() + b"\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def test_the_recipe_alone_stops_its_soffice_at_the_end_of_stdin_and_exits_when_it_dies(
        tmp_path):
    """Without a sidecar to kill its tree: at the end of its stdin the recipe has soffice
    terminate and exits 0 with nothing more on stdout, no process of its soffice left; a
    recipe whose soffice dies while it waits for a request exits 75 at once."""
    _need_soffice_and_uno()
    text = _documents(tmp_path)[0]
    payload = {"input": str(text), "output_dir": str(tmp_path)}
    for end in ("eof", "soffice dies"):
        home = tmp_path / end.replace(" ", "-")
        home.mkdir()
        proc = _serve(tmp_path, home)
        try:
            answer = _ask(proc, "j1", payload)
            assert answer["job_id"] == "j1" and answer["result"]["bytes"] > 1000, answer
            tree = _soffice_tree(answer["result"]["soffice_pid"])
            assert len(tree) >= 2, tree
            if end == "eof":
                proc.stdin.close()
                assert proc.wait(30) == 0, proc.stderr.read().decode()[-2000:]
                assert proc.stdout.read() == b""
            else:
                kill_pid(_soffice_bin(answer["result"]["soffice_pid"]))
                assert proc.wait(30) == 75, proc.stderr.read().decode()[-2000:]
            wait_until(lambda tree=tree: not [p for p in tree if pid_alive(p)], 10,
                       what=f"soffice {sorted(tree)} gone")
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                stream.close()


def test_the_warm_recipe_converts_in_the_default_sandbox(dsn, sidecars, public_dir):
    """SANDBOX=required (bubblewrap, the product's default where the host allows it): the
    recipe, soffice and its pipe live in the warm process's sandbox (its own /tmp); two
    documents in a directory bound read-write are converted by one soffice, and nothing
    of the process is left after the stop."""
    _need_soffice_and_uno()
    if shutil.which("bwrap") is None:
        pytest.fail("bwrap is not installed: apt-get install -y bubblewrap (.ci/run "
                    "installs it)")
    root = public_dir(0o755, 0, "/var/tmp")
    extra = ",".join(p for p in (sandbox_extra_paths(), f"{root}:rw") if p)
    env = _recipe_env(dsn, root, SIDECAR_SANDBOX="required", SIDECAR_EXTRA_PATHS=extra,
                      SIDECAR_PROFILE_CONVERT_DOC_WARM_STAGE_TIMEOUT_SECONDS=STAGE_TIMEOUT)
    documents = _documents(root)[:2]
    jobs = [_convert(dsn, env, doc, root) for doc in documents]
    sc = sidecars(dsn, RECIPE, "--tool", TOOL, env=env)
    rows = [_finished(dsn, job) for job in jobs]
    for row in rows:
        _pdf(row)
    assert len({row["result"]["soffice_pid"] for row in rows}) == 1
    processes = _process_ids(dsn, jobs)
    assert len(processes) == 1
    sc.stop()
    assert not _left(processes)
    assert [e["reason"] for e in sc.events("warm_process_stopped")] == ["shutdown"]
