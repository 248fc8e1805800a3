"""The error vocabulary's helpers that every room shares."""

from __future__ import annotations

import pytest
import trio

from trio_gym.errors import raise_unwrapped


class Expected(Exception):
    pass


async def _fail(exc: BaseException) -> None:
    raise exc


async def _nursery_failing_with(*errors: BaseException) -> None:
    async with trio.open_nursery() as nursery:
        for error in errors:
            nursery.start_soon(_fail, error)


async def test_a_single_error_surfaces_as_itself_with_its_own_cause() -> None:
    cause = OSError("disk full")
    error = Expected("the write failed")
    error.__cause__ = cause
    with pytest.raises(Expected) as raised:
        try:
            await _nursery_failing_with(error)
        except ExceptionGroup as group:
            raise_unwrapped(group)
    assert raised.value is error and raised.value.__cause__ is cause
    assert raised.value.__suppress_context__  # the group it came in is not shown


async def test_several_alike_errors_surface_as_the_first_naming_the_others() -> None:
    with pytest.raises(Expected) as raised:
        try:
            await _nursery_failing_with(Expected("host a"), Expected("host b"))
        except ExceptionGroup as group:
            raise_unwrapped(group, alike=Expected)
    others = {"host a", "host b"} - {str(raised.value)}
    assert raised.value.__notes__ == [f"also: Expected: {other}" for other in others]


async def test_errors_of_different_kinds_stay_the_whole_group() -> None:
    with pytest.raises(ExceptionGroup) as raised:
        try:
            await _nursery_failing_with(Expected("one"), ValueError("a bug"))
        except ExceptionGroup as group:
            raise_unwrapped(group, alike=Expected)
    assert sorted(type(exc).__name__ for exc in raised.value.exceptions) == [
        "Expected",
        "ValueError",
    ]
