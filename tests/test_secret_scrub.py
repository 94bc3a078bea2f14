"""No secret in what the sidecar stores or prints (issue 25, point 3).

The leak the issue found: leptonica, given the path of the mounted database Secret as an
image, printed the file's content as a "file name", and the job's ``error.stderr_tail``
(``sidecar show``) held the whole database URL with its password. Here in small: a real
``sidecar run`` with ``SIDECAR_DATABASE_URL_FILE`` and a real tool
(``tests/tools/echo_secret.py``) that echoes the file named in its payload. Every secret
the sidecar knows (the database URL and password, the guard tokens) is scrubbed from the
stderr tail, the log and the journal (``[secret]``), and a result, next-stage payload or
checkpoint that holds one is not stored (``secret_in_output``, not retried, journaled as
sha256 and size only). Both a userinfo password and a ``?password=`` parameter.

The first part checks the pure pieces (sidecar.protocol.masking's registry, the tail cut,
config.secret_values) without a database.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import orjson
import pytest
from test_secrets import every_row_as_text, leaks, with_password

from kit import base_env, cli, enqueue, job_row, journal_rows, query
from sidecar.protocol.masking import SECRET_MARK, SECRETS, SecretRegistry, secret_forms
from sidecar.protocol.results import stderr_tail_text
from sidecar.runtime.config import load_settings, secret_values

PASSWORD = "Sup3rSecretPw_xyz"
TOOL = "echo_secret.py"  # tests/tools/echo_secret.py; the tool is the command's basename


# --- the registry and the tail, no database -----------------------------------------------


def registry_with(dsn: str) -> SecretRegistry:
    registry = SecretRegistry()
    for label, values in secret_values(load_settings({}), dsn).items():
        registry.add(label, label, values)
    return registry


@pytest.mark.database
@pytest.mark.parametrize("dsn", [
    f"postgresql://app:{PASSWORD}@db:5432/app",
    f"postgresql://app@db:5432/app?sslmode=disable&password={PASSWORD}",
])
def test_both_password_forms_are_known_and_scrubbed(dsn):
    registry = registry_with(dsn)
    text = f"cannot open {dsn}\nalso {PASSWORD} and {orjson.dumps(dsn).decode()}"
    scrubbed = registry.scrub(text)
    assert not leaks(scrubbed), scrubbed
    assert scrubbed.startswith(f"cannot open {SECRET_MARK}\nalso {SECRET_MARK}")
    assert registry.labels_in(PASSWORD.encode()) == ["database_password"]
    assert registry.labels_in(dsn) == ["database_password", "database_url"]
    assert registry.labels_in(b"nothing of it") == []


@pytest.mark.unit
def test_a_percent_encoded_password_is_known_decoded_too():
    registry = registry_with("postgresql://app:p%40ss%2Fword@db/app")
    assert registry.labels_in("p@ss/word") == ["database_password"]
    assert registry.labels_in("p%40ss%2Fword") == ["database_password"]


@pytest.mark.unit
def test_json_escaped_spellings_are_found():
    value = 'pä/ss"word'
    registry = SecretRegistry()
    registry.add("k", "database_password", [value])
    for spelling in (orjson.dumps(value), orjson.dumps(value).replace(b"/", b"\\/"),
                     b'"p\\u00e4\\/ss\\"word"', b'"p\\u00e4/ss\\"word"'):
        assert registry.labels_in(spelling) == ["database_password"], spelling
        assert registry.holds(spelling), spelling
    assert len(secret_forms(value)) >= 4


@pytest.mark.unit
def test_short_values_are_not_registered_and_keys_are_independent():
    registry = SecretRegistry()
    registry.add("a", "x", ["pw", "longer-secret"])
    registry.add("b", "y", ["another-secret"])
    assert registry.scrub("pw longer-secret another-secret") == \
        f"pw {SECRET_MARK} {SECRET_MARK}"
    registry.discard("a")
    assert registry.scrub("longer-secret another-secret") == f"longer-secret {SECRET_MARK}"
    registry.discard("b")
    registry.discard("b")  # unknown: ignored
    assert not registry and registry.scrub("another-secret") == "another-secret"


@pytest.mark.unit
def test_answers_are_the_same_before_and_after_the_alternation_is_compiled():
    """A set of secrets is searched one spelling at a time until it has been searched
    REGEX_AFTER_SEARCHES times, then by its compiled alternation: holds and scrub answer
    alike either way, for text and bytes, and a change of the set (a guard token in or
    out) starts over with the new set at once."""
    from sidecar.protocol.masking import REGEX_AFTER_SEARCHES

    password, token = 'pä/ss"word', "tok-" + "a" * 39
    registry = SecretRegistry()
    registry.add("db", "database_password", [password])
    registry.add(("guard", 1), "guard_token", [token])
    clean = "job_failed bad_result exit 0 but stdout is not one JSON value"
    dirty = '{"line": ' + orjson.dumps(password).decode() + "} and " + token
    answers = []
    for _ in range(REGEX_AFTER_SEARCHES * 2 + 2):
        answers.append((registry.holds(clean), registry.holds(clean.encode()),
                        registry.holds(dirty), registry.holds(dirty.encode()),
                        registry.holds(bytearray(dirty.encode())),
                        registry.scrub(clean), registry.scrub(dirty)))
    assert answers[0] == (False, False, True, True, True, clean,
                          f'{{"line": "{SECRET_MARK}"}} and {SECRET_MARK}')
    assert all(answer == answers[0] for answer in answers)
    registry.add(("guard", 2), "guard_token", ["other-" + "b" * 37])
    registry.discard(("guard", 1))
    assert registry.holds("x other-" + "b" * 37) and not registry.holds(token)
    assert registry.scrub(token) == token


@pytest.mark.unit
def test_a_cut_edge_masks_a_piece_of_a_secret():
    registry = SecretRegistry()
    registry.add("k", "guard_token", ["ABCDEFGHIJ"])
    assert registry.scrub("HIJ rest", cut_start=True) == f"{SECRET_MARK} rest"
    assert registry.scrub("rest ABC", cut_end=True) == f"rest {SECRET_MARK}"
    assert registry.scrub("HIJ rest") == "HIJ rest"  # not cut: a word, not a piece


@pytest.mark.unit
def test_scrub_value_keeps_the_json_shape():
    registry = SecretRegistry()
    registry.add("k", "database_password", ['12,"x'])
    value = {"a": ['12,"x', 12, None], '12,"x': {"b": "y 12,\"x"}}
    assert registry.scrub_value(value) == {
        "a": [SECRET_MARK, 12, None], SECRET_MARK: {"b": f"y {SECRET_MARK}"}}


@pytest.mark.unit
def test_the_tail_is_scrubbed_before_it_is_cut():
    """A secret straddling the 4 KiB cut leaves no piece: the raw tail keeps a margin,
    is scrubbed whole, then cut."""
    key = ("test", "tail")
    SECRETS.add(key, "database_password", [PASSWORD])
    try:
        raw = ("y" * 100 + PASSWORD + "x" * (4096 - 6)).encode()
        tail = stderr_tail_text(raw, False, 4096)
        assert len(tail.encode()) == 4096 and PASSWORD[-6:] not in tail
        # A raw tail that itself starts inside the secret (the tool wrote more).
        tail = stderr_tail_text(PASSWORD[5:].encode() + b" rest", True, 4096)
        assert tail == f"{SECRET_MARK} rest"
    finally:
        SECRETS.discard(key)


# --- a real sidecar, the DSN from a file ------------------------------------------------------


@pytest.fixture(params=["userinfo", "query"])
def secret_env(request, dsn, tmp_path):
    """``(url, env)``: the test database reached with PASSWORD, in the URL's userinfo or
    as ``?password=``, given to the sidecar by SIDECAR_DATABASE_URL_FILE (as the
    manifests mount the Secret). The test server trusts local connections, so any
    password connects; the URL is checked to carry it."""
    if request.param == "userinfo":
        url = with_password(dsn, PASSWORD)
    else:
        parts = urlsplit(dsn)
        query_part = f"{parts.query}&" if parts.query else ""
        url = urlunsplit(parts._replace(query=f"{query_part}password={PASSWORD}"))
    assert PASSWORD in url
    secret_file = tmp_path / "db-url"
    secret_file.write_text(url + "\n")
    env = base_env(url, SIDECAR_LOG_TOOL_STDERR="true", SIDECAR_LOG_LEVEL="debug",
                   SIDECAR_PROFILE_ECHO_SECRET_PY_NEXT_TOOLS="echo_secret.py")
    del env["SIDECAR_DATABASE_URL"]
    env["SIDECAR_DATABASE_URL_FILE"] = str(secret_file)
    return url, env, str(secret_file)


def run_one(sidecars, url: str, env: dict, payload: dict, *extra: str) -> tuple[str, object]:
    """Enqueue one job of the tool and run ``sidecar run --drain`` until it ends; return
    the job id and the sidecar process (its log)."""
    job = enqueue(url, TOOL, payload, *extra, env=env)
    sc = sidecars(url, [TOOL], "--drain", env=env)
    assert sc.wait(60) == 0, sc.stderr_text()[-3000:]
    return job, sc


def assert_nothing_holds(url: str, env: dict, sc, job: str, *secrets: str) -> None:
    """Neither the rows (every table), ``sidecar show``/``events`` nor the sidecar's log
    hold any of ``secrets`` (in any spelling the leak check knows)."""
    log_text = sc.stderr_text()
    assert "Traceback" not in log_text, log_text[-3000:]
    for secret in secrets:
        assert not leaks(log_text, secret), log_text[-3000:]
        for table, texts in every_row_as_text(url).items():
            for text in texts:
                assert not leaks(text, secret), f"{table}: {text}"
        for command in ("show", "events"):
            done = cli(url, command, job, env=env)
            assert done.returncode == 0, done.stderr
            assert not leaks(done.stdout, secret), done.stdout
            assert not leaks(done.stderr, secret), done.stderr


@pytest.mark.e2e
def test_a_tool_echoing_the_secret_file_leaves_no_password(secret_env, sidecars):
    """The issue's leptonica leak: the file's content in the stderr tail, `sidecar show`,
    the log (tool_stderr lines) and the journal. Fails before the scrubbing."""
    url, env, path = secret_env
    job, sc = run_one(sidecars, url, env, {"file": path}, "--max-attempts", "1")
    row = job_row(url, job)
    assert row["state"] == "failed" and row["error"]["kind"] == "exit_code", row["error"]
    tail = row["error"]["stderr_tail"]
    # The tool did echo it: the lines are there, the secret replaced.
    assert f"echo_secret: cannot open {SECRET_MARK}\ntoken={SECRET_MARK}" in tail, tail
    assert sc.events("tool_stderr"), "the stderr lines were logged (so a leak would show)"
    assert_nothing_holds(url, env, sc, job, PASSWORD, url)


@pytest.mark.e2e
def test_a_secret_cut_by_the_tail_leaves_no_piece(secret_env, sidecars):
    """The last 4 KiB of the tool's stderr begin inside the password: no piece of it is
    kept (the tail is scrubbed before the cut, so it may come out shorter than 4 KiB)."""
    url, env, path = secret_env
    echoed = f"token={url}\n"
    pad = 4096 - (len(echoed) - (echoed.index(PASSWORD) + len(PASSWORD) - 6)) - 1
    job, sc = run_one(sidecars, url, env, {"file": path, "pad": pad}, "--max-attempts", "1")
    tail = job_row(url, job)["error"]["stderr_tail"]
    assert tail.endswith("x" * pad + "\n") and len(tail.encode()) <= 4096, tail[:200]
    assert PASSWORD[-6:] not in tail and PASSWORD[-3:] not in tail[:40], tail[:200]
    assert_nothing_holds(url, env, sc, job, PASSWORD, PASSWORD[-6:])


def outcome(url: str, job: str) -> tuple[dict, list]:
    row = job_row(url, job)
    return row, [r["details"] for r in journal_rows(url, job, "secret_in_output")]


@pytest.mark.e2e
def test_a_result_holding_the_password_is_not_stored(secret_env, sidecars):
    url, env, path = secret_env
    job, sc = run_one(sidecars, url, env, {"file": path, "to": "result"})
    row, journaled = outcome(url, job)
    assert row["state"] == "failed" and row["result"] is None, row
    assert row["attempt"] == 1, "secret_in_output is not retried"
    error = row["error"]
    assert error["kind"] == "secret_in_output", error
    assert error["secrets"] == ["database_password", "database_url"], error
    output = orjson.dumps({"text": url})  # what the tool printed (json.dump's spacing)
    assert error["result"]["bytes"] == len(output.replace(b'":"', b'": "')), error
    assert len(journaled) == 1 and journaled[0]["result"] == error["result"], journaled
    assert journaled[0]["secrets"] == error["secrets"], journaled
    assert sc.events("secret_in_output"), sc.stderr_text()[-2000:]
    assert_nothing_holds(url, env, sc, job, PASSWORD, url)


@pytest.mark.e2e
def test_a_next_stage_payload_holding_the_password_is_not_stored(secret_env, sidecars):
    url, env, path = secret_env
    job, sc = run_one(sidecars, url, env, {"file": path, "to": "next"})
    row, journaled = outcome(url, job)
    assert row["state"] == "failed" and row["error"]["kind"] == "secret_in_output", row
    assert row["result"] is None and journaled, row
    assert query(url, "SELECT id FROM tool_jobs WHERE parent_id = $1::uuid", job) == []
    assert_nothing_holds(url, env, sc, job, PASSWORD, url)


@pytest.mark.e2e
def test_a_guard_token_echoed_is_scrubbed_and_refused(secret_env, sidecars):
    """The attempt's own token: scrubbed from its stderr tail, refused in its result."""
    url, env, _ = secret_env
    failed, sc = run_one(sidecars, url, env, {"env": "SIDECAR_GUARD_TOKEN"},
                         "--max-attempts", "1")
    tail = job_row(url, failed)["error"]["stderr_tail"]
    assert f"token={SECRET_MARK}\n" in tail, tail
    refused, sc = run_one(sidecars, url, env, {"env": "SIDECAR_GUARD_TOKEN", "to": "result"})
    row, journaled = outcome(url, refused)
    assert row["error"]["kind"] == "secret_in_output", row["error"]
    assert row["error"]["secrets"] == ["guard_token"] and row["result"] is None, row
    assert journaled[0]["secrets"] == ["guard_token"], journaled


@pytest.mark.e2e
def test_a_checkpoint_holding_the_password_is_refused(secret_env, sidecars):
    url, env, path = secret_env
    job, sc = run_one(sidecars, url, env, {"file": path, "to": "checkpoint"})
    row = job_row(url, job)
    assert row["state"] == "succeeded", row["error"]
    assert row["result"] == {"status": 400, "answer": {
        "error": "secret_in_output", "secrets": ["database_password", "database_url"]}}
    assert row["checkpoint"] is None, row
    assert_nothing_holds(url, env, sc, job, PASSWORD, url)



@pytest.mark.unit
def test_a_guard_token_coming_and_going_recompiles_nothing():
    """Each key's spellings are searched on their own: once the database password's
    alternation is compiled, a guard token added and discarded (twice per attempt) leaves
    that alternation as it is, and a token (one spelling) is never compiled at all."""
    from sidecar.protocol.masking import INLINE_FORMS, REGEX_AFTER_SEARCHES

    password = 'pä/ss"word'
    registry = SecretRegistry()
    registry.add("db", "database_password", [password])
    (db_group,) = registry._snapshot.groups  # the large groups, searched by alternation
    assert len(db_group.forms) > INLINE_FORMS  # else it would never compile
    for _ in range(REGEX_AFTER_SEARCHES + 1):
        assert not registry.holds("a clean log line")
    compiled = db_group.compiled[str]
    for attempt in range(50):
        token = f"tok{attempt}-" + "c" * 40
        registry.add(("guard", attempt), "guard_token", [token])
        for _ in range(REGEX_AFTER_SEARCHES + 1):
            assert registry.holds(f"x {token} y") and not registry.holds("clean")
        assert registry.holds(password) and registry.labels_in(token) == ["guard_token"]
        registry.discard(("guard", attempt))
        assert not registry.holds(token)
    db_group_now, = registry._snapshot.groups
    assert db_group_now is db_group and db_group.compiled[str] is compiled


@pytest.mark.unit
def test_every_printable_ascii_secret_is_found_as_each_encoder_writes_it():
    """A plain ASCII value is registered as one spelling only when every encoder writes
    it unchanged: a value holding any character an encoder escapes is still found in
    JSON written by orjson, Python's json and PHP's slash-escaping encoder."""
    import json
    import string

    for char in string.printable:
        value = f"sec{char}ret"
        registry = SecretRegistry()
        registry.add("k", "database_password", [value])
        written = [value, orjson.dumps(value).decode(), json.dumps(value),
                   json.dumps(value).replace("/", "\\/")]
        for text in written:
            assert registry.holds(f"x {text} y"), (char, text)
            assert registry.holds(f"x {text} y".encode()), (char, text)
            assert SECRET_MARK in registry.scrub(f"x {text} y"), (char, text)
