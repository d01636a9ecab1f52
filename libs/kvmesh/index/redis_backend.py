"""Redis/Valkey block index, shared by several indexer replicas.

Why Redis: replicas of the indexer (and routers) must give identical answers,
so the index lives in one shared store; every piece of state that an answer
depends on is in Redis, none in the replica.

Layout (``NS`` = namespace, default ``kvm``; block keys are 8-byte big-endian
binary strings, the shortest exact form of a uint64):

- ``NS:{model}:h`` HASH ``<key8> -> ";<endpoint>\\x1f<tier>;..."`` (the holders of
  each block). One hash per model namespaces the keys and lets a lookup fetch a
  window of blocks with one HMGET, without building key names.
- ``NS:{model}:r:<endpoint>:<tier>`` SET of ``<key8>`` -- the per-endpoint
  reverse index, so clearing one endpoint costs O(its blocks), never a SCAN.
- ``NS:eps:<endpoint>`` SET naming the endpoint's reverse-index sets.
- ``NS:{model}:s:<key8>`` HASH ``endpoint -> expiry (ms)``: speculative
  entries; the key itself expires with its longest TTL.

Every update and every lookup is one Lua script call (one round trip, atomic).
The lookup script walks the chain server-side and stops at the first block no
endpoint extends. Clearing runs as Lua chunks of ``clear_chunk`` members so a
large endpoint never blocks Redis for long. The scripts build key names at
run time, so this layout targets standalone Redis/Valkey (or one shard), not
Redis Cluster.

Any connection error or timeout surfaces as ``IndexUnavailable``; the client
never retries on its own, so a caller's deadline bounds every call.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterable, Sequence

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvmesh.index.base import (
    TIERS,
    BlockIndex,
    EndpointMatch,
    IndexStats,
    IndexUnavailable,
    LookupResult,
    Tier,
)

log = logging.getLogger(__name__)

_SEP = "\x1f"

_ADD = """
local ns, model, ep, tier, blob = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local pre = ns .. ':{' .. model .. '}:'
local field = ep .. '\\31' .. tier .. ';'
local rkey = pre .. 'r:' .. ep .. ':' .. tier
local added = 0
local hkey = pre .. 'h'
local first = ';' .. field
for i = 1, #blob, 8 do
  local k = string.sub(blob, i, i + 7)
  -- The reverse set and the holder strings change together, so SADD says
  -- whether this endpoint/tier already holds the block.
  if redis.call('SADD', rkey, k) == 1 then
    added = added + 1
    if redis.call('HSETNX', hkey, k, first) == 0 then
      redis.call('HSET', hkey, k, redis.call('HGET', hkey, k) .. field)
    end
  end
end
redis.call('SADD', ns .. ':eps:' .. ep, rkey)
redis.call('SADD', ns .. ':endpoints', ep)
redis.call('SADD', ns .. ':models', model)
if added > 0 then redis.call('HINCRBY', ns .. ':stats', 'entries:' .. tier, added) end
return added
"""

# Removes ';<field>' from one block value; deletes the key when no holder is left.
_UNLINK_FN = """
local function unlink(hkey, k, field)
  local v = redis.call('HGET', hkey, k)
  if not v then return 0 end
  local s, e = string.find(v, ';' .. field, 1, true)
  if not s then return 0 end
  local rest = string.sub(v, 1, s) .. string.sub(v, e + 1)
  if rest == ';' then redis.call('HDEL', hkey, k) else redis.call('HSET', hkey, k, rest) end
  return 1
end
"""

_REMOVE = _UNLINK_FN + """
local ns, model, ep, tier, blob = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local pre = ns .. ':{' .. model .. '}:'
local field = ep .. '\\31' .. tier .. ';'
local rkey = pre .. 'r:' .. ep .. ':' .. tier
local removed = 0
for i = 1, #blob, 8 do
  local k = string.sub(blob, i, i + 7)
  removed = removed + unlink(pre .. 'h', k, field)
  redis.call('SREM', rkey, k)
end
if removed > 0 then redis.call('HINCRBY', ns .. ':stats', 'entries:' .. tier, -removed) end
return removed
"""

# Pops up to n members of one reverse-index set and unlinks them.
_CLEAR_CHUNK = _UNLINK_FN + """
local ns, rkey, n, pre, ep, tier = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5], ARGV[6]
local field = ep .. '\\31' .. tier .. ';'
local members = redis.call('SPOP', rkey, n)
local removed = 0
for _, k in ipairs(members) do
  removed = removed + unlink(pre .. 'h', k, field)
end
if removed > 0 then redis.call('HINCRBY', ns .. ':stats', 'entries:' .. tier, -removed) end
return {#members, removed}
"""

# ARGV: ns, model, spec(0/1), nallow, allow..., ndeny, deny..., blob, extra_model...
# The chain is read with HMGET over galloping windows (128, 256, ... 4096
# keys) and the walk stops at the first block that no candidate extends.
# Runs of blocks with the same holders share one (interned) Lua string, so
# the per-block work is one string comparison; holders are parsed only when
# the value changes.
_LOOKUP = """
local ns, model = ARGV[1], ARGV[2]
local pre = ns .. ':{' .. model .. '}:'
local spec = ARGV[3] == '1'
local idx = 4
local nallow = tonumber(ARGV[idx]); idx = idx + 1
local allow = nil
if nallow > 0 then
  allow = {}
  for j = 1, nallow do allow[ARGV[idx]] = true; idx = idx + 1 end
end
local ndeny = tonumber(ARGV[idx]); idx = idx + 1
local deny = {}
for j = 1, ndeny do deny[ARGV[idx]] = true; idx = idx + 1 end
local blob = ARGV[idx]
local nkeys = #blob / 8
local run, erun = {}, {}
local function walk(hkey)
  local cur, cure = nil, nil   -- active field / endpoint sets
  local prev = nil
  local pos = 0
  local stop = nil
  local win = 128
  while stop == nil and pos < nkeys do
    local hi = math.min(nkeys, pos + win)
    local args = {}
    local j = 1
    for i = pos + 1, hi do args[j] = string.sub(blob, i * 8 - 7, i * 8); j = j + 1 end
    local vals = redis.call('HMGET', hkey, unpack(args))
    for j2 = 1, hi - pos do
      local v = vals[j2]
      local p = pos + j2 - 1
      if not v then stop = p; break end
      if v ~= prev then
        prev = v
        local fields, eps = {}, {}
        for f in string.gmatch(v, '([^;]+)') do
          local ep = string.sub(f, 1, -3)
          if (allow == nil or allow[ep]) and not deny[ep] then fields[f] = true; eps[ep] = true end
        end
        if cur == nil then
          cur, cure = fields, eps
        else
          for f, _ in pairs(cur) do if not fields[f] then run[f] = math.max(run[f] or 0, p); cur[f] = nil end end
          for ep, _ in pairs(cure) do
            if not eps[ep] then erun[ep] = math.max(erun[ep] or 0, p); cure[ep] = nil end
          end
        end
        if next(cure) == nil then stop = p; break end
      end
    end
    pos = hi
    win = math.min(win * 2, 4096)
  end
  if stop == nil then stop = nkeys end
  if cur ~= nil then
    for f, _ in pairs(cur) do run[f] = math.max(run[f] or 0, stop) end
    for ep, _ in pairs(cure) do erun[ep] = math.max(erun[ep] or 0, stop) end
  end
end
walk(pre .. 'h')
-- Extra namespaces (offload stores that serve every model), in the same round trip.
for j = idx + 1, #ARGV do walk(ns .. ':{' .. ARGV[j] .. '}:h') end
for f, n in pairs(run) do if n == 0 then run[f] = nil end end
for ep, n in pairs(erun) do if n == 0 then erun[ep] = nil end end
local out_t, out_e, out_s = {}, {}, {}
for f, n in pairs(run) do out_t[#out_t + 1] = f; out_t[#out_t + 1] = n end
for ep, n in pairs(erun) do out_e[#out_e + 1] = ep; out_e[#out_e + 1] = n end
if spec then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local srun, sexp = {}, {}
  local pos = 0
  while pos < nkeys do
    local k = string.sub(blob, pos * 8 + 1, pos * 8 + 8)
    local kv = redis.call('HGETALL', pre .. 's:' .. k)
    local ext = false
    for j = 1, #kv, 2 do
      local ep, exp = kv[j], tonumber(kv[j + 1])
      if exp > now and (allow == nil or allow[ep]) and not deny[ep] and (srun[ep] or 0) == pos then
        srun[ep] = pos + 1
        if sexp[ep] == nil or exp < sexp[ep] then sexp[ep] = exp end
        ext = true
      end
    end
    if not ext then break end
    pos = pos + 1
  end
  for ep, n in pairs(srun) do
    out_s[#out_s + 1] = ep; out_s[#out_s + 1] = n; out_s[#out_s + 1] = sexp[ep] - now
  end
end
return {out_t, out_e, out_s}
"""

_PUT_SPEC = """
local ns, model, ep, ttl_ms, blob = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]
local pre = ns .. ':{' .. model .. '}:'
local t = redis.call('TIME')
local exp = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + ttl_ms
for i = 1, #blob, 8 do
  local key = pre .. 's:' .. string.sub(blob, i, i + 7)
  redis.call('HSET', key, ep, exp)
  if redis.call('PTTL', key) < ttl_ms then redis.call('PEXPIRE', key, ttl_ms) end
end
return 1
"""

_ENDPOINT_BLOCKS = """
local total = 0
for _, rkey in ipairs(redis.call('SMEMBERS', ARGV[1] .. ':eps:' .. ARGV[2])) do
  total = total + redis.call('SCARD', rkey)
end
return total
"""


def _pack(keys: Sequence[int]) -> bytes:
    return struct.pack(f">{len(keys)}Q", *keys)


class RedisIndex(BlockIndex):
    """Block index in Redis; safe to share between processes."""

    name = "redis"
    blocking = True

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", namespace: str = "kvm",
                 timeout_s: float = 1.0, clear_chunk: int = 2000, client: redis.Redis | None = None) -> None:
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis url {url!r} must start with redis://, rediss:// or unix://")
        self.url = url
        self.namespace = namespace
        self.clear_chunk = clear_chunk
        self.timeout_s = timeout_s
        self.r = client or redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0), retry_on_timeout=False, health_check_interval=0,
        )
        self._add = self.r.register_script(_ADD)
        self._remove = self.r.register_script(_REMOVE)
        self._clear_chunk = self.r.register_script(_CLEAR_CHUNK)
        self._lookup = self.r.register_script(_LOOKUP)
        self._put_spec = self.r.register_script(_PUT_SPEC)
        self._ep_blocks = self.r.register_script(_ENDPOINT_BLOCKS)

    def _call(self, fn, *args):  # type: ignore[no-untyped-def]
        try:
            return fn(*args)
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            raise IndexUnavailable(f"redis {self._safe_url()} unavailable: {exc}") from exc
        except redis.ResponseError as exc:
            if "LOADING" in str(exc) or "BUSY" in str(exc):
                raise IndexUnavailable(f"redis {self._safe_url()} not ready: {exc}") from exc
            raise

    def _safe_url(self) -> str:
        if "@" in self.url:
            scheme, rest = self.url.split("://", 1)
            return f"{scheme}://***@{rest.split('@', 1)[1]}"
        return self.url

    # ---- updates -------------------------------------------------------------------
    def add(self, model: str, endpoint: str, tier: Tier, keys: Sequence[int]) -> int:
        if not keys:
            return 0
        return int(self._call(self._add, [], [self.namespace, model, endpoint, int(Tier(tier)), _pack(keys)]))

    def remove(self, model: str, endpoint: str, tier: Tier, keys: Sequence[int]) -> int:
        if not keys:
            return 0
        return int(self._call(self._remove, [], [self.namespace, model, endpoint, int(Tier(tier)), _pack(keys)]))

    def clear_endpoint(self, endpoint: str, tier: Tier | None = None) -> int:
        reg = f"{self.namespace}:eps:{endpoint}"
        rkeys = [k.decode() for k in self._call(self.r.smembers, reg)]
        removed = 0
        for rkey in rkeys:
            if tier is not None and not rkey.endswith(f":{int(tier)}"):
                continue
            pre = rkey[: rkey.rindex(f"r:{endpoint}:")]
            while True:
                popped, gone = self._call(self._clear_chunk, [], [self.namespace, rkey, self.clear_chunk,
                                                                  pre, endpoint, rkey[-1]])
                removed += int(gone)
                if int(popped) == 0:
                    break
            self._call(self.r.srem, reg, rkey)
        if tier is None:
            self._call(self.r.srem, f"{self.namespace}:endpoints", endpoint)
        return removed

    def put_speculative(self, model: str, endpoint: str, keys: Sequence[int], ttl_s: float) -> None:
        if keys:
            self._call(self._put_spec, [], [self.namespace, model, endpoint, max(1, int(ttl_s * 1000)), _pack(keys)])

    # ---- lookup --------------------------------------------------------------------
    def lookup(self, model: str, keys: Sequence[int], endpoint_filter: Iterable[str] | None = None,
               include_speculative: bool = False, exclude: Iterable[str] | None = None,
               extra_models: Sequence[str] = ()) -> LookupResult:
        result = LookupResult(chain_length=len(keys))
        if not keys:
            return result
        allow = list(endpoint_filter or [])
        deny = list(exclude or [])
        args = [self.namespace, model, "1" if include_speculative else "0", len(allow), *allow,
                len(deny), *deny, _pack(keys), *[m for m in extra_models if m != model]]
        tiers, combined, spec = self._call(self._lookup, [], args)
        for i in range(0, len(tiers), 2):
            field = tiers[i].decode()
            ep, tier = field[:-2], int(field[-1])
            em = result.matches.get(ep) or result.matches.setdefault(ep, EndpointMatch(ep))
            em.tiers[Tier(tier)] = int(tiers[i + 1])
        for i in range(0, len(combined), 2):
            ep = combined[i].decode()
            em = result.matches.get(ep) or result.matches.setdefault(ep, EndpointMatch(ep))
            em.combined = int(combined[i + 1])
        for i in range(0, len(spec), 3):
            ep = spec[i].decode()
            em = result.matches.get(ep) or result.matches.setdefault(ep, EndpointMatch(ep))
            em.speculative = int(spec[i + 1])
            em.speculative_ttl_s = int(spec[i + 2]) / 1000.0
        return result

    # ---- introspection ---------------------------------------------------------------
    def endpoint_blocks(self, endpoint: str) -> int:
        return int(self._call(self._ep_blocks, [], [self.namespace, endpoint]))

    def endpoints(self) -> list[str]:
        return sorted(e.decode() for e in self._call(self.r.smembers, f"{self.namespace}:endpoints"))

    def stats(self) -> IndexStats:
        raw = self._call(self.r.hgetall, f"{self.namespace}:stats")
        by_tier = {t: int(raw.get(f"entries:{int(t)}".encode(), 0)) for t in TIERS}
        info = self._call(self.r.info, "memory")
        return IndexStats(
            backend=self.name,
            entries=sum(by_tier.values()),
            keys=sum(int(self._call(self.r.hlen, f"{self.namespace}:{{{m.decode()}}}:h"))
                     for m in self._call(self.r.smembers, f"{self.namespace}:models")),
            endpoints=int(self._call(self.r.scard, f"{self.namespace}:endpoints")),
            entries_by_tier=by_tier,
            counters={"used_memory": int(info.get("used_memory", 0))},
        )

    def ping(self) -> bool:
        try:
            return bool(self.r.ping())
        except (redis.RedisError, OSError):
            return False

    def check_auth(self) -> None:
        """Raise ValueError when Redis rejects our credentials (a configuration error, not an outage)."""
        try:
            self.r.ping()
        except redis.AuthenticationError as exc:
            raise ValueError(f"redis {self._safe_url()}: authentication failed: {exc}") from None
        except (redis.RedisError, OSError):
            pass  # unreachable now: lookups answer UNAVAILABLE until it is back

    def run_id(self) -> str | None:
        """The server's run id; it changes when Redis restarts (and lost its data)."""
        try:
            return str(self.r.info("server").get("run_id"))
        except (redis.RedisError, OSError):
            return None

    def close(self) -> None:
        self.r.close()
