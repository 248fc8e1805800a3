"""The Ray actor's session (trio on a thread of its own) driven from other threads, without
Ray: what its actor methods do when they overlap. Real processes, the real clock."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.processes import kill_all, processes_with
from trio_gym.config import CallerConfig
from trio_gym.fleet.ray_actor import ActorConfig, Session, SessionFailed

TOKEN_VARIABLE = "TRIO_GYM_SESSION_TEST"


def test_a_shutdown_during_spinup_ends_the_session_once_its_hosts_are_up(tmp_path: Path) -> None:
    token = uuid.uuid4().hex
    caller = CallerConfig(host_env={TOKEN_VARIABLE: token}, work_path=str(tmp_path))
    session = Session(ActorConfig(hosts=2, caller=caller))
    failures: list[BaseException] = []

    def spinup() -> None:
        try:
            session.start()
        except BaseException as exc:
            failures.append(exc)

    spinning = threading.Thread(target=spinup, daemon=True)  # a hung one must not hold pytest
    spinning.start()
    try:
        while not processes_with(TOKEN_VARIABLE, token):  # the hosts are being launched
            time.sleep(0.01)  # clock-ok: a test driving threads from outside trio
        stopping = threading.Thread(target=session.stop, daemon=True)
        stopping.start()
        stopping.join(timeout=60)
        spinning.join(timeout=60)
        assert not stopping.is_alive() and not spinning.is_alive()
        (failure,) = failures
        assert isinstance(failure, SessionFailed)
        assert "shut down while it spun up" in str(failure)
        assert processes_with(TOKEN_VARIABLE, token) == []
        with pytest.raises(SessionFailed, match="the session is not running"):
            list(session.rows_as_completed([{"id": 0}], lambda: False))
        assert not session.healthy()
    finally:
        kill_all(TOKEN_VARIABLE, token)
