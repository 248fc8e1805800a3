"""Reading an export back into a host: the host's own records, and every check made before
anything is installed.

A restore installs all of an export's chosen episodes or none: :func:`plan_restore` reads and
verifies the export, checks that its participants are this host's, that every record is
well-formed and consistent across participants, and that no episode of it was restored here
before — and changes nothing. Installing the plan is the checkpoint's (one synchronous step,
so nothing can move between the checks and the install).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Final

import attrs
import pydantic
from pydantic import BaseModel, ConfigDict, Field

from trio_gym.errors import ErrorCode, WireError, describe_validation_error
from trio_gym.protocol.control import HOST_PARTICIPANT
from trio_gym.protocol.export import invalid, read_export
from trio_gym.protocol.identity import EpisodeId

from .episodes import Episodes, LiveEpisode, RestoredEpisode

SAMPLE: Final = 16  # capture keys listed by name in a refusal; the count is always whole


class HostRecord(BaseModel):
    """One exported episode as the host writes it (:func:`host_record`)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    capture_key: str
    rollout_id: Annotated[str, Field(min_length=1)]
    attempt: Annotated[int, Field(ge=0)]
    step: Annotated[int, Field(ge=0)]
    state: dict[str, Any]


def host_record(live: LiveEpisode) -> dict[str, Any]:
    """The record a commit writes for a parked episode."""
    return {
        "capture_key": live.id.capture_key,
        "rollout_id": live.id.rollout_id,
        "attempt": live.id.attempt,
        "step": live.step,
        "state": live.state,
    }


@attrs.frozen
class RestorePlan:
    """What a verified export installs: its episodes, each as its next attempt."""

    source_checkpoint_id: str | None
    episodes: list[RestoredEpisode]
    renames: dict[str, str]
    """Exported capture key -> the restored attempt's capture key."""
    participant_records: list[dict[str, Any]]
    """The runner's participant's records of the chosen episodes (none without one)."""


def plan_restore(
    directory: Path,
    capture_keys: Sequence[str] | None,
    *,
    participants: Iterable[tuple[str, str]],
    runner_participant: tuple[str, str] | None,
    episodes: Episodes,
) -> RestorePlan:
    """Read and check the export in ``directory``; raises ``export_invalid`` (or
    ``checkpoint_conflict`` for episodes restored here before) and changes nothing."""
    export = read_export(directory)
    expected = set(participants)
    if set(export.records) != expected:
        raise invalid(
            f"{directory}: the export's participants {_names(export.records)} are not this "
            f"host's {_names(expected)}; nothing was restored"
        )
    records = _host_records(directory, export.records[HOST_PARTICIPANT])
    keys = sorted(records) if capture_keys is None else sorted(set(capture_keys))
    missing = [key for key in keys if key not in records]
    if missing:
        raise invalid(
            f"{directory}: {len(missing)} capture key(s) not exported: {missing[:SAMPLE]}"
        )
    for part, rows in export.records.items():
        held = {row["capture_key"] for row in rows}
        if held != set(records):
            raise invalid(
                f"{directory}: participant {'/'.join(part)} holds records for "
                f"{len(held)} episode(s), the host for {len(records)}; the export is "
                "inconsistent, nothing restored"
            )
    restored = [
        RestoredEpisode(
            EpisodeId(records[key].rollout_id, records[key].attempt + 1),
            records[key].step,
            records[key].state,
        )
        for key in keys
    ]
    renames = {key: episode.id.capture_key for key, episode in zip(keys, restored, strict=True)}
    taken = [new for new in renames.values() if episodes.knows(new)]
    if taken:
        raise WireError(
            ErrorCode.CHECKPOINT_CONFLICT,
            f"{len(taken)} episode(s) of this export were already restored here: {taken[:SAMPLE]}",
        )
    participant_records = (
        [r for r in export.records[runner_participant] if r["capture_key"] in renames]
        if runner_participant is not None
        else []
    )
    source = export.manifest.get("checkpoint_id")
    return RestorePlan(source, restored, renames, participant_records)


def _names(participants: Iterable[tuple[str, str]]) -> list[str]:
    """Participants as ``server_name/kind``, the way the export's folders name them."""
    return sorted("/".join(part) for part in participants)


def _host_records(directory: Path, rows: Sequence[Mapping[str, Any]]) -> dict[str, HostRecord]:
    """The host's records by capture key, each checked before anything is installed."""
    records: dict[str, HostRecord] = {}
    for number, row in enumerate(rows, 1):
        try:
            record = HostRecord.model_validate(row)
        except pydantic.ValidationError as exc:
            raise invalid(
                f"{directory}: host record {number} is malformed: {describe_validation_error(exc)}"
            ) from exc
        expected = EpisodeId(record.rollout_id, record.attempt).capture_key
        if record.capture_key != expected:
            raise invalid(
                f"{directory}: host record {number} has capture key {record.capture_key!r}, "
                f"but its rollout and attempt make {expected!r}"
            )
        if record.capture_key in records:
            raise invalid(f"{directory}: episode {expected!r} is exported twice")
        records[record.capture_key] = record
    return records
