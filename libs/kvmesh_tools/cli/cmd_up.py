"""``kvmesh up``: start the local stack and leave it serving until Ctrl-C."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvmesh.config import ConfigError, add_dataclass_args, load_config
from kvmesh_tools.stack.launcher import StackConfig
from kvmesh_tools.stack.stop_signals import stop_on_signals


def _stack_help(name: str) -> Mapping[str, Any]:
    """A ``StackConfig`` field's help, for a field ``UpConfig`` gives another default."""
    return StackConfig.__dataclass_fields__[name].metadata


@dataclass
class UpConfig(StackConfig):
    """The stack ``kvmesh up`` serves: on the well-known router ports, where the library's
    default (0, free ports) suits tests that run several stacks at once."""

    router_port: int = field(default=50050, metadata={"help": "router gRPC port (0 = free port)"})
    http_port: int = field(default=8000, metadata={"help": "router OpenAI HTTP port (0 = free port)"})
    # Sim workers that answer as a model does for an agent: a client that names no max_tokens (curl,
    # LangChain) gets an answer that ends, and an agent's tool loop (Claude Code, Codex, the Agents
    # SDK) ends after a few calls.
    answer_tokens: int = field(default=256, metadata=_stack_help("answer_tokens"))
    tool_call_share: float = field(default=0.75, metadata=_stack_help("tool_call_share"))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="run the local stack (router, indexer, workers, offload) until Ctrl-C")
    add_dataclass_args(p, UpConfig)
    p.set_defaults(func=_run)


def banner(d: dict[str, object], model: str, api_key: str = "") -> str:
    """What a user needs to point a client at the stack, printed once it is up."""
    auth = f" -H 'authorization: Bearer {api_key}'" if api_key else ""
    return "\n".join([
        "",
        "kvmesh is serving (Ctrl-C to stop)",
        f"  OpenAI base URL   {d['router_http']}/v1      model: {model}",
        (f"  API key           {api_key}   (also in {d['api_key_file']}; OPENAI_API_KEY / ANTHROPIC_API_KEY)"
         if api_key else "  API key           none: AUTH IS OFF (--auth off), anyone reaching the ports is served"),
        f"  try it            curl {d['router_http']}/v1/chat/completions -H 'content-type: application/json'{auth} "
        f"-d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"hi\"}}]}}'",
        f"  router gRPC       {d['router_grpc']}",
        *([f"  mutual TLS        on; CA {d['tls']['ca']}, admin identity {d['tls']['admin_cert']} "
           f"(--tls off for plaintext)"] if isinstance(d.get("tls"), dict) else ["  mutual TLS        off"]),
        *([f"  router replicas   {', '.join(map(str, d['routers_http']))} behind Envoy (admin {d['envoy_admin']})"]
          if d.get("envoy_admin") else []),
        (f"  metrics           {d['router_metrics']}   (Authorization: Bearer <the token in "
         f"{d['metrics_token_file']}>)" if d.get("metrics_token_file")
         else f"  metrics           {d['router_metrics']}   (open: --metrics-auth off)"),
        f"  tokenizer         {d['model_dir']}",
        f"  logs              {d['logs']}",
    ])


def _run(args: argparse.Namespace) -> int:
    from kvmesh_tools.stack.launcher import LocalStack

    try:
        cfg = load_config(UpConfig, args)
    except ConfigError as exc:
        print(f"error: {exc}")
        return 2
    stop_on_signals()
    stack = LocalStack(cfg)
    try:
        print("starting the kvmesh stack ...", flush=True)
        stack.start()
        d = stack.describe()
        print(json.dumps(d, indent=1))
        print(f"stack description (addresses, pids) in {stack.write_description()}")
        print(banner(d, cfg.model, stack.api_key), flush=True)
        while True:
            dead = [sp.name for sp in stack.procs if not sp.alive()]
            if stack.envoy is not None and not stack.envoy.alive():
                dead.append("envoy")
            if dead:
                print(f"error: service(s) exited: {', '.join(dead)}; logs in {d['logs']}")
                return 1
            time.sleep(1.0)
    except KeyboardInterrupt:
        print("\nstopping ...", flush=True)
        return 0
    except (RuntimeError, TimeoutError, ValueError) as exc:
        print(f"error: {exc}")
        return 1
    finally:
        stack.stop()
