"""``kvmesh bench router --tls compare`` runs both modes against real indexers (a tiny session).

Only that it measures: both modes route every turn and the ratio is formed from them; the
figures themselves are the bench's job (docs/bench-history.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmesh_tools.cli.main import main

pytestmark = pytest.mark.timeout(180)


def test_tls_compare_routes_every_turn_in_both_modes(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    assert main(["bench", "router", "--tls", "compare", "--endpoints", "3", "--start-tokens", "2000",
                 "--end-tokens", "3200", "--turn-tokens", "300", "--noise-tokens", "1000", "--rounds", "1",
                 "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    (rnd,) = res["rounds"]
    assert rnd["turns"] == 4
    assert res["route_p99_ms_plain"] > 0 and res["route_p99_ms_tls"] > 0
    assert res["tls_over_plain_p99"] == pytest.approx(res["route_p99_ms_tls"] / res["route_p99_ms_plain"])


def test_tls_and_auth_compare_salts_the_tls_side_and_routes_alike(tmp_path: Path) -> None:
    """--auth both: the TLS side also authenticates a key and salts its chain, the plaintext side
    neither; the salted session still lands where its salted blocks are (as the plain one does)."""
    out = tmp_path / "r.json"
    assert main(["bench", "router", "--tls", "compare", "--auth", "both", "--auth-keys", "20", "--endpoints", "3",
                 "--start-tokens", "2000", "--end-tokens", "3200", "--turn-tokens", "300", "--noise-tokens", "1000",
                 "--rounds", "1", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["mode"] == "tls-auth-compare" and res["auth_keys"] == 20
    (rnd,) = res["rounds"]
    assert rnd["turns"] == 4 and rnd["decisions_differ"] == 0
    assert res["tls_over_plain_p99"] == pytest.approx(res["route_p99_ms_tls"] / res["route_p99_ms_plain"])
