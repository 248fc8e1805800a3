"""The results document built as examples finish: exact size limit, deterministic errors."""

from __future__ import annotations

from typing import Any

import pytest

from trio_gym.errors import WireError
from trio_gym.host.batch import ResultsDocument, ResultsInfo

INFO = ResultsInfo(job_id="j", environment_path="e", work_path="w")


def document(results: list[Any], max_bytes: int, order: list[int] | None = None) -> bytes:
    built = ResultsDocument(len(results), INFO, max_bytes)
    for index in order if order is not None else range(len(results)):
        built.add(index, results[index])
    return b"".join(built.pieces())


def test_the_limit_is_exact_to_the_byte() -> None:
    results = [{"a": 1}, {"b": 2}, {"c": "x" * 100}]
    whole = document(results, 10**9)
    assert document(results, len(whole)) == whole  # exactly at the limit: accepted
    with pytest.raises(WireError) as refused:
        document(results, len(whole) - 1)
    assert refused.value.code.value == "payload_too_large"


@pytest.mark.parametrize("order", [[0, 1, 2], [2, 1, 0], [1, 2, 0]])
def test_a_result_that_is_not_json_wins_whatever_finished_first(order: list[int]) -> None:
    results = [{"big": "y" * 1000}, {"x": float("nan")}, {"z": {1, 2}}]
    with pytest.raises(WireError) as refused:
        document(results, 500, order)
    assert refused.value.code.value == "internal"
    assert "the result of example 1 is not JSON" in refused.value.message


def test_results_come_back_in_input_order_whatever_finished_first() -> None:
    results = [{"n": n} for n in range(4)]
    assert document(results, 10**9, [3, 1, 0, 2]) == document(results, 10**9)
