"""Gym's own finalization of rollout records, in a process of the Python that has nemo_gym.

    python -P .../trio_gym/runners/finalize_worker.py

Run by its file, by the Gym Python (nemo-gym needs Python 3.13; the host may run on another):
it imports nothing of trio_gym: only nemo_gym, what nemo_gym depends on, and the standard
library. Its owner is the host (:mod:`trio_gym.runners.finalize`); they speak JSON lines, one
request on standard input, one answer on standard output, in order:

- ``{"id": N, "op": "configure", "config": {Gym's global config}}`` first. The answer says what
  Gym's config switches on (``{"id": N, "ok": true, "finalizes": [...]}``), or why this process
  cannot finalize records for it (``{"id": N, "ok": false, "error": ...}``): a capture folder
  not on this machine, a token store that is not a folder, a Gym without the functions used.
- ``prepare`` ``{row}``: before the row's ``/run``, clear the old model-call and token captures
  of its capture key, as Gym's collection clears the ids it is about to dispatch (a second run
  of the same ids would otherwise append to them).
- ``finish`` ``{row, record, latency_ms}``: the record as Gym's collection finishes it once its
  ``/run`` returned — model-call capture merged, trajectory rebuilt, ``ng_perf`` with the
  measured ``/run`` time, token capture finalized (``mask_sample``, ``_ng_token_capture``, the
  response rebuilt from the token store where configured) — and, when Gym allows it, the frozen
  token snapshot to retire once the record is handed off (``retire``).
- ``retire`` ``{retire: [snapshot, ...]}``: drop those snapshots (their records have been
  delivered).

Every step is Gym's own function (``rollout_collection``, ``base_responses_api_model``,
``token_id_capture``), in the order its ``run_from_config`` applies them; nothing of Gym's
record format is written here. A step that raises is answered ``{"ok": false, "error": ...}``.

Gym's code may print; standard output is the channel to the owner, so the process's file
descriptor 1 is pointed at standard error (which the owner logs) and answers go to a copy of
the original. The worker ends at end-of-file on standard input (its owner closed it, or died),
or at once when its owner is gone while Gym's code is busy (a watching thread).
"""

from __future__ import annotations

import asyncio
import functools
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

# Gym's own JSON (nemo-gym depends on it), what its collection writes records with.
import orjson

# What this worker calls of Gym, by module: looked up once, at configure, so a Gym that lacks
# one (another version) is one clear refusal rather than a failure on every record.
GYM_FUNCTIONS = {
    "nemo_gym.base_responses_api_model": (
        "clear_model_call_captures_for_rollouts",
        "merge_model_call_capture_into_record",
        "model_call_capture_dirs_from_config",
        "observability_enabled_from_config",
    ),
    "nemo_gym.token_id_capture": (
        "TokenCaptureStore",
        "TokenIdCaptureConfig",
        "clear_token_captures_for_rollouts",
        "installed_token_source",
        "token_id_capture_dirs_from_config",
    ),
    "nemo_gym.token_id_capture.config": ("token_id_capture_enabled_for_agent",),
    "nemo_gym.token_id_capture.delivery": (
        "capture_build_can_retire",
        "finalize_rollout_token_capture",
    ),
    "nemo_gym.rollout_correlation": ("maybe_rollout_id_from_run_body",),
    "nemo_gym.rollout_collection": (
        "NG_DISPATCH_DRAINED_KEY",
        "NG_FAILURE_CLASS_KEY",
        "NG_TRAJECTORY_KEY",
        "RolloutCollectionHelper",
        "_NO_RESULT_FAILURE_CLASSES",
        "_attach_ng_perf",
        "_attach_trajectory_record",
        "_has_observation_gap",
    ),
}


class Unavailable(Exception):
    """This process cannot finalize records for the config it was given; the message says why."""


def load_gym() -> dict[str, Any]:
    """Every name of :data:`GYM_FUNCTIONS`; raises :class:`Unavailable` naming a missing one."""
    import importlib

    found: dict[str, Any] = {}
    for module_name, names in GYM_FUNCTIONS.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise Unavailable(f"cannot import {module_name}: {exc}") from exc
        for name in names:
            if not hasattr(module, name):
                version = getattr(sys.modules.get("nemo_gym"), "__version__", "?")
                raise Unavailable(
                    f"nemo_gym {version} has no {module_name}.{name}, which Gym's collection "
                    "finalizes records with in nemo-gym 0.7.0"
                )
            found[name] = getattr(module, name)
    return found


def usable_folder(path: Path, what: str) -> None:
    """Raise :class:`Unavailable` unless ``path`` is a folder here this process can clear.

    Looked at before any of Gym's stores is made for it: a store makes its folder, and records
    finalized against an empty folder of this machine would all read as uncaptured (masked)."""
    if not path.is_dir():
        raise Unavailable(
            f"{what} {path} named by Gym's config is not a folder on this machine (the "
            "deployment writes it where its model server runs)"
        )
    if not os.access(path, os.R_OK | os.W_OK | os.X_OK):
        raise Unavailable(f"{what} {path} named by Gym's config cannot be read and cleared here")


class Finalizer:
    """What one configured worker knows: Gym's functions, its config and where captures are."""

    def __init__(self, config: dict[str, Any]) -> None:
        # Gym's helpers read the global config from the process (Hydra, from argv) when they
        # are not handed it; this process's argv is not a Gym command line.
        import yaml

        os.environ["NEMO_GYM_CONFIG_DICT"] = yaml.safe_dump(config)
        from omegaconf import OmegaConf

        gym = load_gym()
        self.gym = gym
        self.config = OmegaConf.create(config)
        self.capture_dirs: list[Path] = gym["model_call_capture_dirs_from_config"](self.config)
        self.observability = bool(gym["observability_enabled_from_config"](self.config))
        self.token_dirs: list[Path] = gym["token_id_capture_dirs_from_config"](self.config)
        capture = gym["TokenIdCaptureConfig"].model_validate(self.config)
        self.tokens = bool(capture.enabled)
        for directory in self.capture_dirs:
            usable_folder(Path(directory), "the model-call capture folder")
        for directory in self.token_dirs:
            usable_folder(Path(directory), "the token-ID capture folder")
        self.token_source: Any = None
        if self.tokens and capture.token_id_capture.rebuild_response:
            self.token_source = gym["installed_token_source"]()
            if self.token_source is None:
                if not self.token_dirs:
                    raise Unavailable(
                        "Gym's token-ID capture rebuilds responses, and its records go to a "
                        "sink of the framework's, not to a folder this process can read"
                    )
                self.token_source = gym["TokenCaptureStore"](self.token_dirs[0])

    def finalizes(self) -> list[str]:
        parts = []
        if self.capture_dirs:
            parts.append("model_call_capture")
        if self.observability:
            parts.append("ng_perf")
        if self.tokens:
            parts.append("token_id_capture")
        return parts

    def _tokens_captured(self, row: dict[str, Any]) -> bool:
        """Whether the row's agent takes part in token-ID capture (Gym's rule, by agent)."""
        agent = self.gym["RolloutCollectionHelper"]._agent_name_for_row(row, self.config)
        return self._captures_tokens_of(agent)

    @functools.cache  # noqa: B019 - one config per worker; Gym validates the whole config per call
    def _captures_tokens_of(self, agent: Any) -> bool:
        return bool(self.gym["token_id_capture_enabled_for_agent"](self.config, agent))

    def prepare(self, row: dict[str, Any]) -> dict[str, Any]:
        gym = self.gym
        gym["clear_model_call_captures_for_rollouts"]([row], self.capture_dirs)
        if self.token_dirs and self._tokens_captured(row):
            gym["clear_token_captures_for_rollouts"]([row], self.token_dirs)
        return {}

    async def finish(
        self, row: dict[str, Any], record: dict[str, Any], latency_ms: float | None
    ) -> dict[str, Any]:
        gym = self.gym
        failure_class = record.get(gym["NG_FAILURE_CLASS_KEY"])
        no_result = failure_class in gym["_NO_RESULT_FAILURE_CLASSES"] or bool(
            record.get(gym["NG_DISPATCH_DRAINED_KEY"])
        )
        if self.capture_dirs and not no_result:
            gym["merge_model_call_capture_into_record"](
                record,
                self.capture_dirs,
                include_payloads=not gym["_has_observation_gap"](
                    record, "multimodal_history_redacted"
                ),
            )
        if (
            "ng_model_call_capture" in record
            or "ng_agent_observations" in record
            or gym["NG_TRAJECTORY_KEY"] in record
        ):
            gym["_attach_trajectory_record"](row, record)
        gym["_attach_ng_perf"](
            record, observability_enabled=self.observability, rollout_latency_ms=latency_ms
        )
        retire = None
        if not no_result and self._tokens_captured(row):
            build = await gym["finalize_rollout_token_capture"](record, self.token_source)
            rollout_id = gym["maybe_rollout_id_from_run_body"](record)
            if rollout_id is not None and gym["capture_build_can_retire"](build):
                snapshot = build["_capture_snapshot"]
                retire = {
                    "rollout_id": rollout_id,
                    "snapshot_id": str(snapshot["snapshot_id"]),
                    "version": int(snapshot["version"]),
                }
        return {"record": record, "retire": retire}

    async def retire(self, snapshots: list[dict[str, Any]]) -> dict[str, Any]:
        # The drop Gym's retire_rollout_token_capture makes, by the snapshot's identity (what
        # finish answered), so a record finished by an earlier worker is retired all the same.
        retired = []
        for snapshot in snapshots:
            dropped = await self.token_source.drop(
                snapshot["rollout_id"],
                snapshot_id=snapshot["snapshot_id"],
                version=snapshot["version"],
            )
            retired.append(bool(dropped))
        return {"retired": retired}


async def answer(finalizer: Finalizer | None, request: dict[str, Any]) -> dict[str, Any]:
    op = request.get("op")
    if op == "configure":
        raise RuntimeError("configure is the first request, and only the first")
    if finalizer is None:
        raise RuntimeError("not configured")
    if op == "prepare":
        return finalizer.prepare(request["row"])
    if op == "finish":
        return await finalizer.finish(request["row"], request["record"], request["latency_ms"])
    if op == "retire":
        return await finalizer.retire(request["retire"])
    raise RuntimeError(f"no such request {op!r}")


def exit_with_the_owner(owner: int) -> None:
    """End this process once its owner is gone, even while Gym's code is busy or stuck (the
    end of standard input is only read between requests). A thread, looking every second."""

    def watch() -> None:
        while os.getppid() == owner:
            time.sleep(1.0)  # clock-ok: another process's end, which nothing here can await
        os._exit(1)

    threading.Thread(target=watch, name="owner-watch", daemon=True).start()


def main() -> None:
    exit_with_the_owner(os.getppid())
    channel = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever Gym prints goes to standard error, which the owner logs
    sys.stdout = sys.stderr
    loop = asyncio.new_event_loop()
    finalizer: Finalizer | None = None
    for line in sys.stdin.buffer:
        request: Any = None
        try:
            request = orjson.loads(line)
            if request.get("op") == "configure" and finalizer is None:
                finalizer = Finalizer(request["config"])
                reply: dict[str, Any] = {"finalizes": finalizer.finalizes()}
            else:
                reply = loop.run_until_complete(answer(finalizer, request))
            reply = {"id": request.get("id"), "ok": True, **reply}
        except Exception as exc:  # every failure is this request's answer; the worker goes on
            known = isinstance(exc, Unavailable)
            reply = {
                "id": request.get("id") if isinstance(request, dict) else None,
                "ok": False,
                "error": str(exc) if known else f"{type(exc).__name__}: {exc}",
            }
        try:
            written = orjson.dumps(reply)
        except (TypeError, ValueError) as exc:  # a record Gym's JSON cannot write
            error = f"{type(exc).__name__}: {exc}"
            written = orjson.dumps({"id": reply["id"], "ok": False, "error": error})
        channel.write(written + b"\n")
        channel.flush()
    if finalizer is not None and finalizer.token_source is not None:
        loop.run_until_complete(finalizer.token_source.close())


if __name__ == "__main__":
    main()
