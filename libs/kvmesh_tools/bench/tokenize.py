"""``kvmesh bench tokenize``: incremental against full tokenization of a growing agent conversation.

Set-up: the tiny model's tokenizer and chat template; a conversation rendered by the template
that starts near ``--start-tokens`` and grows by 1-5k tokens a turn (user messages of code and
prose, assistant answers) for ``--turns`` turns. Each turn is tokenized twice in the same run:
incrementally (``kvmesh.tokenization.incremental``, verify off so only its own work is timed)
and in full (the baseline). Every turn's two results are compared: ``differences`` must be 0.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

from kvmesh_tools.bench.common import median, percentile, write_json

WORDS = ["agent", "tool", "call", "result", "def", "return", "file", "path", "error", "the", "a", "of", "{", "}",
         "(", ")", "import", "class", "self", "value", "0", "1", "2", "\n", "    ", "x.y", "==", "#", "'s"]


CHARS_PER_TOKEN = 2.0   # of this word mix under the tiny tokenizer (measured: the JSON has the real sizes)


def _message(rng: random.Random, tokens: int) -> str:
    lines, n = [], 0
    while n < tokens * CHARS_PER_TOKEN:
        line = ("    " * rng.randint(0, 3)) + " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14)))
        lines.append(line)
        n += len(line) + 1
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict:
    from kvmesh.tokenization import load_tokenizer
    from kvmesh.tokenization.incremental import IncrementalTokenizer
    from kvmesh.tokenization.tiny_model import write_tiny_model

    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as d:
        tok = load_tokenizer(write_tiny_model(f"{d}/tiny"))
        inc = IncrementalTokenizer(tok.encode_with_offsets, verify="off")
        messages = [{"role": "system", "content": _message(rng, 2000)},
                    {"role": "user", "content": _message(rng, args.start_tokens)}]
        inc_ms, full_ms, sizes, diffs = [], [], [], 0
        turn = 0
        while turn <= args.turns:
            text = tok.render_chat(messages, add_generation_prompt=True)
            t0 = time.perf_counter()
            got = inc.encode_ids(("bench", "s"), text)   # what the router takes (no 200k-int list)
            t1 = time.perf_counter()
            want = tok.encode(text, add_special_tokens=False)
            t2 = time.perf_counter()
            diffs += got.array.tolist() != want
            if turn > 0:                 # the first turn has nothing to reuse: both are full
                inc_ms.append((t1 - t0) * 1e3)
                full_ms.append((t2 - t1) * 1e3)
                sizes.append(len(want))
            grow = rng.randint(args.min_turn_tokens, args.max_turn_tokens)
            messages += [{"role": "assistant", "content": _message(rng, 300)},
                         {"role": "user", "content": _message(rng, grow - 300)}]
            turn += 1
    inc_p50, full_p50 = median(inc_ms), median(full_ms)
    result = {
        "bench": "tokenize",
        "turns": len(inc_ms),
        "tokens_first": sizes[0] if sizes else 0,
        "tokens_last": sizes[-1] if sizes else 0,
        "incremental_tokenize_p50_ms": inc_p50,
        "incremental_tokenize_p99_ms": percentile(inc_ms, 99),
        "full_tokenize_p50_ms": full_p50,
        "full_over_incremental_p50": full_p50 / inc_p50 if inc_p50 else float("nan"),
        "differences": diffs,
        "outcomes": dict(inc.stats.counts),
        "cache_bytes": inc.nbytes,
    }
    result["targets"] = {
        "incremental_p50_le_15ms": inc_p50 <= 15.0,
        "ge_30x_full": result["full_over_incremental_p50"] >= 30.0,
        "no_differences": diffs == 0,
    }
    return result


def _main(args: argparse.Namespace) -> int:
    result = write_json(args.json, run(args))
    keys = ("incremental_tokenize_p50_ms", "full_tokenize_p50_ms", "full_over_incremental_p50", "differences",
            "turns", "tokens_last")
    print({k: round(result[k], 3) if isinstance(result[k], float) else result[k] for k in keys}, result["targets"])
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tokenize", help="incremental vs full tokenization of a growing ~200k-token conversation")
    p.add_argument("--json", default=None, help="write the result here")
    p.add_argument("--start-tokens", type=int, default=200_000, help="about the first turn's size")
    p.add_argument("--min-turn-tokens", type=int, default=1_000)
    p.add_argument("--max-turn-tokens", type=int, default=5_000)
    p.add_argument("--turns", type=int, default=20, help="turns timed after the first")
    p.add_argument("--seed", type=int, default=1)
    p.set_defaults(func=_main)
