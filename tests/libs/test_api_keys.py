"""API keys (kvmesh.api_keys): parsed, kept only as digests, reloaded on change; tenant salts are secret."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kvmesh.api_keys import (
    ApiKeys,
    KeyFileError,
    TenantSalts,
    add_key,
    digest,
    key_from_headers,
    new_key,
    parse_keys,
)


def _wait_for(pred, timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


def test_plain_and_digest_keys_map_to_their_tenant_and_only_digests_are_kept(tmp_path: Path) -> None:
    a, b = new_key(), new_key()
    f = tmp_path / "keys"
    f.write_text(f"# comment\nteam-a {a}\n\nteam-b {digest(b)}   # inline comment\ngw {new_key()} trusted\n")
    keys = ApiKeys(f)
    assert keys.lookup(a).tenant == "team-a" and not keys.lookup(a).trusted
    assert keys.lookup(b).tenant == "team-b"
    assert keys.lookup("kvm-nope") is None and keys.lookup("") is None and keys.lookup("x" * 10_000) is None
    assert len(keys) == 3
    # Nothing in memory is a key: only sha256 digests.
    assert all(k.startswith("sha256:") for k in keys._keys) and a not in str(keys._keys)


@pytest.mark.parametrize("text,why", [
    ("team-a\n", "expected"),
    ("team-a sha256:abc\n", "64 hex"),
    ("team-a key1 admin\n", "unknown flag"),
    ("team-a key1\nteam-b key1\n", "already given"),
])
def test_bad_key_files_are_refused_with_the_line(text: str, why: str) -> None:
    with pytest.raises(KeyFileError, match=why):
        parse_keys(text, "keys")


def test_a_changed_file_is_reloaded_and_a_broken_edit_keeps_the_old_keys(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    old = add_key(f, "team-a")
    assert (f.stat().st_mode & 0o777) == 0o600 and old not in f.read_text()
    keys = ApiKeys(f, reload_s=0.0)
    assert keys.lookup(old).tenant == "team-a"
    new = new_key()
    f.write_text(f"team-a {digest(new)}\n")          # rotation: the new key in, the old one out
    assert _wait_for(lambda: keys.lookup(new) is not None)
    assert keys.lookup(old) is None and keys.reloads == 1
    f.write_text("this line is broken\n")
    os.utime(f, ns=(time.time_ns(), time.time_ns() + 10**9))
    keys.maybe_reload()
    assert keys.reload_errors == 1 and keys.lookup(new).tenant == "team-a"


def test_a_mounted_secret_directory_is_read_and_its_symlink_swap_reloaded(tmp_path: Path) -> None:
    """Kubernetes mounts a Secret as files behind a ``..data`` symlink that an update swaps."""
    k1, k2 = new_key(), new_key()
    v1, v2 = tmp_path / "..v1", tmp_path / "..v2"
    v1.mkdir()
    v2.mkdir()
    (v1 / "keys").write_text(f"team-a {k1}\n")
    (v2 / "keys").write_text(f"team-b {k2}\n")
    (tmp_path / "..data").symlink_to(v1.name)
    (tmp_path / "keys").symlink_to("..data/keys")
    keys = ApiKeys(tmp_path, reload_s=0.0)
    assert keys.lookup(k1).tenant == "team-a" and keys.lookup(k2) is None
    tmp = tmp_path / "..data_tmp"
    tmp.symlink_to(v2.name)
    tmp.rename(tmp_path / "..data")
    assert _wait_for(lambda: keys.lookup(k2) is not None)
    assert keys.lookup(k2).tenant == "team-b" and keys.lookup(k1) is None


def test_a_missing_keys_file_fails_at_start(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError):
        ApiKeys(tmp_path / "absent")


def test_key_from_bearer_or_x_api_key() -> None:
    assert key_from_headers({"authorization": "Bearer k1"}.get) == "k1"
    assert key_from_headers({"authorization": "bearer  k1 "}.get) == "k1"
    assert key_from_headers({"x-api-key": "k2"}.get) == "k2"
    assert key_from_headers({"authorization": "Basic xyz"}.get) == ""
    assert key_from_headers({}.get) == ""


def test_salts_are_secret_per_tenant_and_mix_in_the_client_salt() -> None:
    s1, s2 = TenantSalts(b"s" * 32), TenantSalts(b"t" * 32)
    a = s1.salt("team-a")
    assert a == s1.salt("team-a") and a != s2.salt("team-a")     # depends on the secret
    assert a != s1.salt("team-b") and "team-a" not in a            # per tenant, does not reveal it
    assert s1.salt("team-a", "x") not in (a, s1.salt("team-b", "x"), s1.salt("", "x"))   # combined
    assert s1.salt("ab", "c") != s1.salt("a", "bc")
    assert s1.salt("", "") == ""
    with pytest.raises(ValueError):
        TenantSalts(b"short")
