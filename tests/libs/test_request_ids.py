"""Engine request ids: unique per call, the client's id kept where it fits, always short enough."""

from __future__ import annotations

import re

from kvmesh.request_ids import MAX_CLIENT_PART_BYTES, engine_request_id
from kvmesh.worker.engine.validation import MAX_REQUEST_ID_BYTES


def test_the_client_id_is_kept_and_made_unique() -> None:
    a, b = engine_request_id("rq-1"), engine_request_id("rq-1")
    assert a != b and re.fullmatch(r"rq-1-[0-9a-f]{8}", a) and re.fullmatch(r"rq-1-[0-9a-f]{8}", b)


def test_a_long_client_id_becomes_a_digest_with_room_for_the_routers_suffixes() -> None:
    long_ascii, long_utf8 = "x" * 128, "é" * 50            # 128 bytes; 50 characters, 100 bytes
    fits = "y" * MAX_CLIENT_PART_BYTES
    assert engine_request_id(fits).startswith(fits + "-")
    for cid in (long_ascii, long_utf8):
        eid = engine_request_id(cid)
        assert re.fullmatch(r"sha256:[0-9a-f]{16}-[0-9a-f]{8}", eid)
        assert eid.split("-")[0] == engine_request_id(cid).split("-")[0]   # the same client id, the same digest
    worst = engine_request_id(fits) + "-prefill" + "-r10"
    assert len(worst.encode()) <= MAX_REQUEST_ID_BYTES
