"""``shared.http.from_any_replica``: the first replica that answers; a busy one (503
overloaded with Retry-After) asked again after its delay while the deadline lasts; any
other failure rules a replica out."""

from __future__ import annotations

import asyncio

from shared.errors import RemoteError
from shared.http import from_any_replica


def busy(url: str, retry_after_s: float | None = 0.0) -> RemoteError:
    return RemoteError(url, 503, "overloaded", "compute queue full", retry_after_s=retry_after_s)


def scripted(replies: dict[str, list]):
    """fetch(url) pops the next reply of that url: an exception is raised, a value returned."""
    calls: list[str] = []

    async def fetch(url: str):
        calls.append(url)
        reply = replies[url].pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply

    return fetch, calls


def run(urls, fetch, deadline_s=5.0):
    errors: list[tuple[str, str]] = []
    result = asyncio.run(
        from_any_replica(urls, fetch, deadline_s=deadline_s, on_error=lambda url, exc: errors.append((url, exc.code)))
    )
    return result, errors


def test_the_first_replica_that_answers_gives_it():
    fetch, calls = scripted(
        {"a": [RemoteError("a", None, "unreachable", "refused")], "b": ["state of b"], "c": ["state of c"]}
    )
    result, errors = run(["a", "b", "c"], fetch)
    assert result == "state of b" and calls == ["a", "b"] and errors == [("a", "unreachable")]


def test_a_busy_replica_is_asked_again_and_a_failed_one_is_not():
    fetch, calls = scripted(
        {"a": [busy("a"), busy("a"), "state of a"], "b": [RemoteError("b", 500, "internal", "boom")]}
    )
    result, errors = run(["a", "b"], fetch)
    assert result == "state of a"
    assert calls == ["a", "b", "a", "a"]  # b's 500 ruled it out after the first round
    assert errors == [("a", "overloaded"), ("b", "internal"), ("a", "overloaded")]


def test_a_busy_refusal_without_retry_after_and_a_draining_server_are_not_asked_again():
    draining = RemoteError("b", 503, "draining", "shutting down", retry_after_s=1.0)
    fetch, calls = scripted({"a": [busy("a", retry_after_s=None)], "b": [draining]})
    assert run(["a", "b"], fetch) == (None, [("a", "overloaded"), ("b", "draining")])
    assert calls == ["a", "b"]


def test_no_retry_past_the_deadline():
    fetch, calls = scripted({"a": [busy("a", retry_after_s=30.0), "too late"]})
    result, errors = run(["a"], fetch, deadline_s=1.0)
    assert result is None and calls == ["a"] and errors == [("a", "overloaded")]
