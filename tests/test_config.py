"""Serve configuration: strict keys, layered sources, errors that name their source."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from scripts.settings_table import table_in
from trio_gym.cli import _parser
from trio_gym.config import (
    BOOTSTRAP_VARIABLES,
    BOOTSTRAPPED_FIELDS,
    ENVIRONMENT_VARIABLES,
    SETTINGS,
    CallerConfig,
    ConfigError,
    ServeConfig,
    load_caller_config,
    load_serve_config,
    parse_agent_pairs,
    settings_table,
)
from trio_gym.http import Endpoint


def test_defaults_are_the_contracts_defaults() -> None:
    config = load_serve_config(environ={})
    assert (config.host, config.port, config.runner) == ("127.0.0.1", 8080, "example")
    assert config.heartbeat_interval_s == 15
    assert config.rollout_deadline_s == 1800
    assert config.max_request_bytes == config.max_response_bytes == 256 * 1024 * 1024


def test_flags_beat_environment_beats_file_beats_defaults(tmp_path: Path) -> None:
    file = tmp_path / "serve.yaml"
    file.write_text("port: 9000\nheartbeat_interval_s: 5\njob_id: from-file\nrunner: example\n")
    environ = {
        "NMP_RUNTIME_HTTP_PORT": "9100",
        "NMP_RUNTIME_HTTP_HOST": "10.0.0.1",
        "NMP_JOB_ID": "from-env",
    }
    config = load_serve_config(file=file, environ=environ, flags={"port": 9200, "host": None})
    assert config.port == 9200  # flag
    assert config.job_id == "from-env"  # environment over file
    assert config.heartbeat_interval_s == 5  # file over default
    assert config.host == "10.0.0.1"  # a flag given as None is "not given"


def test_every_upstream_nmp_variable_is_honoured() -> None:
    environ = {
        "NMP_RUNTIME_HTTP_PORT": "8181",
        "NMP_MAX_REQUEST_BYTES": "1000",
        "NMP_MAX_RESPONSE_BYTES": "2000",
        "NMP_ROLLOUT_DEADLINE_S": "60",
        "NMP_JOB_ID": "job-7",
        "NMP_ENVIRONMENT_PATH": "/env",
        "NMP_WORK_PATH": "/work",
    }
    config = load_serve_config(environ=environ)
    assert (config.port, config.max_request_bytes, config.max_response_bytes) == (8181, 1000, 2000)
    assert (config.rollout_deadline_s, config.job_id) == (60, "job-7")
    assert (config.environment_path, config.work_path) == ("/env", "/work")


def test_an_unknown_key_in_the_file_is_an_error_naming_key_and_file(tmp_path: Path) -> None:
    file = tmp_path / "serve.yaml"
    file.write_text("port: 9000\nheartbeat_interval: 5\n")
    with pytest.raises(ConfigError, match=r"serve.yaml: heartbeat_interval: unknown key"):
        load_serve_config(file=file, environ={})


def test_a_bad_environment_value_names_the_variable() -> None:
    with pytest.raises(ConfigError, match=r"NMP_RUNTIME_HTTP_PORT='eighty'"):
        load_serve_config(environ={"NMP_RUNTIME_HTTP_PORT": "eighty"})


def test_a_bad_flag_names_the_flag() -> None:
    with pytest.raises(ConfigError, match=r"--heartbeat-interval-s=-1"):
        load_serve_config(environ={}, flags={"heartbeat_interval_s": -1})


@pytest.mark.parametrize("text", ["- a\n- b\n", "port: [1\n"])
def test_a_file_that_is_not_a_mapping_is_refused(tmp_path: Path, text: str) -> None:
    file = tmp_path / "serve.yaml"
    file.write_text(text)
    with pytest.raises(ConfigError, match=r"serve\.yaml"):
        load_serve_config(file=file, environ={})


def test_the_config_is_frozen_and_strict() -> None:
    config = ServeConfig()
    with pytest.raises(ValueError, match="frozen"):
        config.port = 1  # type: ignore[misc]
    with pytest.raises(ValueError, match="extra"):
        ServeConfig(prot=1)  # type: ignore[call-arg]


# --- the caller dialect ---------------------------------------------------------------------


def test_an_unknown_key_in_the_caller_config_is_an_error_naming_the_key() -> None:
    block = {"environment_path": "/env", "environment_ofline": True}  # the seed's kind of typo
    with pytest.raises(ConfigError, match=r"trainer\.yaml: environment_ofline: unknown key"):
        load_caller_config(block, source="trainer.yaml")


def test_a_launcher_that_sets_only_the_port_gets_every_interface(tmp_path: Path) -> None:
    launched = load_serve_config(environ={"NMP_RUNTIME_HTTP_PORT": "8080"})
    assert launched.host == "0.0.0.0"
    by_hand = load_serve_config(environ={}, flags={"port": 8080})
    assert by_hand.host == "127.0.0.1"
    named = {"NMP_RUNTIME_HTTP_PORT": "8080", "NMP_RUNTIME_HTTP_HOST": "10.1.2.3"}
    assert load_serve_config(environ=named).host == "10.1.2.3"
    file = tmp_path / "serve.yaml"
    file.write_text("host: 127.0.0.1\n")
    from_file = load_serve_config(file=file, environ={"NMP_RUNTIME_HTTP_PORT": "8080"})
    assert from_file.host == "127.0.0.1"


@pytest.mark.parametrize(
    ("text", "meaning"),
    [("", False), ("1", True), ("TRUE", True), (" yes ", True), ("0", False), ("no", False)],
)
def test_booleans_are_read_as_the_upstream_host_reads_them(text: str, meaning: bool) -> None:
    config = load_serve_config(environ={"NMP_ENVIRONMENT_PACKAGE_REQUIRED": text})
    assert config.environment_package_required is meaning


def test_an_unrecognised_boolean_is_false_and_said_so(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("WARNING", logger="trio_gym")
    config = load_serve_config(environ={"NMP_ENVIRONMENT_OFFLINE": "maybe"})
    assert config.environment_offline is False
    (record,) = caplog.records
    assert record.getMessage() == "config_value_read_as_false"
    assert record.trio_gym_fields["variable"] == "NMP_ENVIRONMENT_OFFLINE"


def test_an_empty_variable_is_no_variable() -> None:
    config = load_serve_config(environ={"NMP_RUNTIME_HTTP_PORT": "", "NMP_ROLLOUT_DEADLINE_S": ""})
    assert (config.port, config.rollout_deadline_s, config.host) == (8080, 1800, "127.0.0.1")


def test_the_caller_dialect_carries_a_gym_config_to_a_gym_host() -> None:
    caller = CallerConfig(gym_global_config={"policy_model_name": "m", "config_paths": ["a.yaml"]})
    served = load_serve_config(environ=caller.bootstrap_environment())
    assert served.runner == "gym" and served.gym_global_config == caller.gym_global_config
    assert "NMP_GYM_GLOBAL_CONFIG" not in CallerConfig().bootstrap_environment()


def test_both_dialects_know_environment_offline() -> None:
    assert load_caller_config({"environment_offline": True}, source="x").environment_offline
    assert load_serve_config(environ={"NMP_ENVIRONMENT_OFFLINE": "true"}).environment_offline


@pytest.mark.parametrize("offline", [True, False])
@pytest.mark.parametrize("path", ["/sandbox/env", None])
def test_caller_to_bootstrap_environment_to_serve_config_keeps_every_field(
    offline: bool, path: str | None
) -> None:
    caller = CallerConfig(
        job_id="job-9",
        environment_path=path,
        work_path="/sandbox/work",
        max_request_bytes=1234,
        max_response_bytes=5678,
        rollout_deadline_s=90.5,
        environment_offline=offline,
        host_env={"GYM_LOG_LEVEL": "debug"},
    )
    environ = caller.bootstrap_environment()
    assert set(BOOTSTRAP_VARIABLES) - {"NMP_GYM_GLOBAL_CONFIG"} <= set(environ)
    assert environ["GYM_LOG_LEVEL"] == "debug"
    served = load_serve_config(environ=environ)
    assert served.job_id == caller.job_id
    assert served.environment_path == (caller.environment_path or "")
    assert served.work_path == caller.work_path
    assert served.max_request_bytes == caller.max_request_bytes
    assert served.max_response_bytes == caller.max_response_bytes
    assert served.rollout_deadline_s == caller.rollout_deadline_s
    assert served.environment_offline is offline
    assert served.environment_package_required is (path is not None)


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("NMP_ENVIRONMENT_OFFLINE", "set from this config's own fields"),
        ("NMP_JOB_ID", "set from this config's own fields"),
        ("HF_TOKEN", "looks like a credential"),
        ("AWS_SECRET_ACCESS_KEY", "looks like a credential"),
        ("DB_PASSWORD", "looks like a credential"),
        ("OPENAI_API_KEY", "looks like a credential"),
        ("OPENAI_KEY", "looks like a credential"),
        ("GITHUB_PAT", "looks like a credential"),
        ("1BAD", "not an environment variable name"),
        ("UV_OFFLINE", "set environment_offline instead"),
        ("UV_FIND_LINKS", "decided by the installer stage"),
    ],
)
def test_host_env_may_not_redefine_bootstrap_names_or_carry_secrets(
    name: str, fragment: str
) -> None:
    with pytest.raises(ConfigError, match=name) as refusal:
        load_caller_config({"host_env": {name: "x"}}, source="trainer.yaml")
    assert fragment in str(refusal.value)


@pytest.mark.parametrize(
    "value",
    ["https://user:hunter2@hub.example/api", "sk-abc123", "ghp_abc", "hf_abc", "AKIAIOSFODNN7"],
)
def test_host_env_values_that_are_credentials_are_refused(value: str) -> None:
    with pytest.raises(ConfigError, match="HF_ENDPOINT looks like a credential"):
        load_caller_config({"host_env": {"HF_ENDPOINT": value}}, source="trainer.yaml")


def test_ordinary_host_env_names_pass() -> None:
    caller = load_caller_config(
        {"host_env": {"GIT_AUTHOR_NAME": "a", "NMP_HEARTBEAT_INTERVAL_S": "5"}}, source="x"
    )
    assert load_serve_config(environ=caller.bootstrap_environment()).heartbeat_interval_s == 5


# --- errors that could carry a secret, and errors on one line -----------------------------------

SECRET_NUMBER = "7945610009911"


@pytest.mark.parametrize(
    "text",
    [
        f"control_token: {SECRET_NUMBER}\n",
        f"control_token: [{SECRET_NUMBER}, x]\n",
        f"broker_token: {{a: {SECRET_NUMBER}}}\n",
        f"gym_global_config: [policy_api_key, {SECRET_NUMBER}]\n",
    ],
    ids=["token-as-number", "token-as-list", "broker-token-as-mapping", "gym-config-as-list"],
)
def test_a_secret_in_a_bad_config_file_is_never_echoed(tmp_path: Path, text: str) -> None:
    file = tmp_path / "serve.yaml"
    file.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_serve_config(file=file, environ={})
    message = str(caught.value)
    assert SECRET_NUMBER not in message
    assert "=<redacted>:" in message and "serve.yaml" in message  # still says where and what


def test_a_secret_in_a_bad_variable_is_never_echoed() -> None:
    environ = {"NMP_GYM_GLOBAL_CONFIG": f'["sk-{SECRET_NUMBER}"]'}
    with pytest.raises(ConfigError) as caught:
        load_serve_config(environ=environ)
    assert SECRET_NUMBER not in str(caught.value)
    assert "NMP_GYM_GLOBAL_CONFIG=<redacted>" in str(caught.value)


@pytest.mark.parametrize("variable", ["NMP_HOST_IDENTITY", "NMP_CONTROL_TOKEN"])
@pytest.mark.parametrize("stray", ["\r", "\x00", " ", "\n"])
def test_an_identity_or_token_no_header_can_carry_is_refused_at_start_never_shown(
    variable: str, stray: str
) -> None:
    """A value read from a file with Windows line endings would match no caller, ever: the
    host says so at once (and not the value) rather than refusing every request."""
    with pytest.raises(ConfigError) as caught:
        load_serve_config(environ={variable: f"sk-{SECRET_NUMBER}{stray}"})
    assert SECRET_NUMBER not in str(caught.value)
    assert f"{variable}=<redacted>" in str(caught.value) and "visible ASCII" in str(caught.value)


def test_a_host_env_value_is_never_echoed() -> None:
    with pytest.raises(ConfigError) as caught:
        load_caller_config({"host_env": {"GYM_SEED": int(SECRET_NUMBER)}}, source="trainer.yaml")
    assert SECRET_NUMBER not in str(caught.value) and "host_env" in str(caught.value)


@pytest.mark.parametrize(
    "url",
    ["http://user:hunter2@gym:notaport", "ftp://user:hunter2@gym:1", "http://user:hunter2@"],
    ids=["bad-port", "bad-scheme", "no-host"],
)
def test_a_urls_user_information_is_never_echoed(url: str) -> None:
    with pytest.raises(ValueError) as caught:
        Endpoint.parse(url)
    assert "hunter2" not in str(caught.value) and "<redacted>@" in str(caught.value)
    with pytest.raises(ValueError) as pair:
        parse_agent_pairs([url])  # no NAME= before it
    assert "hunter2" not in str(pair.value)


@pytest.mark.parametrize(
    ("text", "line", "what"),
    [
        ("port: 9000\nagents: [a, b\n", "serve.yaml:3:1", "expected ',' or ']'"),
        ("port: !!python/object:os.system ls\n", "serve.yaml:1:7", "could not determine"),
        ("job_id: 'open\n", "serve.yaml:2:1", "found unexpected end of stream"),
    ],
    ids=["flow-sequence", "refused-tag", "open-quote"],
)
def test_a_yaml_error_is_one_line_naming_file_line_and_column(
    tmp_path: Path, text: str, line: str, what: str
) -> None:
    file = tmp_path / "serve.yaml"
    file.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_serve_config(file=file, environ={})
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"{tmp_path}/{line}: not valid YAML: ") and what in message


def test_the_readmes_settings_table_is_made_from_the_fields() -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    start, end = table_in(readme)
    assert readme[start:end] == settings_table(), "run scripts/settings_table.py"


def test_every_field_has_its_own_variable_and_every_flag_sets_its_field() -> None:
    assert len(set(ENVIRONMENT_VARIABLES.values())) == len(ServeConfig.model_fields)
    # What each kind of flag is given, and the value it must set (of the field's own type).
    given_and_set: dict[Any, tuple[list[str], Any]] = {
        int: (["7"], 7),
        float: (["2.5"], 2.5),
        str: (["x"], "x"),
        bool: ([], True),
        dict[str, str]: (["a=http://h:1"], ["a=http://h:1"]),  # pairs, parsed by _config
    }
    for name, setting in SETTINGS.items():
        if not setting.flag:
            continue
        given, expected = given_and_set[ServeConfig.model_fields[name].annotation]
        args = _parser().parse_args(["serve", setting.flag, *given])
        value = getattr(args, name)
        assert (type(value), value) == (type(expected), expected), setting.flag
        assert args.flag_table[name] == setting.flag
        install = _parser().parse_args(["install"])
        assert (name in install.flag_table) is setting.installer, setting.flag


def test_every_setting_a_caller_shares_with_the_host_reaches_its_environment() -> None:
    # A value unlike its default for each field both configs have: a new shared field fails
    # here until it is listed (and carried).
    values = {
        "job_id": "job-3",
        "environment_path": "/env",
        "work_path": "/w",
        "max_request_bytes": 1001,
        "max_response_bytes": 1002,
        "rollout_deadline_s": 12.5,
        "environment_offline": True,
        "gym_global_config": {"policy_model_name": "m"},
    }
    assert set(CallerConfig.model_fields) & set(ServeConfig.model_fields) == set(values)
    assert set(values) <= set(BOOTSTRAPPED_FIELDS)
    caller = CallerConfig(**values)  # type: ignore[arg-type]
    served = load_serve_config(environ=caller.bootstrap_environment())
    for name, value in values.items():
        assert getattr(served, name) == value, name
