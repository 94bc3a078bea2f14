"""Property-based fuzzing (Hypothesis) of the sidecar's untrusted inputs, on a fixed and
repeatable budget (``fuzz``: derandomized, no example database, no shrinking, bounded
example counts; the whole file runs in about 20 s).

a. ``sidecar enqueue`` arguments, through the real CLI entry (``sidecar.cli.main``) run
   in-process against the per-test PostgreSQL database: tool names, ``--payload`` texts
   and ``--payload-file`` bytes (invalid JSON and UTF-8, NUL, deep nesting, huge and tiny
   numbers, escaped NUL and lone surrogates), idempotency keys, ``--max-attempts`` values,
   JOB_ID arguments, and ``SIDECAR_MAX_PAYLOAD_BYTES``. Either the job row holds exactly the
   given payload (jsonb equality with the input text) or the exit code is 2 with one error
   line and no row; never a traceback. Arguments are built the way Python builds
   ``sys.argv`` (bytes without NUL, decoded with surrogateescape).
b. ``sidecar.runtime.config.load_settings`` on generated ``SIDECAR_*`` environments and
   ``Settings.profile`` on arbitrary tool text: ConfigError (one line, naming a
   ``SIDECAR_`` variable) or success; what succeeds is JSON-serialisable for ``sidecar
   config`` and every accepted profile variable takes effect. ``mask_url`` hides any
   password it is given.
c. ``sidecar.protocol.results.parse_result`` on arbitrary bytes and JSON-ish texts: BadResult or
   ``(value, text)``, and then PostgreSQL accepts ``text`` as jsonb; ``scrub_text`` output
   is always storable in jsonb.
d. The guard API (``sidecar.worker.guard.GuardServer``, real aiohttp server on loopback, a real
   lease claimed from PostgreSQL): arbitrary bodies, Authorization headers, chunked
   transfer; every answer is a documented status, and the server keeps answering.

Each concrete bug found is pinned by a plain test at the end of the file, with its input.
The server must be PostgreSQL with UTF-8 databases (jsonb's unicode escapes depend on it).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import socket
import threading
import uuid
from dataclasses import dataclass
from decimal import Decimal

import asyncpg
import orjson
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kit import FAST_PROFILE, base_env, cli
from sidecar.cli import main as cli_main
from sidecar.protocol import jsontext
from sidecar.protocol.clock import ownership_now
from sidecar.protocol.errors import ConfigError
from sidecar.protocol.jsontext import ExactNumber
from sidecar.protocol.masking import mask_url
from sidecar.protocol.model import RawJson, tool_env_key
from sidecar.protocol.results import BadResult, parse_result, scrub_text
from sidecar.runtime.config import (
    GLOBAL_FIELDS,
    MAX_ATTEMPTS_LIMIT,
    PASSIVE_VARIABLES,
    PROFILE_FIELDS,
    TOOL_NAME,
    Settings,
    load_settings,
)
from sidecar.storage.caller_store import CallerStore
from sidecar.storage.db import init_connection
from sidecar.storage.worker_store import WorkerStore
from sidecar.worker.guard import CHECKPOINT_LIMIT, GUARD_BODY_LIMIT, MAX_REQUEST_ID, GuardServer
from sidecar.worker.lease import Lease


def fuzz(examples: int):
    """The fixed budget: deterministic, no example database, no timing health checks, and
    no shrinking phase, so a failing run costs what a passing one does (the findings are
    pinned below as plain tests; add Phase.shrink locally to minimise a new one)."""
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    phases=(Phase.explicit, Phase.generate),
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.large_base_example])


# PostgreSQL refuses these as jsonb (SQLSTATE class 22 = DataError, or 54 program limit);
# the supervisor and the guard turn them into bad_result / 400.
STORABLE_ERRORS = (asyncpg.DataError, asyncpg.ProgramLimitExceededError)


# --- a real PostgreSQL connection on a loop of its own ---------------------------------------


class LoopThread:
    """An event loop running in a thread: lets synchronous Hypothesis examples talk to a
    connection or a server that lives for the whole test."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


class Pg:
    """One connection with the project's codecs (jsonb parameters as RawJson text)."""

    def __init__(self, dsn: str):
        self.loop = LoopThread()
        self.conn = self.loop.call(self._connect(dsn))

    @staticmethod
    async def _connect(dsn):
        conn = await asyncpg.connect(dsn)
        await init_connection(conn)
        return conn

    def fetch(self, sql: str, *args):
        return self.loop.call(self.conn.fetch(sql, *args))

    def fetchval(self, sql: str, *args):
        return self.loop.call(self.conn.fetchval(sql, *args))

    def jsonb(self, text: str):
        """``SELECT $1::jsonb`` of ``text`` sent as is; raises what PostgreSQL raises."""
        return self.fetchval("SELECT $1::jsonb", RawJson(text))

    def close(self):
        self.loop.call(self.conn.close())
        self.loop.close()


@pytest.fixture
def pg(dsn):
    conn = Pg(dsn)
    yield conn
    conn.close()


# --- strategies ---------------------------------------------------------------------------


def argv_text(max_size: int = 60) -> st.SearchStrategy[str]:
    """Text that can reach ``sys.argv``: no NUL; bytes that are not UTF-8 arrive as lone
    surrogates (surrogateescape), anything else as itself; sometimes very long."""
    return st.one_of(
        st.text(st.characters(blacklist_characters="\x00"), max_size=max_size),
        st.binary(max_size=max_size).map(lambda b: os.fsdecode(b.replace(b"\x00", b""))),
        st.builds(lambda c, n: c * n, st.sampled_from(["a", "é", "-", " ", "\n"]),
                  st.integers(60, 3000)),
    )


JSON_LEAVES = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12),
)
JSON_VALUES = st.recursive(
    JSON_LEAVES,
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=10,
)

# Texts on the edges between orjson, Python and PostgreSQL's jsonb.
SPECIAL_TOKENS = [
    "1e400", "-1e400", "1e308", "2e308", "1e-400", "1e-16383", "1e-16384", "1e-20000",
    "0e-20000", "-0", "-0.0", "1.0e2", "1E+2", "0.1" + "0" * 300 + "1",
    "1" + "0" * 30, "1" + "0" * 400, "-" + "9" * 400, "123456789012345678901234567890",
    '"\\u0000"', '"a\\u0000b"', '"\\\\u0000"', '"\\\\\\u0000"', '"\\\\\\\\u0000"', '"u0000"',
    '"\\ud800"', '"\\udfff"', '"\\udc00\\ud800"', '"\\ud800\\u0041"', '"\\ud83d\\ude00"',
    '"\\uFFFF"', '"\\u00e9"', '"\\/"', "NaN", "Infinity", "-Infinity", "{'a': 1}", "[1,]",
    "", " ", "{} {}", "01", "1.", ".5", "+1", "0x10", "true false", "nul", "\u00a0{}",
    '{"a": 1, "a": 2}', "\t[]\r\n", "[" * 1023 + "]" * 1023, "[" * 1024 + "]" * 1024,
    "[" * 1025 + "]" * 1025, '{"a":' * 1000 + "1" + "}" * 1000, "[" * 3000,
]
SPECIAL = st.sampled_from(SPECIAL_TOKENS)


def _embed(token: str, value) -> str:
    return orjson.dumps(value).decode().replace('"@@"', token, 1)


JSONISH_TEXT = st.one_of(
    JSON_VALUES.map(lambda v: orjson.dumps(v).decode()),
    SPECIAL,
    # A special token somewhere inside an ordinary document.
    st.builds(lambda token, k: _embed(token, {k: "@@", "n": [1, "@@"]}), SPECIAL,
              st.text(max_size=5)),
    st.builds(lambda token, v: _embed(token, [v, "@@"]), SPECIAL, JSON_VALUES),
    # Backslash runs before u0000: which of them is an escaped NUL is a matter of parity.
    st.builds(lambda k, pre: f'["{pre}' + "\\" * k + 'u0000"]', st.integers(0, 6),
              st.sampled_from(["", "a", "\\\\"])),
)

JSONISH_BYTES = st.one_of(
    JSONISH_TEXT.map(str.encode),
    st.binary(max_size=200),
    # Raw NUL, invalid UTF-8, a BOM, a truncated multi-byte sequence, inside valid JSON.
    st.builds(lambda raw, at: (lambda doc: doc[:at] + raw + doc[at:])(b'{"k": ["ab", 1]}'),
              st.sampled_from([b"\x00", b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xef\xbb\xbf",
                               b"\x1f", b"\x7f", b"\xc2\xa0"]), st.integers(0, 16)),
    st.builds(lambda text: b"\xef\xbb\xbf" + text.encode(), JSONISH_TEXT),
)


# --- the CLI, in-process ----------------------------------------------------------------------


@dataclass
class Outcome:
    code: int
    stdout: bytes
    stderr: str
    argparse: bool  # argparse refused the command line itself (SystemExit)


def call_cli(argv: list[str]) -> Outcome:
    """``sidecar ARGV`` in this process, stdout/stderr captured; any exception but
    argparse's SystemExit propagates (and fails the test)."""
    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="surrogateescape")
    err = io.StringIO()
    by_argparse = False
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli_main(argv)
        except SystemExit as exc:
            code, by_argparse = exc.code, True
    out.flush()
    return Outcome(code, out.buffer.getvalue(), err.getvalue(), by_argparse)


def one_error_line(outcome: Outcome) -> str:
    """The single ``sidecar: error:`` line of a refused command (exit 2, no stdout)."""
    assert outcome.code == 2, outcome
    assert outcome.stdout == b"", outcome
    assert "Traceback" not in outcome.stderr, outcome.stderr
    lines = outcome.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("sidecar: error: "), outcome.stderr
    return lines[0]


@pytest.fixture
def sidecar_env(dsn, monkeypatch):
    """os.environ as a sidecar under test sees it (our SIDECAR_* removed, the per-test
    database), for in-process CLI calls."""
    for name in list(os.environ):
        if name.startswith("SIDECAR_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("SIDECAR_DATABASE_URL", dsn)
    monkeypatch.setenv("SIDECAR_DB_TIMEOUT_SECONDS", "10")
    return dsn


def same_json(a, b, approximate: bool = False) -> bool:
    """JSON equality up to number representation: jsonb keeps numbers as numeric and
    prints 6.1e+16 as 61000000000000000, which is then read as an int. Numbers compare by
    exact decimal value (``jsontext.ExactNumber`` keeps what no float holds), or as
    floats with ``approximate`` (against orjson's own, lossy, reading). Iterative:
    documents nest 1024 deep."""
    numbers = (int, float, ExactNumber)
    pending = [(a, b)]
    while pending:
        x, y = pending.pop()
        if isinstance(x, numbers) and isinstance(y, numbers) \
                and not isinstance(x, bool) and not isinstance(y, bool):
            if approximate and float(_decimal(x)) != float(_decimal(y)):  # 1e400: inf
                return False
            if not approximate and _decimal(x) != _decimal(y):
                return False
        elif isinstance(x, list) and isinstance(y, list):
            if len(x) != len(y):
                return False
            pending.extend(zip(x, y, strict=True))
        elif isinstance(x, dict) and isinstance(y, dict):
            if x.keys() != y.keys():
                return False
            pending.extend((x[k], y[k]) for k in x)
        elif type(x) is not type(y) or x != y:
            return False
    return True


def _decimal(number) -> Decimal:
    return Decimal(number.text if isinstance(number, ExactNumber) else repr(number))


def job_count(pg: Pg) -> int:
    return pg.fetchval("SELECT count(*) FROM tool_jobs")


def classify_payload(pg: Pg, raw: bytes) -> str:
    """What enqueue must do with ``raw``: "ok", "bad_json" (not one JSON value, or not
    UTF-8) or "jsonb" (valid JSON that PostgreSQL refuses as jsonb: for a number beyond
    numeric's range the sidecar says so itself, naming jsonb, case F24)."""
    try:
        orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        # orjson refuses a number beyond a double's range, which is valid JSON (case F24).
        if "number is infinity" not in str(exc):
            return "bad_json"
    try:
        pg.jsonb(raw.decode("utf-8"))
    except STORABLE_ERRORS:
        return "jsonb"
    return "ok"


def check_enqueue(pg: Pg, argv: list[str], raw: bytes, source: str, *, tool: str = "ocr",
                  key: str | None = None, max_attempts: int | None = None,
                  other_errors: bool = False) -> Outcome:
    """Run ``argv`` (an enqueue of ``raw`` for ``tool``) and check the outcome against what
    the payload, key and tool call for. ``other_errors``: another argument is invalid too,
    so the error line may name it instead of the payload."""
    kind = classify_payload(pg, raw)
    before = job_count(pg)
    existing = None
    if key is not None and kind == "ok":
        rows = pg.fetch("SELECT id, tool, payload = $2::jsonb AS same FROM tool_jobs "
                        "WHERE idempotency_key = $1", key, RawJson(raw.decode()))
        existing = rows[0] if rows else None
    conflict = existing is not None and not (existing["tool"] == tool and existing["same"])
    outcome = call_cli(argv)
    if outcome.argparse:
        return outcome
    if kind == "ok" and not other_errors and not conflict:
        assert outcome.code == 0, outcome
        answer = orjson.loads(outcome.stdout)
        assert set(answer) == {"id", "created"}, answer
        if existing is not None:  # the same key, tool and payload: the same job
            assert answer == {"id": str(existing["id"]), "created": False}
            assert job_count(pg) == before
            return outcome
        assert answer["created"] is True
        assert job_count(pg) == before + 1
        row = pg.fetch("SELECT tool, idempotency_key, max_attempts, payload, "
                       "payload = $2::jsonb AS same FROM tool_jobs WHERE id = $1",
                       uuid.UUID(answer["id"]), RawJson(raw.decode()))[0]
        assert row["same"], (raw, row["payload"])
        assert same_json(row["payload"], jsontext.loads(raw)), (raw, row["payload"])
        assert row["tool"] == tool
        assert row["idempotency_key"] == (key if key is not None else answer["id"])
        # Not given: NULL, the claiming sidecar's profile decides (issue 26, migration 014).
        assert row["max_attempts"] == max_attempts
        return outcome
    line = one_error_line(outcome)
    assert job_count(pg) == before
    if other_errors:
        pass
    elif kind == "bad_json":
        assert source in line, line
    elif kind == "jsonb":
        assert "jsonb" in line, line
    else:  # the key already names a job of another tool or with another payload
        assert "--idempotency-key" in line and repr(key) in line, line
    return outcome


# --- a. enqueue --------------------------------------------------------------------------------


@pytest.mark.database
@fuzz(120)
@given(tool=argv_text())
def test_enqueue_tool_names(sidecar_env, pg, tool):
    before = job_count(pg)
    outcome = call_cli(["enqueue", "--payload={}", "--", tool])
    if TOOL_NAME.fullmatch(tool):
        assert outcome.code == 0, outcome
        job_id = uuid.UUID(orjson.loads(outcome.stdout)["id"])
        assert pg.fetchval("SELECT tool FROM tool_jobs WHERE id = $1", job_id) == tool
    else:
        assert "tool" in one_error_line(outcome)
        assert job_count(pg) == before


@pytest.mark.database
@fuzz(150)
@given(text=st.one_of(JSONISH_TEXT, argv_text()))
def test_enqueue_payload_argument(sidecar_env, pg, text):
    if "\x00" in text:  # an argv cannot hold NUL; JSON escapes of it are fine
        text = text.replace("\x00", "")
    raw = text.encode("utf-8", "surrogateescape")
    outcome = check_enqueue(pg, ["enqueue", f"--payload={text}", "--", "ocr"], raw,
                            "--payload")
    assert not outcome.argparse, outcome


@pytest.mark.database
@fuzz(120)
@given(data=JSONISH_BYTES)
def test_enqueue_payload_file(sidecar_env, pg, tmp_path, data):
    path = tmp_path / "payload.bin"
    path.write_bytes(data)
    outcome = check_enqueue(pg, ["enqueue", "--payload-file", str(path), "--", "ocr"], data,
                            "--payload-file")
    assert not outcome.argparse, outcome


KEYS = st.one_of(
    st.sampled_from(["k1", "k2", "invoice-42:capture", " ", "", "k\n", "k\t", "x" * 512,
                     "x" * 513, "é" * 512, "\u200b", "\u00a0k"]),
    argv_text(),
)
MAX_ATTEMPTS_TEXT = st.one_of(
    st.integers(-3, MAX_ATTEMPTS_LIMIT + 3).map(str),
    st.integers(-(10**30), 10**30).map(str),
    st.sampled_from([" 7 ", "٣", "1_0", "0x10", "1e3", "", "2147483648", "9" * 5000, "²"]),
    argv_text(10),
)


@pytest.mark.database
@fuzz(150)
@given(tool=st.sampled_from(["ocr", "pdf"]), key=st.none() | KEYS,
       attempts=st.none() | MAX_ATTEMPTS_TEXT, payload=st.sampled_from(
           ['{"a": 1}', '{"a": 2}', '{"a": 1.0}', '{ "a" : 1 }', "[]", "null", '"\\u0000"']))
def test_enqueue_idempotency_keys_and_max_attempts(sidecar_env, pg, tool, key, attempts,
                                                   payload):
    argv = ["enqueue", f"--payload={payload}"]
    if key is not None:
        argv.append(f"--idempotency-key={key}")
    if attempts is not None:
        argv.append(f"--max-attempts={attempts}")
    argv += ["--", tool]
    try:
        # What the CLI's bounded integer type does: ASCII digits only (int() alone also
        # reads other scripts' digits, "٣" as 3, which the CLI refuses).
        n = None if attempts is None else int(attempts) if attempts.isascii() \
            else "not an int"
    except ValueError:
        n = "not an int"
    key_ok = key is None or (key.strip() != "" and len(key) <= 512 and key.isprintable())
    attempts_ok = n is None or (isinstance(n, int) and 1 <= n <= MAX_ATTEMPTS_LIMIT)
    before = job_count(pg)
    outcome = check_enqueue(pg, argv, payload.encode(), "--payload", tool=tool,
                            key=key if key_ok else None,
                            max_attempts=n if attempts_ok else None,
                            other_errors=not (key_ok and attempts_ok))
    if not attempts_ok:  # refused by argparse's bounded type: exit 2, one line (F24)
        assert outcome.argparse and outcome.code == 2, outcome
        assert "Traceback" not in outcome.stderr
        [line] = outcome.stderr.splitlines()
        assert line.startswith("sidecar: error: sidecar enqueue: argument --max-attempts")
        assert job_count(pg) == before
        return
    assert not outcome.argparse, outcome
    if not (key_ok and attempts_ok):
        line = one_error_line(outcome)
        named = [opt for opt, ok in (("--idempotency-key", key_ok),
                                     ("--max-attempts", attempts_ok)) if not ok]
        assert any(opt in line for opt in named) or ("jsonb" in line and "u0000" in payload), \
            line
        assert job_count(pg) == before


@pytest.mark.database
@fuzz(60)
@given(job_id=st.one_of(argv_text(), st.uuids().map(str),
                        st.uuids().map(lambda u: "{" + u.hex.upper() + "}"),
                        st.uuids().map(lambda u: "urn:uuid:" + str(u))),
       command=st.sampled_from(["show", "events", "cancel"]))
def test_job_id_arguments(sidecar_env, pg, job_id, command):
    outcome = call_cli([command, "--", job_id])
    assert not outcome.argparse and "Traceback" not in outcome.stderr, outcome
    try:
        uuid.UUID(job_id)
    except ValueError:
        assert "JOB_ID" in one_error_line(outcome)
        return
    # A well-formed id of no job: exit 1, one line naming it.
    assert outcome.code == 1 and outcome.stdout == b"", outcome
    lines = outcome.stderr.splitlines()
    assert len(lines) == 1 and str(uuid.UUID(job_id)) in lines[0], outcome.stderr


PAYLOAD_LIMIT = 64


@pytest.mark.database
@fuzz(40)
@given(size=st.integers(0, 300), via_file=st.booleans())
def test_payload_over_max_payload_bytes_is_refused(sidecar_env, pg, monkeypatch, tmp_path,
                                                   size, via_file):
    """SIDECAR_MAX_PAYLOAD_BYTES (global): a payload larger than the limit is refused at
    enqueue, one line naming the variable, no row; one well under it is queued."""
    monkeypatch.setenv("SIDECAR_MAX_PAYLOAD_BYTES", str(PAYLOAD_LIMIT))
    raw = orjson.dumps({"s": "x" * size})
    if via_file:
        (tmp_path / "p.json").write_bytes(raw)
        argv = ["enqueue", "--payload-file", str(tmp_path / "p.json"), "--", "ocr"]
    else:
        argv = ["enqueue", f"--payload={raw.decode()}", "--", "ocr"]
    before = job_count(pg)
    outcome = call_cli(argv)
    if len(raw) > PAYLOAD_LIMIT:
        assert "SIDECAR_MAX_PAYLOAD_BYTES" in one_error_line(outcome)
        assert job_count(pg) == before
    elif len(raw) <= PAYLOAD_LIMIT - 16:
        assert outcome.code == 0, outcome
        assert job_count(pg) == before + 1


# --- b. configuration ----------------------------------------------------------------------------


ENV_TEXT = st.text(st.characters(blacklist_characters="\x00"), max_size=20)
ENV_NAME_TEXT = st.text(st.characters(blacklist_characters="\x00="), min_size=1, max_size=20)
TOOL_KEYS = st.one_of(
    st.from_regex(r"[A-Z0-9][A-Z0-9_]{0,12}", fullmatch=True),
    st.sampled_from(["OCR", "OCR_FAST", "ocr", "Ocr", "_X", "A B", "É", "X" * 64, "A-B"]),
    ENV_NAME_TEXT,
)
VALUES = st.one_of(
    st.integers(-5, 10**6).map(str),
    st.floats().map(repr),
    st.integers(2**63 - 2, 10**500).map(str),
    st.sampled_from(["", " ", "0", "1", "2", "3", "0.5", "100", "1e400", "1e308", "-1", "inf",
                     "nan", "1_000", " 7 ", "٣", "²", "64,65", "1,256", "a,b", "true", "off",
                     "json", "text", "transaction", "asyncio", "auto", "127.0.0.1:0",
                     "http://x", "ocr,pdf", "0:0", "PATH,HOME", "SIDECAR_X"]),
    ENV_TEXT,
)
VAR_NAMES = st.one_of(
    st.sampled_from(["SIDECAR_" + n for n in [*PROFILE_FIELDS, *GLOBAL_FIELDS]]),
    st.builds(lambda key, field: f"SIDECAR_PROFILE_{key}_{field}", TOOL_KEYS,
              st.sampled_from(list(PROFILE_FIELDS))),
    ENV_NAME_TEXT.map(lambda rest: "SIDECAR_" + rest),
    ENV_NAME_TEXT.map(lambda rest: "SIDECAR_PROFILE_" + rest),
    st.sampled_from(sorted(PASSIVE_VARIABLES) + ["PATH", "HOME", "sidecar_lease_seconds"]),
)
ENVIRONMENTS = st.dictionaries(VAR_NAMES, VALUES, max_size=6)


def load_or_error(env: dict[str, str]) -> Settings | ConfigError:
    try:
        return load_settings(env)
    except ConfigError as exc:
        return exc


def assert_config_error(exc: ConfigError) -> None:
    assert exc.exit_code == 2
    assert len(exc.message.splitlines()) == 1, exc.message
    assert "SIDECAR_" in exc.message, exc.message


@pytest.mark.unit
@fuzz(150)
@given(env=ENVIRONMENTS)
def test_load_settings_raises_only_one_line_config_errors(env):
    outcome = load_or_error(env)
    if isinstance(outcome, ConfigError):
        assert_config_error(outcome)
    else:
        outcome.default_profile()


INTEGER_SETTINGS = st.dictionaries(
    st.sampled_from([f"SIDECAR_{name}" for name, spec in PROFILE_FIELDS.items()
                     if spec.default.isdigit()]),
    st.integers(0, 10**40).map(str), min_size=1, max_size=2)


@pytest.mark.unit
@fuzz(150)
@given(env=st.one_of(ENVIRONMENTS, INTEGER_SETTINGS))
def test_accepted_settings_serialise_for_sidecar_config(env):
    """What load_settings accepts, ``sidecar config`` and the journal can print as JSON
    (LeaseProfile.as_dict promises plain JSON-able values)."""
    settings_ = load_or_error(env)
    if isinstance(settings_, ConfigError):
        return
    profiles = [settings_.default_profile()] + [
        settings_.profile(key.lower()) for key in settings_.profile_tools()
        if TOOL_NAME.fullmatch(key.lower())]
    for profile in profiles:
        orjson.dumps(profile.as_dict())


# Values each valid on their own, so that the tool key decides whether a variable counts.
_SAFE_VALUES = {"MAX_ATTEMPTS": "5", "STAGE_TIMEOUT_SECONDS": "60", "PROVIDER": "acme",
                "NEXT_TOOLS": "pdf", "BACKOFF_BASE_SECONDS": "1", "MAX_RESULT_BYTES": "1000",
                "NON_RETRYABLE_EXIT_CODES": "3", "RESULT_URL": "http://hooks.example/in"}
PROFILE_VARIABLES = st.dictionaries(
    st.builds(lambda key, field: f"SIDECAR_PROFILE_{key}_{field}", TOOL_KEYS,
              st.sampled_from([f for f in _SAFE_VALUES if f in PROFILE_FIELDS])),
    st.just(""), min_size=1, max_size=3,
).map(lambda env: {var: _SAFE_VALUES[next(f for f in _SAFE_VALUES if var.endswith("_" + f))]
                   for var in env})


@pytest.mark.unit
@fuzz(150)
@given(env=st.one_of(ENVIRONMENTS, PROFILE_VARIABLES))
def test_every_accepted_profile_variable_takes_effect(env):
    """Every SIDECAR_* variable must be known: a SIDECAR_PROFILE_<TOOL>_<FIELD> variable
    that load_settings accepts must set FIELD for some tool (else it is silently ignored,
    which is what the check exists to prevent)."""
    settings_ = load_or_error(env)
    if isinstance(settings_, ConfigError):
        return
    for var in env:
        if not var.startswith("SIDECAR_PROFILE_") or not env[var].strip():
            continue  # an empty or blank variable is unset (case F24): nothing to take effect
        rest = var[len("SIDECAR_PROFILE_"):]
        # A name can read two ways (SIDECAR_PROFILE_FX_FORWARD_MAX_ATTEMPTS: tool fx's
        # FORWARD_MAX_ATTEMPTS, or tool fx-forward's MAX_ATTEMPTS): one must take effect.
        readings = [(rest[: -(len(f) + 1)], f) for f in PROFILE_FIELDS
                    if rest.endswith("_" + f)]
        valid = [(key.lower(), f) for key, f in readings
                 if TOOL_NAME.fullmatch(key.lower()) and tool_env_key(key.lower()) == key]
        assert valid, f"{var} was accepted, but no tool name maps to its key"
        assert any(settings_.profile(tool).sources[f] == var for tool, f in valid), var


@pytest.mark.unit
@fuzz(150)
@given(password=st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=6,
                        max_size=24),
       query=st.booleans())
def test_mask_url_never_shows_a_password(password, query):
    """What `sidecar config` and every connection error print of SIDECAR_DATABASE_URL: a
    password (written as is, or in ?password=) never survives the mask."""
    url = (f"postgresql://app@db.example:5432/app?password={password}" if query
           else f"postgresql://app:{password}@db.example:5432/app")
    masked = mask_url(url)
    assert password not in masked, (url, masked)


TOOLS_TO_ASK = st.one_of(
    argv_text(),
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", fullmatch=True),
    st.sampled_from(["ocr-fast", "OCR.FAST", "ocr_fast", "Ocr-Fast", "ocr-fast\n", "ocr fast"]),
)
FIXED_SETTINGS = load_settings({**FAST_PROFILE, "SIDECAR_PROFILE_OCR_FAST_MAX_ATTEMPTS": "7"})


@pytest.mark.unit
@fuzz(150)
@given(tool=TOOLS_TO_ASK)
def test_profile_of_arbitrary_tool_text(tool):
    try:
        profile = FIXED_SETTINGS.profile(tool)
    except ConfigError as exc:
        assert not TOOL_NAME.fullmatch(tool)
        assert len(exc.message.splitlines()) == 1 and repr(tool) in exc.message
        return
    assert TOOL_NAME.fullmatch(tool)
    assert profile.tool == tool
    assert profile.max_attempts == (7 if tool_env_key(tool) == "OCR_FAST" else 3)
    orjson.dumps(profile.as_dict())


# --- c. what a tool prints -----------------------------------------------------------------------


def check_parse_result(pg: Pg, data: bytes) -> str:
    """parse_result's contract on ``data``; returns "bad_result", "stored" or the name of
    the PostgreSQL error for a result it accepted and jsonb refused."""
    try:
        value, text = parse_result(data)
    except BadResult as exc:
        assert len(exc.message.splitlines()) == 1 and len(exc.message) < 400, exc.message
        return "bad_result"
    assert isinstance(text, RawJson) and text == data.decode("utf-8")
    assert same_json(value, json.loads(data), approximate=True)
    try:
        stored = pg.jsonb(text)
    except STORABLE_ERRORS as exc:  # the supervisor's net: bad_result at commit
        return type(exc).__name__
    assert same_json(stored, value), (data, stored)
    return "stored"


@pytest.mark.database
@fuzz(100)
@given(data=st.binary(max_size=300))
def test_parse_result_arbitrary_bytes(pg, data):
    check_parse_result(pg, data)


@pytest.mark.database
@fuzz(150)
@given(data=JSONISH_BYTES)
def test_parse_result_jsonish(pg, data):
    check_parse_result(pg, data)


ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=80)  # surrogates, NUL too


@pytest.mark.database
@fuzz(150)
@given(text=st.one_of(ANY_TEXT, st.none(),
                      st.lists(st.sampled_from(["\x00", "\ud800", "\udfff", "\\u0000", "é",
                                                "\U0001f600", "\n", "\x1b[31m"]),
                               max_size=10).map("".join)))
def test_scrub_text_is_always_storable(pg, text):
    scrubbed = scrub_text(text)
    if text is None:
        assert scrubbed is None
        return
    assert "\x00" not in scrubbed
    scrubbed.encode("utf-8")  # no lone surrogate left
    if "\x00" not in text and not any("\ud800" <= c <= "\udfff" for c in text):
        assert scrubbed == text  # clean text passes unchanged
    assert pg.jsonb(orjson.dumps({"m": scrubbed}).decode()) == {"m": scrubbed}


# --- d. the guard API ----------------------------------------------------------------------------


GUARD_TOOL = "fuzzed"
DOCUMENTED = {200, 400, 401, 403, 404, 408, 409, 413, 503}


@dataclass
class GuardUnderTest:
    port: int
    token: str
    job_id: uuid.UUID
    fencing_token: int


@pytest.fixture
def guard(dsn):
    """A GuardServer on loopback with one job claimed (lease of 300 s, local deadline in
    600 s) and registered; lives on a loop of its own for the whole test."""
    loop = LoopThread()
    state = {}

    async def start():
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4, init=init_connection)
        store, caller = WorkerStore(pool, timeout=10), CallerStore(pool, timeout=10)
        server = GuardServer(store, load_settings(FAST_PROFILE).profile(GUARD_TOOL), "fuzz-w1")
        url = await server.start()
        await caller.enqueue(GUARD_TOOL, {"n": 1}, None, 3, {})
        job = await store.claim(GUARD_TOOL, "fuzz-w1", 300)
        lease = Lease(job, local_deadline=ownership_now() + 600, lease_until=job.lease_until)
        state.update(pool=pool, server=server)
        return GuardUnderTest(int(url.rsplit(":", 1)[1]), server.register(lease), job.id,
                              job.fencing_token)

    async def stop():
        await state["server"].stop()
        await state["pool"].close()

    try:
        yield loop.call(start())
    finally:
        if state:
            loop.call(stop())
        loop.close()


def http_post(port: int, path: str, body: bytes, headers: list[tuple[str, bytes]],
              chunked: bool = False) -> tuple[int, bytes, dict[str, str]]:
    """One POST over a raw socket (http.client refuses some of the headers we send, and
    gives up on a server that answers before the body is sent): status, body, headers."""
    head = [f"POST {path} HTTP/1.1".encode(), b"Host: 127.0.0.1", b"Connection: close"]
    head += [name.encode() + b": " + value for name, value in headers]
    if chunked:
        head.append(b"Transfer-Encoding: chunked")
        payload = b"".join(b"%x\r\n%s\r\n" % (len(body[at:at + 1000]), body[at:at + 1000])
                           for at in range(0, len(body), 1000)) + b"0\r\n\r\n"
    else:
        head.append(b"Content-Length: %d" % len(body))
        payload = body
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        # The server may answer (413, 401, 400) and close before reading the whole body.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(b"\r\n".join(head) + b"\r\n\r\n" + payload)
        received = bytearray()
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(65536):
                received += chunk
    data = bytes(received)
    while data.startswith(b"HTTP/1.1 1"):  # an interim answer (100 Continue) comes first
        data = data.partition(b"\r\n\r\n")[2]
    status_line, _, rest = data.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1."), f"no HTTP answer: {bytes(received)[:200]!r}"
    header_block, _, answer = rest.partition(b"\r\n\r\n")
    answer_headers = {}
    for line in header_block.split(b"\r\n"):
        name, _, value = line.decode("latin-1").partition(":")
        answer_headers[name.strip()] = value.strip()
    return int(status_line.split()[1]), answer, answer_headers


def guard_expectation(pg: Pg, path: str, body: bytes) -> tuple[int, str | None]:
    """(status, error) the guard must answer an authorised request with."""
    limit = GUARD_BODY_LIMIT if path == "/v1/guard" else CHECKPOINT_LIMIT
    if len(body) > limit:
        return 413, "body_too_large" if path == "/v1/guard" else "checkpoint_too_large"
    if path == "/v1/guard":
        if not body.strip():
            return 200, None
        try:
            parsed = orjson.loads(body)
        except orjson.JSONDecodeError:
            return 400, "bad_json"
        if not isinstance(parsed, dict):
            return 400, "bad_request"
        rid = parsed.get("request_id")
        if rid is not None and not (isinstance(rid, str) and 0 < len(rid) <= MAX_REQUEST_ID
                                    and rid.isprintable()):
            return 400, "bad_request"
        return 200, None
    kind = classify_payload(pg, body)
    return (200, None) if kind == "ok" else (400, "bad_json")


BODIES = st.one_of(
    st.binary(max_size=300),
    JSONISH_BYTES,
    JSON_VALUES.map(orjson.dumps),
    st.builds(lambda rid: orjson.dumps({"request_id": rid}),
              st.one_of(st.text(max_size=210), st.integers(-(2**63), 2**63 - 1), st.none(),
                        st.just(""),
                        st.builds(lambda n: "r" * n, st.integers(195, 5000)),
                        st.lists(st.text(max_size=3), max_size=2))),
    st.builds(lambda n: b" " * n + b"{}", st.sampled_from([0, 4000, 4094, 4095, 4100,
                                                          65530, 65534, 65535, 70000])),
    st.builds(lambda n: b'{"pad": "' + b"x" * n + b'"}', st.sampled_from(
        [4080, 4090, 65520, 65524, 65525, 65530])),
)
AUTH = st.one_of(
    st.just("valid"),
    st.none(),
    st.sampled_from(["bearer-lower", "bearer-spaces", "duplicate", "tampered", "basic",
                     "bare", "token-only"]),
    st.binary(max_size=300).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"")),
    st.text(max_size=300).map(lambda t: "Bearer " + t.replace("\r", "").replace("\n", "")),
)
EXTRA_HEADERS = st.lists(st.tuples(
    st.sampled_from(["Content-Type", "Content-Encoding", "X-Request-Id", "Expect", "Accept"]),
    st.binary(max_size=40).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))),
    max_size=2)


def auth_headers(auth, token: str) -> tuple[list[tuple[str, bytes]], bool]:
    """Authorization headers for one request, and whether they carry the job's secret."""
    bearer = f"Bearer {token}".encode()
    if auth is None:
        return [], False
    if isinstance(auth, bytes):
        return [("Authorization", auth)], False
    named = {
        "valid": ([("Authorization", bearer)], True),
        "bearer-lower": ([("Authorization", f"bearer {token}".encode())], True),
        "bearer-spaces": ([("Authorization", f"Bearer   {token}  ".encode())], True),
        "duplicate": ([("Authorization", bearer), ("Authorization", bearer)], False),
        "tampered": ([("Authorization", bearer[:-1] + (b"A" if bearer[-1:] != b"A"
                                                      else b"B"))], False),
        "basic": ([("Authorization", f"Basic {token}".encode())], False),
        "bare": ([("Authorization", b"Bearer")], False),
        "token-only": ([("Authorization", token.encode())], False),
    }
    if auth in named:
        return named[auth]
    return [("Authorization", auth.encode("utf-8", "surrogateescape"))], auth == bearer.decode()


@pytest.mark.database
@fuzz(150)
@given(path=st.sampled_from(["/v1/guard", "/v1/checkpoint"]), body=BODIES, auth=AUTH,
       extra=EXTRA_HEADERS, chunked=st.booleans())
def test_guard_answers_every_request_with_a_documented_status(guard, pg, path, body, auth,
                                                              extra, chunked):
    headers, authorised = auth_headers(auth, guard.token)
    # The HTTP parser itself refuses control characters in a header (400, text/plain)
    # before any handler runs; the handlers' own answers are checked for clean requests.
    clean = not extra and not any(b < 0x20 and b != 0x09 or b == 0x7F
                                  for _, value in headers for b in value)
    status, answer, response_headers = http_post(guard.port, path, body, headers + extra,
                                                 chunked)
    assert status in DOCUMENTED, (status, answer)
    if status == 200:
        assert authorised, (auth, answer)
    if clean and not authorised:
        assert (status, orjson.loads(answer)) == (401, {"error": "unauthorized"})
        assert response_headers.get("WWW-Authenticate") == "Bearer"
    elif clean:
        expected, error = guard_expectation(pg, path, body)
        assert status == expected, (status, answer, expected, body[:200])
        got = orjson.loads(answer)
        if error is not None:
            assert got["error"] == error, got
        elif path == "/v1/guard":
            assert got["fencing_token"] == guard.fencing_token, got
        else:
            assert got == {"saved": True, "bytes": len(body)}
            stored = pg.fetchval("SELECT checkpoint = $2::jsonb FROM tool_jobs WHERE id = $1",
                                 guard.job_id, RawJson(body.decode()))
            assert stored is True
    # Whatever came before, a well-formed request is still answered.
    status, answer, _ = http_post(guard.port, "/v1/guard", b'{"request_id": "after"}',
                                  [("Authorization", f"Bearer {guard.token}".encode())])
    assert (status, orjson.loads(answer)["fencing_token"]) == (200, guard.fencing_token)


# --- findings, pinned with their concrete inputs --------------------------------------------------


@pytest.mark.unit
def test_a_huge_tolerated_misses_is_a_config_error_not_an_overflow():
    """SIDECAR_TOLERATED_MISSES=10**400 parses as an int; the P10 check multiplies it by a
    float and raised OverflowError (a traceback from every command) instead of ConfigError."""
    outcome = load_or_error({"SIDECAR_TOLERATED_MISSES": "1" + "0" * 400})
    assert isinstance(outcome, ConfigError), outcome
    assert_config_error(outcome)
    assert "SIDECAR_TOLERATED_MISSES" in outcome.message


def _takes(parse, text: str) -> bool:
    try:
        return type(parse(text)) is int
    except ValueError:
        return False


HUGE = "1" + "0" * 30
NO_DATABASE = "postgresql://nobody@127.0.0.1:1/none"  # `sidecar config` connects to nothing
INTEGER_FIELDS = [name for name, spec in PROFILE_FIELDS.items() if _takes(spec.parse, "5")]


@pytest.mark.e2e
@pytest.mark.parametrize("field", INTEGER_FIELDS)
def test_sidecar_config_survives_an_integer_beyond_64_bits(field):
    """An integer setting of 10**30 passes load_settings; `sidecar config` then crashed with
    a traceback (orjson cannot encode it; TOLERATED_MISSES overflows the P10 check first).
    It must be refused with one line naming the variable, or printed."""
    var = "SIDECAR_" + field
    done = cli(NO_DATABASE, "config", env=base_env(NO_DATABASE, **{var: HUGE}))
    err = done.stderr.decode(errors="replace")
    assert "Traceback" not in err, err
    if done.returncode == 0:
        assert json.loads(done.stdout)["defaults"][field.lower()] == int(HUGE)
    else:
        assert done.returncode == 2 and len(err.splitlines()) == 1 and var in err, err


@pytest.mark.unit
@pytest.mark.parametrize("var", ["SIDECAR_LEASE_SECONDS\nSIDECAR_X", "SIDECAR_X\rY",
                                 "SIDECAR_PROFILE_A\nB_LEASE_SECONDS",
                                 "SIDECAR_PROFILE_A\u2028B_MAX_ATTEMPTS"])
def test_a_variable_name_with_a_line_break_gives_a_one_line_error(var):
    """An environment variable *name* may hold a line break; the error naming it is printed
    as is and spans two lines (and a log line can be forged that way)."""
    outcome = load_or_error({var: "x"})
    assert isinstance(outcome, ConfigError), outcome
    assert_config_error(outcome)


@pytest.mark.e2e
def test_a_variable_name_with_a_line_break_is_one_line_from_the_real_cli():
    env = base_env(NO_DATABASE, **{"SIDECAR_X\nforged: line": "1"})
    done = cli(NO_DATABASE, "config", env=env)
    assert done.returncode == 2
    err = done.stderr.decode(errors="replace")
    assert len(err.splitlines()) == 1, err


@pytest.mark.unit
@pytest.mark.parametrize("var, tool", [
    ("SIDECAR_PROFILE_ocr_LEASE_SECONDS", "ocr"),          # lower case: never matched
    ("SIDECAR_PROFILE_Ocr_Fast_MAX_ATTEMPTS", "ocr-fast"),
    ("SIDECAR_PROFILE__OCR_MAX_ATTEMPTS", "_ocr"),          # no tool name starts with _
    ("SIDECAR_PROFILE_OCR FAST_MAX_ATTEMPTS", "ocr fast"),  # a space is no tool character
])
def test_a_profile_variable_no_tool_can_use_is_refused(var, tool):
    """load_settings accepted these SIDECAR_PROFILE_ variables but no tool name maps to
    their key, so they are silently ignored: the misspelling the unknown-variable check
    exists to catch. They must be refused (ConfigError naming the variable) or apply."""
    value = "120" if var.endswith("LEASE_SECONDS") else "7"
    outcome = load_or_error({var: value})
    if isinstance(outcome, ConfigError):
        assert_config_error(outcome)
        assert var in outcome.message
        return
    field = next(f for f in PROFILE_FIELDS if var.endswith("_" + f))
    try:
        profile = outcome.profile(tool)
    except ConfigError:
        pytest.fail(f"{var} accepted, but tool {tool!r} is not a valid tool name")
    assert profile.sources[field] == var, f"{var} accepted and silently ignored"


@pytest.mark.unit
def test_a_long_lease_profile_key_is_refused_or_applies():
    key = "X" * 64  # tool names have at most 63 characters
    outcome = load_or_error({f"SIDECAR_PROFILE_{key}_MAX_ATTEMPTS": "7"})
    if isinstance(outcome, ConfigError):
        assert_config_error(outcome)
        return
    pytest.fail(f"SIDECAR_PROFILE_{key}_MAX_ATTEMPTS accepted, but no tool name is 64 long")


@pytest.mark.database
def test_payload_file_path_with_a_line_break_gives_one_error_line(sidecar_env, tmp_path):
    """The path is echoed as is in the error: a newline in it makes two lines."""
    missing = tmp_path / "no\nsuch.json"
    outcome = call_cli(["enqueue", "--payload-file", str(missing), "--", "ocr"])
    assert "--payload-file" in one_error_line(outcome)
    bad = tmp_path / "bad\rjson"
    bad.write_bytes(b"{not json")
    outcome = call_cli(["enqueue", "--payload-file", str(bad), "--", "ocr"])
    assert "--payload-file" in one_error_line(outcome)


@pytest.mark.database
@pytest.mark.parametrize("text", [b"1e-20000", b"0e-20000", b'{"x": [1e-16384]}',
                                  b"[0." + b"1" * 16384 + b"]",
                                  b'{"s": "' + b"x" * 70000 + b'", "n": 1e-016384}'])
def test_parse_result_refuses_numbers_jsonb_cannot_store(pg, text):
    """orjson reads these as 0.0, so parse_result accepts them; jsonb's numeric refuses them
    ("value overflows numeric format", a DataError the supervisor still catches at commit).
    results.py promises a check before the database: BadResult, like for 1e400."""
    with pytest.raises(asyncpg.DataError):
        pg.jsonb(text.decode())
    with pytest.raises(BadResult):
        parse_result(text)


@pytest.mark.database
@pytest.mark.parametrize("text", [b"[0." + b"1" * 16383 + b"]", b"1e-16383", b"1e00005",
                                  b'{"s": "e-99999 .' + b"9" * 16384 + b'", "n": 2.5}'])
def test_parse_result_accepts_what_jsonb_stores_next_to_the_limit(pg, text):
    """The scale check's pre-filter (a substring search in jsontext.number_shape) may
    look closer than it must, never reject: a fraction of 16383 digits, an exponent with
    a leading zero, and digits inside a string all pass, as jsonb stores them."""
    pg.jsonb(text.decode())
    value, raw = parse_result(text)
    assert str(raw) == text.decode()


@pytest.mark.database
def test_enqueue_of_a_tiny_exponent_is_bad_input_not_a_database_error(sidecar_env, pg):
    """The same numbers as a payload: exit 2 naming jsonb, no row (no exit-1 'database
    error')."""
    outcome = call_cli(["enqueue", "--payload=[1e-20000]", "--", "ocr"])
    assert "jsonb" in one_error_line(outcome)
    assert job_count(pg) == 0


@pytest.mark.database
def test_max_payload_bytes_applies_to_payload_and_payload_file(sidecar_env, pg, monkeypatch,
                                                               tmp_path):
    monkeypatch.setenv("SIDECAR_MAX_PAYLOAD_BYTES", "100")
    big = orjson.dumps({"s": "x" * 200})
    (tmp_path / "big.json").write_bytes(big)
    for argv in (["enqueue", f"--payload={big.decode()}", "--", "ocr"],
                 ["enqueue", "--payload-file", str(tmp_path / "big.json"), "--", "ocr"]):
        assert "SIDECAR_MAX_PAYLOAD_BYTES" in one_error_line(call_cli(argv))
    assert job_count(pg) == 0
    assert call_cli(["enqueue", '--payload={"s": "small"}', "--", "ocr"]).code == 0
    assert job_count(pg) == 1


@pytest.mark.database
def test_guard_expect_header_that_is_not_utf8_is_not_a_server_error(guard):
    """aiohttp's default Expect handler answers an unknown expectation itself (before the
    guard's handler and its authentication) and, when the value is not UTF-8, fails to
    encode its own error text: 500 and an ERROR traceback in the log."""
    for token in (None, guard.token):
        headers = [("Expect", b"\xce\x81\xf9")]
        if token:
            headers.append(("Authorization", f"Bearer {token}".encode()))
        status, answer, _ = http_post(guard.port, "/v1/guard", b"{}", headers)
        assert status in DOCUMENTED and status < 500, (status, answer)


@pytest.mark.database
def test_guard_unknown_expect_header_gets_a_documented_answer(guard):
    """`Expect: foo` is answered 417 by aiohttp before authentication: a status the guard's
    contract does not have, and an unauthorised caller does not get the 401 every other
    unauthorised request gets."""
    status, answer, _ = http_post(guard.port, "/v1/guard", b"{}", [("Expect", b"foo")])
    assert (status, answer) == (401, b'{"error":"unauthorized"}')
    status, answer, _ = http_post(guard.port, "/v1/guard", b"{}", [
        ("Expect", b"foo"), ("Authorization", f"Bearer {guard.token}".encode())])
    assert status == 200, (status, answer)


@pytest.mark.database
def test_a_malformed_authorization_header_does_not_put_the_secret_in_the_log(guard,
                                                                             monkeypatch):
    """The HTTP parser refuses a header with a control character (400); aiohttp logs that
    at ERROR with the raw header line, and the sidecar's library bridge copies 300
    characters of it into a library_log event: the job's guard secret ends up in the log."""
    from sidecar.runtime import log as log_mod

    sink = io.BytesIO()
    log_mod.configure("info", "json")
    monkeypatch.setattr(log_mod.log, "stream", sink)
    status, _, _ = http_post(guard.port, "/v1/guard", b"{}", [
        ("Authorization", f"Bearer {guard.token}\x01".encode())])
    assert status == 400
    logged = sink.getvalue().decode(errors="replace")
    assert guard.token not in logged, logged


@pytest.mark.unit
def test_a_text_log_line_stays_one_line_whatever_a_field_holds():
    """SIDECAR_LOG_FORMAT=text escapes control characters "so a tool cannot drive the
    terminal", but not a newline: a field holding one (aiohttp's parser errors always do,
    see the test above) splits one event over several lines, and can forge a line."""
    from sidecar.runtime.log import EventLog

    sink = io.BytesIO()
    EventLog("info", "text", sink).emit("library_log", "error", reason="a\nFAKE event=x",
                                        exception="BadHttpMessage: 400\n  Invalid header")
    assert len(sink.getvalue().splitlines()) == 1, sink.getvalue()
