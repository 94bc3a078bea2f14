"""The dashboard and the alerts of k8s/monitoring against a real Prometheus (issue 30,
point 2): Debian's `prometheus` scrapes two real sidecars while they run real jobs of
tests/tools/stage_tool.py (results committed and forwarded, one refused by the receiver
and one it keeps answering 503 to, a failure by exit code, one by a bad result, a stage
deadline's tree kill, a job left queued behind a pause), with the PrometheusRule's groups
loaded. `promtool check rules` and `promtool test rules` (tests/monitoring/alerts_test.yaml:
every alert, firing and not) check the rules; every query of every dashboard panel, its
Grafana variables given concrete values, must return data from that Prometheus; the
staged events must show in the series they feed; and the rules, evaluated by that
Prometheus, must be healthy, with the dead-letter alert firing on the refused result.
Each panel's queries are drawn into a static page and screenshot with headless Chromium
(TEST_ARTIFACTS_DIR, default /tmp/sidecar-test-artifacts): Grafana itself is not
installable here. One Prometheus, one database and one pair of sidecars for the module.
"""

from __future__ import annotations

import html
import json
import math
import os
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import asyncpg
import pytest
import yaml
from http_sink import HttpSink

from kit import (
    SidecarProcess,
    base_env,
    cli,
    enqueue,
    free_port,
    query,
    run,
    stop_process,
    wait_until,
)
from sidecar.storage.db import with_database

ROOT = Path(__file__).resolve().parent.parent
MONITORING = ROOT / "k8s" / "monitoring"
ALERT_TESTS = Path(__file__).resolve().parent / "monitoring" / "alerts_test.yaml"
TOOL = "stage_tool.py"
RATE_WINDOW = "2m"  # $__rate_interval: longer than the module, so rates see every event
ARTIFACTS = Path(os.environ.get("TEST_ARTIFACTS_DIR", "/tmp/sidecar-test-artifacts"))

sys.path.insert(0, str(ROOT / "packaging"))
import dashboard  # noqa: E402 - packaging/dashboard.py, not a package


def _need(program: str) -> str:
    path = shutil.which(program)
    if path is None:
        pytest.fail(f"{program} is missing: apt-get install prometheus (.ci/run does)")
    return path


def _rule_groups() -> dict:
    rule = yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())
    assert rule["kind"] == "PrometheusRule"
    return {"groups": rule["spec"]["groups"]}


def _alerts() -> set[str]:
    return {r["alert"] for g in _rule_groups()["groups"] for r in g["rules"] if "alert" in r}


# --- the rules alone ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rules_dir(tmp_path_factory) -> Path:
    """rules.yaml (the PrometheusRule's groups, as Prometheus reads them) beside a copy of
    the alert unit tests."""
    where = tmp_path_factory.mktemp("rules")
    (where / "rules.yaml").write_text(yaml.safe_dump(_rule_groups(), sort_keys=False))
    shutil.copy(ALERT_TESTS, where / ALERT_TESTS.name)
    return where


@pytest.mark.e2e
def test_promtool_checks_the_rules(rules_dir):
    done = subprocess.run([_need("promtool"), "check", "rules", "rules.yaml"], cwd=rules_dir,
                          capture_output=True, timeout=60)
    out = done.stdout.decode() + done.stderr.decode()
    assert done.returncode == 0, out
    assert f"SUCCESS: {len(_alerts())} rules found" in out


@pytest.mark.e2e
def test_promtool_unit_tests_every_alert_firing_and_not(rules_dir):
    done = subprocess.run([_need("promtool"), "test", "rules", ALERT_TESTS.name],
                          cwd=rules_dir, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stdout.decode() + done.stderr.decode()
    firing, quiet = set(), set()
    for case in yaml.safe_load(ALERT_TESTS.read_text())["tests"]:
        for check in case["alert_rule_test"]:
            (firing if check["exp_alerts"] else quiet).add(check["alertname"])
    assert firing == _alerts() and quiet == _alerts()


@pytest.mark.e2e
def test_promtool_fails_an_alert_that_does_not_fire_as_expected(tmp_path):
    """The unit tests can fail: with SidecarQueueTooOld's threshold raised past what the
    series reach, its firing case fails."""
    groups = _rule_groups()
    for group in groups["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == "SidecarQueueTooOld":
                rule["expr"] = rule["expr"].replace("> 600", "> 6000")
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(groups, sort_keys=False))
    shutil.copy(ALERT_TESTS, tmp_path / ALERT_TESTS.name)
    done = subprocess.run([_need("promtool"), "test", "rules", ALERT_TESTS.name],
                          cwd=tmp_path, capture_output=True, timeout=60)
    assert done.returncode != 0
    assert "SidecarQueueTooOld" in done.stdout.decode() + done.stderr.decode()


@pytest.mark.unit
def test_the_committed_dashboard_is_what_the_builder_makes():
    """k8s/monitoring/sidecar-dashboard.json is packaging/dashboard.py's output: run
    `python packaging/dashboard.py` after changing a panel."""
    assert (MONITORING / "sidecar-dashboard.json").read_text() == dashboard.render()
    board = json.loads(dashboard.render())
    assert [p["title"] for p in board["panels"]] == [p.title for p in dashboard.PANELS]
    assert {v["name"] for v in board["templating"]["list"]} == {"datasource", "tool"}
    for panel in board["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"] and all(t["expr"] and t["refId"] for t in panel["targets"])


# --- a real Prometheus scraping real sidecars ------------------------------------------------

@pytest.fixture(scope="module")
def module_dsn(server_dsn):
    """A fresh, migrated database for the module (conftest's ``dsn`` is per test)."""
    name = f"sidecar_t_{uuid.uuid4().hex[:12]}"

    async def admin(sql: str) -> None:
        conn = await asyncpg.connect(server_dsn)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    run(admin(f'CREATE DATABASE "{name}"'))
    url = with_database(server_dsn, name)
    done = cli(url, "migrate")
    assert done.returncode == 0, done.stderr.decode()
    yield url
    run(admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


class Prom:
    """A Prometheus of our own on 127.0.0.1 (its HTTP API), stopped by its pid."""

    def __init__(self, url: str, proc: subprocess.Popen, log: Path):
        self.url, self.proc, self.log = url, proc, log

    def api(self, path: str, **params: str):
        """GET /api/v1/PATH?PARAMS; its ``data`` (the status must be success)."""
        query_string = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query_string}",
                                    timeout=10) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """An instant query now: its series (metric labels and value)."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        return data["result"]

    def value(self, expr: str) -> float:
        """The single series' value of ``expr`` now (NaN when there is none)."""
        result = self.query(expr)
        return float(result[0]["value"][1]) if len(result) == 1 else math.nan


def _scrape(sidecar: SidecarProcess) -> str:
    return sidecar.wait_event("worker_started")["http_addr"]


@pytest.fixture(scope="module")
def stage(module_dsn, tmp_path_factory):
    """Two sidecars of stage_tool.py whose results go to a receiver that refuses the first
    (409 stale_fence: a dead letter) and answers 503 to every later one (kept in the
    outbox), scraped every second by a Prometheus that evaluates the rules; then the jobs.
    Yields (prometheus, test start in Unix seconds, job ids by name, the sidecars)."""
    prometheus = _need("prometheus")
    tmp = tmp_path_factory.mktemp("monitoring")
    sink = HttpSink([(409, {"error": "stale_fence"}), (503, {"error": "busy"})])
    url = sink.start()
    key = "STAGE_TOOL_PY"
    env = base_env(module_dsn, **{f"SIDECAR_PROFILE_{key}_RESULT_URL": f"{url}/results",
                                  f"SIDECAR_PROFILE_{key}_FORWARD_MAX_ATTEMPTS": "10000",
                                  f"SIDECAR_PROFILE_{key}_FORWARD_MAX_AGE_SECONDS": "3600",
                                  f"SIDECAR_PROFILE_{key}_STAGE_TIMEOUT_SECONDS": "1.5"})
    sidecars = [SidecarProcess(module_dsn, [TOOL], "--concurrency", "2", env=env, tmp=tmp)
                for _ in range(2)]
    proc = None
    try:
        targets = [_scrape(s) for s in sidecars]
        (tmp / "rules.yaml").write_text(yaml.safe_dump(_rule_groups(), sort_keys=False))
        (tmp / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": ["rules.yaml"],
            "scrape_configs": [{"job_name": "sidecar",
                                "static_configs": [{"targets": targets}]}]}))
        port = free_port()
        log = tmp / "prometheus.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [prometheus, f"--config.file={tmp / 'prometheus.yml'}",
                 f"--storage.tsdb.path={tmp / 'data'}",
                 f"--web.listen-address=127.0.0.1:{port}"],
                cwd=tmp, stdout=out, stderr=subprocess.STDOUT)
        prom = Prom(f"http://127.0.0.1:{port}", proc, log)
        wait_until(lambda: _answers(prom), 60, 0.2, what=f"prometheus ready ({log})")
        # Every counter is scraped at zero before anything happens, so rate() and
        # increase() see each event.
        wait_until(lambda: prom.value(f'count(sidecar_up{{tool="{TOOL}"}})') == 2, 30, 0.2,
                   what="both sidecars scraped")
        started = time.time()
        jobs = {
            "refused": enqueue(module_dsn, TOOL, {"mode": "last", "n": 1}, env=env),
        }
        wait_until(lambda: len(sink.requests) >= 1, 30, what="the first result forwarded")
        jobs.update({
            "kept": enqueue(module_dsn, TOOL, {"mode": "last", "n": 2}, env=env),
            "exit_code": enqueue(module_dsn, TOOL, {}, "--max-attempts", "1", env=env),
            "bad_result": enqueue(module_dsn, TOOL, {"mode": "none"}, "--max-attempts", "1",
                                  env=env),
            "killed": enqueue(module_dsn, TOOL, {"mode": "idle"}, "--max-attempts", "1",
                              env=env),
        })
        expected = {"refused": "succeeded", "kept": "succeeded", "exit_code": "failed",
                    "bad_result": "failed", "killed": "failed"}
        wait_until(lambda: {name: _state(module_dsn, job) for name, job in jobs.items()}
                   == expected, 60, 0.2, what=f"jobs ending as {expected}")
        done = cli(module_dsn, "pause", TOOL, env=env)
        assert done.returncode == 0, done.stderr.decode()
        jobs["waiting"] = enqueue(module_dsn, TOOL, {"mode": "last", "n": 3}, env=env)
        # Everything scraped: the finished attempts, the queue's age, the outbox.
        wait_until(lambda: prom.value("sum(sidecar_attempts_finished_total)") >= 5
                   and prom.value("max(sidecar_queue_oldest_age_seconds)") >= 1
                   and prom.value("max(sidecar_forward_backlog)") == 1
                   and prom.value("sum(sidecar_forward_dead_letters_total)") == 1,
                   60, 0.25, what="the jobs' ends scraped")
        yield prom, started, jobs, sidecars
    finally:
        if proc is not None:
            stop_process(proc, 15)
        for sidecar in sidecars:
            sidecar.stop()
        sink.stop()


def _answers(prom: Prom) -> bool:
    assert prom.proc.poll() is None, prom.log.read_text()[-3000:]
    try:
        with urllib.request.urlopen(prom.url + "/-/ready", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _state(dsn: str, job_id: str) -> str:
    return query(dsn, "SELECT state FROM tool_jobs WHERE id = $1", job_id)[0]["state"]


def _concrete(expr: str) -> str:
    """A panel's query as Grafana sends it: $tool as its All value, $__rate_interval a
    window longer than the module."""
    out = expr.replace("$__rate_interval", RATE_WINDOW).replace("$tool", ".*")
    assert "$" not in out, out
    return out


def _targets() -> list[tuple[str, str]]:
    board = json.loads((MONITORING / "sidecar-dashboard.json").read_text())
    return [(panel["title"], target["expr"]) for panel in board["panels"]
            for target in panel["targets"]]


@pytest.mark.e2e
def test_every_dashboard_query_returns_data_from_the_real_prometheus(stage):
    prom, _, _, _ = stage
    empty = [f"{title}: {expr}" for title, expr in _targets()
             if not prom.query(_concrete(expr))]
    assert not empty, "queries without data:\n" + "\n".join(empty)


@pytest.mark.e2e
def test_the_staged_events_show_in_the_panels_series(stage):
    """What happened is what the panels show: two sidecars, the claims and successes, each
    failure under its kind, the kill with its latency, the heartbeats' round trips, the
    job waiting behind the pause, the result kept in the outbox and the one refused."""
    prom, started, _, sidecars = stage
    by_title: dict[str, list[dict]] = {}
    for title, expr in _targets():
        by_title.setdefault(title, []).extend(prom.query(_concrete(expr)))

    def values(title: str, **labels: str) -> list[float]:
        return [float(r["value"][1]) for r in by_title[title]
                if all(r["metric"].get(k) == v for k, v in labels.items())]

    assert values("Sidecars alive", tool=TOOL) == [2]
    assert all(v > 0 for v in values("Throughput", tool=TOOL))
    assert len(values("Throughput", tool=TOOL)) == 2  # claimed, succeeded
    assert values("Outcomes", tool=TOOL, outcome="succeeded")[0] > 0
    assert values("Outcomes", tool=TOOL, outcome="failed")[0] > 0
    assert values("Failures by kind", tool=TOOL, kind="exit_code")[0] > 0
    assert values("Failures by kind", tool=TOOL, kind="bad_result")[0] > 0
    assert values("Failures by kind", tool=TOOL, kind="stage_timeout")[0] > 0
    assert values("Failures by kind", tool=TOOL, kind="memory_limit") == [0]
    kills = [float(r["value"][1]) for r in by_title["Kill latency"]
             if "reason" not in r["metric"]]  # p50 and p99
    assert len(kills) == 2 and all(0 < v < 10 for v in kills), kills
    assert values("Kill latency", tool=TOOL, reason="stage_timeout")[0] > 0
    assert all(not math.isnan(v) and v >= 0 for v in values("Heartbeat latency", tool=TOOL))
    assert values("Queue depth", tool=TOOL) == [1]
    waited = time.time() - started
    assert 1 <= values("Queue age", tool=TOOL)[0] <= waited + 5
    assert values("Forwarding backlog", tool=TOOL, kind="refused")[0] > 0
    [waiting] = [r for r in by_title["Forwarding backlog"] if "kind" not in r["metric"]]
    assert float(waiting["value"][1]) == 1
    assert values("Stale results", tool=TOOL) == [0]
    # A heartbeat the database did not answer in time (a loaded CI machine) is an episode
    # of unknown ownership: the panel may show one only when a sidecar logged one.
    episodes = sum(len(s.events("ownership_unknown")) for s in sidecars)
    unknown = values("Ownership unknown", tool=TOOL)
    assert len(unknown) == 2 and (unknown == [0, 0] or episodes > 0), (unknown, episodes)
    assert values("Lease losses", tool=TOOL) == [0, 0]


@pytest.mark.e2e
def test_the_rules_evaluate_on_the_real_series_and_the_dead_letter_fires(stage):
    """Prometheus loaded the PrometheusRule's groups and evaluates every rule without an
    error; the refused result fires SidecarForwardDeadLetters (it has no `for`), and with
    two sidecars alive nothing says the tool has none."""
    prom, _, _, _ = stage
    wait_until(lambda: all(r.get("lastEvaluation", "").startswith("2") and
                           r["lastEvaluation"] != "0001-01-01T00:00:00Z"
                           for g in prom.api("rules")["groups"] for r in g["rules"]),
               30, 0.25, what="every rule evaluated")
    rules = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
    assert {r["name"] for r in rules} == _alerts()
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError"))
                                                     for r in rules]

    def firing():
        return {(a["labels"]["alertname"], a["labels"].get("kind")) for a in
                prom.api("alerts")["alerts"] if a["state"] == "firing"}

    wait_until(lambda: ("SidecarForwardDeadLetters", "refused") in firing(), 30, 0.25,
               what="the dead-letter alert")
    assert {name for name, _ in firing()} == {"SidecarForwardDeadLetters"}


@pytest.mark.e2e
def test_the_panels_are_drawn_for_a_screenshot(stage, tmp_path):
    """Each panel's queries over the module's span, drawn as lines on a static page and
    screenshot by headless Chromium into TEST_ARTIFACTS_DIR/dashboard-panels.png
    (docs/img/dashboard-panels.png is one such)."""
    prom, started, _, _ = stage
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.fail("chromium is missing: apt-get install chromium (.ci/run does)")
    end = time.time()
    panels = []
    for spec in dashboard.PANELS:
        lines = []
        for target in spec.queries:
            data = prom.api("query_range", query=_concrete(target.expr), start=str(started - 5),
                            end=str(end), step="1")
            for series in data["result"]:
                legend = target.legend
                for name, value in series["metric"].items():
                    legend = legend.replace("{{" + name + "}}", value)
                points = [(float(t), float(v)) for t, v in series["values"]
                          if not math.isnan(float(v))]
                lines.append((legend, points))
        assert lines, spec.title
        panels.append((spec, lines))
    page = tmp_path / "panels.html"
    page.write_text(_page(panels, started - 5, end))
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "dashboard-panels.png"
    shot.unlink(missing_ok=True)
    rows = (len(panels) + 1) // 2
    done = subprocess.run(
        [chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         f"--user-data-dir={tmp_path / 'profile'}", "--hide-scrollbars",
         f"--window-size=1400,{rows * 250 + 80}", f"--screenshot={shot}", page.as_uri()],
        capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000


COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f")


def _page(panels, start: float, end: float) -> str:
    """A static page: per panel its title, queries' lines (an SVG, 0 at the bottom) and
    legends with each series' last value."""
    cells = []
    for spec, every in panels:
        # Series that stayed at zero are left out when another moved (a panel of kinds or
        # reasons has many); a panel where nothing moved keeps them all.
        lines = [(legend, points) for legend, points in every
                 if any(v for _, v in points)] or every
        top = max([v for _, points in lines for _, v in points] + [0]) or 1.0
        paths, legends = [], []
        for i, (legend, points) in enumerate(lines[:len(COLOURS)]):
            colour = COLOURS[i]
            xy = " ".join(f"{(t - start) / (end - start) * 640:.1f},"
                          f"{150 - v / top * 140:.1f}" for t, v in points)
            paths.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" '
                         f'points="{xy}"/>')
            last = f"{points[-1][1]:.3g}" if points else "NaN"
            legends.append(f'<span style="color:{colour}">&#9632; '
                           f"{html.escape(legend)} = {last}</span>")
        cells.append(
            f'<div class="panel"><h2>{html.escape(spec.title)} '
            f'<small>({html.escape(spec.unit)}, max {top:.3g})</small></h2>'
            f'<svg viewBox="0 0 640 150" width="640" height="150">'
            f'<line x1="0" y1="150" x2="640" y2="150" stroke="#999"/>{"".join(paths)}</svg>'
            f'<div class="legend">{"<br>".join(legends)}</div></div>')
    return ("<!doctype html><meta charset='utf-8'><style>body{font:13px sans-serif;"
            "margin:12px;background:#fff}h1{font-size:18px;margin:0 0 8px}"
            ".grid{display:grid;grid-template-columns:660px 660px;gap:8px}"
            ".panel{border:1px solid #ccc;padding:6px;height:228px;overflow:hidden}"
            "h2{font-size:14px;margin:0 0 4px}.legend{font-size:11px}</style>"
            "<h1>Sidecar: jobs, leases and kills. Each panel's queries on a real "
            "Prometheus (tests/test_monitoring.py), not Grafana's rendering</h1>"
            f"<div class='grid'>{''.join(cells)}</div>")
