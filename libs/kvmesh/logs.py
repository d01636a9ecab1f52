"""Structured logging for every kvmesh process.

JSON lines by default (what log pipelines ingest); ``text`` for humans at a
terminal. Key/value context goes in ``extra={...}`` and is emitted as fields.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

_RESERVED = set(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in record.__dict__.items():
            if k not in _RESERVED and not k.startswith("_"):
                doc[k] = v if isinstance(v, (str, int, float, bool, type(None))) else repr(v)
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        extras = " ".join(
            f"{k}={v}" for k, v in record.__dict__.items() if k not in _RESERVED and not k.startswith("_")
        )
        base = f"{time.strftime('%H:%M:%S', time.localtime(record.created))} {record.levelname[:4]} {record.name}: {record.getMessage()}"
        out = f"{base} {extras}" if extras else base
        if record.exc_info:
            out += "\n" + self.formatException(record.exc_info)
        return out


def setup_logging(level: str | None = None, fmt: str | None = None) -> None:
    """Configure the root logger once; env KVMESH_LOG_LEVEL / KVMESH_LOG_FORMAT are defaults."""
    level = (level or os.environ.get("KVMESH_LOG_LEVEL") or "INFO").upper()
    fmt = fmt or os.environ.get("KVMESH_LOG_FORMAT") or ("text" if sys.stderr.isatty() else "json")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("httpx", "urllib3", "asyncio", "grpc._cython"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
