"""Seeded synthetic agent sessions with the published Claude Code shape.

Why it exists: tests, the demo and what-if studies need agent traffic of any size
without shipping real traces. Defaults follow /work/shared/docs/anchors.md:
input grows by a median of 632 tokens per turn; think time has a median of 2 s
and a p99 of 11 min; sub-agents come in groups that fire together (median 7,
p90 51 members); a context is occasionally reset (compaction), which breaks the
prefix. All draws come from one ``random.Random(seed)``, so a seed fixes the trace.

Hash ids: every session shares the system prompt's ids (scope ``global``), and
sub-agents of every session share the sub-agent system prompt, as real agents
running one harness do; everything else gets fresh ids.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from kvmesh_tools.traffic.model import Agent, Request, Session, Trace


def _lognormal_from(median: float, q: float, value_at_q: float) -> tuple[float, float]:
    """(mu, sigma) of a lognormal with this median and this value at quantile z-score q."""
    mu = math.log(median)
    sigma = (math.log(value_at_q) - mu) / q
    return mu, sigma


_Z99 = 2.3263
_Z90 = 1.2816


@dataclass
class GeneratorConfig:
    sessions: int = field(default=20, metadata={"help": "number of agent sessions"})
    turns_median: int = field(default=40, metadata={"help": "median main-agent turns per session"})
    block_size: int = field(default=64, metadata={"help": "tokens per hash id"})
    system_tokens: int = field(default=16384, metadata={"help": "shared system prompt + tools (all sessions)"})
    first_user_tokens: int = field(default=2000, metadata={"help": "median first user message"})
    growth_median: float = field(default=632.0, metadata={"help": "median input growth per turn (tokens)"})
    growth_p99: float = field(default=20000.0, metadata={"help": "p99 input growth per turn (tool results)"})
    output_median: float = field(default=317.0, metadata={"help": "median output tokens"})
    output_p99: float = field(default=4000.0, metadata={"help": "p99 output tokens"})
    think_median_s: float = field(default=2.0, metadata={"help": "median think time (s)"})
    think_p99_s: float = field(default=660.0, metadata={"help": "p99 think time (s)"})
    reset_prob: float = field(default=0.01, metadata={"help": "per-turn probability of a prefix reset"})
    reset_keep_tokens: int = field(default=4000, metadata={"help": "summary size after a reset"})
    max_context_tokens: int = field(default=200000, metadata={"help": "reset when the context would exceed this"})
    subagent_group_prob: float = field(default=0.03, metadata={"help": "per-turn probability of a sub-agent group"})
    group_median: float = field(default=7.0, metadata={"help": "median sub-agents per group"})
    group_p90: float = field(default=51.0, metadata={"help": "p90 sub-agents per group"})
    group_max: int = field(default=128, metadata={"help": "cap on a group's size"})
    subagent_system_tokens: int = field(default=8192, metadata={"help": "shared sub-agent system prompt"})
    subagent_task_tokens: int = field(default=1500, metadata={"help": "median sub-agent task prompt"})
    subagent_turns_median: int = field(default=8, metadata={"help": "median turns per sub-agent"})
    group_stagger_s: float = field(default=0.2, metadata={"help": "max spread of a group's launch times"})
    prefill_tok_per_s: float = field(default=20000.0, metadata={"help": "recorded-time model: prefill speed"})
    decode_tok_per_s: float = field(default=60.0, metadata={"help": "recorded-time model: decode speed"})
    seed: int = field(default=0, metadata={"help": "random seed"})
    model: str = field(default="", metadata={"help": "model name recorded on requests"})


class _Ids:
    """Fresh hash ids; ids below 2**20 are reserved for the shared prompts."""

    SYSTEM_BASE = 1
    SUB_SYSTEM_BASE = 1 << 19

    def __init__(self) -> None:
        self.next = 1 << 20

    def fresh(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


class SessionGenerator:
    def __init__(self, cfg: GeneratorConfig) -> None:
        if cfg.sessions <= 0 or cfg.turns_median <= 0 or cfg.block_size <= 0:
            raise ValueError("sessions, turns_median and block_size must be positive")
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.ids = _Ids()
        self._growth = _lognormal_from(cfg.growth_median, _Z99, cfg.growth_p99)
        self._out = _lognormal_from(cfg.output_median, _Z99, cfg.output_p99)
        self._think = _lognormal_from(cfg.think_median_s, _Z99, cfg.think_p99_s)
        self._group = _lognormal_from(cfg.group_median, _Z90, cfg.group_p90)
        bs = cfg.block_size
        self.system_ids = list(range(_Ids.SYSTEM_BASE, _Ids.SYSTEM_BASE + cfg.system_tokens // bs))
        self.sub_system_ids = list(range(_Ids.SUB_SYSTEM_BASE, _Ids.SUB_SYSTEM_BASE + cfg.subagent_system_tokens // bs))

    def _ln(self, params: tuple[float, float]) -> float:
        return self.rng.lognormvariate(*params)

    def _api_time(self, new_tokens: int, out: int) -> float:
        c = self.cfg
        return round(0.2 + new_tokens / c.prefill_tok_per_s + out / c.decode_tok_per_s, 3)

    def _agent(self, sid: str, agent_id: str, t0: float, turns: int, base_ids: list[int], first_tokens: int,
               counter: list[int], depth: int) -> Agent:
        """One agent: ``turns`` turns over a growing context starting with ``base_ids``."""
        c, bs = self.cfg, self.cfg.block_size
        agent = Agent(agent_id=agent_id, t=t0)
        ctx_ids = list(base_ids)
        ctx_tokens = len(base_ids) * bs + first_tokens
        pending = first_tokens  # tokens appended since the last full block boundary bookkeeping
        t = t0
        think = 0.0
        for turn in range(turns):
            if turn > 0:
                growth = int(self._ln(self._growth))
                if self.rng.random() < c.reset_prob or ctx_tokens + growth > c.max_context_tokens:
                    # Compaction: system prompt + a fresh summary; the old prefix is gone.
                    ctx_ids = list(base_ids[: len(self.system_ids)] if depth == 0 else base_ids)
                    ctx_tokens = len(ctx_ids) * bs + c.reset_keep_tokens
                    pending = c.reset_keep_tokens
                else:
                    ctx_tokens += growth
                    pending += growth
            # Blocks that became full since the last turn get fresh ids (the prefix is kept).
            full = ctx_tokens // bs
            if full > len(ctx_ids):
                ctx_ids += self.ids.fresh(full - len(ctx_ids))
            out = max(1, int(self._ln(self._out)))
            counter[0] += 1
            api = self._api_time(pending, out)
            req = Request(uid=f"{sid}/{agent_id}/{counter[0]}", session=sid, agent=agent_id, t=round(t, 6),
                          input_tokens=ctx_tokens, output_tokens=out, hash_ids=list(ctx_ids),
                          namespace="", block_size=bs, think_time=round(think, 6), api_time=api, model=c.model)
            agent.items.append(req)
            pending = out
            ctx_tokens += out  # the response joins the context
            end = t + api
            if depth == 0 and turn < turns - 1 and self.rng.random() < c.subagent_group_prob:
                size = max(1, min(c.group_max, int(round(self._ln(self._group)))))
                sub_end = end
                for k in range(size):
                    st = end + self.rng.uniform(0.0, c.group_stagger_s)
                    task = max(bs, int(self.rng.lognormvariate(math.log(c.subagent_task_tokens), 0.5)))
                    sub_turns = max(1, int(round(self.rng.lognormvariate(math.log(c.subagent_turns_median), 0.6))))
                    sub = self._agent(sid, f"{agent_id}.s{counter[0]}_{k}" if depth else f"s{counter[0]}_{k}",
                                      st, sub_turns, self.sub_system_ids, task, counter, depth + 1)
                    sub.kind = "generated"
                    sub.duration = round(sub.recorded_end - st, 6)
                    agent.items.append(sub)
                    sub_end = max(sub_end, sub.recorded_end)
                end = sub_end
            think = self._ln(self._think)
            t = end + think
        return agent

    def session(self, i: int) -> Session:
        c = self.cfg
        sid = f"g{c.seed}-{i:05d}"
        turns = max(1, int(round(self.rng.lognormvariate(math.log(c.turns_median), 0.7))))
        first = max(1, int(self.rng.lognormvariate(math.log(c.first_user_tokens), 0.5)))
        root = self._agent(sid, "main", 0.0, turns, self.system_ids, first, [0], 0)
        return Session(session_id=sid, root=root, block_size=c.block_size, source="generator")

    def generate(self) -> Trace:
        sessions = [self.session(i) for i in range(self.cfg.sessions)]
        # Ids are unique across the whole generated trace and the prompts are shared: one namespace.
        ns = f"gen:{self.cfg.seed}"
        for s in sessions:
            for r in s.requests():
                r.namespace = ns
        return Trace(sessions=sessions, fmt="native", block_size=self.cfg.block_size)


def generate(cfg: GeneratorConfig | None = None) -> Trace:
    return SessionGenerator(cfg or GeneratorConfig()).generate()
