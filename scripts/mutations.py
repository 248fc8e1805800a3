"""Break one rule at a time on purpose and show which named tests catch it.

Each mutation replaces one exact piece of source in a scratch copy of the checkout, runs the
tests that claim to guard that rule, and reports whether they failed (they must). The checkout
itself is never touched.

    python scripts/mutations.py            # every mutation
    python scripts/mutations.py shield     # the ones whose name contains "shield"
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
# Longer than any guarded test takes, real NeMo Gym's included; a run past it is a hang.
TEST_TIMEOUT_S = 900


class Mutation(NamedTuple):
    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]
    also: tuple[tuple[str, str, str], ...] = ()
    """Further (file, old, new) edits that belong to the same broken rule."""


MUTATIONS = [
    Mutation(
        "close-delimited framing: stream heartbeats to HTTP/1.0 callers as the seed's host did",
        "trio_gym/host/rollouts.py",
        'if caller.http_version == b"1.1":',
        "if True:",
        (
            "tests/test_proxy_regression.py::test_a_long_batch_arrives_whole_through_the_framing_proxy",
            "tests/test_host_wire.py::test_http_10_caller_gets_content_length_and_no_chunks",
        ),
        also=(("trio_gym/http/messages.py", 'if conn.their_http_version != b"1.1":', "if False:"),),
    ),
    Mutation(
        "chunked guard removed as well (h11 then writes the 1.0 body close-delimited)",
        "trio_gym/http/messages.py",
        'if conn.their_http_version != b"1.1":',
        "if False:",
        ("tests/test_http_mechanics.py::test_chunked_body_refuses_an_http_10_peer",),
    ),
    Mutation(
        "empty responses without Content-Length: 0",
        "trio_gym/http/messages.py",
        '_response(status, [("content-length", "0"), *headers])',
        "_response(status, [*headers])",
        (
            "tests/test_host_wire.py::test_empty_responses_carry_content_length_zero",
            "tests/test_http_mechanics.py::test_send_empty_frames_by_content_length_zero",
            "tests/test_proxy_regression.py::test_an_empty_response_through_the_framing_proxy_is_framed",
        ),
    ),
    Mutation(
        "shield removed from the write span",
        "trio_gym/http/connection.py",
        "        with trio.CancelScope(shield=True), trio.move_on_after(",
        "        with trio.CancelScope(shield=False), trio.move_on_after(",
        (
            "tests/test_http_mechanics.py::test_a_write_cancelled_half_way_still_completes",
            "tests/test_http_mechanics.py::test_a_shielded_write_is_bounded_by_send_timeout",
            "tests/test_http_mechanics.py::test_a_socket_write_cancelled_half_way_still_completes",
        ),
    ),
    Mutation(
        "close without draining (reset destroys the 413)",
        "trio_gym/host/server.py",
        "            await _refuse(services, conn, error, busy=busy)\n        await conn.close()",
        "            await _refuse(services, conn, error, busy=busy)\n        await conn.aclose()",
        ("tests/test_host_wire.py::test_413_is_read_by_a_client_still_uploading_50_mb",),
    ),
    Mutation(
        "413 decided after reading the body",
        "trio_gym/http/messages.py",
        "    if declared is not None and declared > max_bytes:",
        "    if False:",
        (
            "tests/test_http_mechanics.py::test_a_declared_length_over_the_limit_is_refused_before_reading_the_body",
        ),
    ),
    Mutation(
        "end-of-file taken as a departure (half-closed callers lose their answer)",
        "trio_gym/http/connection.py",
        "        await self.wait_until_peer_stops_sending()\n        if probe is None:",
        "        await self.wait_until_peer_stops_sending()\n"
        '        raise ConnectionLost("eof")\n'
        "        if probe is None:",
        (
            "tests/test_host_clock.py::test_half_closed_caller_still_gets_its_answer",
            "tests/test_host_wire.py::test_a_half_closed_caller_over_tcp_gets_its_answer",
            "tests/test_reattach.py::test_a_half_closed_keyed_caller_is_still_attached_and_gets_its_whole_answer",
        ),
    ),
    Mutation(
        "no caller watcher (only heartbeats notice a departure)",
        "trio_gym/host/supervision.py",
        "    nursery.start_soon(caller.until_gone, body, heartbeat)\n",
        "",
        ("tests/test_host_wire.py::test_a_caller_that_leaves_mid_batch_cancels_every_example",),
    ),
    Mutation(
        "shutdown does not cancel in-flight batches",
        "trio_gym/host/lifecycle.py",
        "            for scope in self._stoppable:\n                scope.cancel()",
        "            pass",
        (
            "tests/test_host_clock.py::test_shutdown_answers_in_flight_batches_with_shutting_down",
            "tests/test_cli.py::test_a_signal_answers_in_flight_batches_shutting_down_and_exits",
        ),
    ),
    Mutation(
        "the deadline does not apply",
        "trio_gym/host/supervision.py",
        "            batch_scope.deadline = trio.current_time() + deadline_s",
        '            batch_scope.deadline = float("inf")',
        (
            "tests/test_host_clock.py::test_deadline_cancels_every_running_example",
            "tests/test_host_wire.py::test_http_10_deadline_is_504",
        ),
    ),
    Mutation(
        "results in completion order",
        "trio_gym/host/batch.py",
        "        self._parts[index] = encoded",
        '        self._parts[self._parts.index(b"")] = encoded',
        (
            "tests/test_host_wire.py::test_results_come_back_in_input_order_with_identity_keys_and_none_invented",
        ),
    ),
    Mutation(
        "identity keys overwrite the runner's values",
        "trio_gym/host/batch.py",
        "missing = {key: value for key, value in identity.items() if result.get(key) is None}",
        "missing = dict(identity)",
        (
            "tests/test_host_wire.py::test_results_come_back_in_input_order_with_identity_keys_and_none_invented",
        ),
    ),
    Mutation(
        "head size checked only by h11 (a head in one read slips through)",
        "trio_gym/http/connection.py",
        "        if size > self.limits.max_head_bytes:",
        "        if False:",
        (
            "tests/test_http_mechanics.py::test_the_head_limit_holds_even_when_the_head_arrives_in_one_read",
            "tests/test_host_wire.py::test_head_just_over_the_limit_in_one_read_gets_431",
        ),
    ),
    Mutation(
        "no connection cap",
        "trio_gym/host/server.py",
        '    if busy and not (head.method == b"GET" and path in WATCHED_WHEN_BUSY):\n        raise _busy(config)',
        "    if False:\n        raise _busy(config)",
        ("tests/test_host_wire.py::test_extra_connections_beyond_the_cap_get_503_host_busy",),
    ),
    Mutation(
        "environment_offline does not set UV_OFFLINE",
        "trio_gym/install/stage.py",
        '        environ["UV_OFFLINE"] = "1"',
        "        pass",
        (
            "tests/test_install.py::test_wheels_install_and_are_found_by_children_and_by_uv_offline",
            "tests/test_gym_sandboxed.py::test_offline_a_packages_server_venv_is_built_in_the_sandbox_from_wheelhouses_alone[docker]",
        ),
    ),
    Mutation(
        "the config beats the operator's own UV_OFFLINE",
        "trio_gym/install/stage.py",
        "if operator_offline is None and config.environment_offline:",
        "if config.environment_offline:",
        ("tests/test_install.py::test_the_operators_uv_offline_wins",),
    ),
    Mutation(
        "the installed wheels are not put on sys.path",
        "trio_gym/install/stage.py",
        "    sys_path.insert(0, str(target))\n",
        "",
        (
            "tests/test_install.py::test_wheels_install_and_are_found_by_children_and_by_uv_offline",
            "tests/test_install.py::test_the_host_process_imports_the_installed_wheel",
        ),
    ),
    Mutation(
        "an unknown key in the caller config passes",
        "trio_gym/config.py",
        'model_config = ConfigDict(extra="forbid", frozen=True)\n\n    job_id: str = ""',
        'model_config = ConfigDict(extra="ignore", frozen=True)\n\n    job_id: str = ""',
        (
            "tests/test_config.py::test_an_unknown_key_in_the_caller_config_is_an_error_naming_the_key",
        ),
    ),
    Mutation(
        "an unknown key in the serve config passes",
        "trio_gym/config.py",
        'model_config = ConfigDict(extra="forbid", frozen=True)\n\n    host: Annotated',
        'model_config = ConfigDict(extra="ignore", frozen=True)\n\n    host: Annotated',
        ("tests/test_config.py::test_an_unknown_key_in_the_file_is_an_error_naming_key_and_file",),
    ),
    Mutation(
        "the launcher starts without a runtime argument",
        "scripts/gym_host.sh",
        'if [[ $# -lt 1 || -z "${1:-}" ]]; then',
        "if false; then",
        ("tests/test_launcher.py::test_the_launcher_refuses_to_start_without_a_usable_runtime",),
    ),
    Mutation(
        "the launcher does not put the package on PYTHONPATH",
        "scripts/gym_host.sh",
        '  export PYTHONPATH="$package${PYTHONPATH:+:$PYTHONPATH}"',
        "  :",
        (
            "tests/test_launcher.py::test_the_launcher_starts_the_host_with_the_package_on_pythonpath",
        ),
    ),
    Mutation(
        "a body that died after the headers is retried (runs the examples twice)",
        "trio_gym/trainer/answers.py",
        "        reach=Reach.TAKEN,\n        suspect=True,\n        status=status,\n    )",
        "        reach=Reach.UNREACHED,\n        suspect=True,\n        status=status,\n    )",
        ("tests/test_client.py::test_a_body_that_dies_after_the_headers_is_sent_exactly_once",),
    ),
    Mutation(
        "a connection that never landed counted as taken (over HTTP/1.0, and for a row stream)",
        "trio_gym/trainer/host_client.py",
        "        if isinstance(failure, ConnectFailed):\n            return Reach.UNREACHED",
        "        if False:\n            return Reach.UNREACHED",
        (
            "tests/test_client.py::test_over_http_10_only_a_connection_that_never_opened_is_unreached",
        ),
    ),
    Mutation(
        "a re-send waits behind new chunks instead of first in line (#24)",
        "trio_gym/trainer/pool.py",
        "async with self.scheduler.slot(first=send > 1) as member:",
        "async with self.scheduler.slot(first=False) as member:",
        (
            "tests/test_client.py::test_a_failed_host_is_probed_before_more_and_the_resend_goes_first",
        ),
    ),
    Mutation(
        "one more request in flight than max_in_flight",
        "trio_gym/trainer/scheduler.py",
        "        return member.in_flight < self.settings.per_host_in_flight",
        "        return member.in_flight <= self.settings.per_host_in_flight",
        ("tests/test_client.py::test_peak_concurrency_is_exactly_max_in_flight",),
    ),
    Mutation(
        "a flat proxy envelope read as the host's",
        "trio_gym/trainer/answers.py",
        'if isinstance(document, dict) and {"code", "message"} <= set(document):',
        "if False:",
        ("tests/test_client.py::test_each_answer_is_named_and_taken_or_not_by_one_rule",),
    ),
    Mutation(
        "a bug in the trainer disguised as a rollout failure",
        "trio_gym/trainer/pool.py",
        "            raise_unwrapped(group)  # a bug in one chunk's task, as itself",
        '            raise RolloutError("?", origin=Origin.SANDBOX, reach=Reach.TAKEN) from None',
        ("tests/test_client.py::test_a_bug_in_this_process_propagates_as_itself",),
        also=(
            (
                "trio_gym/trainer/pool.py",
                "from trio_gym.trainer.errors import Reach, RolloutError",
                "from trio_gym.trainer.errors import Origin, Reach, RolloutError",
            ),
        ),
    ),
    Mutation(
        "the number of results is not checked",
        "trio_gym/trainer/host_client.py",
        "        if len(results) != expected:",
        "        if False:",
        ("tests/test_client.py::test_each_answer_is_named_and_taken_or_not_by_one_rule",),
    ),
    Mutation(
        "no client-side request deadline",
        "trio_gym/trainer/host_client.py",
        "        with RequestDeadline(self.deadlines, self.settings.request_deadline_s).waiting():",
        "        with RequestDeadline(self.deadlines, math.inf).waiting():",
        ("tests/test_client.py::test_the_client_deadline_bounds_a_host_that_heartbeats_forever",),
    ),
    Mutation(
        "the client uploads first and reads after (an early 413 dies with the upload)",
        "trio_gym/http/client.py",
        "                upload_failed = exc  # the answer may still be readable; the head decides",
        "                raise",
        (
            "tests/test_client.py::test_a_413_decided_while_the_client_still_uploads_is_read_as_a_client_failure",
        ),
        also=(("trio_gym/http/client.py", "nursery.start_soon(upload)", "await upload()"),),
    ),
    Mutation(
        "no minimum body rate (a trickled body holds a slot for hours)",
        "trio_gym/host/rollouts.py",
        "        min_rate=services.limits.min_body_rate,\n        advice=TOO_LARGE_ADVICE,\n",
        "        advice=TOO_LARGE_ADVICE,\n",
        (
            "tests/test_host_clock.py::test_a_trickled_body_gets_408_once_it_falls_below_the_minimum_rate",
        ),
    ),
    Mutation(
        "readiness checked only after reading the body",
        "trio_gym/host/rollouts.py",
        "    services.lifecycle.check_accepting()\n    rows = wants_rows(head)",
        "    rows = wants_rows(head)",
        ("tests/test_host_clock.py::test_the_host_is_checked_ready_before_the_body_is_read",),
    ),
    Mutation(
        "readiness not checked again once the body has arrived",
        "trio_gym/host/rollouts.py",
        "        # The body may have taken a while; the host may be stopping now, or its caller gone.\n        services.lifecycle.check_accepting()",
        "        pass",
        ("tests/test_host_clock.py::test_a_shutdown_while_the_body_arrives_refuses_the_batch",),
    ),
    Mutation(
        "100 Continue sent before the declared length is checked",
        "trio_gym/http/messages.py",
        "    if declared is not None and declared > max_bytes:\n"
        '        raise _too_large(f"declares {declared} bytes", max_bytes, advice)\n'
        "    if conn.peer_waits_for_100_continue:\n"
        "        await conn.send(h11.InformationalResponse(status_code=100, headers=[]))",
        "    if conn.peer_waits_for_100_continue:\n"
        "        await conn.send(h11.InformationalResponse(status_code=100, headers=[]))\n"
        "    if declared is not None and declared > max_bytes:\n"
        '        raise _too_large(f"declares {declared} bytes", max_bytes, advice)',
        (
            "tests/test_host_wire.py::test_expect_100_continue_over_the_limit_gets_413_without_the_body",
        ),
    ),
    Mutation(
        "a request with both Content-Length and Transfer-Encoding accepted",
        "trio_gym/http/messages.py",
        'if b"content-length" in names and b"transfer-encoding" in names:',
        "if False:",
        (
            "tests/test_host_wire.py::test_bytes_that_are_not_our_http_are_refused_clearly",
            "tests/test_hostile.py::test_no_smuggled_request_runs_and_each_framing_trick_gets_one_framed_answer",
        ),
    ),
    Mutation(
        "a body written as one write (send_timeout_s then bounds the whole body)",
        "trio_gym/http/connection.py",
        "            if len(pending) >= self.limits.write_bytes:",
        "            if False:",
        (
            "tests/test_http_mechanics.py::test_send_timeout_bounds_a_stall_not_a_slow_steady_reader",
        ),
    ),
    Mutation(
        "the connection slot released after an await (leaks when cancelled)",
        "trio_gym/http/connection.py",
        "            if self._on_close is not None:\n                self._on_close()\n            await self._transport.aclose()",
        "            await self._transport.aclose()\n            if self._on_close is not None:\n                self._on_close()",
        ("tests/test_host_clock.py::test_a_cancelled_connection_gives_back_its_slot",),
    ),
    Mutation(
        "no overflow: every over-cap connection is dropped without an answer",
        "trio_gym/host/admission.py",
        "        for admitted in (self.served, self.refused):",
        "        for admitted in (self.served,):",
        (
            "tests/test_host_clock.py::test_beyond_the_cap_a_bounded_overflow_hears_503_and_the_rest_are_closed",
        ),
    ),
    Mutation(
        "shutdown waits for a hung runner import",
        "trio_gym/host/lifecycle.py",
        "                abandon_on_cancel=True,",
        "                abandon_on_cancel=False,",
        ("tests/test_cli.py::test_a_signal_during_a_hung_runner_import_still_exits",),
    ),
    Mutation(
        "credential-looking values pass into the sandbox",
        "trio_gym/config.py",
        "if _CREDENTIAL_NAME.search(name) or _CREDENTIAL_VALUE.search(value):",
        "if _CREDENTIAL_NAME.search(name):",
        ("tests/test_config.py::test_host_env_values_that_are_credentials_are_refused",),
    ),
    Mutation(
        "a stream cut before its done line taken as complete",
        "trio_gym/trainer/stream.py",
        '                what = "the stream ended without its done line"',
        "                raise StopAsyncIteration",
        (
            "tests/test_client_stream.py::test_a_stream_cut_before_its_done_line_is_named_as_run_names_a_cut_and_taken",
        ),
    ),
    Mutation(
        "a failed example ends the row stream (cancelling its siblings)",
        "trio_gym/host/rows.py",
        "    work = partial(run_examples, services, examples, episodes, finished, failed, row_offset)",
        "    work = partial(run_examples, services, examples, episodes, finished, None, row_offset)",
        ("tests/test_rows.py::test_a_failed_example_is_a_sidecar_row_and_the_stream_goes_on",),
    ),
    Mutation(
        "rows held back until the batch ends (not in completion order as they finish)",
        "trio_gym/host/rows.py",
        "        async for line, ok, deliveries in rows_out:\n            await body.send(line)",
        "        async for line, ok, deliveries in rows_out:\n"
        "            await trio.sleep_until(trio.current_time() + 1000)\n"
        "            await body.send(line)",
        ("tests/test_rows.py::test_rows_come_in_completion_order_with_empty_line_heartbeats",),
    ),
    Mutation(
        "an agent request that reached the agent is sent again",
        "trio_gym/runners/agents.py",
        "            except ConnectFailed as exc:\n                log_event(",
        "            except NoResponse as exc:\n                log_event(",
        ("tests/test_agents.py::test_a_dropped_connection_is_not_resent_and_requests_match_sends",),
    ),
    Mutation(
        "connection retries toward an agent unbounded by agent_connect_attempts",
        "trio_gym/runners/agents.py",
        "        for attempt in range(1, attempts):",
        "        for attempt in range(1, attempts + 2):",
        ("tests/test_agents.py::test_refused_connections_are_retried_a_bounded_number_of_times",),
    ),
    Mutation(
        "an environment server in front of an agent is bypassed",
        "trio_gym/runners/deployment.py",
        "            return self.servers[fronting[0]]",
        "            pass",
        (
            "tests/test_agents.py::test_the_head_server_names_the_agents_and_environment_servers_front_them",
        ),
    ),
    Mutation(
        "no concurrency bound per agent server",
        "trio_gym/runners/agents.py",
        "                trio.CapacityLimiter(limit),",
        "                trio.CapacityLimiter(10**6),",
        ("tests/test_agents.py::test_concurrency_toward_one_agent_server_is_bounded",),
    ),
    Mutation(
        "an unknown agent does not make the runner ask the head server again",
        "trio_gym/runners/agents.py",
        "        if found is None and self.learns:",
        "        if False:",
        ("tests/test_agents.py::test_an_unknown_agent_makes_the_runner_ask_the_head_server_again",),
    ),
    Mutation(
        "a wait step treated as replay (cut short by a checkpoint)",
        "trio_gym/host/episodes.py",
        '        if mode == "wait":\n            return await step()',
        '        if mode == "never":\n            return await step()',
        ("tests/test_checkpoint.py::test_a_replay_step_is_cut_short_and_a_wait_step_is_not",),
    ),
    Mutation(
        "restore skips the digest check",
        "trio_gym/protocol/export.py",
        "    if digest != entry.sha256:",
        "    if False:",
        (
            "tests/test_checkpoint.py::test_a_tampered_or_unpublished_export_is_refused_and_changes_nothing",
        ),
    ),
    Mutation(
        "retire runs while a checkpoint is open",
        "trio_gym/host/checkpoint.py",
        "        if self.phase not in (CheckpointPhase.IDLE, CheckpointPhase.RESTORED):",
        "        if False:",
        (
            "tests/test_checkpoint.py::test_retire_is_refused_during_a_checkpoint_and_stale_until_forget",
        ),
    ),
    Mutation(
        "time parked charged to the batch deadline (the batch's own deadline, #25)",
        "trio_gym/host/episodes.py",
        "                live.batch_deadline.pause()",
        "                pass",
        ("tests/test_checkpoint.py::test_time_parked_is_not_charged_to_the_deadline",),
    ),
    Mutation(
        "a paused deadline keeps running (the one pausable deadline of both sides, #15)",
        "trio_gym/deadline.py",
        "            self.scope.deadline = math.inf",
        "            pass",
        (
            "tests/test_checkpoint.py::test_time_parked_is_not_charged_to_the_deadline",
            "tests/test_deadlines.py::test_a_paused_deadline_stands_still_until_the_last_holder_releases",
        ),
    ),
    Mutation(
        "an expired lease does not resume the host",
        "trio_gym/host/checkpoint.py",
        "                self._resume(self.checkpoint_id)",
        "                self.lease_until = None",
        ("tests/test_checkpoint.py::test_a_lease_that_expires_resumes_the_host_by_itself",),
    ),
    Mutation(
        "new episodes admitted while admission is closed",
        "trio_gym/host/episodes.py",
        "        if not self.admission_open:",
        "        if False:",
        ("tests/test_checkpoint.py::test_admission_closed_refuses_new_work_but_costs_nothing",),
    ),
    Mutation(
        "a restored episode dispatched twice",
        "trio_gym/host/episodes.py",
        "        if key in self.consumed:",
        "        if False:",
        ("tests/test_checkpoint.py::test_restore_continues_each_episode_once_as_the_next_attempt",),
    ),
    Mutation(
        "the old attempt of a restored episode still admitted",
        "trio_gym/host/episodes.py",
        "        if current is not None and episode.attempt < current:",
        "        if False:",
        ("tests/test_checkpoint.py::test_restore_continues_each_episode_once_as_the_next_attempt",),
    ),
    Mutation(
        "a resumed checkpoint id accepted again",
        "trio_gym/host/checkpoint.py",
        "        if checkpoint_id in self._resumed:\n            raise WireError(",
        "        if False:\n            raise WireError(",
        ("tests/test_checkpoint.py::test_ids_conflict_go_stale_and_completed_calls_replay",),
    ),
    Mutation(
        "restore installs an export whose participants differ from the host's",
        "trio_gym/host/restore.py",
        "    if set(export.records) != expected:",
        "    if False:",
        ("tests/test_checkpoint.py::test_a_restore_with_the_wrong_participants_changes_nothing",),
    ),
    Mutation(
        "the control plane's operations answered without the token",
        "trio_gym/host/control.py",
        "    _authorize(services, head)\n    if services.lifecycle.shutdown_requested",
        "    if services.lifecycle.shutdown_requested",
        (
            "tests/test_checkpoint_rules.py::test_every_operation_needs_the_token_and_the_plane_is_off_without_one",
        ),
    ),
    Mutation(
        "the control plane on although no token is configured",
        "trio_gym/host/control.py",
        "    if not token:",
        "    if False:",
        (
            "tests/test_checkpoint_rules.py::test_every_operation_needs_the_token_and_the_plane_is_off_without_one",
        ),
    ),
    Mutation(
        "a lease of any length accepted",
        "trio_gym/protocol/control.py",
        "le=MAX_LEASE_S, ",
        "",
        ("tests/test_checkpoint_rules.py::test_a_lease_longer_than_an_hour_is_refused",),
    ),
    Mutation(
        "a control error loses its class when pickled",
        "trio_gym/trainer/control.py",
        "(type(self), self.message",
        "(ControlError, self.message",
        ("tests/test_checkpoint_rules.py::test_control_errors_keep_their_class_across_processes",),
    ),
    Mutation(
        "retire of a resumed id checked for its phase before staleness",
        "trio_gym/host/checkpoint.py",
        "        request = sorted(rollouts)\n        self._check_not_stale(checkpoint_id)",
        "        request = sorted(rollouts)",
        ("tests/test_checkpoint_rules.py::test_a_resumed_id_is_stale_before_any_other_rule",),
    ),
    Mutation(
        "two concurrent commits of one checkpoint both export",
        "trio_gym/host/checkpoint.py",
        "        if checkpoint_id in self._committing:",
        "        if False:",
        (
            "tests/test_checkpoint_rules.py::test_concurrent_commits_of_one_checkpoint_write_one_export",
        ),
    ),
    Mutation(
        "an existing manifest accepted whatever it holds",
        "trio_gym/host/export.py",
        "        if path.read_bytes() == staged.read_bytes():",
        "        if True:",
        (
            "tests/test_checkpoint_rules.py::test_a_manifest_is_never_replaced_by_another_checkpoint",
        ),
    ),
    Mutation(
        "commit ignores its capture-key scope",
        "trio_gym/host/checkpoint.py",
        "        keys = sorted(parked) if capture_keys is None else sorted(capture_keys)",
        "        keys = sorted(parked)",
        ("tests/test_checkpoint_rules.py::test_commit_and_restore_honour_a_capture_key_scope",),
    ),
    Mutation(
        "restore ignores its capture-key scope",
        "trio_gym/host/restore.py",
        "    keys = sorted(records) if capture_keys is None else sorted(set(capture_keys))",
        "    keys = sorted(records)",
        ("tests/test_checkpoint_rules.py::test_commit_and_restore_honour_a_capture_key_scope",),
    ),
    Mutation(
        "restore trusts the manifest's record count",
        "trio_gym/protocol/export.py",
        "    if len(lines) != entry.record_count:",
        "    if False:",
        (
            "tests/test_checkpoint_rules.py::test_a_malformed_manifest_is_refused_and_changes_nothing",
        ),
    ),
    Mutation(
        "a records file name may be any path",
        "trio_gym/protocol/export.py",
        'Field(pattern=r"^[0-9a-f]{64}\\.jsonl$")',
        "Field()",
        (
            "tests/test_checkpoint_rules.py::test_a_malformed_manifest_is_refused_and_changes_nothing",
        ),
    ),
    Mutation(
        "host records installed unchecked",
        "trio_gym/host/restore.py",
        "HostRecord.model_validate(row)",
        "HostRecord.model_construct(**row)",
        (
            "tests/test_checkpoint_rules.py::test_a_malformed_host_record_is_refused_even_with_a_matching_digest",
        ),
    ),
    Mutation(
        "a participant's records need not match the host's episodes",
        "trio_gym/host/restore.py",
        "        if held != set(records):",
        "        if False:",
        ("tests/test_checkpoint_rules.py::test_a_participant_holding_other_episodes_is_refused",),
    ),
    Mutation(
        "a second restore of the same export installed again",
        "trio_gym/host/restore.py",
        "    if taken:",
        "    if False:",
        ("tests/test_checkpoint_rules.py::test_a_second_restore_is_refused_and_changes_nothing",),
    ),
    Mutation(
        "one capture key may run twice at once",
        "trio_gym/host/episodes.py",
        "        if key in self.live:",
        "        if False:",
        ("tests/test_checkpoint_rules.py::test_one_capture_key_cannot_run_twice_at_once",),
    ),
    Mutation(
        "a restored episode whose batch was refused is lost",
        "trio_gym/host/episodes.py",
        "        if live.restored is not None and not live.started:",
        "        if False:",
        ("tests/test_checkpoint_rules.py::test_a_restored_episode_survives_a_refused_batch",),
    ),
    Mutation(
        "a resumed batch's deadline never runs again (the batch's own deadline, #25)",
        "trio_gym/host/episodes.py",
        "                deadline.resume()",
        "                pass",
        ("tests/test_checkpoint_rules.py::test_the_deadline_runs_on_after_a_resume",),
    ),
    Mutation(
        "retire keeps a restored episode's participant records",
        "trio_gym/host/checkpoint.py",
        "                    participant.discard(key)",
        "                    pass",
        ("tests/test_checkpoint_rules.py::test_retire_frees_a_restored_episode_and_its_records",),
    ),
    Mutation(
        "a retire with other arguments replays the first reply",
        "trio_gym/host/checkpoint.py",
        "        if done.request != request:",
        "        if False:",
        (
            "tests/test_checkpoint_rules.py::test_retire_and_forget_replay_or_conflict_by_their_arguments",
        ),
    ),
    Mutation(
        "the pacer not woken for a beat due earlier than its next wake-up",
        "trio_gym/host/pacer.py",
        "        if at < self._wake_at:\n            self._earlier.set()",
        "        if False:\n            self._earlier.set()",
        ("tests/test_pacer.py::test_beats_are_called_at_their_own_times_in_order",),
    ),
    Mutation(
        "what the kernel took at once is written again",
        "trio_gym/http/connection.py",
        "        data = data[self._write_now(data) :]\n        transport = self._transport",
        "        self._write_now(data)\n        transport = self._transport",
        (
            "tests/test_http_mechanics.py::test_a_body_larger_than_the_socket_buffer_arrives_whole_over_tcp",
        ),
    ),
    Mutation(
        "results documents of any size",
        "trio_gym/host/batch.py",
        "        if self._size > self._max_bytes:",
        "        if False:",
        ("tests/test_host_wire.py::test_results_over_max_response_bytes_are_refused_with_advice",),
    ),
    Mutation(
        "what the kernel did not take at once is dropped, not owed",
        "trio_gym/http/connection.py",
        "            self._owed, self._owed_since = data[sent:], trio.current_time()",
        "            pass",
        (
            "tests/test_http_mechanics.py::test_a_write_without_waiting_owes_what_the_kernel_did_not_take",
        ),
    ),
    Mutation(
        "owed bytes not paid before the next write",
        "trio_gym/http/connection.py",
        "        pending = bytearray(self._owed)",
        "        pending = bytearray()",
        (
            "tests/test_http_mechanics.py::test_a_write_without_waiting_owes_what_the_kernel_did_not_take",
        ),
    ),
    Mutation(
        "bytes owed forever do not mean the peer is gone",
        "trio_gym/http/connection.py",
        "                if trio.current_time() - self._owed_since >= self.limits.send_timeout_s:",
        "                if False:",
        ("tests/test_http_mechanics.py::test_bytes_owed_for_send_timeout_mean_the_peer_is_gone",),
    ),
    Mutation(
        "the pacer's heartbeat writes nothing",
        "trio_gym/host/supervision.py",
        "            if self.body.send_nowait(self.data):",
        "            if False:",
        (
            "tests/test_proxy_regression.py::test_a_long_batch_arrives_whole_through_the_framing_proxy",
            "tests/test_host_clock.py::test_heartbeat_cadence_over_a_30_minute_batch",
        ),
    ),
    Mutation(
        "several alike errors of a nursery surface as the first alone, the others lost (#15)",
        "trio_gym/errors.py",
        '            found[0].add_note(f"also: {type(other).__name__}: {other}")',
        "            pass",
        ("tests/test_errors.py::test_several_alike_errors_surface_as_the_first_naming_the_others",),
    ),
    Mutation(
        "a nursery's single error surfaces wrapped in its group (#15)",
        "trio_gym/errors.py",
        "        raise found[0]\n    raise group",
        "        raise group\n    raise group",
        (
            "tests/test_errors.py::test_a_single_error_surfaces_as_itself_with_its_own_cause",
            "tests/test_client.py::test_a_bug_in_this_process_propagates_as_itself",
        ),
    ),
    Mutation(
        "a failure handed over still cancels the other examples (#15)",
        "trio_gym/host/batch.py",
        "        failed(episode.index, failure)",
        "        failed(episode.index, failure)\n        raise failure",
        ("tests/test_rows.py::test_a_failed_example_is_a_sidecar_row_and_the_stream_goes_on",),
    ),
    Mutation(
        "a checkpoint phase moved where the table has no move (#15)",
        "trio_gym/host/checkpoint_phases.py",
        "        if to not in TRANSITIONS[self.phase]:",
        "        if False:",
        ("tests/test_checkpoint_phases.py::test_only_the_tables_moves_are_made",),
    ),
    Mutation(
        "a restored host parks episodes, so its restored episodes cannot run (#15)",
        "trio_gym/host/checkpoint_phases.py",
        "    CheckpointPhase.RESTORED: Conduct(admission_open=False, parking=False),",
        "    CheckpointPhase.RESTORED: Conduct(admission_open=False, parking=True),",
        (
            "tests/test_checkpoint_phases.py::test_the_phase_alone_opens_admission_and_parks_episodes",
            "tests/test_checkpoint.py::test_restore_continues_each_episode_once_as_the_next_attempt",
        ),
    ),
    Mutation(
        "a restored host admits new episodes before the resume (#15)",
        "trio_gym/host/checkpoint_phases.py",
        "    CheckpointPhase.RESTORED: Conduct(admission_open=False, parking=False),",
        "    CheckpointPhase.RESTORED: Conduct(admission_open=True, parking=False),",
        (
            "tests/test_checkpoint_phases.py::test_the_phase_alone_opens_admission_and_parks_episodes",
        ),
    ),
    Mutation(
        "parking that ends leaves parked episodes waiting (#15)",
        "trio_gym/host/episodes.py",
        "            self._paused.clear()\n            self._release.note()",
        "            self._paused.clear()",
        ("tests/test_checkpoint.py::test_a_lease_that_expires_resumes_the_host_by_itself",),
    ),
    Mutation(
        "a batch paces its heartbeats itself even when the host's pacer runs (#15)",
        "trio_gym/host/supervision.py",
        "            if not pacer.running:",
        "            if True:",
        ("tests/test_host_clock.py::test_heartbeats_ride_the_hosts_pacer_or_one_the_batch_owns",),
    ),
    Mutation(
        "a stream's transport has no sender beside its connection: heartbeats stay queued (#25)",
        "trio_gym/host/server.py",
        "        nursery.start_soon(transport.send_queued_forever)",
        "        pass",
        ("tests/test_host_clock.py::test_heartbeat_cadence_over_a_30_minute_batch",),
    ),
    Mutation(
        "the gate lets dispatchers through while closed",
        "trio_gym/trainer/gate.py",
        "        while not self._opened.is_set():\n            await self._opened.wait()",
        "        pass",
        ("tests/test_gate.py::test_a_checkpoint_never_counts_an_attempt_waiting_at_the_gate",),
    ),
    Mutation(
        "closing the gate does not wait for admissions under way",
        "trio_gym/trainer/gate.py",
        "        while self._inside:",
        "        while False:",
        ("tests/test_gate.py::test_closing_waits_for_an_admission_under_way",),
    ),
    Mutation(
        "the ledger changed outside a mutation",
        "trio_gym/trainer/ledger.py",
        "        if not self._changed.locked():",
        "        if False:",
        ("tests/test_ledger.py::test_changes_outside_a_mutation_are_refused",),
    ),
    Mutation(
        "a move the table lacks is allowed",
        "trio_gym/trainer/ledger.py",
        "        if to not in MOVES[attempt.state]:",
        "        if False:",
        ("tests/test_ledger.py::test_moves_the_table_does_not_allow_are_refused",),
    ),
    Mutation(
        "waiting for a mutation by polling",
        "trio_gym/trainer/ledger.py",
        "            while self.mutations <= after:\n                await self._changed.wait()",
        "            while self.mutations <= after:\n                self._changed.release()\n                await trio.sleep(0.05)\n                await self._changed.acquire()",
        ("tests/test_ledger.py::test_a_waiter_wakes_at_the_next_mutation_and_not_before",),
    ),
    Mutation(
        "a saved ledger with unknown fields loads",
        "trio_gym/trainer/ledger.py",
        'model_config = ConfigDict(extra="forbid", frozen=True, strict=True)',
        'model_config = ConfigDict(extra="ignore", frozen=True, strict=True)',
        (
            "tests/test_ledger.py::test_a_ledger_that_is_not_exactly_ours_is_refused_with_the_reason",
        ),
    ),
    Mutation(
        "an episode listed twice loads",
        "trio_gym/trainer/ledger.py",
        "        if attempt.capture_key in self._by_key:",
        "        if False:",
        (
            "tests/test_ledger.py::test_a_ledger_that_is_not_exactly_ours_is_refused_with_the_reason",
        ),
    ),
    Mutation(
        "one holder's release ends another's pause",
        "trio_gym/trainer/deadlines.py",
        "        self._holders.discard(holder)\n        if not self._holders:",
        "        self._holders.discard(holder)\n        if True:",
        (
            "tests/test_deadlines.py::test_a_paused_deadline_stands_still_until_the_last_holder_releases",
        ),
    ),
    Mutation(
        "a request started during a pause runs its deadline",
        "trio_gym/trainer/deadlines.py",
        "        if self._holders:\n            deadline.pause()",
        "        pass",
        ("tests/test_deadlines.py::test_a_request_that_starts_during_a_pause_waits_for_it",),
    ),
    Mutation(
        "a trainer manifest without participant topology loads",
        "trio_gym/trainer/manifest.py",
        "    participants: list[Participant] = Field(min_length=1)",
        "    participants: list[Participant] = []",
        (
            "tests/test_trainer_manifest.py::test_a_manifest_without_topology_or_with_surprises_is_refused",
        ),
    ),
    Mutation(
        "an episode with two owners loads",
        "trio_gym/trainer/manifest.py",
        "            if key in seen:",
        "            if False:",
        (
            "tests/test_trainer_manifest.py::test_a_manifest_without_topology_or_with_surprises_is_refused",
        ),
    ),
    Mutation(
        "a beat that raises stops the pacer (and every heartbeat)",
        "trio_gym/host/pacer.py",
        "        except Exception:  # a bug in one beat must not stop every heartbeat of the host",
        "        except ZeroDivisionError:",
        ("tests/test_pacer.py::test_a_beat_that_raises_is_dropped_and_the_others_go_on",),
    ),
    Mutation(
        "the pacer stops with the listener, before the connections",
        "trio_gym/host/server.py",
        "                server_tasks.cancel_scope.cancel()\n",
        "                server_tasks.cancel_scope.cancel()\n                pacing.cancel_scope.cancel()\n",
        ("tests/test_host_wire.py::test_heartbeats_go_on_while_a_stopping_host_waits_for_a_batch",),
    ),
    Mutation(
        "the document's closing bytes not counted against the limit",
        "trio_gym/host/batch.py",
        "max(0, count - 1) + len(self._tail) + 1",
        "max(0, count - 1) + len(self._tail)",
        ("tests/test_results_document.py::test_the_limit_is_exact_to_the_byte",),
    ),
    Mutation(
        "results after the size limit not checked for JSON",
        "trio_gym/host/batch.py",
        "        self._added += 1\n        try:",
        "        self._added += 1\n        if self._too_large_after is not None:\n            return\n        try:",
        (
            "tests/test_results_document.py::test_a_result_that_is_not_json_wins_whatever_finished_first",
        ),
    ),
    Mutation(
        "the drain polls instead of waiting on mutations",
        "trio_gym/trainer/drain.py",
        "            await ledger.wait_for_mutation(cursor)",
        "            await trio.sleep(0.05)",
        ("tests/test_drain.py::test_the_drain_ends_when_the_last_reply_in_flight_settles",),
    ),
    Mutation(
        "a drain timeout lists every id",
        "trio_gym/trainer/drain.py",
        "    raise DrainTimeout(len(left), left[:SAMPLE], timeout_s)",
        "    raise DrainTimeout(len(left), left, timeout_s)",
        ("tests/test_drain.py::test_a_drain_that_times_out_reports_a_count_and_a_short_sample",),
    ),
    Mutation(
        "a retry reuses the lost attempt's rollout id",
        "trio_gym/trainer/ledger.py",
        "_rollout_id(sibling.group_id, sibling.index, sibling.generation + 1)",
        "_rollout_id(sibling.group_id, sibling.index, sibling.generation)",
        ("tests/test_ledger.py::test_a_retry_is_a_fresh_attempt_under_a_new_rollout_id",),
    ),
    Mutation(
        "the trainer manifest written in place (files.write_whole, every whole write's)",
        "trio_gym/files.py",
        '        with os.fdopen(handle, "wb") as file:',
        '        os.close(handle)\n        with open(path, "wb") as file:',
        (
            "tests/test_trainer_manifest.py::test_a_write_that_fails_half_way_leaves_the_old_manifest",
        ),
    ),
    Mutation(
        "examples not counted as cancelled (the counting that proves cancellation)",
        "trio_gym/host/stats.py",
        "        self.examples_ended[outcome, label] += 1\n",
        '        self.examples_ended[outcome, label] += outcome != "cancelled"\n',
        (
            "tests/test_host_clock.py::test_deadline_cancels_every_running_example",
            "tests/test_host_clock.py::test_examples_of_a_runner_with_its_own_nursery_are_counted",
        ),
    ),
    Mutation(
        "an attempt marked DISPATCHED before it waits at the gate",
        "trio_gym/trainer/dispatch.py",
        "        async with self.gate.admission():\n            async with self.ledger.mutation() as ledger:\n                for key in keys:\n                    ledger.dispatch(key, member.name)\n",
        "        async with self.ledger.mutation() as ledger:\n            for key in keys:\n                ledger.dispatch(key, member.name)\n        async with self.gate.admission():\n",
        (
            "tests/test_dispatch.py::test_an_attempt_waiting_at_the_closed_gate_is_not_marked_dispatched",
        ),
    ),
    Mutation(
        "an admission refusal charged as a lost attempt",
        "trio_gym/trainer/dispatch.py",
        "ledger.move(key, AttemptState.RESERVED)  # same identity, nothing spent",
        "ledger.move(key, AttemptState.ABANDONED)",
        (
            "tests/test_dispatch.py::"
            "test_admission_refusals_cost_nothing_and_are_resent_once_admission_reopens",
        ),
    ),
    Mutation(
        "admission refusals re-sent without a bound",
        "trio_gym/trainer/dispatch.py",
        "        if self.admission_refusals[key] > limit:",
        "        if False:",
        (
            "tests/test_dispatch.py::test_a_host_whose_admission_never_reopens_ends_the_group_not_the_loop",
        ),
    ),
    Mutation(
        "lost rows not retired on their host",
        "trio_gym/trainer/dispatch.py",
        "            try:\n                await self.retire_queued(host)",
        "            try:\n                pass",
        (
            "tests/test_dispatch.py::"
            "test_rows_missing_from_a_cut_stream_are_abandoned_retired_and_resent_under_a_new_id",
        ),
    ),
    Mutation(
        "dropped attempts not retired before prepare",
        "trio_gym/trainer/coordinator.py",
        "        await self._hosts.call(dispatcher.retire_queued)",
        "        pass",
        (
            "tests/test_dispatch.py::test_a_dropped_group_is_retired_by_the_next_checkpoint_before_prepare",
        ),
    ),
    Mutation(
        "a stream's deadline not paused with the others",
        "trio_gym/trainer/deadlines.py",
        "            self._registry.track(scope)",
        "            pass",
        ("tests/test_dispatch.py::test_a_stream_deadline_stands_still_while_a_holder_pauses_it",),
    ),
    Mutation(
        "a checkpoint that does not pause request deadlines",
        "trio_gym/trainer/coordinator.py",
        "        dispatcher.deadlines.pause(holder)",
        "        pass",
        (
            "tests/test_coordinator.py::"
            "test_request_deadlines_stand_still_while_a_checkpoint_holds_admission_closed",
        ),
    ),
    Mutation(
        "hosts resumed only when a checkpoint succeeds",
        "trio_gym/trainer/coordinator.py",
        "            try:\n"
        "                manifest = await self._take(checkpoint_id, directory)\n"
        "            finally:",
        "            manifest = await self._take(checkpoint_id, directory)\n            if True:",
        (
            "tests/test_coordinator.py::"
            "test_a_host_that_cannot_park_makes_the_checkpoint_unavailable_then_aborted",
            "tests/test_coordinator.py::test_an_episode_the_trainer_never_dispatched_aborts_the_checkpoint",
        ),
    ),
    Mutation(
        "unavailable checkpoints retried without a bound",
        "trio_gym/trainer/coordinator.py",
        "            if self.consecutive_failures >= limit:",
        "            if False:",
        (
            "tests/test_coordinator.py::"
            "test_a_host_that_cannot_park_makes_the_checkpoint_unavailable_then_aborted",
        ),
    ),
    Mutation(
        "lease renewals never sent",
        "trio_gym/trainer/coordinator.py",
        "            await trio.sleep(lease / 3)",
        "            await trio.sleep_forever()",
        (
            "tests/test_coordinator_hosts.py::test_a_renewal_that_never_answers_fails_the_checkpoint",
        ),
    ),
    Mutation(
        "exported episodes not checked against the ledger",
        "trio_gym/trainer/coordinator.py",
        "        for host, export in exports.items():\n            for key in export.episodes:",
        "        for host, export in {}.items():\n            for key in export.episodes:",
        (
            "tests/test_coordinator.py::test_an_episode_the_trainer_never_dispatched_aborts_the_checkpoint",
        ),
    ),
    Mutation(
        "an episode exported by two hosts accepted",
        "trio_gym/trainer/coordinator.py",
        "                if key in owners:\n                    raise",
        "                if False:\n                    raise",
        ("tests/test_coordinator.py::test_a_commit_reply_that_does_not_fit_aborts_the_checkpoint",),
    ),
    Mutation(
        "committed participants not checked against the host's topology",
        "trio_gym/trainer/coordinator.py",
        "        if named != participants:",
        "        if False:",
        ("tests/test_coordinator.py::test_a_commit_reply_that_does_not_fit_aborts_the_checkpoint",),
    ),
    Mutation(
        "a control reply read without checking that it fits the contract (the typed call, #25)",
        "trio_gym/trainer/control.py",
        "            return operation.reply.model_validate(document)",
        "            return operation.reply.model_construct(**document)",
        (
            "tests/test_control_replies.py::test_a_prepare_reply_that_does_not_fit_aborts_the_checkpoint",
            "tests/test_control_replies.py::test_a_status_reply_that_does_not_fit_aborts_a_take_over",
            "tests/test_control_replies.py::test_a_restore_reply_that_does_not_fit_is_undone_on_every_host",
            "tests/test_control_replies.py::test_a_retire_reply_that_does_not_fit_keeps_the_attempts_queued",
            "tests/test_coordinator.py::test_a_commit_reply_that_does_not_fit_aborts_the_checkpoint",
        ),
    ),
    Mutation(
        "a host in a checkpoint that names none taken for idle",
        "trio_gym/trainer/restore.py",
        "    if status.checkpoint_id is None:",
        "    if False:",
        (
            "tests/test_control_replies.py::test_a_status_reply_that_does_not_fit_aborts_a_take_over",
        ),
    ),
    Mutation(
        "restore skips the topology check (host names: one that left, with no successor)",
        "trio_gym/trainer/restore.py",
        "        if missing:\n            raise RestoreRefused(",
        "        if False:\n            raise RestoreRefused(",
        (
            "tests/test_coordinator.py::test_a_restore_that_does_not_fit_the_live_hosts_changes_nothing",
        ),
    ),
    Mutation(
        "restore skips the topology check (live participants)",
        "trio_gym/trainer/restore.py",
        "        statuses = await self._check_live_topology(manifest, place)",
        "        statuses = await self._statuses()",
        (
            "tests/test_coordinator_hosts.py::"
            "test_restores_that_do_not_fit_live_hosts_or_their_files_change_nothing",
        ),
    ),
    Mutation(
        "restore skips the committed digests",
        "trio_gym/trainer/restore.py",
        "            if on_disk != committed:",
        "            if False:",
        ("tests/test_coordinator.py::test_an_export_swapped_for_another_commit_is_refused",),
    ),
    Mutation(
        "a failed restore left installed on the other hosts",
        "trio_gym/trainer/restore.py",
        "            await self._undo_restore(restore_id, next_attempts)",
        "            pass",
        ("tests/test_coordinator.py::test_a_failed_restore_on_one_host_is_undone_on_every_host",),
    ),
    Mutation(
        "restored episodes dispatched as the same attempt",
        "trio_gym/trainer/restore.py",
        "                    restored.append(ledger.next_attempt(key).capture_key)",
        "                    restored.append(key)",
        (
            "tests/test_coordinator.py::"
            "test_restore_dispatches_each_exported_episode_once_as_the_next_attempt_on_its_host",
            "tests/test_trainer_crash.py::test_a_killed_trainer_restores_and_trains_every_episode_once",
        ),
    ),
    Mutation(
        "a new trainer process reuses the rollout ids of the one before",
        "trio_gym/trainer/restore.py",
        "Ledger.from_json(manifest.ledger, incarnation=uuid.uuid4().hex[:8])",
        "Ledger.from_json(manifest.ledger)",
        (
            "tests/test_coordinator.py::"
            "test_a_trainer_after_a_crash_never_reuses_the_ids_of_work_a_host_still_runs",
        ),
    ),
    Mutation(
        "a fresh trainer process mints the same rollout ids as the one before",
        "trio_gym/trainer/dispatch.py",
        "self.ledger = ledger or Ledger(incarnation=uuid.uuid4().hex[:8])",
        "self.ledger = ledger or Ledger()",
        ("tests/test_dispatch.py::test_a_fresh_trainer_after_a_crash_mints_ids_of_its_own",),
    ),
    Mutation(
        "a retire whose copies are still stopping counted as done",
        "trio_gym/trainer/dispatch.py",
        "        if still != 0:",
        "        if False:",
        ("tests/test_dispatch.py::test_a_retire_whose_copies_are_still_stopping_stays_queued",),
    ),
    Mutation(
        "a stale row left DISPATCHED until its stream ends",
        "trio_gym/trainer/dispatch.py",
        '                self.queue_retire(ledger.move(key, AttemptState.ABANDONED))\n                log_event("attempt_stale"',
        '                log_event("attempt_stale"',
        (
            "tests/test_dispatch.py::test_a_stale_row_is_settled_at_once_so_a_checkpoint_does_not_wait_for_it",
        ),
    ),
    Mutation(
        "a dropped group id run again",
        "trio_gym/trainer/dispatch.py",
        "            elif group.dropped:",
        "            elif False:",
        ("tests/test_dispatch.py::test_a_dropped_group_id_is_not_run_again",),
    ),
    Mutation(
        "re-sent at once after a loss",
        "trio_gym/trainer/dispatch.py",
        "            await trio.sleep(self.settings.resend_backoff_s)",
        "            await trio.sleep(0)",
        (
            "tests/test_dispatch.py::"
            "test_a_request_whose_answer_never_came_is_not_resent_under_the_same_id",
        ),
    ),
    Mutation(
        "a request too large to send re-sent until its budget ends instead of failing at once",
        "trio_gym/trainer/dispatch.py",
        "        if error.reach is Reach.REFUSED:\n            raise GroupFailed",
        "        if False:\n            raise GroupFailed",
        (
            "tests/test_dispatch.py::test_a_request_too_large_to_send_fails_its_group_at_once_naming_the_cause",
        ),
    ),
    Mutation(
        "a cancelled group not dropped",
        "trio_gym/trainer/dispatch.py",
        "            if not finished:\n",
        "            if False:\n",
        (
            "tests/test_dispatch.py::test_a_dropped_group_is_retired_by_the_next_checkpoint_before_prepare",
        ),
    ),
    Mutation(
        "two checkpoints at once on one coordinator",
        "trio_gym/trainer/coordinator.py",
        "        if self._busy:",
        "        if False:",
        ("tests/test_coordinator.py::test_a_second_checkpoint_while_one_is_under_way_is_refused",),
    ),
    Mutation(
        "an episode given up during the drain still listed in the manifest",
        "trio_gym/trainer/coordinator.py",
        "hosts=[_still_owned(exports[host], ledger) for host in sorted(exports)],",
        "hosts=[exports[host] for host in sorted(exports)],",
        (
            "tests/test_coordinator.py::"
            "test_an_episode_given_up_during_the_drain_is_left_out_of_the_manifest",
        ),
    ),
    Mutation(
        "a restore brings back a group the trainer gave up",
        "trio_gym/trainer/restore.py",
        "            if not group.dropped\n",
        "            if True\n",
        (
            "tests/test_coordinator.py::"
            "test_an_episode_given_up_during_the_drain_is_left_out_of_the_manifest",
        ),
    ),
    Mutation(
        "a stale_attempt row sealed as the episode's result",
        "trio_gym/trainer/dispatch.py",
        "            if code == ErrorCode.STALE_ATTEMPT:",
        "            if False:",
        ("tests/test_dispatch.py::test_an_identity_a_host_still_runs_is_a_loss_not_a_result",),
    ),
    Mutation(
        "a row stream whose head never came re-sent under the same id",
        "trio_gym/trainer/host_client.py",
        '        return Reach.UNREACHED if self.settings.http_version == "1.1" and not rows else Reach.TAKEN',
        '        return Reach.UNREACHED if self.settings.http_version == "1.1" else Reach.TAKEN',
        (
            "tests/test_dispatch.py::test_a_request_whose_answer_never_came_is_not_resent_under_the_same_id",
        ),
    ),
    Mutation(
        "the guard ignores its lifeline (#13)",
        "trio_gym/processes/guard.py",
        "            nursery.start_soon(_until_lifeline_ends, nursery.cancel_scope)\n",
        "",
        (
            "tests/test_process_tree.py::test_a_tree_does_not_outlive_its_owner_however_the_owner_dies",
            "tests/test_process_tree.py::test_cancelling_the_owner_stops_every_process_of_the_tree",
            "tests/test_gym_real.py::test_no_gym_process_outlives_the_host",
        ),
    ),
    Mutation(
        "the guard is no subreaper: orphans that left the group escape (#13)",
        "trio_gym/processes/guard.py",
        "    _prctl(_PR_SET_CHILD_SUBREAPER, 1)\n",
        "",
        ("tests/test_process_tree.py::test_cancelling_the_owner_stops_every_process_of_the_tree",),
    ),
    Mutation(
        "nothing is killed after the grace (#13)",
        "trio_gym/processes/guard.py",
        "        tree.signal(members, signal.SIGKILL)",
        "        tree.signal(members, signal.SIGTERM)",
        (
            "tests/test_process_tree.py::test_what_outlives_the_grace_is_killed_at_its_end",
            "tests/test_process_tree.py::test_cancelling_the_owner_stops_every_process_of_the_tree",
        ),
    ),
    Mutation(
        "the wait for a stopping guard is unbounded (#13)",
        "trio_gym/processes/tree.py",
        "        with trio.move_on_after(grace_s + GUARD_MARGIN_S):",
        "        with trio.move_on_after(math.inf):",
        (
            "tests/test_process_tree.py::test_a_guard_that_does_not_exit_is_killed_after_grace_and_margin",
        ),
        also=(
            (
                "trio_gym/processes/tree.py",
                "import subprocess\n",
                "import math\nimport subprocess\n",
            ),
        ),
    ),
    Mutation(
        "a cancelled owner does not wait for its tree to stop (#13)",
        "trio_gym/processes/tree.py",
        "    with trio.CancelScope(shield=True):\n        await lifeline.aclose()",
        "    with trio.CancelScope(shield=False):\n        await lifeline.aclose()",
        ("tests/test_process_tree.py::test_a_guard_that_stops_its_tree_in_time_is_waited_for",),
    ),
    Mutation(
        "the host's control token handed to Gym (#13)",
        "trio_gym/runners/gym.py",
        "    env = {name: value for name, value in environ.items() if name not in WITHHELD_VARIABLES}",
        "    env = dict(environ)",
        (
            "tests/test_gym_runner.py::test_gym_gets_the_hosts_environment_but_never_its_control_token",
            "tests/test_gym_runner.py::test_the_host_starts_gym_waits_for_it_and_runs_rows_through_it",
        ),
    ),
    Mutation(
        "the environment package's configs not given to Gym (#13)",
        "trio_gym/runners/gym.py",
        "        paths.extend(str(package.root / path) for path in package.config_paths)",
        "        pass",
        (
            "tests/test_gym_runner.py::test_the_global_config_puts_the_package_first_and_a_loopback_head_server",
            "tests/test_gym_runner.py::test_the_host_starts_gym_waits_for_it_and_runs_rows_through_it",
        ),
    ),
    Mutation(
        "a Gym that exits after it was up leaves the host ready (#13)",
        "trio_gym/host/lifecycle.py",
        '        self._fail("gym", ended)',
        '        log_event("gym_ended", reason=ended)',
        ("tests/test_gym_runner.py::test_a_gym_that_exits_after_it_is_up_turns_health_failed",),
    ),
    Mutation(
        "a head server saying 503 taken as a deployment that is up (#13)",
        "trio_gym/runners/deployment.py",
        "    if status not in (200, 404):",
        "    if status not in (200, 404, 503):",
        (
            "tests/test_gym_runner.py::test_a_gym_that_is_never_up_fails_at_the_start_timeout_and_is_stopped",
            "tests/test_agents.py::test_the_start_waits_for_a_head_server_that_comes_up_later",
        ),
    ),
    Mutation(
        "a deployment not up yet fails the start at once (#13)",
        "trio_gym/runners/deployment.py",
        "            except DeploymentNotReady as exc:\n                if str(exc) != reason:",
        "            except DeploymentNotReady as exc:\n                raise AgentError(str(exc)) from exc\n                if str(exc) != reason:",
        (
            "tests/test_agents.py::test_the_start_waits_for_a_head_server_that_comes_up_later",
            "tests/test_agents.py::test_a_host_started_before_its_deployment_is_starting_then_ready",
        ),
    ),
    Mutation(
        "a record Gym marks failed taken as a result (#13)",
        "trio_gym/runners/agents.py",
        "            failure = record.get(FAILURE_CLASS_KEY) if isinstance(record, dict) else None",
        "            failure = None",
        (
            "tests/test_agents.py::test_a_gym_failure_record_is_a_failed_row_not_a_result",
            "tests/test_agents.py::test_a_failed_rollout_is_tried_again_counting_attempts_then_succeeds",
        ),
    ),
    Mutation(
        "a failure Gym calls terminal tried again (#13)",
        "trio_gym/runners/agents.py",
        "            if terminal or tries == self.settings.rollout_attempts:",
        "            if tries == self.settings.rollout_attempts:",
        (
            "tests/test_agents.py::test_a_rollout_gym_keeps_failing_fails_its_example_naming_the_class",
        ),
    ),
    Mutation(
        "a failed rollout's next try not counted in _ng_attempt_index (#13)",
        "trio_gym/runners/agents.py",
        "            row = {**row, ATTEMPT_KEY: first + tries}",
        "            row = dict(row)",
        (
            "tests/test_agents.py::test_a_failed_rollout_is_tried_again_counting_attempts_then_succeeds",
        ),
    ),
    Mutation(
        "only agent_server fronts an agent (#13)",
        "trio_gym/runners/deployment.py",
        "        if typed == AGENT_KEY or (field == AGENT_SERVER_FIELD and typed is None):",
        "        if field == AGENT_SERVER_FIELD:",
        (
            "tests/test_agents.py::test_every_field_typed_as_an_agent_puts_its_environment_server_in_front",
        ),
    ),
    Mutation(
        "records not stamped with the environment server (#13)",
        "trio_gym/runners/records.py",
        "        stamped[ENVIRONMENT_SERVER_KEY] = server.name",
        "        pass",
        (
            "tests/test_agents.py::test_records_carry_what_gyms_collection_stamps_and_nothing_invented",
        ),
    ),
    Mutation(
        "a taskset row sent flat, not as an episode request (#13)",
        "trio_gym/runners/agents.py",
        "        body = episode_request(row) if episode else row",
        "        body = row",
        (
            "tests/test_agents.py::test_a_taskset_row_is_an_episode_request_to_its_routed_environment_server",
        ),
    ),
    Mutation(
        "a server's error body quoted with its escapes (#13)",
        "trio_gym/runners/agents.py",
        '                f"{where} answered HTTP {response.status}: {gym_error_text(response.body)}"',
        '                f"{where} answered HTTP {response.status}: {response.body[:500]!r}"',
        (
            "tests/test_agents.py::test_an_agents_error_body_is_quoted_once_and_readable",
            "tests/test_gym_real.py::test_an_agents_500_and_a_failure_record_fail_their_rows_readably",
        ),
    ),
    Mutation(
        "a launcher's port without an address keeps loopback (#13)",
        "trio_gym/config.py",
        '        merged["host"] = LAUNCHED_HOST',
        '        merged["host"] = "127.0.0.1"',
        ("tests/test_config.py::test_a_launcher_that_sets_only_the_port_gets_every_interface",),
    ),
    Mutation(
        "gym_host.sh leaves the host on loopback (#13)",
        "scripts/gym_host.sh",
        "export NMP_RUNTIME_HTTP_HOST=${NMP_RUNTIME_HTTP_HOST:-0.0.0.0}",
        "export NMP_RUNTIME_HTTP_HOST=${NMP_RUNTIME_HTTP_HOST:-127.0.0.1}",
        (
            "tests/test_launcher.py::test_the_launcher_starts_the_host_with_the_package_on_pythonpath",
        ),
    ),
    Mutation(
        "an empty variable read as a value (#13)",
        "trio_gym/config.py",
        '        if text == "":  # an empty variable is unset, as the upstream host reads it\n            continue',
        "        if variable not in environ:\n            continue",
        (
            "tests/test_config.py::test_an_empty_variable_is_no_variable",
            "tests/test_config.py::test_booleans_are_read_as_the_upstream_host_reads_them",
        ),
    ),
    Mutation(
        "a Gym config without a runner keeps the example runner (#13)",
        "trio_gym/config.py",
        '        if isinstance(data, dict) and "runner" not in data and "gym_global_config" in data:',
        "        if False:",
        ("tests/test_gym_runner.py::test_a_gym_config_without_a_runner_means_runner_gym",),
    ),
    Mutation(
        "episode identity invented with the control plane off (#13)",
        "trio_gym/host/batch.py",
        "    identity = episode.id if services.tracks_episodes else None",
        "    identity = episode.id",
        (
            "tests/test_host_wire.py::test_results_come_back_in_input_order_with_identity_keys_and_none_invented",
            "tests/test_agents.py::test_records_carry_what_gyms_collection_stamps_and_nothing_invented",
        ),
    ),
    Mutation(
        "rows of one identity refused with the control plane off (#13)",
        "trio_gym/host/rollouts.py",
        "        identities=services.tracks_episodes,",
        "        identities=True,",
        (
            "tests/test_host_wire.py::test_rows_of_one_identity_both_run_unless_the_control_plane_tracks_episodes",
        ),
    ),
    Mutation(
        "two rows of one episode in a batch admitted with the control plane on (#13)",
        "trio_gym/host/rollouts.py",
        "        if twin != index:",
        "        if False:",
        (
            "tests/test_host_wire.py::test_rows_of_one_identity_both_run_unless_the_control_plane_tracks_episodes",
        ),
    ),
    Mutation(
        "a Gym that exits while the runner starts does not end the start (#13)",
        "trio_gym/host/lifecycle.py",
        "            self._stages.cancel()\n",
        "",
        (
            "tests/test_gym_runner.py::test_a_gym_that_exits_while_the_runner_starts_leaves_the_host_failed",
        ),
    ),
    Mutation(
        "the guard in its owner's process group (#13)",
        "trio_gym/processes/tree.py",
        "        start_new_session=True,\n",
        "",
        (
            "tests/test_process_tree.py::test_a_tree_does_not_outlive_its_owner_however_the_owner_dies",
        ),
    ),
    Mutation(
        "a stopping tree's output not read while it stops (#13)",
        "trio_gym/processes/tree.py",
        '                stopping.start_soon(tree.output.pump, "output", guard.stdout)\n',
        "",
        ("tests/test_process_tree.py::test_what_a_stopping_tree_prints_is_read_while_it_stops",),
    ),
    Mutation(
        "a failed rollout's record keeps the first try's attempt (#13)",
        "trio_gym/runners/agents.py",
        "        return await self._finish(gym_row, stamp_record(row, answer, server), latency_ms)",
        "        first = {k: v for k, v in row.items() if k != ATTEMPT_KEY}\n"
        "        return await self._finish(gym_row, stamp_record(first, answer, server), latency_ms)",
        (
            "tests/test_agents.py::test_a_failed_rollout_is_tried_again_counting_attempts_then_succeeds",
        ),
    ),
    Mutation(
        "the runner retries failed rollouts with the control plane on (#13)",
        "trio_gym/runners/agents.py",
        "            rollout_attempts=1 if config.control_token else config.agent_rollout_attempts,",
        "            rollout_attempts=config.agent_rollout_attempts,",
        (
            "tests/test_agents.py::test_with_the_control_plane_on_the_runner_makes_no_attempts_of_its_own",
        ),
    ),
    Mutation(
        "a secret echoed in a config error (#14)",
        "trio_gym/errors.py",
        '            shown = REDACTED if key in secrets else without_userinfo(repr(error["input"]))',
        '            shown = repr(error["input"])',
        (
            "tests/test_config.py::test_a_secret_in_a_bad_config_file_is_never_echoed",
            "tests/test_config.py::test_a_secret_in_a_bad_variable_is_never_echoed",
        ),
    ),
    Mutation(
        "a URL's user information echoed (#14)",
        "trio_gym/errors.py",
        '    return _USERINFO.sub(rf"\\1{REDACTED}@", text)',
        "    return text",
        ("tests/test_config.py::test_a_urls_user_information_is_never_echoed",),
    ),
    Mutation(
        "a YAML error in PyYAML's words, over several lines (#14)",
        "trio_gym/config.py",
        '        return f"{where}: not valid YAML: {what}{during}"',
        '        return f": not valid YAML: {exc}"',
        ("tests/test_config.py::test_a_yaml_error_is_one_line_naming_file_line_and_column",),
    ),
    Mutation(
        "a HEAD that h11 refused answered with a body (#14)",
        "trio_gym/http/connection.py",
        '        method = self.request_method or self._first_bytes.partition(b" ")[0]',
        "        method = self.request_method",
        ("tests/test_host_wire.py::test_no_answer_to_head_carries_a_body_whatever_refused_it",),
    ),
    Mutation(
        "a checkpoint records its export directories absolute (#14)",
        "trio_gym/trainer/coordinator.py",
        "            directory=export_directory.relative_to(directory).as_posix(),",
        "            directory=str(export_directory),",
        (
            "tests/test_coordinator.py::test_a_checkpoint_moved_elsewhere_restores_from_where_it_is_now",
        ),
    ),
    Mutation(
        "a manifest path that is absolute or leaves the checkpoint accepted (#14)",
        "trio_gym/trainer/manifest.py",
        '    if not path or PurePosixPath(path).is_absolute() or ".." in parts or "\\\\" in path:',
        "    if not path:",
        (
            "tests/test_trainer_manifest.py::test_a_path_that_is_absolute_or_leaves_the_checkpoint_is_refused",
            "tests/test_coordinator.py::test_a_manifest_pointing_outside_its_checkpoint_is_refused_before_any_host_changes",
        ),
    ),
    Mutation(
        "importing the trainer loads the host (#15)",
        "trio_gym/__init__.py",
        "from typing import TYPE_CHECKING, Any\n",
        "from typing import TYPE_CHECKING, Any\n\nfrom trio_gym.host import Host, serve  # noqa: F401\n",
        ("tests/test_layout.py::test_importing_one_side_loads_nothing_of_the_other",),
    ),
    Mutation(
        "the mutation runner counts any non-zero exit as caught (#14)",
        "scripts/mutations.py",
        "    if returncode != 1:\n        return Verdict(False,",
        "    if returncode == 0:\n        return Verdict(False,",
        (
            "tests/test_mutation_runner.py::test_a_mutation_is_caught_only_by_its_named_tests_failing",
        ),
    ),
    Mutation(
        "chunks first sent in whatever order trio starts their tasks (README trial)",
        "trio_gym/trainer/pool.py",
        "                    await nursery.start(self._run_chunk, batch, index)",
        "                    nursery.start_soon(self._run_chunk, batch, index)",
        ("tests/test_client.py::test_chunks_are_first_sent_in_input_order",),
    ),
    Mutation(
        "a Gym that fails unstarted with no global config given is not told so (README trial)",
        "trio_gym/runners/gym.py",
        '        if self.config.gym_global_config:\n            return ""',
        '        if True:\n            return ""',
        (
            "tests/test_gym_runner.py::test_a_gym_started_without_a_global_config_that_fails_says_none_was_given",
        ),
    ),
    Mutation(
        "the pool re-sends a chunk its host had taken (#16)",
        "trio_gym/trainer/pool.py",
        "            if error.reach is not Reach.UNREACHED:",
        "            if error.reach is Reach.REFUSED:",
        (
            "tests/test_pool.py::test_a_host_killed_mid_batch_fails_only_what_it_had_taken_and_is_replaced",
        ),
    ),
    Mutation(
        "the pool takes a host's 503 for the chunk's answer (#16)",
        "trio_gym/trainer/answers.py",
        "                reach=Reach.UNREACHED if not_now else Reach.REFUSED,",
        "                reach=Reach.REFUSED,",
        ("tests/test_pool.py::test_a_host_answering_503_gets_nothing_run_and_is_ejected",),
    ),
    Mutation(
        "a suspect host keeps taking chunks before its probe (#16)",
        "trio_gym/trainer/scheduler.py",
        "        free = [m for m in self._places if m.healthy and self._free(m)]",
        "        free = [m for m in self._places if m.ejected is None and self._free(m)]",
        (
            "tests/test_pool.py::test_a_host_that_stalls_mid_batch_is_ejected_and_the_rest_carry_the_batch",
            "tests/test_reach.py::test_a_cut_answer_fails_its_chunk_once_and_its_host_is_probed_before_more_work",
        ),
    ),
    Mutation(
        "a host whose process is gone is probed like a slow one (#16)",
        "trio_gym/trainer/scheduler.py",
        "            if self.launcher is not None and not await self.launcher.alive(member.host.handle):",
        "            if False:",
        (
            "tests/test_pool.py::test_a_host_killed_mid_batch_fails_only_what_it_had_taken_and_is_replaced",
        ),
    ),
    Mutation(
        "the first host takes every chunk of a small batch (#16)",
        "trio_gym/trainer/scheduler.py",
        "        return min(free, key=lambda m: m.in_flight, default=None)",
        "        return free[0] if free else None",
        (
            "tests/test_opensandbox.py::test_hosts_run_in_sandboxes_and_are_killed_when_the_block_ends",
        ),
    ),
    Mutation(
        "chunks queued when the last host goes wait forever (#16)",
        "trio_gym/trainer/scheduler.py",
        "                if member is None and self._places_left == 0:",
        "                if False:",
        (
            "tests/test_pool.py::test_when_every_host_is_gone_the_queued_chunks_fail_naming_each_end",
        ),
    ),
    Mutation(
        "a host that failed to start is waited for until the timeout (#16)",
        "trio_gym/fleet/launch.py",
        "                if health.status is HealthStatus.FAILED:",
        "                if False:",
        (
            "tests/test_pool.py::test_a_launch_whose_hosts_do_not_become_ready_fails_naming_why_and_leaves_nothing",
            "tests/test_opensandbox.py::test_a_sandbox_whose_host_fails_to_start_fails_the_launch_and_is_killed",
        ),
    ),
    Mutation(
        "a sandbox created under a lost answer is left running (#16)",
        "trio_gym/fleet/opensandbox.py",
        "                rolled_back = self._kill_launched(launch_id, keep=None)",
        "                rolled_back = []",
        (
            "tests/test_opensandbox.py::test_a_create_whose_answer_was_lost_is_rolled_back_and_tried_again",
        ),
    ),
    Mutation(
        "the sandbox TTL is renewed too late (#16)",
        "trio_gym/fleet/opensandbox.py",
        "            await trio.sleep(self.ttl_s / 2)",
        "            await trio.sleep(self.ttl_s * 2)",
        ("tests/test_opensandbox.py::test_the_ttl_is_renewed_at_half_its_length",),
    ),
    Mutation(
        "a platform credential may ride in the hosts' environment (#16)",
        "trio_gym/fleet/opensandbox.py",
        '_CREDENTIAL_VARIABLE = re.compile(r"^(OPEN_?SANDBOX_.*|RAY_ADDRESS)$")',
        '_CREDENTIAL_VARIABLE = re.compile(r"^(OPEN_SANDBOX_API_KEY)$")',
        (
            "tests/test_opensandbox.py::test_credentials_in_the_hosts_environment_are_refused_before_anything_is_created",
        ),
    ),
    Mutation(
        "a dead answer does not make its host suspect (#16)",
        "trio_gym/trainer/scheduler.py",
        "        if not error.suspect:\n            return",
        "        if not error.suspect or error.reach is not Reach.UNREACHED:\n            return",
        (
            "tests/test_pool.py::test_a_host_that_stalls_mid_batch_is_ejected_and_the_rest_carry_the_batch",
        ),
    ),
    Mutation(
        "run_rollouts never looks at Ray's cancel flag (#16)",
        "trio_gym/fleet/ray_actor.py",
        "                    if cancelled():",
        "                    if False:",
        ("tests/test_ray.py::test_cancelling_the_consumer_cancels_every_running_example",),
    ),
    Mutation(
        "a cancelled row stream leaves its rows running (#16)",
        "trio_gym/fleet/ray_actor.py",
        "                    trio.from_thread.run_sync(scope.cancel, trio_token=token)",
        "                    pass",
        ("tests/test_ray.py::test_cancelling_the_consumer_cancels_every_running_example",),
    ),
    Mutation(
        "the actor spins up a second session over the first (#16)",
        "trio_gym/fleet/ray_actor.py",
        "        if self._session is not None:\n            if self._session.failure is not None:",
        "        if False:\n            if self._session.failure is not None:",
        ("tests/test_ray.py::test_the_actor_runs_one_session_and_refuses_bad_config",),
    ),
    Mutation(
        "leaving a provider's block leaves its hosts running (#16)",
        "trio_gym/fleet/launch.py",
        "                    nursery.cancel_scope.cancel()  # every host's task stops its host",
        "                    pass",
        (
            "tests/test_pool.py::test_a_host_answering_503_gets_nothing_run_and_is_ejected",
            "tests/test_opensandbox.py::test_hosts_run_in_sandboxes_and_are_killed_when_the_block_ends",
            "tests/test_ray.py::test_the_ray_provider_places_hosts_on_the_cluster_and_stops_them",
        ),
    ),
    Mutation(
        "a successor restores a departed host's export but its work stays with the departed (#16)",
        "trio_gym/trainer/restore.py",
        "                    ledger.rehost(old, new)",
        "                    pass",
        (
            "tests/test_coordinator.py::test_a_host_that_left_has_its_episodes_restored_on_its_named_successor",
        ),
    ),
    Mutation(
        "a restore restores each host's export on a host of the same name only (#16)",
        "trio_gym/trainer/restore.py",
        "        return {name: successors.get(name, name) for name in named}",
        "        return {name: name for name in named}",
        (
            "tests/test_coordinator.py::test_a_host_that_left_has_its_episodes_restored_on_its_named_successor",
        ),
    ),
    Mutation(
        "a replacement that fails to start crashes the pool (review of #16)",
        "trio_gym/fleet/launch.py",
        "            handle: HostHandle = await self._nursery.start(run_host, name, *args)\n        except ExceptionGroup as group:",
        "            handle: HostHandle = await self._nursery.start(run_host, name, *args)\n        except ZeroDivisionError as group:",
        ("tests/test_pool.py::test_a_replacement_that_fails_to_start_loses_its_slot_not_the_pool",),
    ),
    Mutation(
        "a shutdown during spinup waits forever (review of #16)",
        "trio_gym/fleet/ray_actor.py",
        "            if not self._stopping.is_set():  # stop() sets it before it looks for the token",
        "            if True:",
        (
            "tests/test_session.py::test_a_shutdown_during_spinup_ends_the_session_once_its_hosts_are_up",
        ),
    ),
    Mutation(
        "the half-close probe waits 0.2 s whatever the round trip (#17)",
        "trio_gym/http/connection.py",
        "        round_trip = self.round_trip_s()",
        "        round_trip = None",
        ("tests/test_host_wire.py::test_the_half_close_probe_waits_by_the_measured_round_trip",),
    ),
    Mutation(
        "the round trip read from the wrong field of tcp_info (tcpi_rto) (#17)",
        "trio_gym/http/transport.py",
        "_TCPI_RTT_OFFSET: Final = 8 + 15 * 4",
        "_TCPI_RTT_OFFSET: Final = 8 + 0 * 4",
        ("tests/test_host_wire.py::test_the_half_close_probe_waits_by_the_measured_round_trip",),
    ),
    Mutation(
        "a stopped beat keeps its connection alive until it is due (#17)",
        "trio_gym/host/pacer.py",
        "        self.call = _stopped",
        "        pass",
        (
            "tests/test_pacer.py::test_a_stopped_beat_lets_go_at_once_and_stopped_beats_do_not_pile_up",
        ),
    ),
    Mutation(
        "stopped beats pile up in the pacer's heap (#17)",
        "trio_gym/host/pacer.py",
        "        if len(self._beats) >= self._compact_at:\n            self._compact()",
        "        if False:\n            self._compact()",
        (
            "tests/test_pacer.py::test_a_stopped_beat_lets_go_at_once_and_stopped_beats_do_not_pile_up",
        ),
    ),
    Mutation(
        "the pacer wakes for every beat however close together (#17)",
        "trio_gym/host/pacer.py",
        "max(self._beats[0][0], woke + RESOLUTION_S) if self._beats else math.inf",
        "self._beats[0][0] if self._beats else math.inf",
        ("tests/test_pacer.py::test_beats_due_close_together_share_one_wake_up",),
    ),
    Mutation(
        "a close always waits for the caller's end-of-file (#17)",
        "trio_gym/http/connection.py",
        "            if not (self._lost or self._closed or self._nothing_unread()):",
        "            if not (self._lost or self._closed):",
        (
            "tests/test_http_mechanics.py::test_a_request_read_whole_is_closed_without_waiting_for_the_callers_close",
        ),
    ),
    Mutation(
        "a close at once though the caller's body is still arriving (#17)",
        "trio_gym/http/connection.py",
        "        if self._h11.trailing_data[0] or not (self.peer_is_done_sending or self.eof_received):",
        "        if self._h11.trailing_data[0]:",
        ("tests/test_host_wire.py::test_a_413_survives_a_body_that_starts_after_the_answer",),
    ),
    Mutation(
        "a kept-alive connection never goes back to its pool (#25)",
        "trio_gym/http/client.py",
        "            kept = len(self._idle) < self._max_idle and opened.conn.start_next_request()",
        "            kept = False",
        ("tests/test_connection_pool.py::test_requests_one_after_another_share_one_connection",),
    ),
    Mutation(
        "a waiting connection the server closed is used anyway (#25)",
        "trio_gym/http/client.py",
        "            if now - since < self._idle_s and conn.idle_and_open():",
        "            if now - since < self._idle_s:",
        (
            "tests/test_connection_pool.py::test_a_connection_the_server_closed_while_it_waited_is_not_used",
        ),
    ),
    Mutation(
        "a connection waits for its next request however long (#25)",
        "trio_gym/http/client.py",
        "            if now - since < self._idle_s and conn.idle_and_open():",
        "            if conn.idle_and_open():",
        ("tests/test_connection_pool.py::test_a_connection_waits_no_longer_than_its_idle_time",),
    ),
    Mutation(
        "no bound on the connections waiting in a pool (#25)",
        "trio_gym/http/client.py",
        "            kept = len(self._idle) < self._max_idle and opened.conn.start_next_request()",
        "            kept = opened.conn.start_next_request()",
        ("tests/test_connection_pool.py::test_no_more_connections_wait_than_max_idle",),
    ),
    Mutation(
        "a cancelled exchange leaves its connection open: the server never learns (#25)",
        "trio_gym/http/client.py",
        "            else:\n                await opened.conn.aclose()\n        return Response(",
        "            else:\n                pass\n        return Response(",
        (
            "tests/test_connection_pool.py::test_a_cancelled_exchange_closes_its_connection_and_the_next_gets_a_fresh_one",
        ),
    ),
    Mutation(
        "a read whose event is already here is not a checkpoint (#25)",
        "trio_gym/http/connection.py",
        "            await trio.lowlevel.checkpoint()\n            return event",
        "            return event",
        (
            "tests/test_http_mechanics.py::test_every_read_and_write_of_a_short_exchange_is_a_checkpoint",
        ),
    ),
    Mutation(
        "an async write leaves what a stream's transport queued for a wait no one makes (#25)",
        "trio_gym/http/connection.py",
        "            while data or transport.queued_bytes:",
        "            while data:",
        ("tests/test_client.py::test_the_head_timeout_starts_when_the_upload_ends_not_before",),
    ),
    Mutation(
        "a stream's transport queues without bound (#25)",
        "trio_gym/http/transport.py",
        "        taken = max(0, min(len(data), self._buffer_bytes - len(self._queued)))",
        "        taken = len(data)",
        ("tests/test_http_mechanics.py::test_a_stream_transport_queues_no_more_than_its_buffer",),
    ),
    Mutation(
        "a batch's running line written at once, short or not (#17)",
        "trio_gym/host/batch_state.py",
        "            self.unlogged_running = fields\n            return",
        "            self._log(to, level=logging.INFO, fields=fields)\n            return",
        ("tests/test_host_clock.py::test_a_short_batch_is_one_log_line_and_a_lasting_one_two",),
    ),
    Mutation(
        "a lasting batch's running line never written (#17)",
        "trio_gym/host/supervision.py",
        "    batch.log_running()",
        "    pass",
        ("tests/test_host_clock.py::test_a_short_batch_is_one_log_line_and_a_lasting_one_two",),
    ),
    Mutation(
        "a short batch's one line loses what the running line would have said (#17)",
        "trio_gym/host/batch_state.py",
        "            fields = {**self.unlogged_running, **fields}",
        "            fields = dict(fields)",
        ("tests/test_host_clock.py::test_a_short_batch_is_one_log_line_and_a_lasting_one_two",),
    ),
    Mutation(
        "a log line written directly drops its fields (#17)",
        "trio_gym/logs.py",
        "        text = _line(time.time(), name, event, fields)",
        "        text = _line(time.time(), name, event, {})",
        ("tests/test_logs.py::test_a_line_written_directly_reads_as_one_written_through_a_record",),
    ),
    Mutation(
        "a batch that finished answered as if its deadline had passed (#17)",
        "trio_gym/host/supervision.py",
        "                completed = True",
        "                completed = False",
        ("tests/test_host_clock.py::test_heartbeat_cadence_over_a_30_minute_batch",),
    ),
    Mutation(
        "records passed on unfinished: Gym's finalization skipped (#22)",
        "trio_gym/runners/agents.py",
        "        if self.finalizer is None:\n            return record, None",
        "        if True:\n            return record, None",
        (
            "tests/test_records.py::test_every_record_is_finished_after_its_captures_were_cleared_before_its_run",
            "tests/test_gym_real.py::test_records_equal_gyms_own_collection_key_for_key_through_both_runners",
        ),
    ),
    Mutation(
        "old captures not cleared before a row's /run (#22)",
        "trio_gym/runners/agents.py",
        "                await self.finalizer.prepare(gym_row)",
        "                pass",
        (
            "tests/test_records.py::test_every_record_is_finished_after_its_captures_were_cleared_before_its_run",
            "tests/test_gym_real.py::test_a_second_run_of_the_same_ids_does_not_double_a_capture",
        ),
    ),
    Mutation(
        "a token snapshot retired as soon as its record is finished, delivered or not (#22)",
        "trio_gym/runners/agents.py",
        "                    context.when_delivered(partial(self.finalizer.retire, retirement))",
        "                    self.finalizer.retire(retirement)",
        (
            "tests/test_records.py::test_a_snapshot_is_retired_once_its_row_is_written_and_never_when_undelivered",
            "tests/test_gym_real.py::test_a_token_snapshot_is_retired_once_its_record_is_delivered_and_not_before",
        ),
    ),
    Mutation(
        "a row's deliveries run before its line is written (#22)",
        "trio_gym/host/rows.py",
        '            await body.send(line)\n            counts["completed" if ok else "failed"] += 1\n            deliver(deliveries)',
        '            deliver(deliveries)\n            await body.send(line)\n            counts["completed" if ok else "failed"] += 1',
        (
            "tests/test_records.py::test_a_snapshot_is_retired_once_its_row_is_written_and_never_when_undelivered",
            "tests/test_records.py::test_a_row_whose_line_never_reaches_its_caller_keeps_its_snapshot",
        ),
    ),
    Mutation(
        "a document's deliveries run whether or not it was answered with its results (#22)",
        "trio_gym/host/rollouts.py",
        "    if answer.error is None:\n        deliver(deliveries)",
        "    pass",
        (
            "tests/test_records.py::test_a_snapshot_is_retired_once_its_row_is_written_and_never_when_undelivered",
            "tests/test_records.py::test_a_document_that_fails_as_a_whole_retires_none_of_its_finished_records",
        ),
        also=(
            (
                "trio_gym/host/rollouts.py",
                "    if body is None:\n        await caller.send_whole(",
                "    deliver(deliveries)\n    if body is None:\n        await caller.send_whole(",
            ),
        ),
    ),
    Mutation(
        "rows without identity keys sent as they are (captured nowhere) (#22)",
        "trio_gym/runners/agents.py",
        "        row = numbered(example, context.position)",
        "        row = dict(example)",
        (
            "tests/test_agents.py::test_records_carry_what_gyms_collection_stamps_and_nothing_invented",
            "tests/test_records.py::test_every_record_is_finished_after_its_captures_were_cleared_before_its_run",
            "tests/test_gym_real.py::test_rows_without_identity_keys_are_numbered_by_their_place_and_captured",
        ),
    ),
    Mutation(
        "every chunk numbered from 0 (chunks of one input share capture keys) (#22)",
        "trio_gym/trainer/pool.py",
        "row_offset=index * batch.size,",
        "row_offset=0,",
        (
            "tests/test_records.py::test_chunks_of_one_input_are_numbered_by_their_place_in_it_on_every_host",
        ),
    ),
    Mutation(
        "the host ignores the request's row_offset (#22)",
        "trio_gym/host/batch.py",
        "        position=row_offset + episode.index,",
        "        position=episode.index,",
        (
            "tests/test_records.py::test_every_record_is_finished_after_its_captures_were_cleared_before_its_run",
            "tests/test_gym_real.py::test_rows_without_identity_keys_are_numbered_by_their_place_and_captured",
        ),
    ),
    Mutation(
        "with the control plane on, Gym sees a row without the rollout id it is known by (#22)",
        "trio_gym/host/batch.py",
        "    if identity is not None and rollout_id_of(example) is None:",
        "    if False:",
        (
            "tests/test_records.py::test_with_the_control_plane_on_a_row_reaches_gym_with_the_rollout_id_it_is_known_by",
        ),
    ),
    Mutation(
        "failure records asked for, the batch failed as a whole instead (#22)",
        "trio_gym/host/rollouts.py",
        '    failed = failed_in_place if request.failures == "records" else None',
        "    failed = None",
        (
            "tests/test_records.py::test_failure_records_in_place_keep_every_other_result",
            "tests/test_run_command.py::test_a_failed_example_costs_its_chunk_mates_nothing_and_lands_beside_the_results",
        ),
    ),
    Mutation(
        "a sidecar row without its failure record (#22)",
        "trio_gym/host/rows.py",
        "        rows_in.send_nowait((sidecar_line(index, error, failure.record, limit), False, ()))",
        "        rows_in.send_nowait((sidecar_line(index, error), False, ()))",
        (
            "tests/test_agents.py::test_an_agent_error_fails_its_example_with_the_status_and_an_excerpt",
            "tests/test_records.py::test_a_record_gyms_finalizer_cannot_finish_fails_its_row_naming_why",
        ),
    ),
    Mutation(
        "a gateway's answer read as a rollout that ran (#22)",
        "trio_gym/runners/records.py",
        "    ran = error.status is not None and error.status not in GATEWAY_STATUSES",
        "    ran = error.status is not None",
        (
            "tests/test_agents.py::test_a_failed_run_is_the_failure_record_gyms_collection_writes_for_it",
        ),
    ),
    Mutation(
        "a finalizer call left unbounded (#22)",
        "trio_gym/runners/finalize.py",
        "            with trio.move_on_after(bound_s):",
        "            with trio.move_on_after(math.inf):",
        (
            "tests/test_finalize.py::test_a_worker_that_does_not_answer_in_time_fails_the_call_and_is_replaced",
        ),
    ),
    Mutation(
        "a finalizer that dies is not started again (#22)",
        "trio_gym/runners/finalize.py",
        "            else:\n                await self._keep_starting()",
        "            else:\n                await trio.sleep_forever()",
        (
            "tests/test_finalize.py::test_a_worker_that_dies_fails_exactly_its_calls_in_flight_naming_its_end",
            "tests/test_gym_real.py::test_the_finalizer_killed_mid_batch_fails_only_the_rows_it_was_finishing",
        ),
    ),
    Mutation(
        "a dead finalizer's calls in flight left to wait out their bound (#22)",
        "trio_gym/runners/finalize.py",
        "            if not call.done.is_set():\n                call.failure = self.ended",
        "            if False:\n                call.failure = self.ended",
        (
            "tests/test_finalize.py::test_a_worker_that_dies_fails_exactly_its_calls_in_flight_naming_its_end",
        ),
    ),
    Mutation(
        "an answer for a cancelled call crashes the finalizer (#22)",
        "trio_gym/runners/finalize.py",
        "        call = self.calls.get(number)\n        if call is not None:  # else its caller was cancelled meanwhile",
        "        call = self.calls[number]\n        if call is not None:  # else its caller was cancelled meanwhile",
        (
            "tests/test_finalize.py::test_stray_lines_on_the_answer_channel_are_logged_and_skipped",
            "tests/test_finalize.py::test_a_caller_cancelled_while_its_request_is_written_cuts_no_line",
        ),
    ),
    Mutation(
        "one rollout id run twice at once while its captures are kept (#22)",
        "trio_gym/runners/agents.py",
        "        if key in self._capturing:",
        "        if False:",
        (
            "tests/test_records.py::test_one_rollout_id_runs_once_at_a_time_while_its_captures_are_kept",
        ),
    ),
    Mutation(
        "Gym's capture switches not read: nothing is finalized (#22)",
        "trio_gym/runners/finalize.py",
        "    if config.get(OBSERVABILITY_KEY) is True:",
        "    if False:",
        (
            "tests/test_finalize.py::test_finalization_follows_gyms_own_switches",
            "tests/test_records.py::test_every_record_is_finished_after_its_captures_were_cleared_before_its_run",
        ),
    ),
    Mutation(
        "a host that cannot finalize says nothing in /health (#22)",
        "trio_gym/host/lifecycle.py",
        "            if self.health_notes:",
        "            if False:",
        (
            "tests/test_records.py::test_an_agents_host_that_cannot_finalize_says_so_once_and_in_its_health",
        ),
    ),
    Mutation(
        "the gym runner serves unfinished records when it cannot finalize (#22)",
        "trio_gym/runners/agents.py",
        "            if self.settings.finalize_required:",
        "            if False:",
        ("tests/test_records.py::test_a_gym_runner_that_cannot_finalize_does_not_start",),
    ),
    Mutation(
        "token capture not finalized (a token-less sample unmasked) (#22)",
        "trio_gym/runners/finalize_worker.py",
        "        if not no_result and self._tokens_captured(row):",
        "        if False:",
        (
            "tests/test_gym_real.py::test_records_equal_gyms_own_collection_key_for_key_through_both_runners",
        ),
    ),
    Mutation(
        "capture folders of another machine used here (every record read as uncaptured) (#22)",
        "trio_gym/runners/finalize_worker.py",
        "    if not path.is_dir():",
        "    if False:",
        (
            "tests/test_gym_real.py::test_an_agents_host_whose_capture_folders_are_elsewhere_says_records_are_not_finalized",
        ),
    ),
    Mutation(
        "trio-gym run writes no results when an example failed (#22)",
        "trio_gym/trainer/batch_file.py",
        "    write_results(results, out)\n    sidecar = ",
        "    if not failures:\n        write_results(results, out)\n    sidecar = ",
        (
            "tests/test_run_command.py::test_a_failed_example_costs_its_chunk_mates_nothing_and_lands_beside_the_results",
            "tests/test_run_command.py::test_the_failure_record_of_a_failed_example_is_the_hosts",
        ),
    ),
    Mutation(
        "an earlier run's failure records left beside a clean run's results (#22)",
        "trio_gym/trainer/batch_file.py",
        "        sidecar.unlink(missing_ok=True)",
        "        pass",
        (
            "tests/test_run_command.py::test_a_failed_example_costs_its_chunk_mates_nothing_and_lands_beside_the_results",
        ),
    ),
    Mutation(
        "callers write their own requests (a cancelled one cuts a line in half) (#22)",
        "trio_gym/runners/finalize.py",
        "            self._to_write.send_nowait(number)\n",
        "            await self.process.stdin.send_all(line)  # type: ignore[union-attr]\n",
        (
            "tests/test_finalize.py::test_a_caller_cancelled_while_its_request_is_written_cuts_no_line",
        ),
    ),
    Mutation(
        "each finalizer call bounded by itself (a long queue behind a working worker fails) (#22)",
        "trio_gym/runners/finalize.py",
        "        assert worker is not None\n        return await worker.call(op, fields)",
        "        assert worker is not None\n        with trio.fail_after(self.call_timeout_s):\n            return await worker.call(op, fields)",
        ("tests/test_finalize.py::test_a_long_queue_behind_a_working_finalizer_is_no_failure",),
    ),
    Mutation(
        "a killed finalizer waited for however long it takes (a stop that never ends) (#22)",
        "trio_gym/runners/finalize.py",
        "    with trio.move_on_after(STOP_GRACE_S):\n        await process.wait()\n        return\n    log_event(",
        "    with trio.move_on_after(math.inf):\n        await process.wait()\n        return\n    log_event(",
        ("tests/test_finalize.py::test_a_worker_that_will_not_die_is_left_after_a_bounded_wait",),
    ),
    Mutation(
        "a failed /run's failure record lost when Gym cannot finish it (#22)",
        "trio_gym/runners/agents.py",
        "                except FinalizeFailed as unfinished:  # the failure is the /run's, still",
        "                except ZeroDivisionError as unfinished:",
        (
            "tests/test_records.py::test_a_failed_run_keeps_its_failure_record_when_gym_cannot_finish_it",
        ),
    ),
    Mutation(
        "one rollout id held for all its tries (a next try refused beside the first) (#22)",
        "trio_gym/runners/agents.py",
        "        key = capture_key_of(row)",
        "        key = capture_key_of({**row, ATTEMPT_KEY: 0})",
        (
            "tests/test_records.py::test_one_rollout_id_runs_once_at_a_time_while_its_captures_are_kept",
        ),
    ),
    Mutation(
        "a gateway that could not reach the host read as one that may have (#23)",
        "trio_gym/trainer/gateways.py",
        '    if isinstance(document, dict) and document.get("code") in _BACKEND_NEVER_REACHED_CODES:\n'
        "        return True",
        '    if isinstance(document, dict) and document.get("code") in _BACKEND_NEVER_REACHED_CODES:\n'
        "        return False",
        (
            "tests/test_client.py::test_each_answer_is_named_and_taken_or_not_by_one_rule",
            "tests/test_reach.py::test_a_gateway_that_cannot_reach_a_host_costs_no_chunk_and_the_host_is_ejected",
            "tests/test_platforms_real.py::test_opensandbox_hosts_serve_through_the_proxy_and_survive_a_killed_container",
        ),
    ),
    Mutation(
        "a cut answer named without asking the host (#23)",
        "trio_gym/trainer/answers.py",
        "    if health.status in _ALIVE:",
        "    if True:",
        (
            "tests/test_client.py::test_each_answer_is_named_and_taken_or_not_by_one_rule",
            "tests/test_client_stream.py::test_a_stream_cut_before_its_done_line_is_named_as_run_names_a_cut_and_taken",
            "tests/test_pool.py::test_a_host_killed_mid_batch_fails_only_what_it_had_taken_and_is_replaced",
        ),
    ),
    Mutation(
        "a cut answer does not make its host suspect (#23)",
        "trio_gym/trainer/answers.py",
        "        reach=Reach.TAKEN,\n        suspect=True,\n        status=status,\n    )",
        "        reach=Reach.TAKEN,\n        suspect=False,\n        status=status,\n    )",
        (
            "tests/test_reach.py::test_a_cut_answer_fails_its_chunk_once_and_its_host_is_probed_before_more_work",
            "tests/test_client_stream.py::test_a_stream_cut_before_its_done_line_is_named_as_run_names_a_cut_and_taken",
        ),
    ),
    Mutation(
        "an unreached chunk failed by the pool instead of sent to another host (#23)",
        "trio_gym/trainer/pool.py",
        "            if error.reach is not Reach.UNREACHED:",
        "            if True:",
        (
            "tests/test_reach.py::test_a_gateway_that_cannot_reach_a_host_costs_no_chunk_and_the_host_is_ejected",
            "tests/test_reach.py::test_a_stranger_at_a_hosts_address_is_refused_and_ejected_and_the_chunk_goes_on",
        ),
    ),
    Mutation(
        "the host serves a request carrying another host's identity (#23)",
        "trio_gym/host/server.py",
        "    holder = _holds_identity(config.host_identity, head)",
        "    holder = True",
        (
            "tests/test_reach.py::test_a_host_with_an_identity_refuses_another_naming_neither_and_says_its_digest",
            "tests/test_reach.py::test_a_second_host_on_the_first_ones_port_refuses_the_first_ones_caller",
        ),
    ),
    Mutation(
        "the refusal of another identity names the identity the host holds (#23)",
        "trio_gym/host/server.py",
        '            "provider for the host it launched",',
        '            f"provider for the host it launched (this one is {identity})",',
        (
            "tests/test_reach.py::test_a_host_with_an_identity_refuses_another_naming_neither_and_says_its_digest",
        ),
    ),
    Mutation(
        "a probe believes any host that answers ready (#23)",
        "trio_gym/trainer/hosts.py",
        "    if identity and held != identity_digest(identity):",
        "    if False:",
        (
            "tests/test_reach.py::test_a_second_host_on_the_first_ones_port_refuses_the_first_ones_caller",
        ),
    ),
    Mutation(
        "a stranger at a host's address waits out max_host_failures (#23)",
        "trio_gym/trainer/scheduler.py",
        "            if health.status is HealthStatus.WRONG_HOST:",
        "            if False:",
        (
            "tests/test_reach.py::test_a_stranger_at_a_hosts_address_is_refused_and_ejected_and_the_chunk_goes_on",
        ),
    ),
    Mutation(
        "a provider's host gets no identity (#23)",
        "trio_gym/fleet/launch.py",
        "        named = {IDENTITY_VARIABLE: identity} if identity else {}",
        "        named = {}",
        ("tests/test_pool.py::test_launched_hosts_hold_the_identity_their_handles_carry",),
    ),
    Mutation(
        "OpenSandbox hosts all listen on one port of the shared network (#23)",
        "trio_gym/fleet/opensandbox.py",
        "        return next((p for p in self.ports if p not in self._ports_held and p not in tried), None)",
        "        return next((p for p in self.ports if p not in tried), None)",
        (
            "tests/test_platforms_real.py::test_opensandbox_hosts_serve_through_the_proxy_and_survive_a_killed_container",
        ),
    ),
    Mutation(
        "OpenSandbox hosts on a shared network all given one port (#23)",
        "trio_gym/fleet/opensandbox.py",
        "        if not self.host_network:\n"
        "            return await self._run_sandbox(name, self._spec, self.port, task_status)",
        "        if True:\n"
        "            return await self._run_sandbox(name, self._spec, self.port, task_status)",
        (
            "tests/test_platforms_real.py::test_opensandbox_hosts_serve_through_the_proxy_and_survive_a_killed_container",
        ),
    ),
    Mutation(
        "OpenSandbox hosts listen on every interface of the machine (#23)",
        "trio_gym/fleet/opensandbox.py",
        '        listen = {"NMP_RUNTIME_HTTP_HOST": "127.0.0.1"} if self.host_network else {}',
        "        listen = {}",
        (
            "tests/test_platforms_real.py::test_opensandbox_hosts_serve_through_the_proxy_and_survive_a_killed_container",
        ),
    ),
    Mutation(
        "a port something else holds fails the launch instead of the next port (#23)",
        "trio_gym/fleet/opensandbox.py",
        "                if _ADDRESS_IN_USE not in str(exc):",
        "                if True:",
        ("tests/test_platforms_real.py::test_a_port_something_else_holds_is_skipped_for_the_next",),
    ),
    Mutation(
        "an OpenSandbox host's failure points at a log about to be deleted (#23)",
        "trio_gym/fleet/opensandbox.py",
        '        logs = await trio.to_thread.run_sync(sandbox.get_diagnostic_logs, "container")',
        '        raise SandboxException("not read")',
        (
            "tests/test_platforms_real.py::test_an_opensandbox_hosts_own_start_failure_is_quoted_before_its_log_is_gone",
        ),
    ),
    Mutation(
        "the proxy's API key not carried on a host's requests (#23)",
        "trio_gym/fleet/opensandbox.py",
        "            headers.setdefault(API_KEY_HEADER, self._connection().get_api_key())",
        "            pass",
        (
            "tests/test_opensandbox.py::test_hosts_run_in_sandboxes_and_are_killed_when_the_block_ends",
            "tests/test_platforms_real.py::test_opensandbox_hosts_serve_through_the_proxy_and_survive_a_killed_container",
        ),
    ),
    Mutation(
        "a Docker host's failure without its log (#23)",
        "trio_gym/fleet/docker.py",
        '        return "the end of its output:\\n" + tail.rstrip()',
        '        return "see docker logs"',
        ("tests/test_platforms_real.py::test_a_docker_hosts_own_start_failure_is_quoted",),
    ),
    Mutation(
        "Docker hosts on the host network listen on every interface (#23)",
        "trio_gym/fleet/docker.py",
        '            {"NMP_RUNTIME_HTTP_HOST": "127.0.0.1", "NMP_RUNTIME_HTTP_PORT": "0",',
        '            {"NMP_RUNTIME_HTTP_HOST": "0.0.0.0", "NMP_RUNTIME_HTTP_PORT": "0",',
        (
            "tests/test_platforms_real.py::test_docker_hosts_serve_survive_a_killed_container_and_leave_nothing",
        ),
    ),
    Mutation(
        "a dead trainer's containers never swept (#23)",
        "trio_gym/fleet/docker.py",
        "            if _is_orphaned(owner)",
        "            if False",
        (
            "tests/test_platforms_real.py::test_containers_of_a_trainer_killed_outright_are_swept_by_the_next",
        ),
    ),
    Mutation(
        "a Docker block's containers left when it ends (#23)",
        "trio_gym/fleet/docker.py",
        "            with trio.CancelScope(shield=True):\n                await self._remove(name, container, spec.stop_grace_s)",
        "            pass",
        (
            "tests/test_platforms_real.py::test_docker_hosts_serve_survive_a_killed_container_and_leave_nothing",
        ),
        # The launch's leftovers are removed at the block's end too: both, or the rule holds.
        also=(
            (
                "trio_gym/fleet/docker.py",
                "            with trio.CancelScope(shield=True):\n                await self._remove_leftovers()",
                "            pass",
            ),
        ),
    ),
    Mutation(
        "a busy host's chunk put back without a probe (re-sent in a tight loop) (#23)",
        "trio_gym/trainer/answers.py",
        "                suspect=not_now,  # probed before it gets more: no tight loop of re-sends",
        "                suspect=False,",
        (
            "tests/test_reach.py::test_a_busy_host_is_probed_not_sent_the_same_chunk_again_and_not_ejected",
        ),
    ),
    Mutation(
        "a probe that hears busy counts a failure (a full host ejected) (#23)",
        "trio_gym/trainer/scheduler.py",
        "            if health.status is not HealthStatus.BUSY:  # busy is alive and full: not a failure",
        "            if True:",
        (
            "tests/test_reach.py::test_a_busy_host_is_probed_not_sent_the_same_chunk_again_and_not_ejected",
        ),
    ),
    Mutation(
        "a cut while the host is busy or restarted misnamed (only ready counts as alive) (#23)",
        "trio_gym/trainer/answers.py",
        "    {HealthStatus.READY, HealthStatus.BUSY, HealthStatus.SHUTTING_DOWN, HealthStatus.FAILED}",
        "    {HealthStatus.READY, HealthStatus.STARTING}",
        ("tests/test_client.py::test_each_answer_is_named_and_taken_or_not_by_one_rule",),
    ),
    Mutation(
        "over HTTP/1.0 a proxy's page re-sent (a batch it hid runs twice) (#23)",
        "trio_gym/trainer/host_client.py",
        "        results = decode_response(status, body, page_reach=self.unanswered_reach())",
        "        results = decode_response(status, body)",
        (
            "tests/test_client.py::test_over_http_10_a_proxys_page_may_hide_a_batch_that_ran_so_it_is_taken",
        ),
    ),
    Mutation(
        "a label without a start time judged orphaned (Docker Desktop: every trainer's swept) (#23)",
        "trio_gym/fleet/docker.py",
        "    if machine != _machine() or not pid.isdigit() or not started.isdigit():",
        "    if machine != _machine() or not pid.isdigit():",
        ("tests/test_docker_provider.py::test_only_this_machines_dead_trainers_own_orphans",),
    ),
    Mutation(
        "no head timeout: a stalled host holds a chunk to the request deadline (#24)",
        "trio_gym/trainer/host_client.py",
        "                    head_timeout_s=self.head_timeout_s,",
        "                    head_timeout_s=math.inf,",
        (
            "tests/test_client.py::test_a_host_that_never_answers_its_head_is_given_up_on_at_the_head_timeout",
            "tests/test_run_command.py::test_a_host_that_never_answers_is_given_up_on_at_the_flags_timeouts",
        ),
    ),
    Mutation(
        "the head timeout counted from the request's start (a big upload times out) (#24)",
        "trio_gym/http/client.py",
        "        head_wait = trio.CancelScope()",
        "        head_wait = trio.CancelScope(deadline=trio.current_time() + head_timeout_s)",
        ("tests/test_client.py::test_the_head_timeout_starts_when_the_upload_ends_not_before",),
        also=(
            (
                "trio_gym/http/client.py",
                "            head_wait.deadline = trio.current_time() + head_timeout_s\n",
                "",
            ),
        ),
    ),
    Mutation(
        "a head timeout over HTTP/1.0 (whose host answers only at the end) (#24)",
        "trio_gym/trainer/host_client.py",
        '        return self.settings.head_timeout_s if self.settings.http_version == "1.1" else math.inf',
        "        return self.settings.head_timeout_s",
        (
            "tests/test_client.py::test_over_http_10_the_head_is_bounded_by_the_request_deadline_only",
        ),
    ),
    Mutation(
        "no connect timeout (#24)",
        "trio_gym/http/client.py",
        "        with trio.move_on_after(connect_timeout_s):",
        "        with trio.move_on_after(math.inf):",
        (
            "tests/test_client.py::test_a_connection_that_never_opens_is_given_up_on_at_the_connect_timeout",
        ),
    ),
    Mutation(
        "trio-gym run ignores --head-timeout and --idle-timeout (#24)",
        "trio_gym/cli.py",
        "            idle_timeout_s=args.idle_timeout,\n            head_timeout_s=args.head_timeout,\n",
        "",
        (
            "tests/test_run_command.py::test_a_host_that_never_answers_is_given_up_on_at_the_flags_timeouts",
        ),
    ),
    Mutation(
        "control calls without the host's identity and platform headers (#24)",
        "trio_gym/trainer/control.py",
        "                        *self._headers,\n",
        "",
        (
            "tests/test_reach.py::test_a_dispatchers_host_carries_its_identity_on_rollouts_and_control_calls",
        ),
    ),
    Mutation(
        "a dispatcher's host built from a handle sends no identity with its batches (#24)",
        "trio_gym/trainer/scheduler.py",
        "            identity=handle.identity, opener=opener,",
        "            opener=opener,",
        (
            "tests/test_reach.py::test_a_dispatchers_host_carries_its_identity_on_rollouts_and_control_calls",
        ),
    ),
    Mutation(
        "a lost host's checkpointed episodes run afresh instead of restored on its heir (#24)",
        "trio_gym/trainer/recovery.py",
        "    if heir is not None and keys and last is not None and export is not None:",
        "    if False:",
        (
            "tests/test_recovery.py::test_a_host_lost_between_checkpoints_is_replaced_and_its_episodes_continue_there",
            "tests/test_fleet_faults.py::test_four_hosts_two_killed_checkpoints_every_second_each_episode_once",
            "tests/test_cli.py::test_the_fleet_demo_loses_a_host_mid_run_and_consumes_every_episode_once",
        ),
    ),
    Mutation(
        "a lost host's running attempts handed to its heir as if still dispatched (#24)",
        "trio_gym/trainer/recovery.py",
        "            if attempt.host == lost:\n                ledger.move(attempt.capture_key, AttemptState.ABANDONED)",
        "            if False:\n                ledger.move(attempt.capture_key, AttemptState.ABANDONED)",
        (
            "tests/test_recovery.py::test_a_host_lost_before_any_checkpoint_has_its_work_run_afresh_on_the_replacement",
        ),
    ),
    Mutation(
        "a lost host's work left on it, not moved to its heir (#24)",
        "trio_gym/trainer/recovery.py",
        "        if heir is not None:\n            ledger.rehost(lost, heir.name)",
        "        if False:\n            ledger.rehost(lost, heir.name)",
        (
            "tests/test_recovery.py::test_a_host_lost_between_checkpoints_is_replaced_and_its_episodes_continue_there",
            "tests/test_recovery.py::test_without_a_launcher_the_least_loaded_host_left_inherits_the_lost_ones_work",
        ),
    ),
    Mutation(
        "a group whose work moved to an heir between sends ends without it (#24)",
        "trio_gym/trainer/dispatch.py",
        "            for pending in self._hosts_with_work_to_send(group_id):\n"
        "                if self.scheduler.heir_of(pending) != pending:  # lost, its work never moved\n"
        '                    raise GroupFailed(f"group {group_id!r}: work is left on {pending}, lost")\n'
        "                loop_on(pending)\n",
        "            pass\n",
        (
            "tests/test_recovery.py::test_work_sent_to_a_host_already_dead_follows_it_to_its_replacement",
        ),
    ),
    Mutation(
        "a checkpoint does not wait for a lost host's heir (#24)",
        "trio_gym/trainer/coordinator.py",
        "                await self.dispatcher.scheduler.until_handed_on()",
        "                await trio.lowlevel.checkpoint()",
        (
            "tests/test_recovery.py::test_a_checkpoint_waits_for_a_lost_hosts_heir_within_the_gate_timeout",
        ),
    ),
    Mutation(
        "a host a checkpoint cannot reach is not probed (#24)",
        "trio_gym/trainer/checkpointing.py",
        '                    self.dispatcher.scheduler.suspect(host, f"a control call failed: {error}")',
        "                    pass",
        (
            "tests/test_recovery.py::test_a_host_a_checkpoint_cannot_reach_is_probed_ejected_and_replaced",
        ),
    ),
    Mutation(
        "the host runs a keyed request again instead of attaching it (#24)",
        "trio_gym/host/rollouts.py",
        "    if found is not None:\n        await keyed.attach(found, conn)\n        return\n",
        "",
        (
            "tests/test_reattach.py::test_a_second_post_with_the_same_key_attaches_and_gets_the_answer_from_its_start",
            "tests/test_reattach_real.py::test_a_document_cut_cleanly_by_a_proxy_comes_back_whole_through_reattach",
            "tests/test_dispatch.py::test_a_stream_cut_while_its_host_lives_reattaches_and_no_row_is_lost",
        ),
    ),
    Mutation(
        "the same key with another body attaches to the first (#24)",
        "trio_gym/host/reattach.py",
        "    hasher = hashlib.sha256(body)",
        "    hasher = hashlib.sha256()",
        ("tests/test_reattach.py::test_the_same_key_with_another_body_is_refused_naming_the_key",),
    ),
    Mutation(
        "a keyed batch is cancelled at its caller's disconnect, no grace (#24)",
        "trio_gym/host/reattach.py",
        "            with trio.move_on_after(self.grace_s):",
        "            with trio.move_on_after(0):",
        (
            "tests/test_reattach.py::test_an_abandoned_keyed_batch_runs_on_for_its_grace_and_a_returning_caller_gets_it",
        ),
    ),
    Mutation(
        "a keyed batch no caller comes back for runs on forever (#24)",
        "trio_gym/host/reattach.py",
        '            raise ConnectionLost(\n                f"no caller came back',
        '            continue\n            raise ConnectionLost(\n                f"no caller came back',
        (
            "tests/test_reattach.py::test_a_keyed_batch_no_caller_comes_back_for_is_cancelled_at_its_grace",
        ),
    ),
    Mutation(
        "finished answers kept past their retention (#24)",
        "trio_gym/host/reattach.py",
        "            if age < self.retention_s and self._finished_bytes <= self.retention_bytes:",
        "            if self._finished_bytes <= self.retention_bytes:",
        (
            "tests/test_reattach.py::test_a_finished_answer_is_handed_out_again_until_its_retention_then_refused",
        ),
    ),
    Mutation(
        "finished answers kept beyond the bytes bound (#24)",
        "trio_gym/host/reattach.py",
        "            if age < self.retention_s and self._finished_bytes <= self.retention_bytes:",
        "            if age < self.retention_s:",
        ("tests/test_reattach.py::test_finished_answers_beyond_the_bytes_kept_go_oldest_first",),
    ),
    Mutation(
        "the bytes of the finished answers kept are not counted (#25)",
        "trio_gym/host/reattach.py",
        "            self._finished_bytes += batch.kept_bytes",
        "            self._finished_bytes += 0",
        ("tests/test_reattach.py::test_finished_answers_beyond_the_bytes_kept_go_oldest_first",),
    ),
    Mutation(
        "a key whose answer was dropped runs its batch again (#24)",
        "trio_gym/host/reattach.py",
        "            self.memory.ran.add(batch.key, Gone.EXPIRED)",
        "            pass",
        (
            "tests/test_reattach.py::test_a_finished_answer_is_handed_out_again_until_its_retention_then_refused",
            "tests/test_reattach.py::test_a_keyed_batch_no_caller_comes_back_for_is_cancelled_at_its_grace",
        ),
    ),
    Mutation(
        "a keyed request refused before it ran keeps its key (#24)",
        "trio_gym/host/reattach.py",
        "        del self._batches[batch.key]\n        if ran:",
        "        if ran:\n            del self._batches[batch.key]",
        (
            "tests/test_reattach.py::test_a_keyed_request_refused_before_it_runs_leaves_its_key_free",
        ),
    ),
    Mutation(
        "the client fails a cut answer without reattaching while its host lives (#24)",
        "trio_gym/trainer/host_client.py",
        "            if error.origin is not Origin.PROXY or attach == self.settings.max_reattaches:",
        "            if True:",
        (
            "tests/test_reattach_real.py::test_a_document_cut_cleanly_by_a_proxy_comes_back_whole_through_reattach",
        ),
    ),
    Mutation(
        "a row stream fails its cut without reattaching while its host lives (#24)",
        "trio_gym/trainer/stream.py",
        "        if cut.origin is not Origin.PROXY or self.reattaches >= settings.max_reattaches:",
        "        if True:",
        (
            "tests/test_reattach_real.py::test_a_row_stream_cut_cleanly_by_a_proxy_goes_on_from_where_it_was",
            "tests/test_dispatch.py::test_a_stream_cut_while_its_host_lives_reattaches_and_no_row_is_lost",
        ),
    ),
    Mutation(
        "a reattached row stream reads its rows again as new (#24)",
        "trio_gym/trainer/stream.py",
        "        if index in self._replayed:\n            self._replayed.discard(index)\n            return None\n",
        "",
        (
            "tests/test_reattach_real.py::test_a_row_stream_cut_cleanly_by_a_proxy_goes_on_from_where_it_was",
        ),
    ),
    Mutation(
        "a cancelled request leaves its keyed batch running for the grace (#24)",
        "trio_gym/trainer/host_client.py",
        "            await self.give_up(key)\n            raise",
        "            raise",
        (
            "tests/test_reattach.py::test_a_client_that_gives_its_request_up_has_the_batch_cancelled_at_once",
        ),
    ),
    Mutation(
        "a row stream closed before its end leaves its keyed batch running (#24)",
        "trio_gym/trainer/stream.py",
        "            if given_up:\n                await self._client.give_up(self._key)",
        "            pass",
        ("tests/test_ray.py::test_cancelling_the_consumer_cancels_every_running_example",),
    ),
    Mutation(
        "the Ray actor's checkpoint saves no calls in flight (#24)",
        "trio_gym/fleet/ray_actor.py",
        "                        for c in [*self._restored.values(), *self._calls.values()]\n",
        "                        for c in [*self._restored.values(), *self._calls.values()]\n"
        "                        if False\n",
        (
            "tests/test_ray.py::test_the_actor_checkpoints_mid_flight_and_a_new_actor_restores_each_row_once",
        ),
    ),
    Mutation(
        "a request whose head never came re-sent though its host did not confirm dropping it (#24 review)",
        "trio_gym/trainer/host_client.py",
        "        if await self.give_up(key):\n            return error",
        "        if True:\n            return error",
        (
            "tests/test_client.py::test_a_request_whose_head_never_came_is_taken_unless_its_host_confirms_dropping_it",
        ),
    ),
    Mutation(
        "a request whose head never came re-sent without giving the first up (#24 review)",
        "trio_gym/trainer/host_client.py",
        "                raise await self._unless_dropped(error, key) from headless",
        "                raise error from headless",
        (
            "tests/test_reattach.py::test_a_request_whose_head_never_came_is_dropped_on_the_host_before_it_goes_again",
        ),
    ),
    Mutation(
        "a lost host's requests in flight left running while its work moves (#24 review)",
        "trio_gym/trainer/dispatch.py",
        "            stream.cancel()",
        "            pass",
        (
            "tests/test_recovery.py::test_a_host_ejected_while_it_lives_has_its_streams_cut_and_runs_nothing_twice",
        ),
    ),
    Mutation(
        "a bug in a batch, keyed or not, escapes its connection's boundary (#24 review, #36)",
        "trio_gym/host/server.py",
        '    except* Exception:\n        log_event("connection_failed"',
        '    except* ZeroDivisionError:\n        log_event("connection_failed"',
        ("tests/test_reattach.py::test_a_bug_in_a_keyed_batch_is_a_500_and_the_host_lives",),
    ),
    Mutation(
        "an answer a cut caller is coming back for dropped over the bytes bound (#24 review)",
        "trio_gym/host/reattach.py",
        "            if age < min(self.grace_s, self.retention_s):\n                break",
        "            if age < 0:\n                break",
        (
            "tests/test_reattach.py::test_an_answer_whose_caller_may_come_back_is_kept_over_the_bytes_bound",
        ),
    ),
    Mutation(
        "a DELETE that finds nothing leaves the key free for a late POST (#24 review)",
        "trio_gym/host/reattach.py",
        "            if self.memory.why(key, now) is None:\n                self.memory.given_up.add(key, now)",
        "            pass",
        (
            "tests/test_reattach.py::test_a_request_given_up_before_it_arrives_is_refused_when_it_does",
            "tests/test_hostile.py::test_deletes_of_unseen_keys_are_remembered_and_a_full_table_refuses_not_forgets",
        ),
    ),
    Mutation(
        "a new Ray call after a restore takes a restored call's id (#24 review)",
        "trio_gym/fleet/ray_actor.py",
        '            call_id = f"{self._prefix}-c{self._next_call}"',
        '            call_id = f"c{self._next_call}"',
        (
            "tests/test_ray.py::test_the_actor_checkpoints_mid_flight_and_a_new_actor_restores_each_row_once",
        ),
    ),
    Mutation(
        "a malformed body escapes as the host's own fault, a 500 (#25 fuzz)",
        "trio_gym/http/messages.py",
        '        except h11.RemoteProtocolError as exc:\n            raise WireError(\n                ErrorCode.INVALID_REQUEST, f"malformed body: {protocol_problem(exc)}"',
        '        except ZeroDivisionError as exc:\n            raise WireError(\n                ErrorCode.INVALID_REQUEST, f"malformed body: {protocol_problem(exc)}"',
        (
            "tests/test_http_fuzz.py::test_mutated_requests_never_kill_the_host_and_each_gets_http_or_a_close",
        ),
    ),
    Mutation(
        "the host stays on pure h11 though h11-mypyc is installed (#25)",
        "trio_gym/http/h11_build.py",
        "        import h11_mypyc as h11",
        "        import h11_mypyc_absent as h11",
        ("tests/test_http_fuzz.py::test_the_build_in_use_is_the_one_installed",),
    ),
    Mutation(
        "a runner's start never runs (capabilities as protocols, #25)",
        "trio_gym/host/lifecycle.py",
        "            elif isinstance(runner, StartingRunner):",
        "            elif False:",
        ("tests/test_runners.py::test_a_user_runner_loaded_by_import_path_runs_end_to_end",),
    ),
    Mutation(
        "a runner that holds something is never closed (capabilities as protocols, #25)",
        "trio_gym/host/lifecycle.py",
        "        if isinstance(self._runner, ClosingRunner):",
        "        if False:",
        (
            "tests/test_runners.py::test_a_runner_that_holds_something_is_closed_once_after_serving_ends",
        ),
    ),
    Mutation(
        "a runner's promise of boundaries ignored (capabilities as protocols, #25)",
        "trio_gym/host/lifecycle.py",
        "        return isinstance(self._runner, BoundaryReporter) and self._runner.reports_boundaries",
        "        return False",
        (
            "tests/test_runners.py::test_only_a_boundary_reporter_is_waited_for_before_its_first_boundary",
        ),
    ),
    Mutation(
        "a change noted wakes its waiters for good: the event is never renewed (#25)",
        "trio_gym/changes.py",
        "        self._event.set()\n        self._event = trio.Event()",
        "        self._event.set()",
        (
            "tests/test_changes.py::test_every_waiter_wakes_at_a_note_and_sleeps_again_until_the_next",
        ),
    ),
    Mutation(
        "a control operation of the protocol's table left unrouted (#25 review)",
        "trio_gym/host/control.py",
        "    FORGET: _forget,\n",
        "",
        (
            "tests/test_checkpoint_rules.py::test_every_operation_of_the_protocols_table_is_routed_and_carried_out",
        ),
    ),
    Mutation(
        "a runner's promise of boundaries ignored when listing restarts (#25 review)",
        "trio_gym/host/episodes.py",
        "        if self._reports_boundaries():\n            return []",
        "        if False:\n            return []",
        (
            "tests/test_runners.py::test_only_a_boundary_reporter_is_waited_for_before_its_first_boundary",
        ),
    ),
    Mutation(
        "#25 an export's files written and fsynced on the trio thread (the host stalls meanwhile)",
        "trio_gym/host/checkpoint.py",
        """await trio.to_thread.run_sync(
                            write_records, directory, server_name, kind, rows
                        )""",
        "write_records(directory, server_name, kind, rows)",
        ("tests/test_checkpoint.py::test_the_host_runs_on_while_an_export_file_is_written",),
    ),
    Mutation(
        "#25 the trainer's manifest written and fsynced on the trio thread, under the ledger lock",
        "trio_gym/trainer/coordinator.py",
        "await trio.to_thread.run_sync(write_manifest, directory, manifest)",
        "write_manifest(directory, manifest)",
        ("tests/test_coordinator.py::test_the_trainer_runs_on_while_its_manifest_is_written",),
    ),
    Mutation(
        "#25 a field's environment variable left out of the table made from the fields",
        "trio_gym/config.py",
        "name: setting.variable for name, setting in SETTINGS.items()",
        'name: setting.variable for name, setting in SETTINGS.items() if name != "port_file"',
        (
            "tests/test_config.py::test_every_field_has_its_own_variable_and_every_flag_sets_its_field",
        ),
    ),
    Mutation(
        "#25 install offered serve's flags, serve only the installer's",
        "trio_gym/cli.py",
        "if not setting.flag or (installer_only and not setting.installer):",
        "if not setting.flag or (installer_only is not setting.installer):",
        (
            "tests/test_config.py::test_every_field_has_its_own_variable_and_every_flag_sets_its_field",
        ),
    ),
    Mutation(
        "#25 a field's description changed and the README's settings table left as it was",
        "trio_gym/config.py",
        'description="TCP port; 0 picks a free one."',
        'description="TCP port."',
        ("tests/test_config.py::test_the_readmes_settings_table_is_made_from_the_fields",),
    ),
    Mutation(
        "#25 a caller's work path not carried into the host's launch environment",
        "trio_gym/config.py",
        """    "job_id",
    "environment_path",
    "work_path",
""",
        """    "job_id",
    "environment_path",
""",
        (
            "tests/test_config.py::test_every_setting_a_caller_shares_with_the_host_reaches_its_environment",
            "tests/test_config.py::test_caller_to_bootstrap_environment_to_serve_config_keeps_every_field",
        ),
    ),
    Mutation(
        "#25 the manifest published in the worker thread, where a resume meanwhile cannot stop it",
        "trio_gym/host/checkpoint.py",
        "await trio.to_thread.run_sync(stage_manifest, staged, manifest)",
        "await trio.to_thread.run_sync(lambda: (stage_manifest(staged, manifest), "
        "publish_manifest(directory, staged)))",
        (
            "tests/test_checkpoint.py::"
            "test_a_resume_while_the_manifest_is_staged_means_it_is_never_published",
        ),
    ),
    Mutation(
        "#25 the manifest published although a resume came while it was staged",
        "trio_gym/host/checkpoint.py",
        "if self.checkpoint_id == checkpoint_id and not export.cancel_called:",
        "if True:",
        (
            "tests/test_checkpoint.py::"
            "test_a_resume_while_the_manifest_is_staged_means_it_is_never_published",
        ),
    ),
    Mutation(
        "#25 the tests' disk clock jumps while a worker thread writes",
        "tests/conftest.py",
        "busy = trio.to_thread.current_default_thread_limiter().borrowed_tokens > 0",
        "busy = False",
        (
            "tests/test_checkpoint.py::test_commit_exports_digested_records_and_a_manifest",
            "tests/test_coordinator.py::"
            "test_a_checkpoint_exports_parked_episodes_drains_the_rest_and_resumes",
        ),
    ),
    Mutation(
        "#25 every valued flag parsed as text, whatever its field's type",
        "trio_gym/cli.py",
        "parser.add_argument(setting.flag, dest=name, type=kind, help=text)",
        "parser.add_argument(setting.flag, dest=name, type=str, help=text)",
        (
            "tests/test_config.py::test_every_field_has_its_own_variable_and_every_flag_sets_its_field",
        ),
    ),
    Mutation(
        "a heartbeat written is not counted (#26)",
        "trio_gym/host/supervision.py",
        "                self.stats.count_beat(late)\n",
        "                pass\n",
        ("tests/test_metrics.py::test_each_metric_moves_as_its_event_happens",),
    ),
    Mutation(
        "a heartbeat's lateness measured from its write, not its due time (#26)",
        "trio_gym/host/supervision.py",
        "        late, self.due = now - self.due, now + self.interval_s\n",
        "        late, self.due = 0.0, now + self.interval_s\n",
        ("tests/test_metrics.py::test_a_heartbeats_lateness_is_measured_from_the_time_it_was_due",),
    ),
    Mutation(
        "a batch answered deadline_exceeded counted as internal (#26)",
        "trio_gym/host/batch_state.py",
        '            self.failed_with = fields.get("code")\n',
        "            self.failed_with = None\n",
        ("tests/test_metrics.py::test_each_metric_moves_as_its_event_happens",),
    ),
    Mutation(
        "a batch whose caller left counted as ok (#26)",
        "trio_gym/host/batch_state.py",
        '            return "caller_gone"\n',
        '            return "ok"\n',
        ("tests/test_metrics.py::test_each_metric_moves_as_its_event_happens",),
    ),
    Mutation(
        "a refused request is not counted (#26)",
        "trio_gym/host/server.py",
        "    services.stats.requests_refused[refusal.code.value] += 1\n",
        "",
        (
            "tests/test_metrics.py::test_each_metric_moves_as_its_event_happens",
            "tests/test_metrics.py::test_a_full_host_still_answers_its_metrics_and_counts_whom_it_refused",
        ),
    ),
    Mutation(
        "a connection refused busy is not counted (#26)",
        "trio_gym/host/server.py",
        '        services.stats.connections_refused["busy"] += 1\n',
        "        pass\n",
        (
            "tests/test_metrics.py::test_a_full_host_still_answers_its_metrics_and_counts_whom_it_refused",
        ),
    ),
    Mutation(
        "a full host refuses its /metrics too (#26)",
        "trio_gym/host/server.py",
        '    if busy and not (head.method == b"GET" and path in WATCHED_WHEN_BUSY):\n',
        "    if busy:\n",
        (
            "tests/test_metrics.py::test_a_full_host_still_answers_its_metrics_and_counts_whom_it_refused",
            "tests/test_hostile.py::test_eight_hundred_concurrent_scrapes_are_all_answered_those_over_the_cap_too",
        ),
    ),
    Mutation(
        "a failure class from outside taken whatever it is (#26)",
        "trio_gym/host/stats.py",
        "        if not isinstance(value, str) or not LABEL_PATTERN.fullmatch(value):\n",
        "        if not isinstance(value, str):\n",
        ("tests/test_metrics.py::test_failure_classes_from_outside_stay_a_bounded_label",),
    ),
    Mutation(
        "failure classes from outside without a bound on how many (#26)",
        "trio_gym/host/stats.py",
        "            if len(self.seen) >= MAX_FOREIGN_LABELS:\n",
        "            if False:\n",
        (
            "tests/test_metrics.py::test_failure_classes_from_outside_stay_a_bounded_label",
            "tests/test_hostile.py::test_a_thousand_failure_classes_keep_the_metrics_bounded_and_every_record_whole",
        ),
    ),
    Mutation(
        "a failed example counted without its failure class (#26)",
        "trio_gym/host/batch.py",
        "            None if failure is None else failure.record.get(FAILURE_CLASS_KEY),\n",
        "            None,\n",
        ("tests/test_metrics.py::test_a_gym_failure_record_is_counted_by_its_class",),
    ),
    Mutation(
        "a stopping host closes its port at once: nobody sees shutting_down (#26)",
        "trio_gym/host/server.py",
        "                    await stats.batch_changes.until(lambda: stats.batches_running == 0)\n",
        "                    await trio.lowlevel.checkpoint()\n",
        ("tests/test_metrics.py::test_metrics_answer_at_every_stage",),
    ),
    Mutation(
        "bytes read from callers are not counted (#26)",
        "trio_gym/http/connection.py",
        "                    self._traffic.read += len(data)\n",
        "                    self._traffic.read += 0\n",
        ("tests/test_metrics.py::test_each_metric_moves_as_its_event_happens",),
    ),
    Mutation(
        "an ejection is not counted (#26)",
        "trio_gym/trainer/scheduler.py",
        "        self.stats.ejections += 1\n",
        "",
        (
            "tests/test_pool.py::test_a_host_killed_mid_batch_fails_only_what_it_had_taken_and_is_replaced",
        ),
    ),
    Mutation(
        "a failed replacement is counted as a replacement (#26)",
        "trio_gym/trainer/scheduler.py",
        "            self.stats.replacements_failed += 1\n",
        "            self.stats.replacements += 1\n",
        ("tests/test_pool.py::test_a_replacement_that_fails_to_start_loses_its_slot_not_the_pool",),
    ),
    Mutation(
        "a chunk given up is not counted by its origin (#26)",
        "trio_gym/trainer/pool.py",
        "        self.stats.chunks_failed[final.origin.value] += 1\n",
        "",
        (
            "tests/test_pool.py::test_a_host_killed_mid_batch_fails_only_what_it_had_taken_and_is_replaced",
        ),
    ),
    Mutation(
        "an aborted checkpoint counted as unavailable (#26)",
        "trio_gym/trainer/coordinator.py",
        '                outcome = "aborted"\n',
        '                outcome = "unavailable"\n',
        (
            "tests/test_coordinator.py::test_a_host_that_cannot_park_makes_the_checkpoint_unavailable_then_aborted",
        ),
    ),
    Mutation(
        "trio-gym run's exporter counts no chunk sent (#26)",
        "trio_gym/trainer/pool.py",
        "        self.stats.chunks_sent += 1\n",
        "",
        ("tests/test_metrics.py::test_trio_gym_run_serves_its_own_metrics_while_it_runs",),
    ),
    Mutation(
        "the live status view scrolls instead of redrawing in place (#26)",
        "trio_gym/trainer/status.py",
        'CLEAR: Final = "\\x1b[H\\x1b[2J"\n',
        'CLEAR: Final = ""\n',
        ("tests/test_metrics.py::test_status_on_a_terminal_refreshes_in_place",),
    ),
    Mutation(
        "trio-gym status --once says all is well while a host is down (#26)",
        "trio_gym/trainer/status.py",
        "        return 0 if all(r.health.status is HealthStatus.READY for r in now) else 1\n",
        "        return 0\n",
        (
            "tests/test_metrics.py::test_status_once_prints_a_line_per_host_and_says_if_any_is_not_ready",
        ),
    ),
    Mutation(
        "a finalizer refusal is not counted as a failure (#26)",
        "trio_gym/runners/finalize.py",
        "            self.counts.failures[op] += 1\n",
        "",
        (
            "tests/test_records.py::test_a_record_gyms_finalizer_cannot_finish_fails_its_row_naming_why",
        ),
    ),
    Mutation(
        "a stopping host still carries out control operations (#26 review)",
        "trio_gym/host/control.py",
        "    if services.lifecycle.shutdown_requested.is_set() and operation is not RESUME:\n",
        "    if False:\n",
        (
            "tests/test_metrics.py::test_a_stopping_host_carries_out_no_control_operation_but_a_resume",
        ),
    ),
    Mutation(
        "a stopping host refuses even the resume that lets go (#26 review)",
        "trio_gym/host/control.py",
        "    if services.lifecycle.shutdown_requested.is_set() and operation is not RESUME:\n",
        "    if services.lifecycle.shutdown_requested.is_set():\n",
        (
            "tests/test_metrics.py::test_a_stopping_host_carries_out_no_control_operation_but_a_resume",
        ),
    ),
    Mutation(
        "the stage gauge lists only the current stage: a host that left ready has no 0 (#26 review)",
        "trio_gym/host/metrics.py",
        "            STAGES,\n",
        "            [lifecycle.stage],\n",
        ("tests/test_metrics.py::test_metrics_answer_at_every_stage",),
    ),
    Mutation(
        "a component choice extends the orchestrator's config_paths instead of replacing them (#27)",
        "trio_gym/runners/gym.py",
        "    if selection is None:\n        paths.extend(own)\n",
        "    paths.extend(own)\n    if selection is None:\n        pass\n",
        (
            "tests/test_gym_runner.py::test_a_component_choice_replaces_the_orchestrators_config_paths_by_the_upstream_rule",
            "tests/test_gym_real.py::test_a_choice_of_the_packages_own_components_replaces_the_orchestrators_config_paths",
        ),
    ),
    Mutation(
        "a component choice adds the agent config though the package declares the agent (#27)",
        "trio_gym/runners/gym.py",
        '    if selection["agent_instance"] not in package.agents:\n',
        '    if selection.get("agent_config") or selection["agent_instance"] not in package.agents:\n',
        (
            "tests/test_gym_runner.py::test_a_component_choice_replaces_the_orchestrators_config_paths_by_the_upstream_rule",
        ),
    ),
    Mutation(
        "a temp directory too long for Ray's sockets is left for Ray to fail on (#27)",
        "trio_gym/runners/gym.py",
        "    if len(longest.encode()) > UNIX_SOCKET_PATH_LIMIT:\n",
        "    if False:\n",
        (
            "tests/test_gym_runner.py::test_a_ray_temp_directory_too_long_for_its_sockets_is_refused_naming_it",
            "tests/test_gym_real.py::test_a_temp_directory_too_long_for_rays_sockets_fails_the_start_naming_it",
        ),
    ),
    Mutation(
        "a component choice leaves out the resources server the package lacks (#27)",
        "trio_gym/runners/gym.py",
        '    if selection["resources_server_instance"] not in package.resources_servers:\n',
        "    if False:\n",
        (
            "tests/test_gym_runner.py::test_a_component_choice_replaces_the_orchestrators_config_paths_by_the_upstream_rule",
            "tests/test_gym_real.py::test_a_choice_of_the_packages_agent_and_the_images_resources_server_loads_the_images",
        ),
    ),
    Mutation(
        "DELETEs of keys never seen kept among the keys that ran, in one bounded list (#36)",
        "trio_gym/host/reattach.py",
        "                self.memory.given_up.add(key, now)",
        "                self.memory.ran.add(key, Gone.GIVEN_UP_BEFORE)",
        (
            "tests/test_keys.py::test_an_expired_key_stays_refused_after_any_number_of_deletes_and_posts_of_other_keys",
        ),
        also=(
            (
                "trio_gym/host/keys.py",
                "        ran_capacity: int = 1 << 20,\n        ran_segment: int = 1 << 14,",
                "        ran_capacity: int = 4096,\n        ran_segment: int = 64,",
            ),
        ),
    ),
    Mutation(
        "a DELETE that cannot be remembered makes room by forgetting another (#36)",
        "trio_gym/host/keys.py",
        "        if len(self._until) >= self._capacity:\n",
        "        if len(self._until) >= self._capacity:\n            self._until.popitem(last=False)\n        if False:\n",
        (
            "tests/test_keys.py::test_a_delete_that_cannot_be_remembered_is_refused_and_evicts_nothing",
            "tests/test_hostile.py::test_deletes_of_unseen_keys_are_remembered_and_a_full_table_refuses_not_forgets",
        ),
    ),
    Mutation(
        "a key that ran is looked up only among the newest keys remembered (#36)",
        "trio_gym/host/keys.py",
        "        for digests, reasons in reversed(self._segments):  # the newest first",
        "        for digests, reasons in list(self._segments)[-1:]:",
        (
            "tests/test_keys.py::test_keys_that_ran_are_forgotten_oldest_first_and_only_as_more_keys_run",
        ),
    ),
    Mutation(
        "a key whose batch was cut before its answer ended runs again (#36)",
        "trio_gym/host/reattach.py",
        "        if ran:\n            self.memory.ran.add(",
        "        if False:\n            self.memory.ran.add(",
        (
            "tests/test_reattach.py::test_a_keyed_batch_no_caller_comes_back_for_is_cancelled_at_its_grace",
        ),
    ),
    Mutation(
        "keys decoded lossily, any bytes taken (#36)",
        "trio_gym/host/keys.py",
        "    if not 1 <= len(key) <= MAX_KEY_LENGTH or not _KEY_BYTES.issuperset(key):",
        "    if not 1 <= len(key) <= MAX_KEY_LENGTH:",
        (
            "tests/test_keys.py::test_a_key_outside_visible_ascii_is_refused_naming_the_rule_never_its_bytes",
            "tests/test_keys.py::test_two_keys_that_differ_in_one_byte_are_two_keys_or_both_refused",
            "tests/test_hostile.py::test_keys_outside_the_alphabet_are_refused_naming_the_rule_and_run_nothing",
            "tests/test_hostile.py::test_100000_hostile_requests_leave_the_host_serving_bounded_and_discreet",
        ),
        also=(
            (
                "trio_gym/host/keys.py",
                '    return key.decode("ascii")',
                '    return key.decode("ascii", "replace")',
            ),
        ),
    ),
    Mutation(
        "a refusal quotes the key escaped, not as sent (#36)",
        "trio_gym/host/reattach.py",
        '                f"Idempotency-Key: {key} belongs to another request',
        '                f"Idempotency-Key: {key!r} belongs to another request',
        ("tests/test_keys.py::test_a_refusal_quotes_the_key_as_it_was_sent",),
    ),
    Mutation(
        "batches not bounded by max_batches (#36)",
        "trio_gym/host/rollouts.py",
        "        services.check_batch_room()  # then nothing waits until it is counted\n",
        "",
        (
            "tests/test_reattach.py::test_keyed_batches_whose_callers_hung_up_after_the_head_never_run_more_than_the_limit",
            "tests/test_reattach.py::test_health_says_busy_while_every_batch_that_may_run_runs",
            "tests/test_hostile.py::test_six_thousand_keyed_posts_half_abandoned_never_run_more_than_max_batches",
            "tests/test_hostile.py::test_100000_hostile_requests_leave_the_host_serving_bounded_and_discreet",
        ),
    ),
    Mutation(
        "/health says ready while every batch that may run runs (#36)",
        "trio_gym/host/server.py",
        "    if status == 200:\n        try:\n            services.check_batch_room()",
        "    if False:\n        try:\n            services.check_batch_room()",
        ("tests/test_reattach.py::test_health_says_busy_while_every_batch_that_may_run_runs",),
    ),
    Mutation(
        "a keyed batch holds its caller's socket (and connection place) until the batch ends (#36)",
        "trio_gym/host/reattach.py",
        "        await conn.close()  # its part is over; the batch runs on in this task",
        "        pass",
        (
            "tests/test_reattach.py::test_keyed_batches_whose_callers_hung_up_after_the_head_never_run_more_than_the_limit",
        ),
    ),
    Mutation(
        "a batch's lines do not name its key (#36)",
        "trio_gym/host/batch_state.py",
        '        named: dict[str, Any] = {"key": self.key} if self.key is not None else {}',
        "        named: dict[str, Any] = {}",
        (
            "tests/test_reattach.py::test_every_line_of_a_keyed_batch_names_its_batch_and_key_until_its_one_end",
        ),
    ),
    Mutation(
        "a keyed caller's lines name its key but not its batch (#36)",
        "trio_gym/host/reattach.py",
        '            log_event("keyed_caller_left", batch=batch.batch.id, key=batch.key, why=str(lost))',
        '            log_event("keyed_caller_left", key=batch.key, why=str(lost))',
        (
            "tests/test_reattach.py::test_every_line_of_a_keyed_batch_names_its_batch_and_key_until_its_one_end",
        ),
    ),
    Mutation(
        "a DELETE waits for the batch's attached callers to go (#36)",
        "trio_gym/host/reattach.py",
        "            while batch.callers and not batch.batch.given_up:",
        "            while batch.callers:",
        (
            "tests/test_reattach.py::test_a_delete_gives_a_batch_up_at_once_even_while_a_caller_reads_it",
        ),
    ),
    Mutation(
        "a caller without the host's identity is served (#36)",
        "trio_gym/host/server.py",
        "    if not presented:\n        return False",
        "    if not presented:\n        return True",
        (
            "tests/test_reach.py::test_a_host_with_an_identity_refuses_another_naming_neither_and_says_its_digest",
            "tests/test_keys.py::test_a_host_with_an_identity_takes_no_delete_and_remembers_nothing_from_a_stranger",
            "tests/test_neighbour.py::test_a_neighbour_without_the_identity_runs_cancels_and_learns_nothing_but_ready",
            "tests/test_secrets.py::test_an_in_process_host_never_answers_or_logs_a_piece_of_its_identity_or_token",
            "tests/test_hostile.py::test_100000_hostile_requests_leave_the_host_serving_bounded_and_discreet",
            "tests/test_hostile.py::test_bad_identities_and_tokens_are_refused_on_every_route_and_run_nothing",
        ),
    ),
    Mutation(
        "a stranger's /health says all a holder's does (#36)",
        "trio_gym/host/server.py",
        "            return partial(_answer_health_to_stranger, busy=busy)",
        "            return _answer_health",
        (
            "tests/test_reach.py::test_a_host_with_an_identity_refuses_another_naming_neither_and_says_its_digest",
            "tests/test_neighbour.py::test_a_neighbour_without_the_identity_runs_cancels_and_learns_nothing_but_ready",
            "tests/test_hostile.py::test_bad_identities_and_tokens_are_refused_on_every_route_and_run_nothing",
        ),
    ),
    Mutation(
        "a refused header line quoted whole (#36)",
        "trio_gym/http/messages.py",
        "    problem = protocol_problem(exc)",
        "    problem = str(exc)",
        (
            "tests/test_host_wire.py::test_a_refused_header_line_is_named_never_quoted_in_the_answer_or_the_log",
            "tests/test_secrets.py::test_an_in_process_host_never_answers_or_logs_a_piece_of_its_identity_or_token",
            "tests/test_secrets.py::test_a_host_process_never_answers_or_prints_a_piece_of_its_identity_or_token",
            "tests/test_hostile.py::test_100000_hostile_requests_leave_the_host_serving_bounded_and_discreet",
            "tests/test_hostile.py::test_bad_identities_and_tokens_are_refused_on_every_route_and_run_nothing",
        ),
    ),
    Mutation(
        "a path echoed whole in a 404 (#36)",
        "trio_gym/host/server.py",
        '            f"no such path {shown(path.encode())}; this host serves GET /health, GET /metrics "',
        '            f"no such path {path}; this host serves GET /health, GET /metrics "',
        (
            "tests/test_host_wire.py::test_a_refusal_echoes_a_bounded_escaped_piece_of_what_the_caller_sent",
        ),
    ),
    Mutation(
        "every validation problem listed, however many (#36)",
        "trio_gym/errors.py",
        "    shown_problems = problems[:MAX_PROBLEMS_SHOWN]",
        "    shown_problems = problems",
        (
            "tests/test_host_wire.py::test_a_refusal_echoes_a_bounded_escaped_piece_of_what_the_caller_sent",
        ),
    ),
    Mutation(
        "an identity or token no header can carry accepted at start (#36)",
        "trio_gym/config.py",
        "        if value and not travels_in_a_header(value):",
        "        if False:",
        (
            "tests/test_config.py::test_an_identity_or_token_no_header_can_carry_is_refused_at_start_never_shown",
            "tests/test_secrets.py::test_serve_refuses_a_secret_ending_in_a_cr_at_start_and_shows_it_redacted",
        ),
    ),
    Mutation(
        "kept answers counted by their bytes alone (#36)",
        "trio_gym/host/reattach.py",
        "        return self.log.size + ANSWER_OVERHEAD_BYTES",
        "        return self.log.size",
        ("tests/test_reattach.py::test_finished_answers_beyond_the_bytes_kept_go_oldest_first",),
    ),
    Mutation(
        "a request carrying another identity taken as the holder's (#36)",
        "trio_gym/host/server.py",
        "    if not all([hmac.compare_digest(value, expected) for value in presented]):  # each compared",
        "    if False:",
        (
            "tests/test_neighbour.py::test_a_neighbour_without_the_identity_runs_cancels_and_learns_nothing_but_ready",
            "tests/test_hostile.py::test_bad_identities_and_tokens_are_refused_on_every_route_and_run_nothing",
        ),
    ),
    Mutation(
        "one right identity among wrong ones lets a request in (#36)",
        "trio_gym/host/server.py",
        "    if not all([hmac.compare_digest(value, expected) for value in presented]):  # each compared",
        "    if not any([hmac.compare_digest(value, expected) for value in presented]):",
        (
            "tests/test_hostile.py::test_bad_identities_and_tokens_are_refused_on_every_route_and_run_nothing",
        ),
    ),
    Mutation(
        "an empty identity taken as another host's (#36)",
        "trio_gym/host/server.py",
        "if name == _IDENTITY_HEADER and value]",
        "if name == _IDENTITY_HEADER]",
        (
            "tests/test_neighbour.py::test_a_neighbour_without_the_identity_runs_cancels_and_learns_nothing_but_ready",
        ),
    ),
    Mutation(
        "a stranger's DELETE is carried out (#36)",
        "trio_gym/host/server.py",
        "    if not holder:\n        if head.method",
        '    if not holder and head.method != b"DELETE":\n        if head.method',
        (
            "tests/test_neighbour.py::test_a_neighbour_without_the_identity_runs_cancels_and_learns_nothing_but_ready",
        ),
    ),
    Mutation(
        "a stranger may read /metrics (#36)",
        "trio_gym/host/server.py",
        '        if head.method == b"GET" and path == HEALTH_PATH:',
        '        if head.method == b"GET" and path in (HEALTH_PATH, METRICS_PATH):',
        (
            "tests/test_neighbour.py::test_a_neighbour_without_the_identity_runs_cancels_and_learns_nothing_but_ready",
            "tests/test_hostile.py::test_bad_identities_and_tokens_are_refused_on_every_route_and_run_nothing",
        ),
    ),
    Mutation(
        "one batch over max_batches let in (#36)",
        "trio_gym/host/state.py",
        "        if self.stats.batches_running >= limit:",
        "        if self.stats.batches_running > limit:",
        (
            "tests/test_hostile.py::test_six_thousand_keyed_posts_half_abandoned_never_run_more_than_max_batches",
        ),
    ),
    Mutation(
        "a DELETE while the body is still checked frees the key (#36 review)",
        "trio_gym/host/reattach.py",
        "        ran = batch.batch.ran or batch.batch.given_up  # a DELETE answered is a promise too",
        "        ran = batch.batch.ran",
        (
            "tests/test_reattach.py::test_a_delete_while_the_body_is_still_checked_keeps_the_batch_from_ever_running",
        ),
    ),
    Mutation(
        "a keyed batch's callers not watched: one that hung up is seen at the next heartbeat (#36)",
        "trio_gym/host/reattach.py",
        "        await _watched(conn, probe, partial(_copy_until_ended, log, body))",
        "        await _copy_until_ended(log, body)",
        (
            "tests/test_hostile.py::test_a_keyed_batch_whose_caller_hangs_up_is_given_up_once_the_grace_has_passed",
        ),
    ),
    Mutation(
        "caller bytes echoed without bound (#36)",
        "trio_gym/errors.py",
        "def shown(data: bytes, limit: int = 100) -> str:",
        "def shown(data: bytes, limit: int = 1_000_000) -> str:",
        (
            "tests/test_hostile.py::test_100000_hostile_requests_leave_the_host_serving_bounded_and_discreet",
        ),
    ),
    Mutation(
        "a refused header line's value shown (#36)",
        "trio_gym/http/messages.py",
        '                f"carry{hint}; its value is not shown"',
        '                f"carry{hint}; its value is {shown(value)}"',
        (
            "tests/test_secrets.py::test_an_in_process_host_never_answers_or_logs_a_piece_of_its_identity_or_token",
            "tests/test_secrets.py::test_a_host_process_never_answers_or_prints_a_piece_of_its_identity_or_token",
        ),
    ),
    Mutation(
        "the client sends a header value HTTP cannot carry, and h11 quotes it (#36)",
        "trio_gym/http/client.py",
        "    for name, value in headers:\n        if not travels_in_a_header(value):",
        "    for name, value in ():\n        if not travels_in_a_header(value):",
        (
            "tests/test_secrets.py::test_a_client_refuses_a_header_value_that_cannot_travel_naming_the_header_not_the_value",
        ),
    ),
    Mutation(
        "trio-gym status presents no identity (#36)",
        "trio_gym/trainer/status.py",
        "                headers=handle.request_headers(),",
        "                headers=(),",
        (
            "tests/test_neighbour.py::test_a_neighbour_without_the_identity_runs_cancels_and_learns_nothing_but_ready",
            "tests/test_metrics.py::test_status_reads_a_host_launched_with_an_identity_as_its_holder_only",
        ),
    ),
    Mutation(
        "status says a wrong identity is wrong (#36)",
        "trio_gym/trainer/status.py",
        "            elif response.status == DEFAULT_STATUS[ErrorCode.WRONG_HOST]:",
        "            elif False:",
        (
            "tests/test_metrics.py::test_status_reads_a_host_launched_with_an_identity_as_its_holder_only",
        ),
    ),
    Mutation(
        "a departed caller noticed only at the next heartbeat: never probed (#36)",
        "trio_gym/host/reattach.py",
        "            probe = partial(body.send, log.heartbeat)",
        "            probe = None",
        (
            "tests/test_reattach.py::test_a_keyed_batch_no_caller_comes_back_for_is_cancelled_at_its_grace",
        ),
    ),
    Mutation(
        "trio-gym status shows a bad identity file's content (#36)",
        "trio_gym/trainer/hosts.py",
        '            "(its content is not shown)"',
        '            f"(it holds {identity!r})"',
        (
            "tests/test_secrets.py::test_status_refuses_an_identity_file_that_cannot_travel_without_showing_it",
        ),
    ),
    Mutation(
        "a batch given up while its body is checked runs all the same (#36 review)",
        "trio_gym/host/batch_state.py",
        "        if self.given_up:\n            raise answer_expired(",
        "        if False:\n            raise answer_expired(",
        (
            "tests/test_reattach.py::test_a_delete_while_the_body_is_still_checked_keeps_the_batch_from_ever_running",
        ),
    ),
    Mutation(
        "a keyed caller over HTTP/1.0 not watched until its answer's end (#36 review)",
        "trio_gym/host/reattach.py",
        "        await _watched(conn, None, partial(_until_begun, log))",
        "        await _until_begun(log)",
        (
            "tests/test_hostile.py::test_a_keyed_batch_whose_caller_hangs_up_is_given_up_once_the_grace_has_passed",
        ),
    ),
    Mutation(
        "a refused example's own text echoed whole (#36 review)",
        "trio_gym/host/rollouts.py",
        'f"examples[{index}]: {bounded(str(exc))}"',
        'f"examples[{index}]: {exc}"',
        (
            "tests/test_host_wire.py::test_a_refused_example_is_named_with_a_bounded_piece_of_what_it_holds",
        ),
        also=(
            (
                "trio_gym/host/rollouts.py",
                'f"({bounded(episode.capture_key, 200)}); give each row',
                'f"({episode.capture_key}); give each row',
            ),
        ),
    ),
    Mutation(
        "a bug after a keyed answer ended cuts its first caller, and the batch is never filed (#36 review)",
        "trio_gym/host/reattach.py",
        "            except Exception as exc:  # not yet: the first caller still gets what the log has",
        "            except ZeroDivisionError as exc:",
        (
            "tests/test_reattach.py::test_a_bug_after_a_keyed_answer_ended_still_delivers_it_and_keeps_it",
        ),
        also=(
            (
                "trio_gym/host/reattach.py",
                "        finally:\n            self._ended(batch)",
                "        else:\n            self._ended(batch)",
            ),
        ),
    ),
    Mutation(
        "a keyed batch of no examples kept and remembered (#36 review)",
        "trio_gym/host/batch_state.py",
        "        return self.state is not BatchState.ACCEPTED and self.size > 0",
        "        return self.state is not BatchState.ACCEPTED",
        ("tests/test_reattach.py::test_a_keyed_batch_of_no_examples_is_answered_and_not_kept",),
    ),
    Mutation(
        "trio-gym run presents no identity to the hosts it is given (#36)",
        "trio_gym/fleet/spread.py",
        '            HostHandle(f"host-{index}", url, identity=identity) for index, url in enumerate(urls)',
        '            HostHandle(f"host-{index}", url) for index, url in enumerate(urls)',
        (
            "tests/test_run_command.py::test_run_presents_the_identity_in_its_file_to_hosts_launched_with_one",
        ),
        also=(
            (
                "trio_gym/fleet/spread.py",
                "url, client_settings, progress=progress, stats=stats, identity=identity",
                "url, client_settings, progress=progress, stats=stats",
            ),
        ),
    ),
    Mutation(
        "a starting deployment looked at after a growing backoff (#37)",
        "trio_gym/runners/deployment.py",
        "            await trio.sleep(START_POLL_S)",
        "            await trio.sleep(5.0)",
        (
            "tests/test_gym_runner.py::test_a_starting_deployment_is_seen_up_within_a_poll_and_its_wait_logged_once",
        ),
    ),
    Mutation(
        "a starting deployment's wait logged at every look (#37)",
        "trio_gym/runners/deployment.py",
        "                if str(exc) != reason:",
        "                if True:",
        (
            "tests/test_gym_runner.py::test_a_starting_deployment_is_seen_up_within_a_poll_and_its_wait_logged_once",
        ),
    ),
    Mutation(
        "Docker hosts get no mounts (#37)",
        "trio_gym/fleet/docker.py",
        "*publish, *binds,",
        "*publish,",
        (
            "tests/test_gym_sandboxed.py::test_a_sandboxed_gym_answers_through_the_platform_as_gyms_own_collection_does[docker]",
        ),
    ),
    Mutation(
        "OpenSandbox sandboxes get no volumes (#37)",
        "trio_gym/fleet/opensandbox.py",
        "volumes=volumes or None,",
        "volumes=None,",
        (
            "tests/test_opensandbox.py::test_hosts_run_in_sandboxes_and_are_killed_when_the_block_ends",
            "tests/test_gym_sandboxed.py::test_a_sandboxed_gym_answers_through_the_platform_as_gyms_own_collection_does[opensandbox]",
        ),
    ),
    Mutation(
        "a mount is read-write unless said (#37)",
        "trio_gym/fleet/launch.py",
        "    read_only: bool = True\n",
        "    read_only: bool = False\n",
        (
            "tests/test_opensandbox.py::test_hosts_run_in_sandboxes_and_are_killed_when_the_block_ends",
        ),
    ),
    Mutation(
        "Gym's per-server builds not given the venv's base interpreter (#37)",
        "trio_gym/runners/gym.py",
        "        *venv_home(python),\n",
        "",
        (
            "tests/test_gym_sandboxed.py::test_offline_a_packages_server_venv_is_built_in_the_sandbox_from_wheelhouses_alone[docker]",
        ),
    ),
    Mutation(
        "an unreachable index is not named first (#37)",
        "trio_gym/runners/gym.py",
        '                        failure = f"{cause}\\n{failure}"',
        "                        pass",
        (
            "tests/test_gym_sandboxed.py::test_without_offline_the_unreachable_index_fails_the_start_naming_it_and_the_switch[docker]",
        ),
    ),
    Mutation(
        "Gym's output forgets its first index failure once past the tail (#37)",
        "trio_gym/processes/tree.py",
        "OutputTail(name, remember=remember)",
        "OutputTail(name)",
        (
            "tests/test_gym_sandboxed.py::test_without_offline_the_unreachable_index_fails_the_start_naming_it_and_the_switch[docker]",
        ),
    ),
    Mutation(
        "an offline host's uv output taken for an unreachable index (#37)",
        "trio_gym/runners/gym.py",
        'if found is None or env.get("UV_OFFLINE", "").lower() in ("1", "true", "yes"):',
        "if found is None:",
        (
            "tests/test_gym_runner.py::test_an_unreachable_index_is_one_line_naming_it_the_server_and_the_switch",
        ),
    ),
]


class Verdict(NamedTuple):
    caught: bool
    why: str


def verdict(returncode: int | None, output: str, tests: Sequence[str]) -> Verdict:
    """Whether pytest's run of ``tests`` caught the mutation.

    Only a run that *failed* (exit 1) with at least one named test among its failures is a
    catch. A renamed test id (exit 4), a collection or syntax error (exit 2), an interruption
    or a hang (``returncode`` None) say the check is stale or broken, not that it guards the
    rule; a failure of some other test says nothing about this one.
    """
    if returncode is None:
        return Verdict(False, "hung: pytest did not finish in time")
    if returncode != 1:
        return Verdict(False, f"pytest exited {returncode}, not 1: a stale or broken check")
    failed = {line.split()[1] for line in output.splitlines() if line.startswith("FAILED ")}
    named = [t for t in tests if any(f == t or f.startswith(f"{t}[") for f in failed)]
    if not named:
        return Verdict(False, f"none of the named tests failed (failed: {sorted(failed)})")
    return Verdict(True, f"{len(named)} of {len(tests)} named test(s) failed")


def run(mutation: Mutation) -> bool:
    """True if the named tests failed under the mutation (the rule is guarded)."""
    with tempfile.TemporaryDirectory(prefix="trio-gym-mutation-") as scratch:
        copy = Path(scratch) / "checkout"
        shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".git", ".venv", "*.egg-info"))
        for file, old, new in ((mutation.file, mutation.old, mutation.new), *mutation.also):
            target = copy / file
            source = target.read_text()
            if source.count(old) != 1:
                print(f"STALE   {mutation.name}\n        {old!r} is not in {file} exactly once")
                return False
            target.write_text(source.replace(old, new))
        # A temporary base of its own: pytest prunes all but the newest few base directories
        # under the shared default, which would delete the files of a suite running meanwhile.
        basetemp = f"--basetemp={Path(scratch) / 'pytest'}"
        command = [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", basetemp]
        try:
            result = subprocess.run(
                [*command, *mutation.tests],
                cwd=copy,
                capture_output=True,
                text=True,
                timeout=TEST_TIMEOUT_S,
                check=False,
            )
            returncode, output = result.returncode, result.stdout
        except subprocess.TimeoutExpired:
            returncode, output = None, ""
        summary = output.strip().splitlines()[-1] if output.strip() else ""
        judged = verdict(returncode, output, mutation.tests)
        label = "CAUGHT" if judged.caught else "MISSED"
        print(f"{label}  {mutation.name}\n        {judged.why}; {summary}")
        return judged.caught


def main() -> int:
    wanted = sys.argv[1] if len(sys.argv) > 1 else ""
    chosen = [m for m in MUTATIONS if wanted in m.name]
    missed = [m.name for m in chosen if not run(m)]
    print(f"\n{len(chosen) - len(missed)} of {len(chosen)} mutations caught")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
