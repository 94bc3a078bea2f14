"""Lease profiles from the environment: defaults, per-tool overrides, rule P10
(L > R x H + J), number parsing, unknown variables; both sidecar.runtime.config.load_settings
directly and the `sidecar` command refusing to start (exit 2, one line)."""

from __future__ import annotations

import uuid

import pytest

from kit import FAST_PROFILE, base_env, cli, enqueue, one_line_error, scalar
from sidecar.protocol.errors import ConfigError
from sidecar.protocol.model import tool_env_key
from sidecar.runtime.config import GLOBAL_FIELDS, PROFILE_FIELDS, load_settings, secret_values

UNREACHABLE = "postgresql://bob:s3cretpw@127.0.0.1:1/nope"


def plain_env(dsn: str, **extra: str) -> dict[str, str]:
    """base_env without the suite's fast profile: the built-in defaults apply
    (L 90, H 30, R 1, J 20) unless ``extra`` sets something."""
    env = base_env(dsn)
    for key in FAST_PROFILE:
        env.pop(key, None)
    env.update(extra)
    return env


def refused(message_parts, **extra):
    """`sidecar enqueue ocr` with ``extra`` set must exit 2 before touching the (unreachable)
    database, with one stderr line containing every part of ``message_parts``."""
    done = cli(UNREACHABLE, "enqueue", "ocr", env=plain_env(UNREACHABLE, **extra))
    assert done.returncode == 2, (done.returncode, done.stderr.decode(errors="replace"))
    assert done.stdout == b""
    line = one_line_error(done)
    for part in message_parts:
        assert part in line, f"{part!r} not in {line!r}"
    assert "cannot reach" not in line
    return line


def config_error(env: dict[str, str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_settings(env)
    message = info.value.message
    assert "\n" not in message
    assert info.value.exit_code == 2
    return message


# --- load_settings: defaults and overrides -----------------------------------------------


@pytest.mark.unit
def test_defaults():
    settings = load_settings({})
    p = settings.profile("ocr")
    assert (p.lease_seconds, p.heartbeat_seconds, p.tolerated_misses, p.jitter_seconds) == \
        (90, 30, 1, 20)
    assert p.max_attempts == 3
    assert p.non_retryable_exit_codes == frozenset({64, 65})
    assert p.lease_seconds > p.tolerated_misses * p.heartbeat_seconds + p.jitter_seconds


@pytest.mark.unit
def test_environment_outside_the_prefix_is_ignored():
    settings = load_settings({"PATH": "/bin", "HOME": "/root", "SIDECARX": "1",
                              "sidecar_lease_seconds": "1"})
    assert settings.profile("ocr").lease_seconds == 90


@pytest.mark.unit
def test_passive_variables_are_allowed():
    settings = load_settings({"SIDECAR_JOB_ID": str(uuid.uuid4()), "SIDECAR_TOOL": "ocr",
                              "SIDECAR_ATTEMPT": "1", "SIDECAR_FENCING_TOKEN": "4",
                              "SIDECAR_TEST_DATABASE_URL": "postgresql://x@y/z"})
    assert settings.profile("ocr").lease_seconds == 90


@pytest.mark.unit
def test_global_values_apply_to_every_tool():
    settings = load_settings({"SIDECAR_LEASE_SECONDS": "120", "SIDECAR_MAX_ATTEMPTS": "6"})
    for tool in ("ocr", "pdf"):
        p = settings.profile(tool)
        assert p.lease_seconds == 120 and p.max_attempts == 6


@pytest.mark.unit
def test_per_tool_override_beats_the_global():
    settings = load_settings({
        "SIDECAR_LEASE_SECONDS": "120",
        "SIDECAR_MAX_ATTEMPTS": "6",
        "SIDECAR_PROFILE_OCR_LEASE_SECONDS": "200",
        "SIDECAR_PROFILE_OCR_MAX_ATTEMPTS": "2",
    })
    ocr = settings.profile("ocr")
    other = settings.profile("pdf")
    assert ocr.lease_seconds == 200 and ocr.max_attempts == 2
    assert other.lease_seconds == 120 and other.max_attempts == 6
    assert ocr.sources["LEASE_SECONDS"] == "SIDECAR_PROFILE_OCR_LEASE_SECONDS"
    assert other.sources["LEASE_SECONDS"] == "SIDECAR_LEASE_SECONDS"


@pytest.mark.unit
def test_tool_key_maps_other_characters_to_underscore():
    assert tool_env_key("ocr-fast") == "OCR_FAST"
    assert tool_env_key("ocr.v2") == "OCR_V2"
    settings = load_settings({"SIDECAR_PROFILE_OCR_FAST_MAX_ATTEMPTS": "8"})
    assert settings.profile("ocr-fast").max_attempts == 8
    assert settings.profile("ocr").max_attempts == 3


@pytest.mark.unit
def test_fractions_are_accepted():
    settings = load_settings({"SIDECAR_LEASE_SECONDS": "1.5", "SIDECAR_HEARTBEAT_SECONDS": "0.5",
                              "SIDECAR_JITTER_SECONDS": "0.5",
                              "SIDECAR_KILL_GRACE_SECONDS": "0.25",
                              "SIDECAR_POLL_SECONDS": "0.1"})
    p = settings.profile("ocr")
    assert p.lease_seconds == 1.5 and p.heartbeat_seconds == 0.5 and p.jitter_seconds == 0.5
    assert p.kill_grace_seconds == 0.25
    assert settings.poll_seconds == 0.1


@pytest.mark.unit
def test_per_tool_fraction_override():
    settings = load_settings({"SIDECAR_PROFILE_OCR_HEARTBEAT_SECONDS": "0.5",
                              "SIDECAR_PROFILE_OCR_JITTER_SECONDS": "0.5",
                              "SIDECAR_PROFILE_OCR_KILL_GRACE_SECONDS": "0.2",
                              "SIDECAR_PROFILE_OCR_LEASE_SECONDS": "1.5"})
    p = settings.profile("ocr")
    assert (p.lease_seconds, p.heartbeat_seconds, p.jitter_seconds) == (1.5, 0.5, 0.5)


@pytest.mark.unit
def test_a_lease_too_short_to_kill_the_tool_before_it_ends_is_refused():
    """P10 holds (1.5 > 1 x 0.5 + 0.5) but the default kill grace (5 s) cannot fit: the
    tree could not be dead before the lease ends (P14b)."""
    message = config_error({"SIDECAR_PROFILE_OCR_HEARTBEAT_SECONDS": "0.5",
                            "SIDECAR_PROFILE_OCR_JITTER_SECONDS": "0.5",
                            "SIDECAR_PROFILE_OCR_LEASE_SECONDS": "1.5"})
    assert "SIDECAR_PROFILE_OCR_LEASE_SECONDS=1.5" in message
    assert "kill grace" in message and "SIDECAR_KILL_GRACE_SECONDS" in message


# --- load_settings: rule P10 ------------------------------------------------------------


@pytest.mark.unit
def test_p10_global_lease_too_short():
    message = config_error({"SIDECAR_LEASE_SECONDS": "30"})
    assert "SIDECAR_LEASE_SECONDS" in message
    assert "P10" in message
    assert "30" in message and "20" in message and "50" in message


@pytest.mark.unit
def test_p10_per_tool_lease_too_short_names_the_tool_variable():
    message = config_error({"SIDECAR_PROFILE_OCR_LEASE_SECONDS": "30"})
    assert "SIDECAR_PROFILE_OCR_LEASE_SECONDS" in message
    assert "P10" in message
    assert "30" in message and "50" in message


@pytest.mark.unit
def test_p10_equality_is_refused():
    message = config_error({"SIDECAR_LEASE_SECONDS": "50"})
    assert "P10" in message and "50" in message


@pytest.mark.unit
def test_p10_just_above_is_accepted():
    # 1 x 10 + 40.4 = 50.4 < 50.5; and 50.5 - 10 - 5 - 5.05 = 30.45 s of silence >= 10
    env = {"SIDECAR_LEASE_SECONDS": "50.5", "SIDECAR_HEARTBEAT_SECONDS": "10",
           "SIDECAR_JITTER_SECONDS": "40.4"}
    assert load_settings(env).profile("ocr").lease_seconds == 50.5


@pytest.mark.unit
def test_p10_alone_is_not_enough_when_a_missed_heartbeat_would_abandon_the_job():
    """90 > 1 x 30 + 20 holds for 50.5 too, but after one missed heartbeat the local
    deadline (50.5 - 5 - 5.05 s after the last renewal sent) passes before the next one."""
    message = config_error({"SIDECAR_LEASE_SECONDS": "50.5"})
    assert "SIDECAR_LEASE_SECONDS=50.5" in message and "missed heartbeat" in message


@pytest.mark.unit
def test_p10_counts_tolerated_misses():
    # 3 x 30 + 20 = 110 > 90 (default lease)
    message = config_error({"SIDECAR_TOLERATED_MISSES": "3"})
    assert "P10" in message and "110" in message
    assert "SIDECAR_TOLERATED_MISSES" in message
    env = {"SIDECAR_TOLERATED_MISSES": "2", "SIDECAR_HEARTBEAT_SECONDS": "20"}
    assert load_settings(env).profile("x").tolerated_misses == 2


@pytest.mark.unit
def test_p10_heartbeat_too_long_names_the_heartbeat_variable():
    message = config_error({"SIDECAR_PROFILE_OCR_HEARTBEAT_SECONDS": "80"})
    assert "P10" in message
    assert "SIDECAR_PROFILE_OCR_HEARTBEAT_SECONDS" in message
    assert "100" in message  # 1 x 80 + 20


@pytest.mark.unit
def test_invalid_profile_of_another_tool_is_refused_at_start():
    env = {"SIDECAR_PROFILE_PDF_LEASE_SECONDS": "10"}
    message = config_error(env)
    assert "SIDECAR_PROFILE_PDF_LEASE_SECONDS" in message and "P10" in message


# --- load_settings: numbers -------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("var", [
    "SIDECAR_LEASE_SECONDS", "SIDECAR_HEARTBEAT_SECONDS", "SIDECAR_TOLERATED_MISSES",
    "SIDECAR_MAX_ATTEMPTS", "SIDECAR_STAGE_TIMEOUT_SECONDS", "SIDECAR_MAX_RESULT_BYTES",
    "SIDECAR_PROFILE_OCR_LEASE_SECONDS", "SIDECAR_PROFILE_OCR_HEARTBEAT_SECONDS",
    "SIDECAR_PROFILE_OCR_MAX_ATTEMPTS", "SIDECAR_POLL_SECONDS", "SIDECAR_DB_TIMEOUT_SECONDS",
])
@pytest.mark.parametrize("value", ["0", "-1"])
def test_zero_and_negative_are_refused(var, value):
    message = config_error({var: value})
    assert var in message


@pytest.mark.unit
@pytest.mark.parametrize("var", [
    "SIDECAR_JITTER_SECONDS", "SIDECAR_KILL_GRACE_SECONDS", "SIDECAR_BACKOFF_BASE_SECONDS",
    "SIDECAR_BACKOFF_MAX_SECONDS", "SIDECAR_DRAIN_SECONDS", "SIDECAR_PROFILE_OCR_JITTER_SECONDS",
])
def test_negative_durations_are_refused(var):
    message = config_error({var: "-0.5"})
    assert var in message


@pytest.mark.unit
@pytest.mark.parametrize("var", [
    "SIDECAR_LEASE_SECONDS", "SIDECAR_HEARTBEAT_SECONDS", "SIDECAR_JITTER_SECONDS",
    "SIDECAR_PROFILE_OCR_LEASE_SECONDS", "SIDECAR_POLL_SECONDS",
])
@pytest.mark.parametrize("value", ["abc", "nan", "inf", "-inf", "NaN", "Infinity", "1e999"])
def test_non_numeric_and_non_finite_are_refused(var, value):
    message = config_error({var: value})
    assert var in message
    assert value in message


@pytest.mark.unit
@pytest.mark.parametrize("var", ["SIDECAR_TOLERATED_MISSES", "SIDECAR_MAX_ATTEMPTS",
                                 "SIDECAR_PROFILE_OCR_MAX_ATTEMPTS",
                                 "SIDECAR_MAX_RESULT_BYTES"])
@pytest.mark.parametrize("value", ["1.5", "abc", "nan"])
def test_counts_must_be_integers(var, value):
    message = config_error({var: value})
    assert var in message


# --- load_settings: unknown variables ------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("var", [
    "SIDECAR_LEASE_SECONDSS", "SIDECAR_LEASE_SECOND", "SIDECAR_HEARTBEAT", "SIDECAR_FOO",
    "SIDECAR_PROFILE_OCR_LEASE_SECOND", "SIDECAR_PROFILE_OCR_LEASESECONDS",
    "SIDECAR_PROFILE_OCR", "SIDECAR_PROFILE__LEASE_SECONDS", "SIDECAR_PROFILE_OCR_POLL_SECONDS",
])
def test_unknown_variables_are_errors(var):
    message = config_error({var: "100"})
    assert var in message


# --- load_settings: NON_RETRYABLE_EXIT_CODES --------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("text,codes", [
    ("64, 65", {64, 65}),
    ("64,65", {64, 65}),
    ("1", {1}),
    ("255", {255}),
    (" 2 , 3 ,4 ", {2, 3, 4}),
    ("70,", {70}),
])
def test_non_retryable_exit_codes_parse(text, codes):
    settings = load_settings({"SIDECAR_NON_RETRYABLE_EXIT_CODES": text})
    assert settings.profile("ocr").non_retryable_exit_codes == frozenset(codes)


@pytest.mark.unit
def test_non_retryable_exit_codes_per_tool():
    settings = load_settings({"SIDECAR_PROFILE_OCR_NON_RETRYABLE_EXIT_CODES": "3,4"})
    assert settings.profile("ocr").non_retryable_exit_codes == frozenset({3, 4})
    assert settings.profile("pdf").non_retryable_exit_codes == frozenset({64, 65})


@pytest.mark.unit
@pytest.mark.parametrize("text", ["300", "0", "-1", "abc", "64;65", "64,abc", "1.5", "256"])
def test_non_retryable_exit_codes_invalid(text):
    message = config_error({"SIDECAR_NON_RETRYABLE_EXIT_CODES": text})
    assert "SIDECAR_NON_RETRYABLE_EXIT_CODES" in message


@pytest.mark.unit
def test_non_retryable_exit_codes_invalid_per_tool():
    message = config_error({"SIDECAR_PROFILE_OCR_NON_RETRYABLE_EXIT_CODES": "300"})
    assert "SIDECAR_PROFILE_OCR_NON_RETRYABLE_EXIT_CODES" in message


# --- load_settings: other globals ----------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("var,value", [
    ("SIDECAR_LOG_LEVEL", "verbose"),
    ("SIDECAR_LOG_FORMAT", "xml"),
    ("SIDECAR_EVENT_LOOP", "trio"),
])
def test_enumerated_globals_refuse_unknown_values(var, value):
    message = config_error({var: value})
    assert var in message


LISTEN_PASSWORD = "Listen-pw-do-not-print-3e1"


@pytest.mark.unit
@pytest.mark.parametrize("value", [
    f"mysql://app:{LISTEN_PASSWORD}@db/app",
    f"host=db password={LISTEN_PASSWORD}",
    f"postgresql://app:{LISTEN_PASSWORD}@db:port/app",
    f"postgresql://app:{LISTEN_PASSWORD}@[::1/app",
])
def test_a_listen_url_that_is_not_a_postgresql_url_is_one_line_naming_it(value):
    message = config_error({"SIDECAR_LISTEN_DATABASE_URL": value})
    assert message.startswith("SIDECAR_LISTEN_DATABASE_URL ")
    assert "postgresql://" in message  # the form expected
    assert LISTEN_PASSWORD not in message


@pytest.mark.unit
def test_the_listen_url_may_not_be_the_transaction_pooler_itself():
    bouncer = f"postgresql://app:{LISTEN_PASSWORD}@pgbouncer:6432/app"
    env = {"SIDECAR_DATABASE_URL": bouncer, "SIDECAR_LISTEN_DATABASE_URL": bouncer}
    message = config_error({**env, "SIDECAR_DATABASE_POOLER": "transaction"})
    assert "SIDECAR_LISTEN_DATABASE_URL" in message and "session" in message
    assert LISTEN_PASSWORD not in message
    assert load_settings(env).listen_database_url == bouncer  # no pooler: one server


@pytest.mark.unit
def test_a_valid_listen_url_is_kept_and_its_password_is_a_secret():
    listen = f"postgresql://app:{LISTEN_PASSWORD}@db:5432/app"
    settings = load_settings({"SIDECAR_DATABASE_POOLER": "transaction",
                              "SIDECAR_LISTEN_DATABASE_URL": listen})
    assert settings.listen_database_url == listen
    assert load_settings({}).listen_database_url == ""
    secrets = secret_values(settings, "postgresql://app:other-pw-123@pgbouncer:6432/app")
    assert listen in secrets["database_url"]
    assert {LISTEN_PASSWORD, "other-pw-123"} <= set(secrets["database_password"])


@pytest.mark.unit
def test_the_listen_url_may_come_from_a_mounted_secret_file(tmp_path):
    """SIDECAR_LISTEN_DATABASE_URL_FILE, like SIDECAR_DATABASE_URL_FILE: its first line is
    the URL, checked as the variable is, a secret, and a file the sandbox hides."""
    from sidecar.worker.isolation import secret_files

    listen = f"postgresql://app:{LISTEN_PASSWORD}@db:5432/app"
    secret = tmp_path / "listen-url"
    secret.write_text(f"  {listen}\nnext line ignored\n")
    env = {"SIDECAR_DATABASE_POOLER": "transaction",
           "SIDECAR_LISTEN_DATABASE_URL_FILE": str(secret)}
    settings = load_settings(env)
    assert settings.listen_database_url == listen
    assert str(secret) in secret_files(settings)
    secrets = secret_values(settings, "postgresql://app:other-pw-123@pgbouncer:6432/app")
    assert listen in secrets["database_url"]
    assert LISTEN_PASSWORD in secrets["database_password"]

    both = config_error({**env, "SIDECAR_LISTEN_DATABASE_URL": listen})
    assert both.startswith("SIDECAR_LISTEN_DATABASE_URL_FILE=") and "both set" in both
    secret.write_text("\n")
    assert "empty" in config_error(env)
    secret.write_text(f"mysql://app:{LISTEN_PASSWORD}@db/app\n")
    wrong = config_error(env)
    assert wrong.startswith("SIDECAR_LISTEN_DATABASE_URL_FILE") and LISTEN_PASSWORD not in wrong
    missing = config_error({"SIDECAR_LISTEN_DATABASE_URL_FILE": str(tmp_path / "absent")})
    assert "cannot read it" in missing


# --- the command refuses to start --------------------------------------------------------


@pytest.mark.e2e
def test_cli_global_lease_breaking_p10():
    refused(["SIDECAR_LEASE_SECONDS", "P10", "30", "50"], SIDECAR_LEASE_SECONDS="30")


@pytest.mark.e2e
def test_cli_tool_lease_breaking_p10():
    line = refused(["SIDECAR_PROFILE_OCR_LEASE_SECONDS", "P10", "30", "20", "50"],
                   SIDECAR_PROFILE_OCR_LEASE_SECONDS="30")
    assert "s3cretpw" not in line


@pytest.mark.e2e
@pytest.mark.parametrize("var,value", [
    ("SIDECAR_LEASE_SECONDS", "0"),
    ("SIDECAR_LEASE_SECONDS", "-5"),
    ("SIDECAR_HEARTBEAT_SECONDS", "0"),
    ("SIDECAR_PROFILE_OCR_HEARTBEAT_SECONDS", "-1"),
    ("SIDECAR_TOLERATED_MISSES", "0"),
    ("SIDECAR_JITTER_SECONDS", "-1"),
    ("SIDECAR_MAX_ATTEMPTS", "0"),
])
def test_cli_zero_or_negative(var, value):
    refused([var], **{var: value})


@pytest.mark.e2e
@pytest.mark.parametrize("value", ["abc", "nan", "inf"])
def test_cli_non_numeric(value):
    refused(["SIDECAR_LEASE_SECONDS", value], SIDECAR_LEASE_SECONDS=value)
    refused(["SIDECAR_PROFILE_OCR_HEARTBEAT_SECONDS", value],
            SIDECAR_PROFILE_OCR_HEARTBEAT_SECONDS=value)


@pytest.mark.e2e
@pytest.mark.parametrize("var", ["SIDECAR_LEASE_SECONDSS", "SIDECAR_PROFILE_OCR_LEASE_SECOND"])
def test_cli_misspelled_variable(var):
    refused([var], **{var: "100"})


@pytest.mark.e2e
def test_cli_invalid_profile_of_another_tool_is_refused():
    refused(["SIDECAR_PROFILE_PDF_LEASE_SECONDS", "P10"], SIDECAR_PROFILE_PDF_LEASE_SECONDS="10")


@pytest.mark.e2e
def test_cli_invalid_exit_codes():
    refused(["SIDECAR_NON_RETRYABLE_EXIT_CODES", "300"], SIDECAR_NON_RETRYABLE_EXIT_CODES="300")


@pytest.mark.e2e
def test_cli_valid_profile_reaches_the_database():
    """Control for `refused`: with a valid profile the same command gets as far as the
    (unreachable) database and exits 1, so exit 2 above really is the configuration."""
    done = cli(UNREACHABLE, "enqueue", "ocr",
               env=plain_env(UNREACHABLE, SIDECAR_LEASE_SECONDS="80",
                             SIDECAR_NON_RETRYABLE_EXIT_CODES="64, 65"))
    assert done.returncode == 1
    assert "cannot reach" in one_line_error(done)


@pytest.mark.e2e
@pytest.mark.parametrize("extra", [
    {"SIDECAR_LEASE_SECONDS": "30"},
    {"SIDECAR_PROFILE_TRUE_LEASE_SECONDS": "30"},
    {"SIDECAR_PROFILE_OTHER_LEASE_SECONDS": "30"},
    {"SIDECAR_LEASE_SECONDSS": "100"},
    {"SIDECAR_HEARTBEAT_SECONDS": "nan"},
])
def test_run_with_bad_profile_exits_2_before_touching_the_database(extra):
    done = cli(UNREACHABLE, "run", "--drain", "--", "true",
               env=plain_env(UNREACHABLE, **extra), timeout=60)
    assert done.returncode == 2, (done.returncode, done.stderr.decode(errors="replace"))
    line = one_line_error(done)
    assert next(iter(extra)) in line
    assert "cannot reach" not in line


@pytest.mark.e2e
def test_run_with_bad_tool_profile_via_tool_option_exits_2():
    done = cli(UNREACHABLE, "run", "--drain", "--tool", "ocr", "--", "true",
               env=plain_env(UNREACHABLE, SIDECAR_PROFILE_OCR_LEASE_SECONDS="30"), timeout=60)
    assert done.returncode == 2
    line = one_line_error(done)
    assert "SIDECAR_PROFILE_OCR_LEASE_SECONDS" in line and "P10" in line


@pytest.mark.e2e
def test_run_with_valid_profile_and_unreachable_database_exits_1():
    done = cli(UNREACHABLE, "run", "--drain", "--", "true", env=plain_env(UNREACHABLE),
               timeout=60)
    assert done.returncode == 1, done.stderr.decode(errors="replace")
    err = done.stderr.decode(errors="replace")
    assert "Traceback" not in err
    assert "s3cretpw" not in err
    assert "127.0.0.1:1" in err


# --- the command with a valid profile, on the real database --------------------------------


@pytest.mark.e2e
def test_cli_fractions_are_accepted(dsn):
    env = plain_env(dsn, SIDECAR_LEASE_SECONDS="1.5", SIDECAR_HEARTBEAT_SECONDS="0.25",
                    SIDECAR_JITTER_SECONDS="0.5", SIDECAR_POLL_SECONDS="0.5",
                    SIDECAR_KILL_GRACE_SECONDS="0.25")
    job_id = enqueue(dsn, "ocr", {}, env=env)
    assert scalar(dsn, "SELECT count(*) FROM tool_jobs WHERE id = $1", uuid.UUID(job_id)) == 1


@pytest.mark.e2e
def test_cli_per_tool_override_beats_the_global(dsn):
    """MAX_ATTEMPTS of the profile of the sidecar that claims a job (issue 26: not the
    producer's): the per-tool value for ocr, the global one for pdf."""
    env = plain_env(dsn, SIDECAR_MAX_ATTEMPTS="7", SIDECAR_PROFILE_OCR_MAX_ATTEMPTS="5")
    ocr = enqueue(dsn, "ocr", {})
    pdf = enqueue(dsn, "pdf", {})
    for tool in ("ocr", "pdf"):
        done = cli(dsn, "run", "--tool", tool, "--drain", "--", "cat", env=env, timeout=60)
        assert done.returncode == 0, done.stderr.decode(errors="replace")
    assert scalar(dsn, "SELECT max_attempts FROM tool_jobs WHERE id = $1", uuid.UUID(ocr)) == 5
    assert scalar(dsn, "SELECT max_attempts FROM tool_jobs WHERE id = $1", uuid.UUID(pdf)) == 7


@pytest.mark.e2e
def test_cli_per_tool_lease_can_fix_a_global_that_only_it_uses(dsn):
    """A valid per-tool lease with the defaults elsewhere starts fine."""
    env = plain_env(dsn, SIDECAR_PROFILE_OCR_LEASE_SECONDS="75")
    job_id = enqueue(dsn, "ocr", {}, env=env)
    assert scalar(dsn, "SELECT tool FROM tool_jobs WHERE id = $1", uuid.UUID(job_id)) == "ocr"


@pytest.mark.e2e
def test_cli_drain_run_with_valid_profile_and_no_jobs_exits_0(dsn):
    done = cli(dsn, "run", "--drain", "--", "true", timeout=60)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    assert "Traceback" not in done.stderr.decode(errors="replace")


_ARABIC_INDIC = str.maketrans("0123456789", "٠١٢٣٤٥٦٧٨٩")


def _digit_settings() -> list[tuple[str, str]]:
    """Every setting whose default holds digits (numbers, durations, exit codes, uids),
    with those digits written in another script (int() and float() read "٦٤" as 64)."""
    found = []
    for table, prefix in ((GLOBAL_FIELDS, "SIDECAR_"), (PROFILE_FIELDS, "SIDECAR_")):
        for name, field in table.items():
            if any(c.isdigit() for c in field.default):
                found.append((prefix + name, field.default.translate(_ARABIC_INDIC)))
    return found


@pytest.mark.unit
@pytest.mark.parametrize("var,value", _digit_settings())
def test_digits_of_other_scripts_are_refused_by_every_setting(var, value):
    """One parser rule for every bounded value (issue 41, point 13's kind): only ASCII
    digits; SIDECAR_NON_RETRYABLE_EXIT_CODES once read "٦٤" as 64."""
    assert var in config_error({var: value})


@pytest.mark.unit
@pytest.mark.parametrize("env", [
    {"SIDECAR_NETWORK": "none", "SIDECAR_SANDBOX": "off"},
    {"SIDECAR_PROFILE_OCR_NETWORK": "none", "SIDECAR_PROFILE_OCR_SANDBOX": "off"},
])
def test_network_none_without_the_sandbox_is_refused_not_dropped(env):
    """NETWORK=none is the namespace sandbox's: with SANDBOX=off the tool used the host's
    network and nothing said so (issue 41, point 1's kind: a setting that silently
    switches off another)."""
    message = config_error(env)
    assert "NETWORK" in message and "SANDBOX" in message and "host's network" in message
