"""Arena cap and trim of the native heap: callable in any process, never an error."""

from __future__ import annotations

import ctypes.util
import platform

import pytest

from kvmesh.native_memory import limit_arenas, malloc_trim


def test_off_means_untouched() -> None:
    assert limit_arenas(0) is False


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc" or not ctypes.util.find_library("c"), reason="glibc only")
def test_glibc_accepts_the_cap_and_the_trim() -> None:
    assert limit_arenas(2) is True
    blobs = [bytearray(256 * 1024) for _ in range(64)]   # heap memory to give back
    del blobs
    assert isinstance(malloc_trim(), bool)
