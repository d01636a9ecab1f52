"""Named shapes of generated agent traffic, shared by the commands that drive a live stack.

Why it exists: ``make demo`` and ``kvmesh soak`` both replay generated agent sessions, but they
need different prompt sizes. The demo wants prompts long enough that prefill dominates time to
first token, so a cache hit shows in its TTFT; the soak holds hundreds of sessions on a default
``kvmesh up`` stack (and on small test stacks) for half an hour, so its prompts must fit a
worker's KV many times over. When the demo's prompts grew 4x, the soak, which borrowed the
demo's shape, started sending prompts larger than its test stack's whole cache (HTTP 400). Each
command now names the shape it was sized for.
"""

from __future__ import annotations

from typing import Any

# What both shapes share: short sessions with frequent, large sub-agent bursts sharing their
# prompts, small outputs and seconds of thinking between turns.
_AGENT_RHYTHM: dict[str, Any] = dict(
    turns_median=6, output_median=24, output_p99=96, think_median_s=2.0, think_p99_s=30.0,
    reset_prob=0.02, subagent_group_prob=0.3, group_median=5, group_p90=12, group_max=12,
    subagent_turns_median=3, group_stagger_s=0.05)


def short_agent_sessions(sessions: int, seed: int) -> Any:
    """~3k-token prompts, up to 16k: what the soak runs, 200 sessions on a default stack."""
    from kvmesh_tools.traffic.generator import GeneratorConfig, generate

    return generate(GeneratorConfig(
        sessions=sessions, seed=seed, system_tokens=4096, first_user_tokens=600, growth_median=300,
        growth_p99=3000, max_context_tokens=16000, subagent_system_tokens=2048, subagent_task_tokens=300,
        **_AGENT_RHYTHM))


def long_agent_sessions(sessions: int, seed: int) -> Any:
    """12k-token prompts at the median, up to 64k: what ``make demo`` runs.

    Long enough that prefill dominates a request's time to first token, as in agent traffic
    (~195k tokens a turn in the shared traces; here less, so that three fresh stacks run in a
    few minutes): a hit on the sub-agents' shared 8k-token prompt saves ~0.2 s of (10x
    accelerated) prefill. With 3k-token prompts a hit saved ~10 ms, about what precise's index
    lookup costs, and the demo's TTFT showed the stack's own noise rather than the routing
    (docs/bench-history.md, "make demo's TTFT").
    """
    from kvmesh_tools.traffic.generator import GeneratorConfig, generate

    return generate(GeneratorConfig(
        sessions=sessions, seed=seed, system_tokens=16384, first_user_tokens=2000, growth_median=1200,
        growth_p99=12000, max_context_tokens=64000, subagent_system_tokens=8192, subagent_task_tokens=1500,
        **_AGENT_RHYTHM))
