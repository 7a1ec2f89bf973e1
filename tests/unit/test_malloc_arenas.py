"""The stage server caps glibc's heap arenas before its threads allocate, unless the
operator set ``MALLOC_ARENA_MAX`` (glibc reads that itself)."""

from __future__ import annotations

import platform

import pytest

from services.stage_server.__main__ import limit_malloc_arenas


def test_the_operator_s_malloc_arena_max_wins(monkeypatch):
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert limit_malloc_arenas() is False


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt(M_ARENA_MAX) is glibc's")
def test_on_glibc_the_cap_is_set(monkeypatch):
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    assert limit_malloc_arenas(2) is True
