"""``kvmesh bench detokenize``: streaming an answer's text, a window per chunk against the whole
answer per chunk.

Set-up: the tiny model's tokenizer; answers of ``--lengths`` tokens (random ids, special tokens
among them) streamed one token a chunk, as an engine streams a decode step. Each answer is turned
into text twice in the same run: incrementally (``kvmesh.tokenization.detokenize``, what the
router's doors, the worker's HTTP API and the reasoning streams run) and by decoding the whole
answer so far at each chunk (the baseline, what the doors did before). Medians of ``--reps``;
both texts are compared: ``differences`` must be 0.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

from kvmesh_tools.bench.common import median, write_json


def _whole(tok, ids: list[int]) -> str:
    """The baseline: the whole answer decoded at every chunk, its new text sent when it ends on a
    character (the doors' old ``_Detok``); returns what was sent, flushed at the end."""
    sent, acc = "", []
    for t in ids:
        acc.append(t)
        now = tok.decode(acc)
        if not now.endswith("\ufffd"):
            sent += now[len(sent):]
    return sent + tok.decode(acc)[len(sent):]


def run(args: argparse.Namespace) -> dict:
    from kvmesh.tokenization import load_tokenizer
    from kvmesh.tokenization.detokenize import IncrementalDetokenizer
    from kvmesh.tokenization.tiny_model import write_tiny_model

    rng = random.Random(args.seed)
    lengths = [int(x) for x in args.lengths.split(",")]
    result: dict = {"bench": "detokenize", "reps": args.reps, "lengths": lengths, "differences": 0}
    with tempfile.TemporaryDirectory() as d:
        tok = load_tokenizer(write_tiny_model(f"{d}/tiny"))
        for n in lengths:
            inc_ms, whole_ms = [], []
            for _ in range(args.reps):
                ids = [rng.randrange(0, 32000) for _ in range(n)]
                t0 = time.perf_counter()
                detok = IncrementalDetokenizer(tok)
                for i, t in enumerate(ids):
                    detok.push([t], final=i == n - 1)
                t1 = time.perf_counter()
                want = _whole(tok, ids)
                t2 = time.perf_counter()
                result["differences"] += detok.text != want
                inc_ms.append((t1 - t0) * 1e3)
                whole_ms.append((t2 - t1) * 1e3)
            inc, whole = median(inc_ms), median(whole_ms)
            result[f"incremental_{n}_p50_ms"] = inc
            result[f"whole_{n}_p50_ms"] = whole
            result[f"whole_over_incremental_{n}"] = whole / inc if inc else float("nan")
    longest = max(lengths)
    result["targets"] = {
        "no_differences": result["differences"] == 0,
        f"ge_10x_whole_at_{longest}": result[f"whole_over_incremental_{longest}"] >= 10.0,
    }
    return result


def _main(args: argparse.Namespace) -> int:
    result = write_json(args.json, run(args))
    print({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items() if k != "bench"})
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("detokenize", help="streamed answer text: a window per chunk vs the whole answer per chunk")
    p.add_argument("--json", default=None, help="write the result here")
    p.add_argument("--lengths", default="300,4000", help="answer lengths in tokens, comma-separated")
    p.add_argument("--reps", type=int, default=5, help="answers per length (medians)")
    p.add_argument("--seed", type=int, default=1)
    p.set_defaults(func=_main)
