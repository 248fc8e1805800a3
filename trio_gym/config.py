"""The host's configuration, and how it is layered from file, environment and flags.

Precedence, lowest to highest: defaults < config file < ``NMP_*`` environment variables <
command-line flags. An image bakes in a file; the orchestrator that launches a sandbox speaks
through the environment; a person at a terminal uses flags.

The layering is a plain dict merge over one strict model rather than pydantic-settings: every
source is validated by the same ``extra="forbid"`` model, and an error names the source that
supplied the bad value (``NMP_RUNTIME_HTTP_PORT='abc'``, ``serve.yaml: port``, ``--port``).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Final

import attrs
import pydantic
import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from trio_gym.errors import describe_validation_error, without_userinfo
from trio_gym.http import HttpLimits, travels_in_a_header
from trio_gym.logs import log_event

MiB: Final = 1024 * 1024

PositiveSeconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]

# Marks a field whose value is never echoed in an error (tokens, a config holding API keys).
SECRET: Final[dict[str, Any]] = {"secret": True}


@attrs.frozen
class Setting:
    """Where a :class:`ServeConfig` field is set from besides a config file: its environment
    variable (the upstream host's name) and, when a person at a terminal needs it, a flag.
    Written once on the field (``Annotated[type, Setting(...)]``); the variables table, the
    flags of ``serve`` and ``install``, a caller's bootstrap environment and the README's
    settings table are all made from these."""

    variable: str
    flag: str = ""
    installer: bool = False
    """The installer stage reads it: ``install`` takes its flag as well as ``serve``."""


class ServeConfig(BaseModel):
    """Everything ``trio-gym serve`` needs. Frozen; unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: Annotated[str, Setting("NMP_RUNTIME_HTTP_HOST", "--host")] = Field(
        default="127.0.0.1",
        description="Address to bind (0.0.0.0 when a launcher sets NMP_RUNTIME_HTTP_PORT and no "
        "address).",
    )
    port: Annotated[int, Setting("NMP_RUNTIME_HTTP_PORT", "--port")] = Field(
        default=8080, ge=0, le=65535, description="TCP port; 0 picks a free one."
    )
    port_file: Annotated[str, Setting("NMP_PORT_FILE", "--port-file")] = Field(
        default="",
        description="Once listening, write the bound port here (for a launcher that passed port "
        "0): the file appears whole, with the port and a newline.",
    )
    runner: Annotated[str, Setting("NMP_RUNNER", "--runner")] = Field(
        default="example",
        description="'example', 'agents', 'gym', or a user runner as 'package.module:factory' "
        "('gym' when gym_global_config is given and no runner is named).",
    )
    heartbeat_interval_s: Annotated[
        PositiveSeconds, Setting("NMP_HEARTBEAT_INTERVAL_S", "--heartbeat-interval")
    ] = Field(
        default=15.0,
        description="Seconds between single-space heartbeat chunks while a batch runs.",
    )
    rollout_deadline_s: Annotated[
        PositiveSeconds, Setting("NMP_ROLLOUT_DEADLINE_S", "--deadline")
    ] = Field(
        default=1800.0,
        description="Longest a batch may run; a request's deadline_s is capped by it.",
    )
    max_request_bytes: Annotated[int, Setting("NMP_MAX_REQUEST_BYTES", "--max-request-bytes")] = (
        Field(default=256 * MiB, gt=0, description="Largest request body; a larger one is 413.")
    )
    max_response_bytes: Annotated[
        int, Setting("NMP_MAX_RESPONSE_BYTES", "--max-response-bytes")
    ] = Field(
        default=256 * MiB,
        gt=0,
        description="Largest results document; a batch whose answer outgrows it fails, named.",
    )
    max_head_bytes: Annotated[int, Setting("NMP_MAX_HEAD_BYTES")] = Field(
        default=16 * 1024, ge=1024, description="Largest request head."
    )
    read_timeout_s: Annotated[PositiveSeconds, Setting("NMP_READ_TIMEOUT_S")] = Field(
        default=30.0,
        description="Whole request head, and each gap in a body, must arrive within this.",
    )
    send_timeout_s: Annotated[PositiveSeconds, Setting("NMP_SEND_TIMEOUT_S")] = Field(
        default=30.0, description="A caller that takes no bytes for this long is given up."
    )
    reattach_grace_s: Annotated[PositiveSeconds, Setting("NMP_REATTACH_GRACE_S")] = Field(
        default=60.0,
        description="A batch sent with an Idempotency-Key runs on this long with no caller "
        "attached (its caller may come back for it); then it is cancelled.",
    )
    answer_retention_s: Annotated[PositiveSeconds, Setting("NMP_ANSWER_RETENTION_S")] = Field(
        default=600.0,
        description="How long a keyed batch's finished answer is kept to be handed out again.",
    )
    answer_retention_bytes: Annotated[int, Setting("NMP_ANSWER_RETENTION_BYTES")] = Field(
        default=256 * MiB,
        ge=0,
        description="Finished keyed answers kept, in bytes (the oldest go first).",
    )
    max_connections: Annotated[int, Setting("NMP_MAX_CONNECTIONS")] = Field(
        default=1024,
        gt=0,
        description="Connections served at once; more are answered 503 host_busy.",
    )
    max_batches: Annotated[int, Setting("NMP_MAX_BATCHES")] = Field(
        default=1024,
        gt=0,
        description="Batches running at once, a caller attached or not (a keyed batch runs on "
        "for reattach_grace_s after its caller hung up); more are answered 503 host_busy.",
    )
    shutdown_grace_s: Annotated[PositiveSeconds, Setting("NMP_SHUTDOWN_GRACE_S")] = Field(
        default=10.0,
        description="On SIGTERM, how long in-flight answers get before connections are cut.",
    )
    job_id: Annotated[str, Setting("NMP_JOB_ID")] = Field(
        default="", description="Echoed in every results document."
    )
    environment_path: Annotated[
        str, Setting("NMP_ENVIRONMENT_PATH", "--environment-path", installer=True)
    ] = Field(default="", description="The environment package (nemo-environment.yaml) to install.")
    work_path: Annotated[str, Setting("NMP_WORK_PATH", "--work-path", installer=True)] = Field(
        default="", description="Writable directory for installs."
    )
    environment_offline: Annotated[
        bool, Setting("NMP_ENVIRONMENT_OFFLINE", "--environment-offline", installer=True)
    ] = Field(
        default=False,
        description="Set UV_OFFLINE=1 beside UV_FIND_LINKS so nothing consults an index "
        "(an operator's own UV_OFFLINE wins).",
    )
    environment_package_required: Annotated[bool, Setting("NMP_ENVIRONMENT_PACKAGE_REQUIRED")] = (
        Field(default=False, description="Fail the start when no environment package is found.")
    )
    install_timeout_s: Annotated[PositiveSeconds, Setting("NMP_INSTALL_TIMEOUT_S")] = Field(
        default=900.0, description="Longest the installer stage's uv run may take."
    )
    control_token: Annotated[str, Setting("NMP_CONTROL_TOKEN")] = Field(
        default="",
        description="Bearer token of the checkpoint control plane; empty turns the plane off.",
        json_schema_extra=SECRET,
    )
    host_identity: Annotated[str, Setting("NMP_HOST_IDENTITY")] = Field(
        default="",
        description="Given by the provider that launched this host: a request carrying "
        "another identity is refused (421 wrong_host); empty accepts any.",
        json_schema_extra=SECRET,
    )
    agents: Annotated[dict[str, str], Setting("NMP_AGENTS", "--agent")] = Field(
        default_factory=dict,
        description="For runner 'agents': agent name -> base URL of its server (or of the "
        "environment server in front of it); as a variable, a=URL,b=URL.",
    )
    head_server: Annotated[str, Setting("NMP_HEAD_SERVER", "--head-server")] = Field(
        default="", description="For runner 'agents': a Gym head server that lists every server."
    )
    agent_max_connections: Annotated[int, Setting("NMP_AGENT_MAX_CONNECTIONS")] = Field(
        default=64, gt=0, description="Requests in flight to one agent server at once."
    )
    agent_connect_attempts: Annotated[int, Setting("NMP_AGENT_CONNECT_ATTEMPTS")] = Field(
        default=5, gt=0, description="Tries to connect to an agent server before failing."
    )
    agent_retry_backoff_s: Annotated[PositiveSeconds, Setting("NMP_AGENT_RETRY_BACKOFF_S")] = Field(
        default=0.5, description="Connection retry n waits n times this long."
    )
    agent_rollout_attempts: Annotated[int, Setting("NMP_AGENT_ROLLOUT_ATTEMPTS")] = Field(
        default=3,
        gt=0,
        description="Tries per row when Gym answers that its rollout failed (_ng_failure_class), "
        "as Gym's own collection retries it (NEMO_GYM_MAX_ROLLOUT_ATTEMPTS, 3).",
    )
    gym_global_config: Annotated[dict[str, Any] | None, Setting("NMP_GYM_GLOBAL_CONFIG")] = Field(
        default=None,
        description="For runner 'gym': Gym's global config (JSON object), merged with the "
        "environment package's config_paths; given without a runner, the runner is 'gym'.",
        json_schema_extra=SECRET,  # it holds the model's API key
    )
    gym_python: Annotated[str, Setting("NMP_GYM_PYTHON", "--gym-python")] = Field(
        default="",
        description="For runner 'gym', and for finalizing Gym's records: the Python interpreter "
        "that has nemo_gym (default: this one, when nemo_gym imports here).",
    )
    gym_start_timeout_s: Annotated[PositiveSeconds, Setting("NMP_GYM_START_TIMEOUT_S")] = Field(
        default=600.0,
        description="How long a Gym deployment (runner 'gym', or a head server for runner "
        "'agents') may take to answer before the start fails.",
    )
    gym_finalize_timeout_s: Annotated[PositiveSeconds, Setting("NMP_GYM_FINALIZE_TIMEOUT_S")] = (
        Field(
            default=60.0,
            description="Longest Gym's finalizer may take over one record (or one capture cleared) "
            "before the row fails and the finalizer is started again.",
        )
    )
    gym_stop_grace_s: Annotated[PositiveSeconds, Setting("NMP_GYM_STOP_GRACE_S")] = Field(
        default=10.0,
        description="On stopping, how long Gym's processes get after SIGTERM before SIGKILL.",
    )
    dataset_path: Annotated[str, Setting("NMP_DATASET_PATH")] = Field(
        default="", description="Handed to Gym's processes as NMP_DATASET_PATH."
    )
    broker_url: Annotated[str, Setting("NMP_BROKER_URL")] = Field(
        default="", description="Handed to Gym's processes as NMP_BROKER_URL."
    )
    broker_token: Annotated[str, Setting("NMP_BROKER_TOKEN")] = Field(
        default="",
        description="Handed to Gym's processes as NMP_BROKER_TOKEN (a secret).",
        json_schema_extra=SECRET,
    )

    @model_validator(mode="before")
    @classmethod
    def _gym_config_names_the_runner(cls, data: Any) -> Any:
        """The upstream orchestrator launches its host with NMP_GYM_GLOBAL_CONFIG and no
        runner: that is a Gym deployment to start."""
        if isinstance(data, dict) and "runner" not in data and "gym_global_config" in data:
            return {**data, "runner": "gym"}
        return data

    @field_validator("gym_global_config", mode="before")
    @classmethod
    def _gym_config_from_text(cls, value: Any) -> Any:
        """``NMP_GYM_GLOBAL_CONFIG`` holds the object as JSON text."""
        if not isinstance(value, str):
            return value
        try:
            return json.loads(value)
        except ValueError as exc:
            raise ValueError(f"not JSON ({exc}); expected a JSON object") from exc

    @field_validator("runner")
    @classmethod
    def _runner_spec(cls, runner: str) -> str:
        if runner in ("example", "agents", "gym") or re.fullmatch(
            r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", runner
        ):
            return runner
        raise ValueError("expected 'example', 'agents', 'gym' or 'package.module:factory'")

    @field_validator("control_token", "host_identity")
    @classmethod
    def _header_carries_it(cls, value: str) -> str:
        """Both travel in a header, where nothing but visible ASCII and inner spaces survives:
        one read from a file with Windows line endings would match no caller, ever."""
        if value and not travels_in_a_header(value):
            raise ValueError(
                "must be visible ASCII with no space at either end (a header carries it; "
                "a value read from a file with Windows line endings ends in a CR)"
            )
        return value

    @field_validator("agents", mode="before")
    @classmethod
    def _agents_from_text(cls, value: Any) -> Any:
        """``NMP_AGENTS="a=http://h:1,b=http://h:2"`` as well as a mapping."""
        if not isinstance(value, str):
            return value
        pairs = [item.strip() for item in value.split(",") if item.strip()]
        return parse_agent_pairs(pairs)

    @model_validator(mode="after")
    def _settings_fit_the_runner(self) -> ServeConfig:
        if self.runner == "agents" and not (self.agents or self.head_server):
            raise ValueError(
                "runner 'agents' needs --agent NAME=URL (repeatable) or --head-server URL"
            )
        if self.agents and self.runner != "agents":
            raise ValueError("--agent is for --runner agents")
        if self.head_server and self.runner != "agents":
            raise ValueError(
                "--head-server is for --runner agents (a Gym deployment that already runs); "
                "runner 'gym' starts its own"
            )
        if self.gym_global_config is not None and self.runner != "gym":
            raise ValueError(
                f"gym_global_config (NMP_GYM_GLOBAL_CONFIG) is for runner 'gym', not "
                f"{self.runner!r}; remove one of them"
            )
        return self

    def http_limits(self) -> HttpLimits:
        return HttpLimits(
            max_head_bytes=self.max_head_bytes,
            read_timeout_s=self.read_timeout_s,
            send_timeout_s=self.send_timeout_s,
        )


def _setting_of(name: str) -> Setting:
    settings = [m for m in ServeConfig.model_fields[name].metadata if isinstance(m, Setting)]
    if len(settings) != 1:
        raise TypeError(f"ServeConfig.{name} needs one Setting in its annotation")
    return settings[0]


SETTINGS: Final[dict[str, Setting]] = {name: _setting_of(name) for name in ServeConfig.model_fields}
# The environment variables the host honours, by field; the NMP_ names are the upstream host's.
ENVIRONMENT_VARIABLES: Final[dict[str, str]] = {
    name: setting.variable for name, setting in SETTINGS.items()
}


# What a flag whose field is a mapping takes, repeated (``--agent a=URL --agent b=URL``).
FLAG_VALUES: Final[dict[str, str]] = {"agents": "NAME=URL"}


def environment_text(value: Any) -> str:
    """A field's value as its environment variable carries it (read back by
    :func:`load_serve_config`): booleans as 1/0, mappings as JSON."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, dict):
        return json.dumps(value)
    return repr(value) if isinstance(value, float) else str(value)


def default_text(name: str) -> str:
    """A field's default as a person reads it (sizes in KiB/MiB; none for an empty mapping)."""
    value = ServeConfig.model_fields[name].get_default(call_default_factory=True)
    if value is None or value == {}:
        return "none"
    if name.endswith("_bytes") and value % 1024 == 0:
        return f"{value // MiB} MiB" if value % MiB == 0 else f"{value // 1024} KiB"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"`{json.dumps(value)}`" if isinstance(value, str | bool) else f"`{value}`"


def settings_table() -> str:
    """The README's settings table, made from the fields (a test holds the README to it)."""
    rows = ["| flag | variable | config key | default | what it sets |", "|---|---|---|---|---|"]
    for name, setting in SETTINGS.items():
        flag = " ".join(filter(None, (setting.flag, FLAG_VALUES.get(name))))
        flag = f"`{flag}`" if flag else ""
        description = (ServeConfig.model_fields[name].description or "").replace("|", "\\|")
        rows.append(
            f"| {flag} | `{setting.variable}` | `{name}` | {default_text(name)} | {description} |"
        )
    return "\n".join(rows) + "\n"


# Where the host listens when nothing names an address. A launcher that sets the port but no
# address (the upstream orchestrator, scripts/gym_host.sh) publishes the port from outside the
# sandbox, where loopback reaches nothing; a person at a terminal keeps loopback.
LAUNCHED_HOST: Final = "0.0.0.0"

# How the upstream host reads a boolean variable: these mean true, anything else false, and an
# empty variable is no variable at all.
_TRUE_WORDS: Final = frozenset({"1", "true", "yes"})
_FALSE_WORDS: Final = frozenset({"0", "false", "no", "off"})


def parse_agent_pairs(pairs: list[str]) -> dict[str, str]:
    """``["name=http://host:port", ...]`` as a mapping; raises ``ValueError`` naming a bad pair."""
    agents: dict[str, str] = {}
    for pair in pairs:
        name, sep, url = pair.partition("=")
        if not sep or not name.strip() or not url.strip():
            raise ValueError(
                f"{without_userinfo(pair)!r}: expected NAME=URL, e.g. my_agent=http://127.0.0.1:8001"
            )
        if name.strip() in agents:
            raise ValueError(f"agent {name.strip()!r} is given twice")
        agents[name.strip()] = url.strip()
    return agents


# The fields a caller's bootstrap environment carries (the caller config's own, and whether
# the package must be there: it must when the caller names one).
BOOTSTRAPPED_FIELDS: Final = (
    "job_id",
    "environment_path",
    "work_path",
    "max_request_bytes",
    "max_response_bytes",
    "rollout_deadline_s",
    "environment_offline",
    "environment_package_required",
    "gym_global_config",
)
# Their variables: a caller's extra host variables may not redefine them.
BOOTSTRAP_VARIABLES: Final = tuple(ENVIRONMENT_VARIABLES[name] for name in BOOTSTRAPPED_FIELDS)

# Names that carry secrets. A sandbox's environment is readable by the untrusted code inside
# it, so a credential must never travel there as an ordinary host variable.
_CREDENTIAL_NAME: Final = re.compile(
    r"TOKEN|SECRET|PASSWORD|PASSWD|PASSPHRASE|API_?KEY|ACCESS_?KEY|PRIVATE_?KEY|CREDENTIAL"
    r"|AUTH(?!OR)|COOKIE|SESSION_?KEY|(^|_)KEY$|(^|_)PAT$",
    re.IGNORECASE,
)
# Values that are credentials whatever their name: URL user information, and the prefixes of
# widely used token formats (OpenAI, Anthropic, GitHub, Hugging Face, Slack, AWS, JWTs).
_CREDENTIAL_VALUE: Final = re.compile(
    r"://[^/@\s]+:[^/@\s]+@|^(sk-|ghp_|gho_|ghs_|github_pat_|hf_|xox[abp]-|AKIA|eyJ)"
)
# Variables the installer stage derives from this config; set through host_env they would
# silently overrule it (UV_OFFLINE there would count as the operator's own).
_INSTALLER_VARIABLES: Final = ("UV_OFFLINE", "UV_FIND_LINKS")
_VARIABLE_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class CallerConfig(BaseModel):
    """The caller dialect: the block a trainer's own config carries to ask for a sandboxed host.

    :meth:`bootstrap_environment` turns it into the environment the host is launched with; the
    host reads the same variables back into its :class:`ServeConfig`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    job_id: str = ""
    environment_path: str | None = Field(
        default=None, description="The environment package; when given, it must exist."
    )
    work_path: str = Field(default="/tmp/trio-gym-work", description="Writable in the sandbox.")
    max_request_bytes: int = Field(default=256 * MiB, gt=0)
    max_response_bytes: int = Field(default=256 * MiB, gt=0)
    rollout_deadline_s: PositiveSeconds = 1800.0
    environment_offline: bool = Field(
        default=False,
        description="The wheelhouse is a complete closure: install and resolve with no index.",
    )
    host_env: dict[str, str] = Field(
        default_factory=dict,
        description="Extra variables for the host process (no secrets).",
        json_schema_extra=SECRET,  # its values are never echoed: a screen is not a guarantee
    )
    gym_global_config: dict[str, Any] | None = Field(
        default=None,
        description="Gym's global config for a host that starts the environment's Gym "
        "deployment (NMP_GYM_GLOBAL_CONFIG); its model settings are the operator's.",
        json_schema_extra=SECRET,
    )
    rollout_chunk_size: int = Field(default=8, gt=0, description="Examples per request.")
    rollout_max_in_flight: int = Field(default=8, gt=0, description="Requests at once.")
    rollout_max_attempts: int = Field(default=3, gt=0, description="Tries per retryable chunk.")

    @field_validator("host_env")
    @classmethod
    def _check_host_env(cls, host_env: dict[str, str]) -> dict[str, str]:
        for name, value in host_env.items():
            if not _VARIABLE_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not an environment variable name")
            if name in BOOTSTRAP_VARIABLES:
                raise ValueError(
                    f"{name} is set from this config's own fields; remove it from host_env"
                )
            if name in _INSTALLER_VARIABLES:
                raise ValueError(
                    f"{name} is decided by the installer stage from environment_offline and the "
                    "package; set environment_offline instead"
                )
            if _CREDENTIAL_NAME.search(name) or _CREDENTIAL_VALUE.search(value):
                raise ValueError(
                    f"{name} looks like a credential; the sandbox's code can read its "
                    "environment, so pass secrets through the orchestrator's secret mechanism"
                )
        return host_env

    def bootstrap_environment(self) -> dict[str, str]:
        """The host's launch environment: the bootstrap variables plus ``host_env``
        (``NMP_GYM_GLOBAL_CONFIG`` only when there is a Gym config: it selects the runner)."""
        values = {
            **{
                name: getattr(self, name)
                for name in BOOTSTRAPPED_FIELDS
                if name != "environment_package_required"
            },
            "environment_path": self.environment_path or "",
            "environment_package_required": bool(self.environment_path),
        }
        return {
            **self.host_env,
            **{
                ENVIRONMENT_VARIABLES[name]: environment_text(value)
                for name, value in values.items()
                if value is not None
            },
        }


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names each bad key and its source."""


def yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML error on one line, to follow a file name: ``:LINE:COLUMN: what was expected``.

    PyYAML's own message draws the offending line with a caret under it, over several lines;
    a log keeps lines one by one, and the line drawn may hold a secret."""
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        what = exc.problem or "unreadable"
        during = f" ({exc.context})" if exc.context else ""
        return f"{where}: not valid YAML: {what}{during}"
    return f": not valid YAML: {type(exc).__name__}"


def read_config_file(path: Path) -> dict[str, Any]:
    """Load a YAML (or JSON) mapping; raises :class:`ConfigError` naming the file."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file ({exc.strerror})") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}{yaml_problem(exc)}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the config file must hold a mapping, not {type(data).__name__}")
    return data


def load_serve_config(
    *,
    file: Path | None = None,
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
    flag_names: Mapping[str, str] | None = None,
) -> ServeConfig:
    """Layer defaults, ``file``, ``environ`` (default: ``os.environ``) and ``flags``.

    ``flags`` maps field names to values; ``None`` values mean "flag not given". ``flag_names``
    maps a field to the flag that set it, for error messages. Raises :class:`ConfigError` with
    every problem, each naming where the value came from.
    """
    environ = os.environ if environ is None else environ
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if file is not None:
        for key, value in read_config_file(file).items():
            merged[key] = value
            sources[key] = f"{file}: {key}"
    for field, variable in ENVIRONMENT_VARIABLES.items():
        text = environ.get(variable, "")
        if text == "":  # an empty variable is unset, as the upstream host reads it
            continue
        merged[field] = _boolean_word(variable, text) if field in _BOOLEAN_FIELDS else text
        sources[field] = f"environment variable {variable}"
    for field, value in (flags or {}).items():
        if value is not None:
            merged[field] = value
            sources[field] = (flag_names or {}).get(field, f"--{field.replace('_', '-')}")
    if "host" not in merged and environ.get(ENVIRONMENT_VARIABLES["port"], ""):
        merged["host"] = LAUNCHED_HOST
        sources["host"] = "NMP_RUNTIME_HTTP_PORT without NMP_RUNTIME_HTTP_HOST (a launcher)"
    try:
        return ServeConfig.model_validate(merged)
    except pydantic.ValidationError as exc:
        raise ConfigError(
            describe_validation_error(exc, sources, secrets=secret_fields(ServeConfig))
        ) from exc


_BOOLEAN_FIELDS: Final = frozenset(
    name for name, field in ServeConfig.model_fields.items() if field.annotation is bool
)


def _boolean_word(variable: str, text: str) -> bool:
    """A boolean variable as the upstream host reads it: 1/true/yes are true, all else false."""
    word = text.strip().lower()
    if word not in _TRUE_WORDS | _FALSE_WORDS:
        log_event(
            "config_value_read_as_false",
            level=logging.WARNING,
            variable=variable,
            value=text,
            reason="only 1, true and yes mean true",
        )
    return word in _TRUE_WORDS


def load_caller_config(data: Any, *, source: str) -> CallerConfig:
    """Validate a caller block (from a trainer's YAML, say); errors name ``source`` and the key."""
    try:
        return CallerConfig.model_validate(data)
    except pydantic.ValidationError as exc:
        secrets = secret_fields(CallerConfig)
        raise ConfigError(f"{source}: {describe_validation_error(exc, secrets=secrets)}") from exc


def secret_fields(model: type[BaseModel]) -> frozenset[str]:
    """The fields of ``model`` marked :data:`SECRET`."""
    return frozenset(
        name
        for name, field in model.model_fields.items()
        if isinstance(field.json_schema_extra, dict) and field.json_schema_extra.get("secret")
    )
