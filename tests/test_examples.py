"""The tool examples under examples/ run against the reference receiver: one effect per
operation key, fenced with the attempt's token, replayed (not repeated) on a retry."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from kit import base_env, cli, enqueue, query

EXAMPLES = Path(__file__).parent.parent / "examples"


def _effects(url: str) -> list[dict]:
    with urllib.request.urlopen(url + "/effects", timeout=5) as response:
        return json.load(response)["effects"]


@pytest.mark.parametrize("example", ["create_case.sh", "create_case.py"])
def test_example_tool_sends_a_fenced_idempotent_effect(dsn, receiver, example):
    # The tool sees RECEIVER_URL only because its profile lets it through.
    env = base_env(dsn, RECEIVER_URL=receiver.url,
                   SIDECAR_PROFILE_CREATE_CASE_ENV_PASSTHROUGH="PATH,RECEIVER_URL")
    job_id = enqueue(dsn, "create-case", {"customer": "c-1048", "summary": "check invoice"},
                     env=env)
    done = cli(dsn, "run", "--tool", "create-case", "--drain", "--", str(EXAMPLES / example),
               env=env)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    job = query(dsn, "SELECT state, result, fencing_token FROM tool_jobs WHERE id = $1",
                job_id)[0]
    assert job["state"] == "succeeded", job
    assert job["result"]["status"] == 201
    [effect] = _effects(receiver.url)
    assert effect["idempotency_key"] == f"tool-job:{job_id}:create_case"
    assert effect["fence"] == job["fencing_token"] == 1
    assert effect["entity"] == f"tool-job:{job_id}"
    assert effect["body"] == {"customer": "c-1048", "summary": "check invoice"}

    # A second attempt of the same job (token 2) repeats the operation: the receiver
    # replays its answer instead of acting twice.
    query(dsn, "UPDATE tool_jobs SET state = 'queued', result = NULL WHERE id = $1", job_id)
    again = cli(dsn, "run", "--tool", "create-case", "--drain", "--", str(EXAMPLES / example),
                env=env)
    assert again.returncode == 0, again.stderr.decode()[-2000:]
    job = query(dsn, "SELECT state, result, fencing_token FROM tool_jobs WHERE id = $1",
                job_id)[0]
    assert job["state"] == "succeeded" and job["fencing_token"] == 2
    assert job["result"]["receiver"] == {"effect_id": effect["id"], "entity": effect["entity"],
                                         "fence": 1}
    assert len(_effects(receiver.url)) == 1
