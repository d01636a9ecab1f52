"""``kvmesh hash`` end to end (in-process main, real stdin/stdout)."""

from __future__ import annotations

import io
import json

import pytest

from kvmesh.hashing import BlockHasher, ExtraKeys
from kvmesh_tools.cli.main import main
from tests.paths import DATA

pytestmark = pytest.mark.timeout(60)


def run(monkeypatch, capsys, stdin: str, *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    rc = main(["hash", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_prints_event_keys(monkeypatch, capsys) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    toks = list(range(100, 170))
    rc, out, _ = run(
        monkeypatch, capsys, json.dumps(toks), "--algo", "sha256_cbor", "--block-size", "16",
        "--cache-salt", "s", "--lora-name", "l", "--lora-path", "/p",
    )  # fmt: skip
    assert rc == 0
    want = BlockHasher("sha256_cbor", 16).block_keys(toks, ExtraKeys(cache_salt="s", lora_name="l", lora_path="/p"))
    assert json.loads(out) == want and len(want) == 4


def test_digest_and_seed(monkeypatch, capsys) -> None:
    rc, out, _ = run(monkeypatch, capsys, "[1,2,3,4]", "--block-size", "2", "--digest", "--seed", "x", "--algo", "xxhash")
    assert rc == 0
    assert json.loads(out) == [d.hex() for d in BlockHasher("xxhash", 2, seed="x").block_digests([1, 2, 3, 4])]


@pytest.mark.parametrize(
    "stdin, args, msg",
    [
        ("not json", ["--block-size", "4"], "not valid JSON"),
        ('{"a": 1}', ["--block-size", "4"], "expected a JSON list"),
        ("[1, 2.5]", ["--block-size", "4"], "index 1"),
        ("[1, -3]", ["--block-size", "4"], "negative"),
        ("[1]", ["--block-size", "0"], "--block-size"),
        ("[1]", ["--block-size", "4", "--lora-path", "/x"], "--lora-name"),
    ],
)
def test_bad_input_exit_2(monkeypatch, capsys, stdin, args, msg) -> None:
    rc, out, err = run(monkeypatch, capsys, stdin, *args)
    assert rc == 2 and out == "" and msg in err


def test_unknown_algo_is_argparse_error(monkeypatch, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        run(monkeypatch, capsys, "[]", "--block-size", "4", "--algo", "md5")
    assert e.value.code == 2


def test_matches_hashes_recorded_from_vllm(monkeypatch, capsys) -> None:
    """What a user would do: feed the request's tokens, compare with the engine's event."""

    vectors = json.loads((DATA / "vllm_hash_vectors.json").read_text())
    case = next(c for c in vectors["cases"] if c["name"] == "sha256_default")
    rec = next(r for r in case["records"] if r["cache_salt"] and r["events"] and r["events"][0]["parent_block_hash"] is None)
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    rc, out, _ = run(
        monkeypatch, capsys, json.dumps(rec["prompt_token_ids"] + rec["output_token_ids"]),
        "--algo", "sha256", "--block-size", str(case["block_size"]), "--cache-salt", rec["cache_salt"],
    )  # fmt: skip
    assert rc == 0
    got = json.loads(out)
    want = rec["events"][0]["block_hashes"]
    assert got[: len(want)] == want
