"""The closed-loop real-time replayer and its report.

Each request is released by ``kvmesh_tools.traffic.schedule`` (previous turn finished +
think time, scaled by ``time_scale``), waits for a slot under the concurrency
limit, and is sent with token ids synthesised from its hash ids. What the stack
answers is recorded per request and summarised.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvmesh.routing.fidelity import count
from kvmesh.rpc.tls import TLS_METADATA, TlsConfig
from kvmesh_tools.moves_report import moved_metrics
from kvmesh_tools.replay.transport import Call, GrpcTransport, HttpTransport, Outcome
from kvmesh_tools.traffic.model import Trace
from kvmesh_tools.traffic.schedule import Schedule, ScheduleOptions, ScheduleRunner, build_schedule
from kvmesh_tools.traffic.tokens import TokenSynthesizer

log = logging.getLogger(__name__)


@dataclass
class ReplayConfig:
    ENV_PREFIX: ClassVar[str] = "KVMESH_REPLAY_"

    target: str = field(default="127.0.0.1:50050", metadata={
        "help": "router address: HOST:PORT (grpc) or http://HOST:PORT (http)"})
    api: str = field(default="grpc", metadata={"help": "grpc | http"})
    api_key: str = field(default="", metadata={
        "help": "the router's API key (Bearer); `kvmesh up` prints it and writes it to <log_dir>/auth/api-key"})
    model: str = field(default="", metadata={"help": "model name ('' = the router's first model)"})
    time_scale: float = field(default=1.0, metadata={"help": "replay this many times faster than recorded"})
    concurrency: int = field(default=64, metadata={"help": "max requests in flight"})
    vocab_size: int = field(default=32000, metadata={"help": "token ids are drawn below this"})
    max_output_tokens: int = field(default=0, metadata={"help": "cap each request's output (0 = as recorded)"})
    policy: str = field(default="", metadata={"help": "per-request routing policy override ('' = router's)"})
    salt: str = field(default="", metadata={"help": "fresh token space and session ids (fair repeated runs)"})
    timeout_s: float = field(default=600.0, metadata={"help": "per-request deadline"})
    mode: str = field(default="closed", metadata={"help": "closed | open"})
    start_window_s: float | None = field(default=None, metadata={"help": "spread session starts (recorded s)"})
    max_think_s: float | None = field(default=3600.0, metadata={"help": "cap one recorded gap (recorded s)"})
    seed: int = field(default=0, metadata={"help": "seed for session starts"})
    progress: bool = field(default=True, metadata={"help": "show a progress bar"})
    # grpc api: the client identity for a router that runs mutual TLS (--tls-cert/--tls-key/--tls-ca).
    tls: TlsConfig = field(default_factory=TlsConfig, metadata=TLS_METADATA)


@dataclass
class ReplayResult:
    metrics: dict[str, Any]
    records: list[dict[str, Any]]


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(round(q / 100.0 * (len(s) - 1)))))
    return round(s[k], 5)


def _dist(values: list[float]) -> dict[str, float | None]:
    return {"p50": _pct(values, 50), "p90": _pct(values, 90), "p99": _pct(values, 99),
            "mean": round(sum(values) / len(values), 5) if values else None}


def summarize(records: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    ok = [r for r in records if not r["error"]]
    prompt = sum(r["prompt_tokens"] for r in ok)
    # The hit is what no engine computed for the request (``Outcome.reused``): a split's decode
    # engine also counts as cached the KV its prefill engine computed, which is a transfer. Of it,
    # the GPU's share is at most the decode engine's GPU count; the rest came from the store.
    cached = sum(r["reused"] for r in ok)
    gpu = sum(min(r["cached_gpu"], r["reused"]) for r in ok)
    off = cached - gpu
    out_tok = sum(r["output_tokens"] for r in ok)
    pred = [(r["predicted"], r["cached"]) for r in ok if r["predicted"] is not None]
    errors: dict[str, int] = {}
    for r in records:
        if r["error"]:
            key = r["error"].split(":", 1)[0]
            errors[key] = errors.get(key, 0) + 1
    return {
        "requests": len(records),
        "ok": len(ok),
        "errors": sum(errors.values()),
        "errors_by_kind": errors,
        "wall_s": round(wall_s, 3),
        "ttft_s": _dist([r["ttft_s"] for r in ok if r["ttft_s"] is not None]),
        "itl_s": _dist([r["itl_s"] for r in ok if r["itl_s"] is not None]),
        "e2e_s": _dist([r["e2e_s"] for r in ok]),
        "queue_wait_s": _dist([r["queue_wait_s"] for r in ok]),
        # The parts of ``ttft_s`` the stack reports (None where it does not): the router's decision
        # (request in -> endpoint chosen, the index lookup included) and the engine's own time to
        # first token (its queue, restores and prefill). The rest is the hops between the three.
        "decision_ms": _dist([r["decision_ms"] for r in ok if r.get("decision_ms") is not None]),
        "lookup_ms": _dist([r["lookup_ms"] for r in ok if r.get("lookup_ms") is not None]),
        "engine_ttft_s": _dist([r["engine_ttft_s"] for r in ok if r.get("engine_ttft_s") is not None]),
        "output_tok_per_s": round(out_tok / wall_s, 2) if wall_s > 0 else 0.0,
        "requests_per_s": round(len(ok) / wall_s, 3) if wall_s > 0 else 0.0,
        "prompt_tokens": prompt,
        "output_tokens": out_tok,
        "hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        "gpu_hit_rate": round(gpu / prompt, 4) if prompt else 0.0,
        "offload_hit_rate": round(off / prompt, 4) if prompt else 0.0,
        "predicted_vs_actual": {
            "requests": len(pred),
            "predicted_cached_tokens": sum(p for p, _ in pred),
            "actual_cached_tokens": sum(a for _, a in pred),
            "exact_share": round(sum(1 for p, a in pred if p == a) / len(pred), 4) if pred else None,
            "mean_abs_diff_tokens": round(sum(abs(p - a) for p, a in pred) / len(pred), 2) if pred else None,
        },
        # Each missed prediction's cause, as the router classified it (kvmesh.routing.fidelity).
        "mismatches": count([r.get("mismatch", "") for r in ok if r["predicted"] is not None]),
        "split_requests": sum(1 for r in ok if r["split"]),
        "transferred_tokens": sum(r["transferred"] for r in ok),
        "hit_rate_unsplit": round(sum(r["reused"] for r in ok if not r["split"])
                                  / max(1, sum(r["prompt_tokens"] for r in ok if not r["split"])), 4),
        **moved_metrics(((r["prompt_tokens"], r["reused"], r.get("given_up", 0)) for r in ok if r.get("moved")),
                        prompt),
        "endpoints": sorted({r["endpoint"] for r in ok if r["endpoint"]}),
    }


class _Progress:
    def __init__(self, total: int, enabled: bool, label: str) -> None:
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=label or "replay", unit="req", dynamic_ncols=True)

    def update(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


async def run_replay(trace: Trace, cfg: ReplayConfig, schedule: Schedule | None = None,
                     label: str = "") -> ReplayResult:
    """Replay ``trace`` against a live router; returns the summary and per-request records."""
    if cfg.time_scale <= 0 or cfg.concurrency <= 0:
        raise ValueError("time_scale and concurrency must be > 0")
    if cfg.api not in ("grpc", "http"):
        raise ValueError(f"api must be 'grpc' or 'http', got {cfg.api!r}")
    schedule = schedule or build_schedule(trace, ScheduleOptions(
        mode=cfg.mode, start_window_s=cfg.start_window_s, max_think_s=cfg.max_think_s, seed=cfg.seed))
    if cfg.api == "grpc":
        transport: GrpcTransport | HttpTransport = GrpcTransport(cfg.target, cfg.model, cfg.timeout_s, cfg.tls,
                                                                 cfg.api_key)
    else:
        base = cfg.target if cfg.target.startswith("http") else f"http://{cfg.target}"
        transport = HttpTransport(base, cfg.model, cfg.timeout_s, cfg.api_key)
    try:
        if not cfg.model:
            models = await transport.models()
            if not models:
                raise RuntimeError(f"router at {cfg.target} serves no model")
            transport.model = models[0]
        return await _drive(trace, schedule, cfg, transport, label)
    finally:
        await transport.close()


async def _drive(trace: Trace, schedule: Schedule, cfg: ReplayConfig, transport: Any, label: str) -> ReplayResult:
    synth = TokenSynthesizer(cfg.vocab_size, salt=cfg.salt)
    runner = ScheduleRunner(schedule, cfg.time_scale)
    sem = asyncio.Semaphore(cfg.concurrency)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    heap: list[tuple[float, int]] = list(runner.initial())
    heapq.heapify(heap)
    records: list[dict[str, Any]] = []
    wake = asyncio.Event()
    inflight: set[asyncio.Task] = set()
    progress = _Progress(len(schedule), cfg.progress, label)
    prefix = f"{cfg.salt}:" if cfg.salt else ""

    async def one(idx: int, release: float) -> None:
        req = schedule.nodes[idx].req
        tokens = synth.prompt(req)
        max_tokens = max(1, req.output_tokens)
        if cfg.max_output_tokens:
            max_tokens = min(max_tokens, cfg.max_output_tokens)
        async with sem:
            sent_rel = loop.time() - t0
            try:
                out: Outcome = await transport.call(Call(request_id=f"{prefix}{req.uid}", tokens=tokens,
                                                         max_tokens=max_tokens,
                                                         session_id=f"{prefix}{req.session}/{req.agent}",
                                                         policy=cfg.policy))
            except Exception as exc:  # noqa: BLE001 - one bad request must not stop the replay
                out = Outcome(sent=time.monotonic(), prompt_tokens=len(tokens), error=f"{type(exc).__name__}: {exc}")
        done_rel = loop.time() - t0
        ttft = (out.first_token - out.sent) if out.first_token is not None else None
        itl = None
        if len(out.chunk_times) > 1 and out.output_tokens > 1:
            itl = (out.chunk_times[-1] - out.chunk_times[0]) / (out.output_tokens - 1)
        records.append({
            "uid": req.uid, "session": req.session, "agent": req.agent, "release_s": round(release, 4),
            "sent_s": round(sent_rel, 4), "queue_wait_s": round(sent_rel - release, 4),
            "ttft_s": ttft, "itl_s": itl, "e2e_s": round(done_rel - sent_rel, 5),
            "prompt_tokens": out.prompt_tokens, "output_tokens": out.output_tokens, "cached": out.cached,
            "reused": out.reused, "transferred": out.transferred, "moved": out.moved, "given_up": out.given_up,
            "cached_gpu": out.cached_gpu, "cached_offload": out.cached_offload, "predicted": out.predicted,
            "endpoint": out.endpoint, "split": out.split, "mismatch": out.mismatch,
            "decision_ms": out.decision_ms, "lookup_ms": out.lookup_ms, "engine_ttft_s": out.engine_ttft_s,
            "error": out.error})
        if out.error:
            log.warning("replay request failed", extra={"uid": req.uid, "error": out.error})
        for item in runner.complete(idx, done_rel):
            heapq.heappush(heap, item)
        progress.update()
        wake.set()

    try:
        while not runner.finished:
            if heap:
                release, idx = heap[0]
                delay = release - (loop.time() - t0)
                if delay <= 0:
                    heapq.heappop(heap)
                    task = asyncio.create_task(one(idx, release))
                    inflight.add(task)
                    task.add_done_callback(inflight.discard)
                    continue
                wake.clear()
                try:
                    await asyncio.wait_for(wake.wait(), timeout=delay)
                except TimeoutError:
                    pass
            else:
                if not inflight:
                    break   # nothing can ever be released (should not happen)
                wake.clear()
                await wake.wait()
        if inflight:
            await asyncio.gather(*inflight)
    finally:
        for t in inflight:
            t.cancel()
        progress.close()
    wall = loop.time() - t0
    records.sort(key=lambda r: r["sent_s"])
    return ReplayResult(summarize(records, wall), records)
