"""The tiny model directory: deterministic, loadable offline, tokenizer and model agree."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh.tokenization import TokenizerError, load_tokenizer
from kvmesh.tokenization.tiny_model import TinyModelSpec, write_tiny_model

pytestmark = pytest.mark.timeout(120)


def _digest(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_same_input_gives_byte_identical_files(tiny_model_dir: Path, tmp_path: Path) -> None:
    again = write_tiny_model(tmp_path / "again")
    assert _digest(again) == _digest(tiny_model_dir)


def test_cli_writes_model_and_refuses_to_clobber(tmp_path: Path, tiny_model_dir: Path) -> None:
    out = tmp_path / "m"
    cmd = [sys.executable, "-m", "kvmesh_tools.cli.main", "model", "init", "--tiny", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["vocab_size"] == 32000
    assert _digest(out) == _digest(tiny_model_dir)
    r2 = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    assert r2.returncode == 1 and "exists" in r2.stderr


def test_vocab_matches_model_config(tiny_model_dir: Path) -> None:
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    tok = load_tokenizer(tiny_model_dir)
    assert tok.vocab_size == cfg["vocab_size"] == 32000
    assert tok.eos_token_id == cfg["eos_token_id"]
    assert tok.bos_token_id == cfg["bos_token_id"]
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == 32
    assert cfg["max_position_embeddings"] >= 131072


def test_small_vocab_is_padded_exactly(tmp_path: Path) -> None:
    d = write_tiny_model(tmp_path / "small", TinyModelSpec(vocab_size=1000, corpus_lines=2000))
    assert load_tokenizer(d).vocab_size == 1000
    assert json.loads((d / "config.json").read_text())["vocab_size"] == 1000


def test_transformers_loads_offline_and_agrees(tiny_model_dir: Path) -> None:
    # A fresh interpreter with the network disabled, as a deployed router would be.
    code = f"""
import json
from transformers import AutoTokenizer
t = AutoTokenizer.from_pretrained({str(tiny_model_dir)!r}, local_files_only=True)
msgs = [{{"role": "system", "content": "be brief"}}, {{"role": "user", "content": "list files"}},
        {{"role": "assistant", "content": "", "tool_calls": [
            {{"id": "c1", "function": {{"arguments": {{}}, "name": "ls"}}, "type": "function"}}]}},
        {{"role": "tool", "tool_call_id": "c1", "content": "a.py b.py"}}]
tools = [{{"type": "function", "function": {{"name": "ls", "description": None, "parameters": {{}}}}}}]
ids = t.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=True)
ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
text = t.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False)
print(json.dumps({{"len": len(t), "enc": t.encode("def main(): return 42", add_special_tokens=False),
                  "chat": ids, "text": text}}))
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(tiny_model_dir / ".hf")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    hf = json.loads(r.stdout.strip().splitlines()[-1])
    ours = load_tokenizer(tiny_model_dir)
    assert hf["len"] == ours.vocab_size
    assert hf["enc"] == ours.encode("def main(): return 42")
    # Sent as OpenAI clients send it; the renderer normalizes it as vLLM does (arguments parsed,
    # keys in OpenAI's order, null description), which is the input given to transformers above.
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "list files"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "a.py b.py"}]
    tools = [{"type": "function", "function": {"name": "ls", "parameters": {}}}]
    assert hf["text"] == ours.render_chat(msgs, tools=tools)
    assert hf["chat"] == ours.apply_chat_template(msgs, tools=tools)


def test_roundtrip_and_special_tokens(tiny_model_dir: Path) -> None:
    tok = load_tokenizer(tiny_model_dir)
    text = "Hello wörld 🙂\n\tdef f(x): return x + 1  # ok"
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.encode("<|im_start|>") == [tok.token_to_id("<|im_start|>")]


def test_chat_rendering_is_append_only(tiny_model_dir: Path) -> None:
    # Turn N's prompt must be a token prefix of turn N+1's, or agent prompts never hit the cache.
    tok = load_tokenizer(tiny_model_dir)
    conv = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "fix the bug"}]
    first = tok.apply_chat_template(conv, add_generation_prompt=False)
    conv2 = conv + [{"role": "assistant", "content": "Looking at main.py"}, {"role": "user", "content": "go on"}]
    second = tok.apply_chat_template(conv2, add_generation_prompt=True)
    assert second[: len(first)] == first
    assert tok.decode(second, skip_special_tokens=False).endswith("<|im_start|>assistant\n")


def test_bad_chat_requests_name_the_problem(tiny_model_dir: Path, tmp_path: Path) -> None:
    tok = load_tokenizer(tiny_model_dir)
    with pytest.raises(TokenizerError, match="non-empty list"):
        tok.apply_chat_template([])
    with pytest.raises(TokenizerError, match=r"messages\[1\]"):
        tok.apply_chat_template([{"role": "user", "content": "x"}, {"content": "no role"}])
    with pytest.raises(TokenizerError, match="not a directory"):
        load_tokenizer(tmp_path / "missing")


def test_seeded_weights_and_lora_are_deterministic(tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    from kvmesh.tokenization.tiny_model import weight_shapes, write_random_weights, write_tiny_lora

    spec = TinyModelSpec()
    a = write_random_weights(tmp_path, spec, seed=3).read_bytes()
    (tmp_path / "b").mkdir()
    assert write_random_weights(tmp_path / "b", spec, seed=3).read_bytes() == a
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert {k: v.shape for k, v in tensors.items()} == weight_shapes(spec)
    l1 = write_tiny_lora(tmp_path / "l1")
    l2 = write_tiny_lora(tmp_path / "l2")
    assert _digest(l1) == _digest(l2)
    assert json.loads((l1 / "adapter_config.json").read_text())["target_modules"] == ["q_proj", "v_proj"]
