"""The sidecar's Grafana dashboard as code (issue 30), built with grafana-foundation-sdk.

``python packaging/dashboard.py`` writes ``k8s/monitoring/sidecar-dashboard.json``, which
k8s/monitoring installs as a ConfigMap for Grafana's dashboard sidecar;
tests/test_monitoring.py checks that the committed file is what ``build()`` makes and runs
every panel's query against a real Prometheus scraping real sidecars.

Every query reads only the sidecar's own series (sidecar.ops.metrics, docs/operations.md
"Metrics and health") through two variables: ``$datasource`` (a Prometheus data source) and
``$tool`` (one tool or more, from ``sidecar_up``). Gauges that every sidecar of a tool
samples from the same table (queue depth and age, forwarding backlog) are read with
``max by (tool)``, never summed: ten sidecars see the same queue.

Needs the ``monitoring`` extra (``pip install -e '.[monitoring]'``); nothing of the sidecar
imports this file.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import NamedTuple

from grafana_foundation_sdk.builders import dashboard, prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh, VariableSort

OUTPUT = Path(__file__).resolve().parent.parent / "k8s" / "monitoring" / "sidecar-dashboard.json"
UID = "sidecar-jobs"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
TOOL = 'tool=~"$tool"'
RATE = "$__rate_interval"


class Query(NamedTuple):
    """One panel query: PromQL (with ``$tool`` and ``$__rate_interval``) and its legend."""

    expr: str
    legend: str


class PanelSpec(NamedTuple):
    """One panel: title, what it shows (the panel's description), unit, queries, and
    whether it is a stat (one number per tool) rather than a time series."""

    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]
    is_stat: bool = False


def _quantile(q: float, metric: str) -> str:
    return (f"histogram_quantile({q}, sum by (tool, le) "
            f"(rate({metric}_bucket{{{TOOL}}}[{RATE}])))")


PANELS: tuple[PanelSpec, ...] = (
    PanelSpec("Sidecars alive", "Sidecar processes of each tool exporting sidecar_up now.",
              "none", (Query(f"count by (tool) (sidecar_up{{{TOOL}}})", "{{tool}}"),),
              is_stat=True),
    PanelSpec("Throughput", "Jobs claimed and attempts that committed a result, per second.",
              "ops", (Query(f"sum by (tool) (rate(sidecar_jobs_claimed_total{{{TOOL}}}"
                            f"[{RATE}]))", "{{tool}} claimed"),
                      Query(f"sum by (tool) (rate(sidecar_attempts_finished_total{{{TOOL}, "
                            f'outcome="succeeded"}}[{RATE}]))', "{{tool}} succeeded"))),
    PanelSpec("Outcomes", "Attempts ended per second, by outcome (a job may take several).",
              "ops", (Query(f"sum by (tool, outcome) (rate(sidecar_attempts_finished_total"
                            f"{{{TOOL}}}[{RATE}]))", "{{tool}} {{outcome}}"),)),
    PanelSpec("Failures by kind", "Attempts that failed or were requeued, per second, by "
              "the error.kind written to the job.", "ops",
              (Query(f"sum by (tool, kind) (rate(sidecar_attempt_failures_total{{{TOOL}}}"
                     f"[{RATE}]))", "{{tool}} {{kind}}"),)),
    PanelSpec("Lease losses", "Leases lost before the job ended (zero rows or the local "
              "deadline), and jobs claimed from an owner whose lease had expired.", "ops",
              (Query(f"sum by (tool) (rate(sidecar_leases_expired_total{{{TOOL}}}[{RATE}]))",
                     "{{tool}} lost"),
               Query(f"sum by (tool) (rate(sidecar_jobs_reclaimed_total{{{TOOL}}}[{RATE}]))",
                     "{{tool}} reclaimed"))),
    PanelSpec("Ownership unknown", "Leases whose ownership is unknown now (the database did "
              "not confirm them), and episodes begun per second.", "short",
              (Query(f"sum by (tool) (sidecar_leases_ownership_unknown{{{TOOL}}})",
                     "{{tool}} leases unknown now"),
               Query(f"sum by (tool) (rate(sidecar_ownership_unknown_episodes_total{{{TOOL}}}"
                     f"[{RATE}]))", "{{tool}} episodes/s"))),
    PanelSpec("Kill latency", "First signal of a tree kill to every process gone (p50, p99), "
              "and kills per second by reason.", "s",
              (Query(_quantile(0.5, "sidecar_kill_duration_seconds"), "{{tool}} p50"),
               Query(_quantile(0.99, "sidecar_kill_duration_seconds"), "{{tool}} p99"),
               Query(f"sum by (tool, reason) (rate(sidecar_child_kills_total{{{TOOL}, "
                     f'signal!="already_exited"}}[{RATE}]))', "{{tool}} {{reason}} kills/s"))),
    PanelSpec("Stale results", "Outcomes not committed because the lease was no longer "
              "ours (P6): the fence refused a stale owner.", "short",
              (Query(f"sum by (tool) (increase(sidecar_completions_rejected_total{{{TOOL}}}"
                     f"[{RATE}]))", "{{tool}}"),)),
    PanelSpec("Queue depth", "Jobs the claim may take now by its row rules (queued, due and "
              "before their expiry, or under an expired lease with an attempt left); flow "
              "limits not applied.",
              "short", (Query(f"max by (tool) (sidecar_queue_depth{{{TOOL}}})", "{{tool}}"),)),
    PanelSpec("Queue age", "How long the oldest queued job has been due, by the database's "
              "clock.", "s",
              (Query(f"max by (tool) (sidecar_queue_oldest_age_seconds{{{TOOL}}})",
                     "{{tool}}"),)),
    PanelSpec("Heartbeat latency", "Round trip of one renewal statement (p50, p99), and the "
              "lease left just before a renewal (p1: the closest call).", "s",
              (Query(_quantile(0.5, "sidecar_heartbeat_duration_seconds"), "{{tool}} p50"),
               Query(_quantile(0.99, "sidecar_heartbeat_duration_seconds"), "{{tool}} p99"),
               Query(_quantile(0.01, "sidecar_lease_slack_seconds"),
                     "{{tool}} lease slack p1"))),
    PanelSpec("Forwarding backlog", "Results waiting in the outbox for RESULT_URL, and "
              "results dead-lettered by kind.", "short",
              (Query(f"max by (tool) (sidecar_forward_backlog{{{TOOL}}})", "{{tool}} waiting"),
               Query(f"sum by (tool, kind) (increase(sidecar_forward_dead_letters_total"
                     f"{{{TOOL}}}[{RATE}]))", "{{tool}} dead letters {{kind}}"))),
)


def _panel(spec: PanelSpec, width: int):
    kind = stat if spec.is_stat else timeseries
    panel = (kind.Panel().title(spec.title).description(spec.description).unit(spec.unit)
             .datasource(DATASOURCE).span(width).height(8))
    for ref, query in zip("ABCDEFGH", spec.queries, strict=False):
        panel = panel.with_target(prometheus.Dataquery().expr(query.expr)
                                  .legend_format(query.legend).ref_id(ref)
                                  .datasource(DATASOURCE))
    if not spec.is_stat:
        panel = panel.min(0)
    return panel


def build() -> dict:
    """The dashboard as Grafana's JSON model (a dict): the variables ``datasource`` and
    ``tool``, then PANELS in rows of two (the first, a stat, as wide as one)."""
    board = (dashboard.Dashboard("Sidecar: jobs, leases and kills").uid(UID)
             .tags(["sidecar"]).refresh("30s").time("now-3h", "now").timezone("browser")
             .editable()
             .with_variable(dashboard.DatasourceVariable("datasource").label("Data source")
                            .type("prometheus"))
             .with_variable(dashboard.QueryVariable("tool").label("Tool")
                            .datasource(DATASOURCE)
                            .query("label_values(sidecar_up, tool)")
                            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
                            .sort(VariableSort.ALPHABETICAL_ASC)
                            .multi(True).include_all(True).all_value(".*")))
    for spec in PANELS:
        board = board.with_panel(_panel(spec, 12))
    return json.loads(json.dumps(board.build(), cls=JSONEncoder))


def render() -> str:
    """The committed file's text: build() as indented JSON with a final newline."""
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def main() -> int:
    """Write OUTPUT; return 0."""
    OUTPUT.write_text(render())
    print(OUTPUT, file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
