"""``kvmesh up``: start the local stack and leave it serving until Ctrl-C."""

from __future__ import annotations

import argparse
import json
import signal
import time

from kvmesh.config import ConfigError, add_dataclass_args, load_config


def register(sub: argparse._SubParsersAction) -> None:
    from kvmesh_tools.stack.launcher import StackConfig

    p = sub.add_parser("up", help="run the local stack (router, indexer, workers, offload) until Ctrl-C")
    add_dataclass_args(p, StackConfig)
    p.set_defaults(func=_run)


def banner(d: dict[str, object], model: str) -> str:
    """What a user needs to point a client at the stack, printed once it is up."""
    return "\n".join([
        "",
        "kvmesh is serving (Ctrl-C to stop)",
        f"  OpenAI base URL   {d['router_http']}/v1      model: {model}",
        f"  try it            curl {d['router_http']}/v1/chat/completions -H 'content-type: application/json' "
        f"-d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"hi\"}}]}}'",
        f"  router gRPC       {d['router_grpc']}",
        *([f"  router replicas   {', '.join(map(str, d['routers_http']))} behind Envoy (admin {d['envoy_admin']})"]
          if d.get("envoy_admin") else []),
        f"  metrics           {d['router_metrics']}",
        f"  tokenizer         {d['model_dir']}",
        f"  logs              {d['logs']}",
    ])


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _run(args: argparse.Namespace) -> int:
    from kvmesh_tools.stack.launcher import LocalStack, StackConfig

    try:
        cfg = load_config(StackConfig, args, env_prefix="KVMESH_STACK_")
    except ConfigError as exc:
        print(f"error: {exc}")
        return 2
    if cfg.router_port == 0 and args.router_port is None:
        cfg.router_port = 50050
    if cfg.http_port == 0 and args.http_port is None:
        cfg.http_port = 8000
    signal.signal(signal.SIGTERM, _raise_interrupt)
    stack = LocalStack(cfg)
    try:
        print("starting the kvmesh stack ...", flush=True)
        stack.start()
        d = stack.describe()
        print(json.dumps(d, indent=1))
        print(banner(d, cfg.model), flush=True)
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
