"""The block checksum of the offload path: XXH3-64 (seed 0), whole or piece by piece.

Every block the store holds carries one checksum, made by whoever wrote it and checked by
whoever reads it (clients by default, the disk tier on every read). It was CRC32C; XXH3 is
much faster on the hosts measured (docs/bench-history.md) and a verified shm get
checksums every byte it copies, so the checksum is a large share of a get's time.

The streaming form gives the same digest as the one-shot form over the concatenated
pieces, so a block checksummed piece by piece (the copy loop, in the destination)
matches one checksummed whole (the gRPC stream, the disk tier). The ``xxhash`` package holds
the GIL while it hashes; the copy loop runs on two threads and only the copy
(``ctypes.memmove``) would then overlap, so ``PieceHasher`` calls the same XXH3 functions
through ctypes, which releases the GIL, when the package's extension exports them (the
xxhash 4.1 wheels do); otherwise it falls back to the package's own streaming object.
"""

from __future__ import annotations

import ctypes
import logging

import xxhash

log = logging.getLogger(__name__)

BytesLike = bytes | bytearray | memoryview


def block_checksum(data: BytesLike) -> int:
    """XXH3-64 of ``data``: the checksum a block is stored, sent and verified with."""
    return xxhash.xxh3_64_intdigest(data)


def _load_xxh3() -> tuple[ctypes.CDLL, ctypes._CFuncPtr] | None:
    """The extension's XXH3 functions, and its ``update`` that picks AVX2/AVX-512 at run time.

    The wheels build xxhash with its x86 dispatcher: the plain ``XXH3_64bits_update`` is the
    SSE2 baseline (half the speed here), ``XXH3_64bits_update_dispatch`` what the package's
    own methods call. Reset and digest have no dispatched form (they touch a few bytes)."""
    try:
        lib = ctypes.CDLL(xxhash._xxhash.__file__)
        lib.XXH3_createState.restype = ctypes.c_void_p
        lib.XXH3_createState.argtypes = []
        lib.XXH3_freeState.argtypes = [ctypes.c_void_p]
        lib.XXH3_64bits_reset.argtypes = [ctypes.c_void_p]
        lib.XXH3_64bits_digest.argtypes = [ctypes.c_void_p]
        lib.XXH3_64bits_digest.restype = ctypes.c_uint64
        update = getattr(lib, "XXH3_64bits_update_dispatch", None) or lib.XXH3_64bits_update
        update.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    except (OSError, AttributeError) as exc:  # a build that hides its symbols
        log.debug("XXH3 through ctypes unavailable (%s): checksumming with the GIL held", exc)
        return None
    return lib, update


_LOADED = _load_xxh3()
_XXH3, _UPDATE = _LOADED if _LOADED is not None else (None, None)


class PieceHasher:
    """One block's XXH3-64 built piece by piece, reusable for the next block after ``reset``.

    ``update`` takes the piece both as a view and as its address: the ctypes path hashes the
    address with the GIL released, the fallback hashes the view. One hasher per thread.
    """

    def __init__(self) -> None:
        self._state: int | None = None
        self._py: xxhash.xxh3_64 | None = None
        if _XXH3 is not None:
            self._state = _XXH3.XXH3_createState()
            if not self._state:
                raise MemoryError("XXH3_createState")
        self.reset()

    def reset(self) -> None:
        if self._state is not None:
            _XXH3.XXH3_64bits_reset(self._state)  # type: ignore[union-attr]
        else:
            self._py = xxhash.xxh3_64()

    def update(self, view: memoryview, address: int) -> None:
        """Continue over ``view``, which lives at ``address`` (the caller keeps it alive)."""
        if self._state is not None:
            _UPDATE(self._state, address, len(view))  # type: ignore[misc]
        else:
            self._py.update(view)  # type: ignore[union-attr]

    def digest(self) -> int:
        if self._state is not None:
            return int(_XXH3.XXH3_64bits_digest(self._state))  # type: ignore[union-attr]
        return self._py.intdigest()  # type: ignore[union-attr]

    def __del__(self) -> None:
        if self._state is not None and _XXH3 is not None:
            _XXH3.XXH3_freeState(self._state)
            self._state = None
