"""Redis/Valkey block index, shared by several indexer replicas.

Why Redis: replicas of the indexer (and routers) must give identical answers,
so the index lives in one shared store; every piece of state that an answer
depends on is in Redis, none in the replica.

Layout (``NS`` = namespace, default ``kvm``; block keys are 8-byte big-endian
binary strings, the shortest exact form of a uint64):

- ``NS:{model}:h`` HASH ``<key8> -> ";<endpoint>\\x1f<tier>;..."`` (the holders of
  each block). One hash per model namespaces the keys and lets a lookup fetch a
  window of blocks with one HMGET, without building key names.
- ``NS:{model}:r:<endpoint>:<tier>`` HASH ``<key8> -> r<n> | p<parent8><n>``, the
  per-endpoint reverse index (clearing one endpoint costs O(its blocks), never
  a SCAN). It also records each block's parent and how many of its children
  this holder has, which is what keeps the prefix-closed flag below exact.
- ``NS:{model}:dirty`` SET of endpoints whose held blocks may not be
  prefix-closed (a block stored without its parent, a removal that left
  children behind, or a producer that gave no parent links).
- ``NS:eps:<endpoint>`` SET naming the endpoint's reverse-index hashes.
- ``NS:{model}:sp`` HASH ``<key8> -> "<endpoint>=<expiry ms>:<put>;..."``:
  speculative entries (a router's picks), with ``<put>`` the number of the write
  (``NS:{model}:spseq``); written and probed by ``redis_common`` (``LUA_PUT_SPEC``,
  ``LUA_SPEC_PROBE``), as in the cluster layout. Clearing a whole endpoint (its
  engine was reset or it is gone) drops its entries: the picks made for it are void.
- Rolling upgrade: layout 2 first kept one hash per block, ``NS:{model}:s:<key8>``
  (``endpoint -> expiry``), read with one HGETALL per block (~9 ms of Redis time
  for a 3,400-block chain). An indexer not yet upgraded still writes and reads only
  that form. This one reads it too, as a fallback: a lookup checks whether the
  chain's first block has such a key (one EXISTS; old writes are chains from their
  first block too) and only then walks it block by block, each endpoint keeping
  the longer of its two runs. So during an upgrade new replicas see old replicas'
  picks; old replicas do not see new ones (they cannot be changed), for at most
  one TTL (``MAX_SPECULATIVE_TTL_S``, 300 s) after the last old replica stops.
  Writing both forms was not done: it brings back the ~12 ms per write the new
  form removed, for a loss that is a few seconds of predictions on some replicas.
  Clearing an endpoint does not reach old-form entries (they expire on their own).
- ``NS:layout`` the layout version, checked at start.

Why the prefix-closed flag: an engine stores a block only after its parent
and evicts children before parents (vLLM frees a request's blocks tail
first), so for a clean endpoint "holds block i of a chain" flips from true to
false once. The lookup then reads every ``probe_stride``-th block and one
stride-long gap per distinct run end, about ``n / stride + stride`` reads
instead of ``n``; dirty endpoints are walked block by block. The answer is
the same either way (tested against the in-memory backend).

Speculative entries are probed the same way (``redis_common.LUA_SPEC_PROBE``).

Every update and every lookup is one Lua script call (one round trip, atomic).
The lookup stops at the first probe no candidate holds. Clearing runs as Lua
chunks of ``clear_chunk`` members so a large endpoint never blocks Redis for
long. The scripts build key names at run time, so this layout targets
standalone Redis/Valkey (or one shard), not Redis Cluster.

Any connection error or timeout surfaces as ``IndexUnavailable``; the client
never retries on its own, so a caller's deadline bounds every call. The Lua
pieces and client glue the cluster backend shares are in ``redis_common``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from typing import Any

import redis
import redis.asyncio
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvmesh.index.base import TIERS, IndexStats, LookupResult, Tier
from kvmesh_indexer.redis_common import (
    LUA_FILTER,
    LUA_LIB,
    LUA_PROBE,
    LUA_PUT_SPEC,
    LUA_SPEC_LEGACY,
    LUA_SPEC_PROBE,
    SPEC_DROP,
    RedisIndexBase,
    add_matches,
    filter_args,
    pack_keys,
    pairs_of,
    starts_args,
)

log = logging.getLogger(__name__)

_SEP = "\x1f"

# The reverse-index value, 'r<children>' for a first block or 'p<parent8><children>' where
# <children> counts this holder's blocks whose parent is this block (the rest of the Lua
# helpers: redis_common.LUA_LIB).
_LIB = LUA_LIB + """
local function rparse(v)
  if string.sub(v, 1, 1) == 'r' then return nil, tonumber(string.sub(v, 2)) end
  return string.sub(v, 2, 9), tonumber(string.sub(v, 10))
end
local function rval(par, n)
  if not par then return 'r' .. numstr(n) end
  return 'p' .. par .. numstr(n)
end
"""

# ARGV: ns, model, ep, tier, blob, nstarts, (offset, parent8 or '')...
# nstarts == 0 means the parent links are unknown.
_ADD = _LIB + """
local ns, model, ep, tier, blob = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local nst = tonumber(ARGV[6])
local starts = {}
for j = 0, nst - 1 do starts[tonumber(ARGV[7 + 2 * j])] = ARGV[8 + 2 * j] end
local pre = ns .. ':{' .. model .. '}:'
local field = ep .. '\\31' .. tier .. ';'
local rkey = pre .. 'r:' .. ep .. ':' .. tier
local hkey = pre .. 'h'
local ks = keys_of(blob)
local have = hmget_all(rkey, ks)
local dirty = nst == 0
-- nch[k]: children of new key k in this batch (nil: k is not new); npar[k]: its parent or false
-- (parallel tables: a table per key cost more than the work)
local newk, npar, nch, ext = {}, {}, {}, {}
local prev = nil
for i = 1, #ks do
  local k = ks[i]
  local par = starts[i - 1]
  if par == nil then par = prev elseif par == '' then par = false end
  prev = k
  if not have[i] and nch[k] == nil then
    newk[#newk + 1] = k
    npar[k] = par or false
    nch[k] = 0
    if par == nil then dirty = true
    elseif par then
      if nch[par] then nch[par] = nch[par] + 1 else ext[par] = (ext[par] or 0) + 1 end
    end
  end
end
local out = {}
for _, k in ipairs(newk) do
  out[#out + 1] = k
  out[#out + 1] = rval(npar[k], nch[k])
end
local pk = {}
for p, _ in pairs(ext) do pk[#pk + 1] = p end
if #pk > 0 then
  local pv = hmget_all(rkey, pk)
  for j, p in ipairs(pk) do
    if pv[j] then
      local pp, n = rparse(pv[j])
      out[#out + 1] = p
      out[#out + 1] = rval(pp, n + ext[p])
    else
      dirty = true  -- an orphan: its parent is not held here
    end
  end
end
hset_all(rkey, out)
if #newk > 0 then hold_all(hkey, newk, field) end
if dirty then redis.call('SADD', pre .. 'dirty', ep) end
redis.call('SADD', ns .. ':eps:' .. ep, rkey)
redis.call('SADD', ns .. ':endpoints', ep)
redis.call('SADD', ns .. ':models', model)
if #newk > 0 then redis.call('HINCRBY', ns .. ':stats', 'entries:' .. tier, #newk) end
return #newk
"""

# Removing a block that still has children here leaves orphans, so the
# endpoint loses the prefix-closed guarantee (marked dirty). Children removed
# in the same call do not count, whatever their order in the batch.
_REMOVE = _LIB + """
local ns, model, ep, tier, blob = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local pre = ns .. ':{' .. model .. '}:'
local field = ep .. '\\31' .. tier .. ';'
local rkey = pre .. 'r:' .. ep .. ':' .. tier
local hkey = pre .. 'h'
local ks = keys_of(blob)
local have = hmget_all(rkey, ks)
local gone, order = {}, {}
for i = 1, #ks do
  local v = have[i]
  if v and gone[ks[i]] == nil then
    local par, n = rparse(v)
    gone[ks[i]] = {par, n}
    order[#order + 1] = ks[i]
  end
end
local ext = {}
for _, k in ipairs(order) do
  local par = gone[k][1]
  if par then
    if gone[par] then gone[par][2] = gone[par][2] - 1 else ext[par] = (ext[par] or 0) + 1 end
  end
end
local dirty = false
for _, k in ipairs(order) do
  if gone[k][2] > 0 then dirty = true end
  unlink(hkey, k, field)
end
for lo = 1, #order, CH do redis.call('HDEL', rkey, unpack(order, lo, math.min(#order, lo + CH - 1))) end
local pk = {}
for p, _ in pairs(ext) do pk[#pk + 1] = p end
if #pk > 0 then
  local pv = hmget_all(rkey, pk)
  local out = {}
  for j, p in ipairs(pk) do
    if pv[j] then
      local pp, n = rparse(pv[j])
      out[#out + 1] = p
      out[#out + 1] = rval(pp, math.max(0, n - ext[p]))
    end
  end
  hset_all(rkey, out)
end
if dirty then redis.call('SADD', pre .. 'dirty', ep) end
if #order > 0 then redis.call('HINCRBY', ns .. ':stats', 'entries:' .. tier, -#order) end
return #order
"""

# Pops up to n members of one reverse index and unlinks them.
_CLEAR_CHUNK = LUA_LIB + """
local ns, rkey, n, pre, ep, tier = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5], ARGV[6]
local field = ep .. '\\31' .. tier .. ';'
local members = redis.call('HRANDFIELD', rkey, n)
local removed = 0
for _, k in ipairs(members) do
  removed = removed + unlink(pre .. 'h', k, field)
end
if #members > 0 then redis.call('HDEL', rkey, unpack(members)) end
if removed > 0 then redis.call('HINCRBY', ns .. ':stats', 'entries:' .. tier, -removed) end
return {#members, removed}
"""

# ARGV: ns, model, spec(0/1), stride, nallow, allow..., ndeny, deny..., blob, extra_model...
#
# Endpoints not in the model's dirty set hold prefix-closed block sets (every
# block's parent is held in the same tier), so along a chain "holds block i"
# can only go from true to false once. For them the script reads every
# ``stride``-th block (galloping windows, stopping at the first probe no
# candidate holds) and then only the one stride-long gap where each run ends.
# Dirty endpoints are walked block by block (HMGET windows, stopping at the
# first block none of them extends); runs of blocks with the same holders
# share one interned Lua string, so that walk parses a value only when it
# changes.
_LOOKUP = LUA_LIB + """
local ns, model = ARGV[1], ARGV[2]
local pre = ns .. ':{' .. model .. '}:'
local spec = ARGV[3] == '1'
local S = tonumber(ARGV[4])
local idx = 5
""" + LUA_FILTER + """
local blob = ARGV[idx]
local nkeys = #blob / 8
local run, erun = {}, {}
local function key(p) return string.sub(blob, p * 8 + 1, p * 8 + 8) end
""" + LUA_SPEC_PROBE + LUA_SPEC_LEGACY + """
local function fields_of(v, want)
  local fs = {}
  if v then
    for f in string.gmatch(v, '([^;]+)') do
      if want(string.sub(f, 1, -3)) then fs[f] = true end
    end
  end
  return fs
end
local function note(f, n)
  if n > 0 then
    run[f] = math.max(run[f] or 0, n)
    local ep = string.sub(f, 1, -3)
    erun[ep] = math.max(erun[ep] or 0, n)
  end
end
""" + LUA_PROBE + """
local function probe_walk(hkey, want)
  for f, n in pairs(probe(hkey, fields_of(redis.call('HGET', hkey, key(0)), want))) do note(f, n) end
end
local function block_walk(hkey, want)
  local cur, cure = nil, nil   -- active field / endpoint sets
  local prev = nil
  local pos = 0
  local stop = nil
  local win = 128
  local frun = {}
  while stop == nil and pos < nkeys do
    local hi = math.min(nkeys, pos + win)
    local args = {}
    for i = pos, hi - 1 do args[#args + 1] = key(i) end
    local vals = redis.call('HMGET', hkey, unpack(args))
    for j2 = 1, hi - pos do
      local v = vals[j2]
      local p = pos + j2 - 1
      if not v then stop = p; break end
      if v ~= prev then
        prev = v
        local fields = fields_of(v, want)
        local eps = {}
        for f, _ in pairs(fields) do eps[string.sub(f, 1, -3)] = true end
        if cur == nil then
          cur, cure = fields, eps
        else
          for f, _ in pairs(cur) do if not fields[f] then frun[f] = p; cur[f] = nil end end
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
    for f, _ in pairs(cur) do frun[f] = stop end
    for ep, _ in pairs(cure) do erun[ep] = math.max(erun[ep] or 0, stop) end
  end
  for f, n in pairs(frun) do if n > 0 then run[f] = math.max(run[f] or 0, n) end end
end
local function search(p)
  local dirty = {}
  local nd = 0
  for _, ep in ipairs(redis.call('SMEMBERS', p .. 'dirty')) do
    if allowed(ep) then dirty[ep] = true; nd = nd + 1 end
  end
  probe_walk(p .. 'h', function(ep) return allowed(ep) and not dirty[ep] end)
  if nd > 0 then block_walk(p .. 'h', function(ep) return dirty[ep] == true end) end
end
search(pre)
-- Extra namespaces (offload stores that serve every model), in the same round trip.
for j = idx + 1, #ARGV do search(ns .. ':{' .. ARGV[j] .. '}:') end
for ep, n in pairs(erun) do if n == 0 then erun[ep] = nil end end
local out_t, out_e, out_s = {}, {}, {}
for f, n in pairs(run) do out_t[#out_t + 1] = f; out_t[#out_t + 1] = n end
for ep, n in pairs(erun) do out_e[#out_e + 1] = ep; out_e[#out_e + 1] = n end
if spec then
  out_s = spec_probe(pre .. 'sp', nkeys)
  -- Layout 2's first form (one hash per block), written by indexers not yet upgraded.
  if redis.call('EXISTS', pre .. 's:' .. key(0)) == 1 then
    out_s = spec_legacy(out_s, nkeys, function(p)
      local kv, t = redis.call('HGETALL', pre .. 's:' .. key(p)), {}
      for j = 1, #kv, 2 do t[kv[j]] = tonumber(kv[j + 1]) end
      return t
    end)
  end
end
-- runs joined into one string each (``redis_common.pairs_of``)
return {table.concat(out_t, ';'), table.concat(out_e, ';'), out_s}
"""

# ARGV: ns, model, endpoint, ttl_ms, blob (a chain from its first block); see redis_common.LUA_PUT_SPEC.
_PUT_SPEC = LUA_LIB + LUA_PUT_SPEC + """
local ns, model = ARGV[1], ARGV[2]
local pre = ns .. ':{' .. model .. '}:'
put_spec(pre .. 'sp', pre .. 'spseq', ARGV[3], tonumber(ARGV[4]), ARGV[5])
redis.call('SADD', ns .. ':models', model)
return 1
"""


_ENDPOINT_BLOCKS = """
local total = 0
for _, rkey in ipairs(redis.call('SMEMBERS', ARGV[1] .. ':eps:' .. ARGV[2])) do
  total = total + redis.call('HLEN', rkey)
end
return total
"""


LAYOUT_VERSION = "2"


class RedisIndex(RedisIndexBase):
    """Block index in Redis; safe to share between processes."""

    name = "redis"

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", namespace: str = "kvm",
                 timeout_s: float = 1.0, clear_chunk: int = 2000, client: redis.Redis | None = None,
                 probe_stride: int = 32) -> None:
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis url {url!r} must start with redis://, rediss:// or unix://")
        self.url = url
        self.namespace = namespace
        self.clear_chunk = clear_chunk
        if probe_stride < 1:
            raise ValueError(f"probe_stride must be >= 1, got {probe_stride}")
        self.probe_stride = probe_stride
        self._layout_checked = False
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
        self._spec_drop = self.r.register_script(SPEC_DROP)
        self._ep_blocks = self.r.register_script(_ENDPOINT_BLOCKS)
        # Lookups from the servicer's event loop go through an asyncio client of the same URL
        # (``lookup_async``): no thread hop (~0.5-0.6 ms a lookup at load 3, of ~1-1.5 ms). Only
        # when this index made its own client; a client passed in is used as it is, from a thread.
        self.native_async = client is None
        self._aclient: tuple[asyncio.AbstractEventLoop, Any, Any] | None = None   # (loop, client, script)
        self._closing: asyncio.Task | None = None

    # ---- updates -------------------------------------------------------------------
    def layout_value(self) -> str:
        return LAYOUT_VERSION

    def layout_mismatch(self, found: str) -> str:
        return (f"redis namespace {self.namespace!r} holds index layout v{found}, this indexer writes "
                f"v{LAYOUT_VERSION}; use another --redis-namespace or delete its keys")

    def add(self, model: str, endpoint: str, tier: Tier, keys: Sequence[int],
            chain_starts: Sequence[tuple[int, int | None]] | None = None) -> int:
        if not keys:
            return 0
        self._check_layout()
        return int(self._call(self._add, [], [self.namespace, model, endpoint, int(Tier(tier)), pack_keys(keys),
                                              *starts_args(chain_starts)]))

    def remove(self, model: str, endpoint: str, tier: Tier, keys: Sequence[int]) -> int:
        if not keys:
            return 0
        self._check_layout()
        return int(self._call(self._remove, [], [self.namespace, model, endpoint, int(Tier(tier)), pack_keys(keys)]))

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
                # Nothing of the endpoint is left under this model: it is prefix-closed again.
                self._call(self.r.srem, f"{pre}dirty", endpoint)
        if tier is None:
            self._call(self.r.srem, f"{self.namespace}:endpoints", endpoint)
            for m in self._call(self.r.smembers, f"{self.namespace}:models"):
                self._drop_speculative(f"{self.namespace}:{{{m.decode()}}}:sp", endpoint)
        return removed

    def _drop_speculative(self, skey: str, endpoint: str) -> None:
        """Drop ``endpoint``'s speculative entries from one hash, ``clear_chunk`` fields a call."""
        cursor = b"0"
        while True:
            cursor = self._call(self._spec_drop, [skey], [cursor, endpoint, self.clear_chunk])
            if cursor in (b"0", 0, "0"):
                return

    def put_speculative(self, model: str, endpoint: str, keys: Sequence[int], ttl_s: float) -> None:
        if keys:
            self._call(self._put_spec, [], [self.namespace, model, endpoint, max(1, int(ttl_s * 1000)), pack_keys(keys)])

    # ---- lookup --------------------------------------------------------------------
    def lookup(self, model: str, keys: Sequence[int], endpoint_filter: Iterable[str] | None = None,
               include_speculative: bool = False, exclude: Iterable[str] | None = None,
               extra_models: Sequence[str] = ()) -> LookupResult:
        result = LookupResult(chain_length=len(keys))
        if not keys:
            return result
        tiers, combined, spec = self._call(self._lookup, [], self._lookup_args(
            model, keys, endpoint_filter, include_speculative, exclude, extra_models))
        return add_matches(result, pairs_of(tiers), pairs_of(combined), spec)

    async def lookup_async(self, model: str, keys: Sequence[int], endpoint_filter: Iterable[str] | None = None,
                           include_speculative: bool = False, exclude: Iterable[str] | None = None,
                           extra_models: Sequence[str] = ()) -> LookupResult:
        """``lookup`` on the running event loop's asyncio client (the same script and answer)."""
        result = LookupResult(chain_length=len(keys))
        if not keys:
            return result
        loop = asyncio.get_running_loop()
        if self._aclient is None or self._aclient[0] is not loop:
            # A client belongs to the loop it was made in (tests run several loops in one process).
            ac = redis.asyncio.Redis.from_url(
                self.url, socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s,
                retry=AsyncRetry(NoBackoff(), 0), retry_on_timeout=False, health_check_interval=0)
            self._aclient = (loop, ac, ac.register_script(_LOOKUP))
        args = self._lookup_args(model, keys, endpoint_filter, include_speculative, exclude, extra_models)
        with self._redis_errors():
            tiers, combined, spec = await self._aclient[2](keys=[], args=args)
        return add_matches(result, pairs_of(tiers), pairs_of(combined), spec)

    def _lookup_args(self, model: str, keys: Sequence[int], endpoint_filter: Iterable[str] | None,
                     include_speculative: bool, exclude: Iterable[str] | None,
                     extra_models: Sequence[str]) -> list[Any]:
        return [self.namespace, model, "1" if include_speculative else "0", self.probe_stride,
                *filter_args(endpoint_filter, exclude), pack_keys(keys), *[m for m in extra_models if m != model]]

    def close(self) -> None:
        super().close()
        ac, self._aclient = self._aclient, None
        if ac is not None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return   # no loop now: the process is ending and its sockets with it
            if loop is ac[0]:
                self._closing = loop.create_task(ac[1].aclose())   # kept so it is not collected

    # ---- introspection ---------------------------------------------------------------
    def endpoint_blocks(self, endpoint: str) -> int:
        return int(self._call(self._ep_blocks, [], [self.namespace, endpoint]))

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

    def run_id(self) -> str | None:
        """The server's run id; it changes when Redis restarts (and lost its data)."""
        try:
            return str(self.r.info("server").get("run_id"))
        except (redis.RedisError, OSError):
            return None
