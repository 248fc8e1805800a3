"""The trainer's checkpoint manifest: atomic, and refused unless it says where the state is."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from trio_gym.trainer.manifest import (
    MANIFEST_NAME,
    CheckpointManifest,
    ManifestError,
    load_manifest,
    write_manifest,
)

DIGEST = "ab" * 32


def manifest(**changes: Any) -> dict[str, Any]:
    document: dict[str, Any] = {
        "format": "trio-gym-trainer-checkpoint-v1",
        "checkpoint_id": "c7",
        "ledger": {"version": 1, "groups": []},
        "hosts": [
            {
                "instance": "http://a:8080",
                "directory": "hosts/a",
                "episodes": ["g1.0", "g1.1-a1"],
                "participants": [
                    {
                        "server_name": "host",
                        "kind": "episodes",
                        "state_directory": "hosts/a/participants/episodes/host",
                        "records_file": f"{DIGEST}.jsonl",
                        "sha256": DIGEST,
                        "record_count": 2,
                    }
                ],
            }
        ],
    }
    document.update(changes)
    return document


def test_a_manifest_round_trips_and_replaces_the_old_one_whole(tmp_path: Path) -> None:
    write_manifest(tmp_path, CheckpointManifest.model_validate(manifest(checkpoint_id="c6")))
    written = CheckpointManifest.model_validate(manifest())
    write_manifest(tmp_path, written)
    assert load_manifest(tmp_path) == written
    assert sorted(p.name for p in tmp_path.iterdir()) == [MANIFEST_NAME]  # no temporary left


@pytest.mark.parametrize(
    ("document", "reason"),
    [
        (manifest(hosts=[{**manifest()["hosts"][0], "participants": []}]), "participants"),
        (
            manifest(
                hosts=[{k: v for k, v in manifest()["hosts"][0].items() if k != "participants"}]
            ),
            "participants",
        ),
        (manifest(format="v0"), "format"),
        (manifest(surprise=True), "surprise"),
        (
            manifest(
                hosts=[manifest()["hosts"][0], {**manifest()["hosts"][0], "instance": "http://b"}]
            ),
            "exported by both http://a:8080 and http://b",
        ),
    ],
    ids=["empty-topology", "no-topology", "format", "unknown-field", "two-owners"],
)
def test_a_manifest_without_topology_or_with_surprises_is_refused(
    tmp_path: Path, document: dict[str, Any], reason: str
) -> None:
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(document))
    with pytest.raises(ManifestError, match=reason):
        load_manifest(tmp_path)


def _host_with(**changes: Any) -> dict[str, Any]:
    return {**manifest()["hosts"][0], **changes}


def _participant_in(state_directory: str) -> dict[str, Any]:
    participant = manifest()["hosts"][0]["participants"][0]
    return _host_with(participants=[{**participant, "state_directory": state_directory}])


@pytest.mark.parametrize(
    "host",
    [
        _host_with(directory="/exports/c7/a"),
        _host_with(directory="hosts/../../elsewhere"),
        _participant_in("/exports/c7/a/participants/episodes/host"),
        _participant_in("../participants"),
    ],
    ids=["absolute-export", "escaping-export", "absolute-state", "escaping-state"],
)
def test_a_path_that_is_absolute_or_leaves_the_checkpoint_is_refused(
    tmp_path: Path, host: dict[str, Any]
) -> None:
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(manifest(hosts=[host])))
    with pytest.raises(ManifestError, match="not a path inside the checkpoint"):
        load_manifest(tmp_path)


def test_no_manifest_or_a_broken_one_is_named(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="no checkpoint manifest"):
        load_manifest(tmp_path)
    (tmp_path / MANIFEST_NAME).write_text('{"format": ')
    with pytest.raises(ManifestError, match="not JSON"):
        load_manifest(tmp_path)


def test_a_write_that_fails_half_way_leaves_the_old_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = CheckpointManifest.model_validate(manifest(checkpoint_id="c6"))
    write_manifest(tmp_path, old)

    def crash(descriptor: int) -> None:
        raise OSError("the disk went away")

    monkeypatch.setattr("os.fsync", crash)
    with pytest.raises(OSError, match="disk went away"):
        write_manifest(tmp_path, CheckpointManifest.model_validate(manifest()))
    monkeypatch.undo()
    assert load_manifest(tmp_path) == old
