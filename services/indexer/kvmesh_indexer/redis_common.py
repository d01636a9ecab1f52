"""What the two Redis index backends share: Lua building blocks and the client glue.

``redis_backend`` (one Redis or Valkey) and ``redis_cluster_backend`` (Redis Cluster) keep
their own key layouts and scripts, one backend per file; the parts that do not depend on the
layout live here once, so a fix to the lookup's probing or to error mapping reaches both:

- ``LUA_LIB``: chunked HMGET/HSET (Lua's ``unpack`` has a stack limit), ``keys_of`` (a
  blob of 8-byte keys as a table), ``unlink`` (drop one holder from a block's holder list,
  the key with it when none is left), ``numstr`` (memoized number to string), ``now_ms``
  (the server's clock) and ``hold_all`` (append one holder field to many blocks).
- ``LUA_FILTER``: the lookup's endpoint filter (allow list, deny list) read from ``ARGV``
  from position ``idx`` on, and ``allowed(ep)``.
- ``LUA_PROBE``: ``probe(hkey, cand)``, the prefix-closed walk: holder fields in ``cand``
  (held at position 0) are read every ``S``-th block, then the one gap where each run ends.
- ``RedisIndexBase``: error mapping to ``IndexUnavailable``, the layout check, credentials,
  the argument encodings and the assembly of a ``LookupResult``.

A script includes the snippets it needs by concatenation; ``LUA_FILTER`` and ``LUA_PROBE``
expect the including script to define what they name (``idx``; ``key(p)``, ``S``, ``nkeys``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar

import redis

from kvmesh.index.base import BlockIndex, EndpointMatch, IndexUnavailable, LookupResult, Tier
from kvmesh.index.packed import packed_blob

LUA_LIB = """
local CH = 1000
local function hmget_all(key, ks)
  local out = {}
  for lo = 1, #ks, CH do
    local vs = redis.call('HMGET', key, unpack(ks, lo, math.min(#ks, lo + CH - 1)))
    for j = 1, #vs do out[lo + j - 1] = vs[j] end
  end
  return out
end
local function hset_all(key, kv)
  for lo = 1, #kv, 2 * CH do redis.call('HSET', key, unpack(kv, lo, math.min(#kv, lo + 2 * CH - 1))) end
end
local function keys_of(blob)
  local ks = {}
  for i = 1, #blob / 8 do ks[i] = string.sub(blob, i * 8 - 7, i * 8) end
  return ks
end
-- Removes ';<field>' from one block's holders; deletes the field when no holder is left.
local function unlink(hkey, k, field)
  local v = redis.call('HGET', hkey, k)
  if not v then return 0 end
  local s, e = string.find(v, ';' .. field, 1, true)
  if not s then return 0 end
  local rest = string.sub(v, 1, s) .. string.sub(v, e + 1)
  if rest == ';' then redis.call('HDEL', hkey, k) else redis.call('HSET', hkey, k, rest) end
  return 1
end
-- Numbers as strings, memoized: depths and child counts repeat, and Lua's number to string
-- conversion (a sprintf) was a visible share of an add's per-block work.
local NUMS = {}
local function numstr(x)
  local s = NUMS[x]
  if s == nil then s = tostring(x); NUMS[x] = s end
  return s
end
-- Appends ``field`` to the holders of every key in ``ks`` that lacks it (HMGET, then one HSET of
-- the changed fields). Blocks of a chain mostly share one holder value (Lua interns strings, so
-- equal values are one table key), so each distinct value is searched and extended once.
-- Returns the keys that were changed, in order.
local function hold_all(hkey, ks, field)
  local needle = ';' .. field
  local vs = hmget_all(hkey, ks)
  local kv, memo, added = {}, {}, {}
  for i = 1, #ks do
    local v = vs[i] or ';'
    local nv = memo[v]
    if nv == nil then
      if string.find(v, needle, 1, true) then nv = false else nv = v .. field end
      memo[v] = nv
    end
    if nv then
      kv[#kv + 1] = ks[i]
      kv[#kv + 1] = nv
      added[#added + 1] = ks[i]
    end
  end
  hset_all(hkey, kv)
  return added
end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

LUA_FILTER = """
local nallow = tonumber(ARGV[idx]); idx = idx + 1
local allow = nil
if nallow > 0 then
  allow = {}
  for j = 1, nallow do allow[ARGV[idx]] = true; idx = idx + 1 end
end
local ndeny = tonumber(ARGV[idx]); idx = idx + 1
local deny = {}
for j = 1, ndeny do deny[ARGV[idx]] = true; idx = idx + 1 end
local function allowed(ep) return (allow == nil or allow[ep]) and not deny[ep] end
"""

# Endpoints whose blocks are prefix-closed (every block's parent held in the same tier) hold
# block i of a chain "true then false" once, so for them the walk reads every S-th block
# (galloping HMGET windows, stopping at the first probe none of the candidates holds) and then
# only the one stride-long gap where each run ends: about n / S + S reads instead of n.
# Holder values repeat along a chain (runs of blocks with the same holders), and Lua interns
# strings, so each distinct value is parsed once into a set of its fields and a value equal to
# the previous one is skipped: a field check is a table lookup, not a string search (building
# ';' .. f .. ';' and searching it per field and block was most of the lookup's server time).
# Returns ends[field] = the run's length from position 0 (fields of ``cand`` only).
LUA_PROBE = """
local function probe(hkey, cand)
  local ends, alive, last = {}, {}, {}
  if next(cand) == nil then return ends end
  local sets, none = {}, {}
  local function holders(v)
    if not v then return none end
    local t = sets[v]
    if t == nil then
      t = {}
      for f in string.gmatch(v, '([^;]+)') do t[f] = true end
      sets[v] = t
    end
    return t
  end
  for f, _ in pairs(cand) do alive[f] = true; last[f] = 0 end
  local nprobe = math.floor((nkeys - 1) / S) + 1
  local j, win, pv = 1, 8, nil
  local nalive = 1
  while nalive > 0 and j < nprobe do
    local hi = math.min(nprobe - 1, j + win - 1)
    local args = {}
    for q = j, hi do args[#args + 1] = key(q * S) end
    local vals = redis.call('HMGET', hkey, unpack(args))
    for q = j, hi do
      local v = vals[q - j + 1]
      if v ~= pv then
        pv = v
        local h = holders(v)
        for f, _ in pairs(alive) do
          if not h[f] then alive[f] = nil; last[f] = q - 1 end   -- alive at the probe before
        end
      end
      if next(alive) == nil then nalive = 0; break end
    end
    j = hi + 1
    win = math.min(win * 2, 256)
  end
  for f, _ in pairs(alive) do last[f] = nprobe - 1 end
  -- Each run ends inside the gap after its last probe; read each gap once.
  local gaps = {}
  for f, q in pairs(last) do
    gaps[q] = gaps[q] or {}
    gaps[q][#gaps[q] + 1] = f
  end
  for q, fs in pairs(gaps) do
    local lo, hi = q * S + 1, math.min(nkeys - 1, q * S + S - 1)
    local stop = q * S + 1
    if lo <= hi then
      local args = {}
      for p = lo, hi do args[#args + 1] = key(p) end
      local vals = redis.call('HMGET', hkey, unpack(args))
      local gv = nil
      stop = hi + 1
      for p = lo, hi do
        local v = vals[p - lo + 1]
        if v ~= gv then
          gv = v
          local h = holders(v)
          local keep = {}
          for _, f in ipairs(fs) do
            if h[f] then keep[#keep + 1] = f else ends[f] = p end
          end
          fs = keep
          if #fs == 0 then break end
        end
      end
    end
    for _, f in ipairs(fs) do ends[f] = stop end
  end
  return ends
end
"""

# Speculative entries (a router's picks), shared by both layouts: one hash per (model, slot) with
# values "<endpoint>=<expiry ms>:<write>;..." where <write> numbers the write (a counter key).
#
# A write is a chain from its first block (``PutSpeculative``'s contract) and a block key fixes its
# whole prefix, so every write that holds block i + 1 of a chain holds block i too: along a chain,
# the newest write of an endpoint that holds each block is the same or an older one. So when two
# probes ``S`` apart show the endpoint's entry of the same write, still live, every block between
# has it; only where the write changes (or the entry is gone) is the gap read.
# ``spec_probe(skey, n)`` expects ``key(p)``, ``S`` and ``allowed(ep)`` (LUA_FILTER) and returns
# the flat answer ``endpoint, blocks, ttl_ms, ...`` for the chain's first ``n`` blocks.
LUA_SPEC_PROBE = """
local function spec_probe(skey, n)
  local out = {}
  if n == 0 then return out end
  local now = now_ms()
  local parsed = {}
  local function live(v)   -- value -> {ep -> {expiry, write}} of its live, allowed entries
    if not v then return {} end
    local r = parsed[v]
    if r == nil then
      r = {}
      for ep, e, w in string.gmatch(v, '([^;=]+)=(%d+):(%d+)') do
        local exp = tonumber(e)
        if exp > now and allowed(ep) then r[ep] = {exp, w} end
      end
      parsed[v] = r
    end
    return r
  end
  local srun, sexp, swrite, alive = {}, {}, {}, {}
  -- Blocks lo..hi, walked for each of eps until its first block without a live entry.
  local function scan(lo, hi, eps)
    if lo > hi then return end
    local args = {}
    for p = lo, hi do args[#args + 1] = key(p) end
    local vals = redis.call('HMGET', skey, unpack(args))
    for _, ep in ipairs(eps) do
      for p = lo, hi do
        local e = live(vals[p - lo + 1])[ep]
        if not e then srun[ep] = p; alive[ep] = nil; break end
        if e[1] < sexp[ep] then sexp[ep] = e[1] end
        swrite[ep] = e[2]
      end
    end
  end
  for ep, e in pairs(live(redis.call('HGET', skey, key(0)))) do
    alive[ep] = true; sexp[ep] = e[1]; swrite[ep] = e[2]
  end
  local nprobe = math.floor((n - 1) / S) + 1
  local q, win = 1, 8
  while next(alive) ~= nil and q < nprobe do
    local hi = math.min(nprobe - 1, q + win - 1)
    local args = {}
    for r = q, hi do args[#args + 1] = key(r * S) end
    local vals = redis.call('HMGET', skey, unpack(args))
    for r = q, hi do
      local ents = live(vals[r - q + 1])
      local check = {}
      for ep, _ in pairs(alive) do
        local e = ents[ep]
        if not (e and e[2] == swrite[ep]) then check[#check + 1] = ep end
      end
      if #check > 0 then scan((r - 1) * S + 1, r * S, check) end
      if next(alive) == nil then break end
    end
    q = hi + 1
    win = math.min(win * 2, 256)
  end
  local rest = {}
  for ep, _ in pairs(alive) do rest[#rest + 1] = ep end
  if #rest > 0 then scan((nprobe - 1) * S + 1, n - 1, rest) end
  for ep, _ in pairs(alive) do srun[ep] = n end
  for ep, m in pairs(srun) do
    if m > 0 then out[#out + 1] = ep; out[#out + 1] = m; out[#out + 1] = sexp[ep] - now end
  end
  return out
end
"""

# ``put_spec(skey, seqkey, ep, ttl_ms, blob)``: one write (a chain from its first block). Rewrites
# the blocks' values in HMGET/HSET windows (a chain's blocks mostly share one old value, so each
# distinct value is rewritten once), then drops the fully expired fields among 2 * (fields added)
# + 16 random ones, so stale fields stay about as many as live ones. The hash and the counter
# expire with the longest TTL written (so a counter starting again never meets a live entry).
LUA_PUT_SPEC = """
local function put_spec(skey, seqkey, ep, ttl_ms, blob)
  local now = now_ms()
  local mine = ep .. '=' .. (now + ttl_ms) .. ':' .. redis.call('INCR', seqkey)
  local memo = {}
  local function rewrite(v)
    if not v then return mine end
    local r = memo[v]
    if r == nil then
      local out = {}
      for e, x, w in string.gmatch(v, '([^;=]+)=(%d+):(%d+)') do
        if e ~= ep and tonumber(x) > now then out[#out + 1] = e .. '=' .. x .. ':' .. w end
      end
      out[#out + 1] = mine
      r = table.concat(out, ';')
      memo[v] = r
    end
    return r
  end
  local ks = keys_of(blob)
  local added = 0
  for lo = 1, #ks, CH do
    local hi = math.min(#ks, lo + CH - 1)
    local vs = redis.call('HMGET', skey, unpack(ks, lo, hi))
    local kv = {}
    for j = lo, hi do
      kv[#kv + 1] = ks[j]
      kv[#kv + 1] = rewrite(vs[j - lo + 1])
    end
    added = added + redis.call('HSET', skey, unpack(kv))
  end
  if added > 0 then
    local sample = redis.call('HRANDFIELD', skey, 2 * added + 16, 'WITHVALUES')
    for j = 1, #sample, 2 do
      local live = false
      for _, x in string.gmatch(sample[j + 1], '([^;=]+)=(%d+):%d+') do
        if tonumber(x) > now then live = true; break end
      end
      if not live then redis.call('HDEL', skey, sample[j]) end
    end
  end
  if redis.call('PTTL', skey) < ttl_ms then redis.call('PEXPIRE', skey, ttl_ms) end
  if redis.call('PTTL', seqkey) < ttl_ms then redis.call('PEXPIRE', seqkey, ttl_ms) end
end
"""

# Entries of the layouts before write numbers, read during a rolling upgrade (see each backend's
# docstring): ``entries(p)`` gives block p's {endpoint -> expiry ms}. Walked block by block from
# the chain's first block (the old way), merged into ``out`` (``spec_probe``'s answer): an
# endpoint keeps the longer of its two runs.
LUA_SPEC_LEGACY = """
local function spec_legacy(out, n, entries)
  local now = now_ms()
  local srun, sexp = {}, {}
  local pos = 0
  while pos < n do
    local ext = false
    for ep, exp in pairs(entries(pos)) do
      if exp > now and allowed(ep) and (srun[ep] or 0) == pos then
        srun[ep] = pos + 1
        if sexp[ep] == nil or exp < sexp[ep] then sexp[ep] = exp end
        ext = true
      end
    end
    if not ext then break end
    pos = pos + 1
  end
  local at = {}
  for j = 1, #out, 3 do at[out[j]] = j end
  for ep, m in pairs(srun) do
    local j = at[ep]
    if j == nil then
      out[#out + 1] = ep; out[#out + 1] = m; out[#out + 1] = sexp[ep] - now
    elseif m > out[j + 1] then
      out[j + 1] = m; out[j + 2] = sexp[ep] - now
    end
  end
  return out
end
"""

# One chunk of dropping an endpoint's speculative entries (its engine was reset: the picks made
# for it are void). KEYS: the speculative hash. ARGV: HSCAN cursor, endpoint, count. Returns the
# next cursor ('0' when done).
SPEC_DROP = LUA_LIB + """
local r = redis.call('HSCAN', KEYS[1], ARGV[1], 'COUNT', tonumber(ARGV[3]))
local kv, mark = r[2], ';' .. ARGV[2] .. '='
for j = 1, #kv, 2 do
  local v = kv[j + 1]
  if string.find(';' .. v, mark, 1, true) then
    local out = {}
    for e in string.gmatch(v, '([^;]+)') do
      if string.sub(e, 1, #ARGV[2] + 1) ~= ARGV[2] .. '=' then out[#out + 1] = e end
    end
    if #out == 0 then redis.call('HDEL', KEYS[1], kv[j]) else redis.call('HSET', KEYS[1], kv[j], table.concat(out, ';')) end
  end
end
return r[1]
"""


def pack_keys(keys: Sequence[int]) -> bytes:
    """Block keys as one blob of 8-byte big-endian strings (the shortest exact form of a uint64);
    keys that came packed (``BlockChain.keys_be64``, ``kvmesh.index.packed``) go as they are."""
    return packed_blob(keys)


def starts_args(chain_starts: Sequence[tuple[int, int | None]] | None) -> list[Any]:
    """``nstarts, (offset, parent8 or b'')...``; ``nstarts`` 0 = the parent links are unknown."""
    if chain_starts is None:
        return [0]
    out: list[Any] = [len(chain_starts)]
    for off, parent in chain_starts:
        out += [off, b"" if parent is None else parent.to_bytes(8, "big")]
    return out


def filter_args(endpoint_filter: Iterable[str] | None, exclude: Iterable[str] | None) -> list[Any]:
    """What ``LUA_FILTER`` reads: ``nallow, allow..., ndeny, deny...`` (no allow list = all)."""
    allow = list(endpoint_filter or [])
    deny = list(exclude or [])
    return [len(allow), *allow, len(deny), *deny]


def pairs_of(blob: bytes) -> list[tuple[bytes, bytes]]:
    """A lookup script's ``name;n;name;n...`` answer as pairs. The scripts join their runs into one
    string: a reply of two RESP elements per holder cost the client (pure-Python RESP parsing)
    more than the lookup's Redis time. Holder fields and endpoint ids never contain ';' (holder
    values are ';'-separated)."""
    if not blob:
        return []
    parts = blob.split(b";")
    return list(zip(parts[::2], parts[1::2], strict=True))


def add_matches(result: LookupResult, runs: Iterable[tuple[bytes, Any]], combined: Iterable[tuple[bytes, Any]],
                spec: Sequence[Any]) -> LookupResult:
    """Fill ``result`` from a lookup's answer: per-tier runs by holder field (``<endpoint>\\x1f<tier>``),
    combined runs by endpoint, and the flat speculative list ``endpoint, blocks, ttl_ms, ...``."""
    def match(ep: str) -> EndpointMatch:
        return result.matches.get(ep) or result.matches.setdefault(ep, EndpointMatch(ep))

    for f, n in runs:
        field = f.decode()
        match(field[:-2]).tiers[Tier(int(field[-1]))] = int(n)
    for e, n in combined:
        match(e.decode()).combined = int(n)
    for i in range(0, len(spec), 3):
        em = match(spec[i].decode())
        em.speculative = int(spec[i + 1])
        em.speculative_ttl_s = int(spec[i + 2]) / 1000.0
    return result


class RedisIndexBase(BlockIndex):
    """The client glue of a Redis-backed index; a backend sets ``r``, ``url``, ``namespace`` and
    ``_layout_checked`` and says which layout it writes (``layout_value``, ``layout_mismatch``)."""

    blocking = True
    label: ClassVar[str] = "redis"   # in error messages
    # Errors meaning "Redis cannot answer now": the caller gets IndexUnavailable (and retries later).
    UNAVAILABLE: ClassVar[tuple[type[BaseException], ...]] = (redis.ConnectionError, redis.TimeoutError, OSError)
    NOT_READY: ClassVar[tuple[str, ...]] = ("LOADING", "BUSY")   # in a ResponseError's text
    r: Any
    url: str
    namespace: str
    _layout_checked: bool

    def _call(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        with self._redis_errors():
            return fn(*args, **kw)

    @contextlib.contextmanager
    def _redis_errors(self) -> Iterator[None]:
        """Redis errors meaning "cannot answer now" become IndexUnavailable (sync and asyncio calls)."""
        try:
            yield
        except self.UNAVAILABLE as exc:
            raise IndexUnavailable(f"{self.label} {self._safe_url()} unavailable: {exc}") from exc
        except redis.ResponseError as exc:
            if any(s in str(exc) for s in self.NOT_READY):
                raise IndexUnavailable(f"{self.label} {self._safe_url()} not ready: {exc}") from exc
            raise

    def _safe_url(self) -> str:
        if "@" in self.url:
            scheme, rest = self.url.split("://", 1)
            return f"{scheme}://***@{rest.split('@', 1)[1]}"
        return self.url

    def layout_value(self) -> str:
        raise NotImplementedError

    def layout_mismatch(self, found: str) -> str:
        raise NotImplementedError

    def check_layout(self) -> None:
        """Raise ValueError for a namespace written by another layout; an unreachable Redis is checked later."""
        try:
            self._check_layout()
        except IndexUnavailable:
            pass

    def _check_layout(self) -> None:
        """Refuse a namespace written by an incompatible layout (once per client)."""
        if self._layout_checked:
            return
        key, want = f"{self.namespace}:layout", self.layout_value()
        self._call(self.r.setnx, key, want)
        got = self._call(self.r.get, key)
        if got is not None and got.decode() != want:
            raise ValueError(self.layout_mismatch(got.decode()))
        self._layout_checked = True

    def check_auth(self) -> None:
        """Raise ValueError when Redis rejects our credentials (a configuration error, not an outage)."""
        try:
            self.r.ping()
        except redis.AuthenticationError as exc:
            raise ValueError(f"{self.label} {self._safe_url()}: authentication failed: {exc}") from None
        except (redis.RedisError, OSError):
            pass  # unreachable now: lookups answer UNAVAILABLE until it is back

    def endpoints(self) -> list[str]:
        return sorted(e.decode() for e in self._call(self.r.smembers, f"{self.namespace}:endpoints"))

    def close(self) -> None:
        self.r.close()
