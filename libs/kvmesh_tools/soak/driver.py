"""Drive N concurrent simulated agent sessions for T minutes against a running stack.

Why it exists: a replay ends when its trace does; a soak must hold a steady load for as long
as asked and show, minute by minute, whether anything drifts -- errors, TTFT, hit rate,
prediction accuracy, and the memory of every service (issue 21: decode workers grew ~17 MB/min,
the store went to 3-4x its RAM tier). Each of ``sessions`` slots runs one generated agent
session turn after turn (``traffic.shapes.short_agent_sessions``: prompts that fit a default
stack's workers many times over), then starts a fresh one, until the
time is up; RSS of every service process listed in the stack's ``stack.json`` (written by
``kvmesh up``) is sampled from ``/proc`` every ``sample_s``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from kvmesh_tools.replay.errors import describe_error, summary
from kvmesh_tools.replay.transport import Call, HttpTransport, Outcome
from kvmesh_tools.traffic.tokens import TokenSynthesizer

log = logging.getLogger(__name__)


@dataclass
class SoakConfig:
    ENV_PREFIX: ClassVar[str] = "KVMESH_SOAK_"

    stack: str = field(default="out/stack/stack.json", metadata={
        "help": "the running stack's description, written by `kvmesh up` into its log dir"})
    sessions: int = field(default=50, metadata={"help": "concurrent agent sessions"})
    minutes: float = field(default=2.0, metadata={"help": "how long to run"})
    max_output_tokens: int = field(default=32, metadata={"help": "cap each request's output"})
    think_scale: float = field(default=0.1, metadata={"help": "recorded think times are scaled by this"})
    max_think_s: float = field(default=2.0, metadata={"help": "cap of one (scaled) think time"})
    sample_s: float = field(default=5.0, metadata={"help": "RSS sampling period"})
    timeout_s: float = field(default=300.0, metadata={"help": "per-request deadline"})
    seed: int = field(default=0, metadata={"help": "seed of the generated sessions"})
    out: str = field(default="out/soak", metadata={"help": "soak.json and soak.png go here"})
    progress: bool = field(default=True, metadata={"help": "print one line per minute"})


def load_stack(path: str | Path) -> dict[str, Any]:
    doc = json.loads(Path(path).read_text())
    if not doc.get("router_http"):
        raise ValueError(f"{path}: no router_http; is it a `kvmesh up` stack.json?")
    return doc


def rss_bytes(pid: int) -> int | None:
    """Resident set size of ``pid`` from /proc (None when the process is gone)."""
    return rss_parts(pid).get("VmRSS")


def rss_parts(pid: int) -> dict[str, int]:
    """``VmRSS`` and its shared-memory part ``RssShmem`` (bytes; empty when the process is gone).

    RSS counts the pages of shared segments a process has touched: a worker that maps the
    offload store's slabs (zero-copy gets and puts) shows the store's pages as its own. Kept
    apart, a growth of private memory is told from one of mapped store pages."""
    out: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(("VmRSS:", "RssShmem:")):
                out[line.split(":")[0]] = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return {}
    return out


def _session_requests(seed: int) -> list[Any]:
    """One generated agent session's requests in recorded order (short prompts, traffic.shapes)."""
    from kvmesh_tools.traffic.shapes import short_agent_sessions

    trace = short_agent_sessions(1, seed)
    return sorted(trace.requests(), key=lambda r: r.t)


async def run_soak(cfg: SoakConfig) -> dict[str, Any]:
    """Run the soak; returns ``{"config", "stack", "records", "samples"}`` (see ``report.summarize``)."""
    if cfg.sessions < 1 or cfg.minutes <= 0:
        raise ValueError("sessions must be >= 1 and minutes > 0")
    stack = load_stack(cfg.stack)
    key = ""
    if stack.get("api_key_file"):
        key = Path(str(stack["api_key_file"])).read_text().strip()
    transport = HttpTransport(str(stack["router_http"]), "", cfg.timeout_s, key)
    models = await transport.models()
    if not models:
        raise RuntimeError(f"the router at {stack['router_http']} serves no model")
    transport.model = models[0]
    synth = TokenSynthesizer(32000, salt=f"soak{cfg.seed}:{time.time_ns()}")
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    wall0 = time.time()
    end = t0 + cfg.minutes * 60.0
    records: list[dict[str, Any]] = []
    samples: list[dict[str, Any]] = []
    pids: dict[str, int] = {k: int(v) for k, v in (stack.get("pids") or {}).items()}
    counter = [0]

    async def slot(i: int) -> None:
        while loop.time() < end:
            counter[0] += 1
            sid = cfg.seed * 1_000_003 + counter[0]
            for req in _session_requests(sid):
                if loop.time() >= end:
                    return
                tokens = synth.prompt(req)
                sent = loop.time() - t0
                try:
                    out: Outcome = await transport.call(Call(
                        request_id=f"soak-{sid}-{req.uid}", tokens=tokens,
                        max_tokens=max(1, min(req.output_tokens, cfg.max_output_tokens)),
                        session_id=f"soak-{sid}/{req.agent}"))
                except Exception as exc:  # noqa: BLE001 - one bad request must not stop the soak
                    out = Outcome(sent=time.monotonic(), prompt_tokens=len(tokens), error=summary(exc),
                                  error_detail={**describe_error(exc), "phase": "client"})
                rec = {
                    "sent_s": round(sent, 3), "ttft_s": (out.first_token - out.sent) if out.first_token else None,
                    "prompt_tokens": out.prompt_tokens, "cached": out.cached, "reused": out.reused,
                    "predicted": out.predicted,
                    "mismatch": out.mismatch, "split": out.split, "endpoint": out.endpoint,
                    "error": out.error}
                if out.error:
                    # Every failure explained: when and what it was (wall clock, to match the
                    # services' logs), and the exception chain, errno and phase for a transport error.
                    done = loop.time() - t0
                    rec |= {"request_id": f"soak-{sid}-{req.uid}", "failed_s": round(done, 3),
                            "failed_at": time.strftime("%H:%M:%S", time.gmtime(wall0 + done)),
                            "error_detail": out.error_detail}
                    log.warning("soak request failed", extra={"request_id": rec["request_id"], "error": out.error,
                                                              "detail": out.error_detail})
                records.append(rec)
                think = min(cfg.max_think_s, max(0.0, req.think_time) * cfg.think_scale)
                if think:
                    await asyncio.sleep(think)

    async def sampler() -> None:
        while True:
            parts = {name: rss_parts(pid) for name, pid in pids.items()}
            samples.append({"t_s": round(loop.time() - t0, 2),
                            "rss": {name: p.get("VmRSS") for name, p in parts.items()},
                            "rss_shmem": {name: p.get("RssShmem") for name, p in parts.items()}})
            if loop.time() >= end:
                return
            await asyncio.sleep(cfg.sample_s)

    async def progress() -> None:
        from kvmesh_tools.soak.report import minute_rows

        shown = 0
        while True:
            await asyncio.sleep(5.0)
            rows = minute_rows(records, samples, cfg.minutes)
            done = int((loop.time() - t0) // 60)
            for row in rows[shown:done]:
                print(_line(row), flush=True)
                shown += 1

    side = [asyncio.create_task(sampler())]
    if cfg.progress:
        side.append(asyncio.create_task(progress()))
    try:
        await asyncio.gather(*(slot(i) for i in range(cfg.sessions)))
        await side[0]
    finally:
        for t in side:
            t.cancel()
        await transport.close()
    return {"config": cfg.__dict__ | {}, "stack": {k: stack.get(k) for k in ("router_http", "pids", "logs")},
            "records": records, "samples": samples}


def _line(row: dict[str, Any]) -> str:
    rss = ", ".join(f"{k} {v:.0f}" for k, v in sorted(row["rss_mib"].items()) if v is not None)
    return (f"minute {row['minute']}: {row['requests']} requests, {row['errors']} errors, TTFT p50 "
            f"{row['ttft_p50_s']} p99 {row['ttft_p99_s']} s, hit {row['hit_rate']}, predicted==actual "
            f"{row['prediction_accuracy']} ({row['prediction_accuracy_unsplit']} unsplit), view bugs {row['mismatches'].get('view_bug', 0)}; RSS MiB: {rss}")
