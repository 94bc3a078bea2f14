"""A worker whose database role may not create anything (docs/operations.md, "What a
tool can still read in these pods"): on a current schema it starts, runs, prunes and
retries with only the grants the docs list, and the scaler's role reads the demand with
SELECT on tool_jobs alone."""

from __future__ import annotations

import uuid
from urllib.parse import urlsplit, urlunsplit

import pytest

from kit import base_env, cli, enqueue, job_row, query, scalar

WORKER_GRANTS = """
REVOKE CREATE ON SCHEMA public FROM PUBLIC;
GRANT USAGE ON SCHEMA public TO {role};
GRANT SELECT, INSERT, UPDATE, DELETE
    ON tool_jobs, tool_job_events, tool_job_outbox, tool_idle_sidecars TO {role};
GRANT SELECT ON sidecar_schema_migrations TO {role};
GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO {role};
"""


def _as(dsn: str, role: str) -> str:
    parts = urlsplit(dsn)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{role}@{host}"))


@pytest.fixture
def role(dsn):
    """A login role of our own in the test's server, dropped afterwards."""
    names = []

    def make(grants: str) -> str:
        name = f"sidecar_r_{uuid.uuid4().hex[:10]}"
        query(dsn, f'CREATE ROLE "{name}" LOGIN')
        names.append(name)
        for statement in grants.format(role=f'"{name}"').split(";"):
            if statement.strip():
                query(dsn, statement)
        return name

    yield make
    for name in names:
        query(dsn, f'DROP OWNED BY "{name}"')
        query(dsn, f'DROP ROLE "{name}"')


def test_a_worker_without_ddl_rights_runs_on_a_current_schema(dsn, role):
    worker = _as(dsn, role(WORKER_GRANTS))
    env = base_env(worker)
    assert scalar(dsn, "SELECT has_schema_privilege($1, 'public', 'CREATE')",
                  urlsplit(worker).username) is False
    job = enqueue(worker, "cat", {"n": 1}, env=env)
    done = cli(worker, "run", "--drain", "--", "cat", env=env)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert job_row(dsn, job)["state"] == "succeeded"
    assert cli(worker, "prune", "--older-than", "1", env=env).returncode == 0
    assert cli(worker, "retry", "--tool", "cat", env=env).returncode == 0


def test_the_scalers_role_needs_only_select_on_tool_jobs(dsn, role):
    scaler = _as(dsn, role("GRANT USAGE ON SCHEMA public TO {role};"
                           "GRANT SELECT ON tool_jobs TO {role}"))
    enqueue(dsn, "ocr", {})
    assert scalar(scaler, "SELECT tool_job_demand('ocr')") == 1
