"""Block index on Redis Cluster (or Valkey cluster): the index past one Redis.

Why a layout of its own: a Lua script may only touch keys of one hash slot, and
the single-Redis layout (one holder hash per model, built key names) puts the
whole index in one slot. Here every key carries a hash tag chosen so that one
chain lookup reads at most two slots, whatever the cluster size:

- Blocks at depth ``< D`` (``--redis-anchor-depth``) of a chain live under the
  tag of the chain's first block (the *root*), blocks at depth ``>= D`` under
  the tag of the chain's block at depth ``D`` (the *anchor*). Block keys are
  chained hashes (a key fixes its whole prefix), so a block's tag is a property
  of the key, and a lookup of ``keys`` reads ``{keys[0]}`` for positions
  ``[0, D)`` and ``{keys[D]}`` for the rest: one or two shards. Chains that
  share a long prefix (a system prompt) share the root shard for ``D`` blocks
  only; past it they spread over the cluster by their anchor.
- ``NS:{<tag>}:h:<model>`` HASH ``<key8> -> ";<endpoint>\\x1f<tier>;..."``
  the holders, as in the single layout.
- ``NS:{e:<endpoint>}:r:<model>:<tier>`` HASH ``<key8> -> <tag8>(p<parent8>|r)<depth>,<children>``:
  the per-endpoint reverse index, on the endpoint's own slot. It is what makes
  clearing an endpoint O(its blocks) and it is where a new block finds its
  parent's tag and depth (an engine stores a block after its parent, in some
  tier). ``NS:{e:<endpoint>}:reg`` names the endpoint's reverse indexes,
  ``NS:{e:<endpoint>}:n`` counts its entries per tier.
- ``NS:{<root>}:sp:<model>`` HASH ``<key8> -> "<endpoint>=<expiry ms>:<write>;..."``:
  speculative entries of the chains starting at ``root`` (a router writes them
  for a chain from its first block), ``<write>`` numbered by ``NS:{<root>}:spseq:<model>``.
  Written and probed every ``probe_stride``-th block by ``redis_common`` (``LUA_PUT_SPEC``,
  ``LUA_SPEC_PROBE``), as in the single layout. Clearing a whole endpoint drops its
  entries (its engine was reset: the picks made for it are void).
  Rolling upgrade: indexers before write numbers kept ``NS:{<root>}:s:<model>``
  (``"<endpoint>=<expiry ms>;..."``) and read only it. A lookup reads that hash too,
  block by block, when it exists for the chain's root (one EXISTS in the same call),
  each endpoint keeping the longer run; old indexers do not see new entries, for at
  most one TTL (300 s) after the last of them stops (see ``redis_backend``).
- ``NS:{<tag>}:d:<model>`` SET of endpoints that, within this tag, hold a block
  without its same-tier parent (or lost a parent under a child). The others are
  prefix-closed there, so a lookup probes them every ``probe_stride``-th block
  as the single layout does; dirty ones are walked block by block.
- ``NS:endpoints``, ``NS:models``, ``NS:layout``: global, written rarely.

A block whose parent its endpoint does not hold in any tier (an orphan, or a
batch given without parent links) is filed as a new root; lookups of its true
chain do not see it. vLLM stores and evicts in prefix order, so this only
loses blocks that could not extend a leading match anyway (counted:
``orphans``).

Updates are single-slot calls, ordered so a failure in between never leaves a
holder the reverse index does not know (add: reverse index, then holders;
remove: holders, then reverse index); the holder calls of one batch, one per
tag, go out in one pipeline. An add whose chain segments start at roots or at
chain tails this client stored for the endpoint (a request's next blocks: the
usual case) guesses every key's tag from the tail's tag and depth and sends the
reverse-index call and the holder calls in one pipeline: one round trip, not
two. The reverse-index script checks the guess; when it disagrees (another
replica changed the endpoint) or did not run, the holder fields the guessed calls
added are removed again (they return exactly those keys), then the two-step path
runs or the error is raised. So a holder the reverse index does not know is left
only if that removal fails too, or the client dies between the two answers.
A lookup is one Lua call
per shard, both in one pipeline for chains longer than ``D``. Any replica of the indexer reads the same keys, so it answers the
same. Connection errors, a master down, or a slot moving raise
``IndexUnavailable`` once the client's retries are spent.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterable, Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
from redis.cluster import ClusterNode, RedisCluster

from kvmesh.index.base import TIERS, IndexStats, IndexUnavailable, LookupResult, Tier
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

LAYOUT_VERSION = "c1"
SCHEMES = ("redis+cluster://", "rediss+cluster://")

# The reverse-index value is <tag8> then 'p'<parent8> (the parent is held in the same tier) or
# 'r' (it is not), then "<depth>,<children>" where <children> counts this holder's blocks whose
# same-tier parent is this one.
_LIB = LUA_LIB + """
local function rparse(v)
  local tag, par, rest = string.sub(v, 1, 8), nil, nil
  if string.sub(v, 9, 9) == 'p' then par = string.sub(v, 10, 17); rest = string.sub(v, 18)
  else rest = string.sub(v, 10) end
  local c = string.find(rest, ',', 1, true)
  return tag, par, tonumber(string.sub(rest, 1, c - 1)), tonumber(string.sub(rest, c + 1))
end
local function rval(tag, par, d, n)
  if par then return tag .. 'p' .. par .. numstr(d) .. ',' .. numstr(n) end
  return tag .. 'r' .. numstr(d) .. ',' .. numstr(n)
end
"""

# KEYS: reg, counts, rindex of the added tier, rindex of every tier (parents may be in another tier)
# ARGV: tier, D, blob, nstarts, (offset, parent8 or '')..., hint  (nstarts == 0: links unknown; hint:
# the client's tag8 for every key when it sent the holder call at once, else '')
# Returns {new, orphans, first, ndirty, mismatch, tails, dirty tag8..., tag8 keys-blob ...} for the keys
# new to this endpoint+tier; a dirty tag is one where this endpoint now holds a block without its
# same-tier parent; tails: key8 tag8 depth(8 digits) of each chain segment's last key.
_EP_ADD = _LIB + """
local tier, D, blob = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local nst = tonumber(ARGV[4])
local starts = {}
for j = 0, nst - 1 do starts[tonumber(ARGV[5 + 2 * j])] = ARGV[6 + 2 * j] end
local rkey = KEYS[3]
local n = #blob / 8
local ks = keys_of(blob)
local have = hmget_all(rkey, ks)
local here = {}
for i = 1, n do here[ks[i]] = have[i] or false end
local function held_here(k)
  if here[k] == nil then here[k] = redis.call('HGET', rkey, k) or false end
  return here[k]
end
-- the batch's keys held in the other tiers, read in one HMGET per tier (a call per key costs more)
local other = {}
for j = 4, #KEYS do
  if j ~= 3 + tonumber(tier) and redis.call('EXISTS', KEYS[j]) == 1 then
    local vs = hmget_all(KEYS[j], ks)
    for i = 1, n do if vs[i] and not other[ks[i]] then other[ks[i]] = vs[i] end end
  end
end
for i = 1, n do if other[ks[i]] == nil then other[ks[i]] = false end end
-- tag and depth of keys met so far (parallel tables: a table per key cost more than the work)
local itag, idep = {}, {}
local function meta(k)
  local t = itag[k]
  if t then return t, idep[k] end
  local v = held_here(k) or other[k]
  if v == nil then   -- not in the batch: a parent, looked up on its own
    for j = 4, #KEYS do
      if j ~= 3 + tonumber(tier) then v = v or redis.call('HGET', KEYS[j], k) end
    end
  end
  if v then
    local tg, _, d = rparse(v)
    itag[k] = tg; idep[k] = d
    return tg, d
  end
  return nil
end
-- nch[k]: children of new key k in this batch (nil: k is not new); nsp[k]: its same-tier parent or false
local orphans, order, nsp, nch, ext, dirty = 0, {}, {}, {}, {}, {}
local prev = nil
for i = 1, n do
  local k = ks[i]
  local par = starts[i - 1]
  if par == nil then par = prev elseif par == '' then par = false end
  prev = k
  if have[i] then
    meta(k)
  elseif nch[k] == nil then
    local tag, d = meta(k)
    if not tag then
      local pt, pd = nil, nil
      if par then pt, pd = meta(par) end
      if not pt then
        if par ~= false then orphans = orphans + 1 end
        tag, d = k, 0
      elseif pd < D - 1 then tag, d = pt, pd + 1
      elseif pd == D - 1 then tag, d = k, D
      else tag, d = pt, D + 1 end   -- past the anchor; depth capped at D + 1
      itag[k] = tag; idep[k] = d
    end
    local sp = false
    if par and d > 0 then
      if nch[par] then sp = par; nch[par] = nch[par] + 1
      elseif held_here(par) then sp = par; ext[par] = (ext[par] or 0) + 1 end
    end
    -- a run inside this tag that may have a hole: lookups walk this endpoint block by block there
    if not sp and d > 0 and d ~= D then dirty[tag] = true end
    nsp[k] = sp; nch[k] = 0
    order[#order + 1] = k
  end
end
local kv = {}
for _, k in ipairs(order) do
  kv[#kv + 1] = k
  kv[#kv + 1] = rval(itag[k], nsp[k], idep[k], nch[k])
end
for p, c in pairs(ext) do
  local t, pp, d, nc = rparse(here[p])
  kv[#kv + 1] = p
  kv[#kv + 1] = rval(t, pp, d, nc + c)
end
hset_all(rkey, kv)
if #order > 0 then redis.call('HINCRBY', KEYS[2], tier, #order) end
-- The client's guess of each key's tag (one-round-trip adds): any key filed elsewhere, or a tag
-- marked dirty, and the holder call it sent with the guess must be redone from this answer.
local hint = ARGV[5 + 2 * nst] or ''
local mismatch = 0
if #hint > 0 then
  if #hint ~= 8 * n or next(dirty) ~= nil then mismatch = 1
  else
    for i = 1, n do
      if itag[ks[i]] ~= string.sub(hint, 8 * i - 7, 8 * i) then mismatch = 1; break end
    end
  end
end
-- tag and depth of the key that ends each chain segment: the parent of the endpoint's next batch
local tails = {}
for i = 1, n do
  local k = ks[i]
  if (i == n or starts[i] ~= nil) and itag[k] then
    tails[#tails + 1] = k .. itag[k] .. string.format('%08d', idep[k])
  end
end
local out = {#order, orphans, redis.call('SADD', KEYS[1], rkey), 0, mismatch, table.concat(tails)}
for t, _ in pairs(dirty) do out[#out + 1] = t; out[4] = out[4] + 1 end
-- grouped by tag (a reply of two strings per key costs the client more than the work here)
local groups, tags = {}, {}
for _, k in ipairs(order) do
  local t = itag[k]
  local g = groups[t]
  if not g then g = {}; groups[t] = g; tags[#tags + 1] = t end
  g[#g + 1] = k
end
for _, t in ipairs(tags) do
  out[#out + 1] = t
  if #tags == 1 and #order == n then out[#out + 1] = blob   -- the whole batch, new, under one tag
  else out[#out + 1] = table.concat(groups[t]) end
end
return out
"""

# KEYS: holder hash, dirty set of that tag. ARGV: field, blob of keys, endpoint, mark dirty ('1'|'0').
# Returns the keys it added the field to (a blob), so a guessed call can be undone exactly.
_HOLD_ADD = _LIB + """
local added = hold_all(KEYS[1], keys_of(ARGV[2]), ARGV[1])
if ARGV[4] == '1' then redis.call('SADD', KEYS[2], ARGV[3]) end
return table.concat(added)
"""

# KEYS: holder hash, dirty set of that tag. ARGV: field, blob, endpoint, dirty op ('+' mark, '-' unmark, '').
_HOLD_DEL = LUA_LIB + """
local field, blob = ARGV[1], ARGV[2]
local gone = 0
for _, k in ipairs(keys_of(blob)) do gone = gone + unlink(KEYS[1], k, field) end
if ARGV[4] == '+' then redis.call('SADD', KEYS[2], ARGV[3]) elseif ARGV[4] == '-' then
  redis.call('SREM', KEYS[2], ARGV[3]) end
return gone
"""

# KEYS: rindex, counts. ARGV: tier, key8...  Drops the keys (whose holders are already unlinked)
# and lowers their same-tier parents' child counts.
_EP_REMOVE = _LIB + """
local ks = {}
for i = 2, #ARGV do ks[#ks + 1] = ARGV[i] end
local vs = hmget_all(KEYS[1], ks)
local gone, dec = {}, {}
for i, k in ipairs(ks) do if vs[i] then gone[k] = vs[i] end end
for k, v in pairs(gone) do
  local _, par = rparse(v)
  if par and not gone[par] then dec[par] = (dec[par] or 0) + 1 end
end
local kv = {}
for p, c in pairs(dec) do
  local v = redis.call('HGET', KEYS[1], p)
  if v then
    local t, pp, d, nc = rparse(v)
    kv[#kv + 1] = p
    kv[#kv + 1] = rval(t, pp, d, math.max(0, nc - c))
  end
end
hset_all(KEYS[1], kv)
local n = 0
for lo = 1, #ks, CH do n = n + redis.call('HDEL', KEYS[1], unpack(ks, lo, math.min(#ks, lo + CH - 1))) end
if n > 0 then redis.call('HINCRBY', KEYS[2], ARGV[1], -n) end
return n
"""

# KEYS: rindex, counts. ARGV: tier, key8...  (clearing a whole tier: no child counts to keep)
_EP_DEL = """
local n = redis.call('HDEL', KEYS[1], unpack(ARGV, 2))
if n > 0 then redis.call('HINCRBY', KEYS[2], ARGV[1], -n) end
return n
"""

# One shard's part of a lookup: positions [base, base + limit) of the chain.
# KEYS: per namespace (model first, then extra models) its holder hash and dirty set, then the
#       speculative hash and its pre-write-number form (if asked).
# ARGV: blob, base, final('1'|'0'), spec('1'|'0'), limit (blocks of blob to walk; speculative entries
#       are read along all of it), stride, nallow, allow..., ndeny, deny..., then per namespace a start
#       state: '-' (from the chain's first block) or "<fields ;-joined>@<endpoints ;-joined>" alive
#       at ``base`` (holder values keep ';' out of fields; endpoint ids have no '@').
# Endpoints not in the tag's dirty set hold, within this tag, no block without its same-tier parent,
# so "holds block i" flips from true to false once along the range: read every stride-th block, then
# the one gap where each run ends. Dirty endpoints are walked block by block, parsing a value only
# when it changes. Returns, per namespace, its runs "field;n;..." and combined runs "ep;n;..." (one
# string each, ``redis_common.pairs_of``) and the state alive at the range end, then the
# speculative runs (ep, n, ttl_ms ...).
_WALK = LUA_LIB + """
local blob, base, final, spec = ARGV[1], tonumber(ARGV[2]), ARGV[3] == '1', ARGV[4] == '1'
local limit, S = tonumber(ARGV[5]), tonumber(ARGV[6])
local idx = 7
""" + LUA_FILTER + """
local nkeys = math.min(limit, #blob / 8)
local nall = #blob / 8
local nns = #KEYS
if spec then nns = nns - 2 end
nns = nns / 2
local run, erun = {}, {}
local function key(p) return string.sub(blob, p * 8 + 1, p * 8 + 8) end
local function split(s)
  local t = {}
  for x in string.gmatch(s, '([^;]+)') do t[x] = true end
  return t
end
local function note(t, k, n) if n > 0 and n > (t[k] or 0) then t[k] = n end end
""" + LUA_PROBE + LUA_SPEC_PROBE + LUA_SPEC_LEGACY + """
-- block by block from the range start; cur/cure: fields/endpoints alive there
local function blockwalk(hkey, cur, cure, ncur, ncure)
  local prev, pos, stop, win = nil, 0, nil, 64
  while stop == nil and pos < nkeys do
    local hi = math.min(nkeys, pos + win)
    local args = {}
    for i = pos, hi - 1 do args[#args + 1] = key(i) end
    local vals = redis.call('HMGET', hkey, unpack(args))
    for j = 1, hi - pos do
      local v = vals[j]
      local p = pos + j - 1
      if not v then stop = p; break end
      if v ~= prev then
        prev = v
        local fields, eps = {}, {}
        for f in string.gmatch(v, '([^;]+)') do
          fields[f] = true
          eps[string.sub(f, 1, -3)] = true
        end
        for f, _ in pairs(cur) do
          if not fields[f] then note(run, f, base + p); cur[f] = nil end
        end
        for ep, _ in pairs(cure) do
          if not eps[ep] then note(erun, ep, base + p); cure[ep] = nil end
        end
        if next(cure) == nil then stop = p; break end
      end
    end
    pos = hi
    win = math.min(win * 2, 4096)
  end
  if stop == nil and not final then
    for f, _ in pairs(cur) do ncur[f] = true end
    for ep, _ in pairs(cure) do ncure[ep] = true end
    return
  end
  local at = base + (stop or nkeys)
  for f, _ in pairs(cur) do note(run, f, at) end
  for ep, _ in pairs(cure) do note(erun, ep, at) end
end
local function walk(hkey, dkey, state)
  if nkeys == 0 then return '' end
  local v0 = redis.call('HGET', hkey, key(0))
  local cur, cure = {}, {}
  if state == '-' then
    if v0 then
      for f in string.gmatch(v0, '([^;]+)') do
        local ep = string.sub(f, 1, -3)
        if allowed(ep) then cur[f] = true; cure[ep] = true end
      end
    end
  else
    local bar = string.find(state, '@', 1, true)
    cur, cure = split(string.sub(state, 1, bar - 1)), split(string.sub(state, bar + 1))
  end
  if next(cure) == nil then return '' end
  local dirty = {}
  for _, ep in ipairs(redis.call('SMEMBERS', dkey)) do if cure[ep] then dirty[ep] = true end end
  local ncur, ncure = {}, {}
  -- clean endpoints: every field present at the range start is a candidate (its run gives the
  -- combined match; only fields alive since block 0 give a per-tier match)
  local cand = {}
  if v0 then
    for f in string.gmatch(v0, '([^;]+)') do
      local ep = string.sub(f, 1, -3)
      if cure[ep] and not dirty[ep] then cand[f] = true end
    end
  end
  local ends = probe(hkey, cand)
  local ebest = {}
  for f, e in pairs(ends) do
    local ep = string.sub(f, 1, -3)
    if e > (ebest[ep] or 0) then ebest[ep] = e end
  end
  local dcur, dcure = {}, {}
  for ep, _ in pairs(cure) do
    if dirty[ep] then dcure[ep] = true
    elseif (ebest[ep] or 0) == nkeys and not final then ncure[ep] = true
    else note(erun, ep, base + (ebest[ep] or 0)) end
  end
  for f, _ in pairs(cur) do
    local ep = string.sub(f, 1, -3)
    if dirty[ep] then dcur[f] = true
    elseif (ends[f] or 0) == nkeys and not final then ncur[f] = true
    else note(run, f, base + (ends[f] or 0)) end
  end
  if next(dcure) ~= nil then blockwalk(hkey, dcur, dcure, ncur, ncure) end
  if next(ncure) == nil then return '' end
  local fs, es = {}, {}
  for f, _ in pairs(ncur) do fs[#fs + 1] = f end
  for ep, _ in pairs(ncure) do es[#es + 1] = ep end
  return table.concat(fs, ';') .. '@' .. table.concat(es, ';')
end
local states, out_t, out_e, out_s = {}, {}, {}, {}
for j = 1, nns do
  run, erun = {}, {}
  states[j] = walk(KEYS[2 * j - 1], KEYS[2 * j], ARGV[idx + j - 1])
  local t, e = {}, {}
  for f, n in pairs(run) do t[#t + 1] = f; t[#t + 1] = n end
  for ep, n in pairs(erun) do e[#e + 1] = ep; e[#e + 1] = n end
  out_t[j], out_e[j] = table.concat(t, ';'), table.concat(e, ';')   -- redis_common.pairs_of
end
if spec then
  out_s = spec_probe(KEYS[#KEYS - 1], nall)
  -- Layout c1's first form ("<endpoint>=<expiry ms>;...", no write numbers), written by indexers
  -- not yet upgraded: walked block by block, only when such a hash exists for this root.
  if redis.call('EXISTS', KEYS[#KEYS]) == 1 then
    out_s = spec_legacy(out_s, nall, function(p)
      local t = {}
      local v = redis.call('HGET', KEYS[#KEYS], key(p))
      if v then
        for ep, e in string.gmatch(v, '([^;=]+)=(%d+)') do t[ep] = tonumber(e) end
      end
      return t
    end)
  end
end
return {out_t, out_e, states, out_s}
"""

# KEYS: speculative hash, its write counter. ARGV: endpoint, ttl_ms, blob (redis_common.LUA_PUT_SPEC).
_PUT_SPEC = LUA_LIB + LUA_PUT_SPEC + """
put_spec(KEYS[1], KEYS[2], ARGV[1], tonumber(ARGV[2]), ARGV[3])
return 1
"""


def parse_cluster_url(url: str) -> tuple[list[ClusterNode], dict[str, Any]]:
    """``redis+cluster://[user:pw@]host:port[,host:port...]`` -> startup nodes and connection options."""
    if not url.startswith(SCHEMES):
        raise ValueError(f"redis cluster url {url!r} must start with redis+cluster:// or rediss+cluster://")
    parts = urlsplit(url.replace("+cluster", "", 1))
    netloc = parts.netloc
    opts: dict[str, Any] = {"ssl": parts.scheme == "rediss"}
    if "@" in netloc:
        cred, netloc = netloc.rsplit("@", 1)
        user, _, pw = cred.partition(":")
        if user:
            opts["username"] = unquote(user)
        if pw:
            opts["password"] = unquote(pw)
    nodes = []
    for hp in netloc.split(","):
        host, _, port = hp.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"redis cluster url {url!r}: {hp!r} is not host:port")
        nodes.append(ClusterNode(host.strip("[]"), int(port)))
    return nodes, opts


def _hex(tag8: bytes) -> str:
    return tag8.hex()


class RedisClusterIndex(RedisIndexBase):
    """Block index on a Redis Cluster; a lookup touches at most two shards."""

    name = "redis-cluster"
    # chain tails remembered per endpoint: a vLLM step has up to max_num_seqs (256 by default)
    # running requests, each a tail; ~350 bytes an entry
    TAILS_PER_ENDPOINT = 512
    label = "redis cluster"
    UNAVAILABLE = (*RedisIndexBase.UNAVAILABLE, redis.exceptions.RedisClusterException,
                   redis.exceptions.ClusterDownError, redis.exceptions.SlotNotCoveredError,
                   redis.exceptions.TryAgainError)
    NOT_READY = (*RedisIndexBase.NOT_READY, "CLUSTERDOWN", "TRYAGAIN", "MOVED", "ASK")

    def __init__(self, url: str, namespace: str = "kvm", timeout_s: float = 1.0, clear_chunk: int = 2000,
                 anchor_depth: int = 64, probe_stride: int = 32, client: RedisCluster | None = None) -> None:
        nodes, opts = parse_cluster_url(url)
        if anchor_depth < 1:
            raise ValueError(f"anchor_depth must be >= 1, got {anchor_depth}")
        self.url = url
        self.namespace = namespace
        self.timeout_s = timeout_s
        self.clear_chunk = clear_chunk
        self.anchor_depth = anchor_depth
        if probe_stride < 1:
            raise ValueError(f"probe_stride must be >= 1, got {probe_stride}")
        self.probe_stride = probe_stride
        self._layout_checked = False
        # How many shards each lookup touched (the target is <= 2), and orphans filed as roots.
        self.lookup_shards: collections.Counter[int] = collections.Counter()
        self.orphans = 0
        self.last_lookup_shards = 0
        # endpoint -> {(model, tier, key): (tag8, depth)} of the chain tails this process stored: the
        # parents of the endpoint's next batches, so an add can send its holder calls at once.
        self._tails: dict[str, dict[tuple[str, int, int], tuple[bytes, int]]] = {}
        self.r = client or RedisCluster(
            startup_nodes=nodes, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            cluster_error_retry_attempts=2, require_full_coverage=False, **opts)
        self._ep_add = self.r.register_script(_EP_ADD)
        self._hold_add = self.r.register_script(_HOLD_ADD)
        self._hold_del = self.r.register_script(_HOLD_DEL)
        self._ep_del = self.r.register_script(_EP_DEL)
        self._ep_remove = self.r.register_script(_EP_REMOVE)
        self._walk = self.r.register_script(_WALK)
        self._put_spec = self.r.register_script(_PUT_SPEC)
        self._spec_drop = self.r.register_script(SPEC_DROP)

    # ---- key names -----------------------------------------------------------------
    def _hkey(self, tag: str, model: str) -> str:
        return f"{self.namespace}:{{{tag}}}:h:{model}"

    def _dkey(self, tag: str, model: str) -> str:
        return f"{self.namespace}:{{{tag}}}:d:{model}"

    def _skey(self, root: str, model: str, kind: str = "sp") -> str:
        return f"{self.namespace}:{{{root}}}:{kind}:{model}"

    def _ekey(self, endpoint: str, rest: str) -> str:
        return f"{self.namespace}:{{e:{endpoint}}}:{rest}"

    def layout_value(self) -> str:
        return f"{LAYOUT_VERSION}:{self.anchor_depth}"

    def layout_mismatch(self, found: str) -> str:
        return (f"redis namespace {self.namespace!r} holds index layout {found!r}, this indexer writes "
                f"{self.layout_value()} (layout:anchor depth); use the same --redis-anchor-depth, another "
                "--redis-namespace, or delete its keys")

    # ---- updates -------------------------------------------------------------------
    def add(self, model: str, endpoint: str, tier: Tier, keys: Sequence[int],
            chain_starts: Sequence[tuple[int, int | None]] | None = None) -> int:
        if not keys:
            return 0
        self._check_layout()
        t = int(Tier(tier))
        rk = [self._ekey(endpoint, f"r:{model}:{x}") for x in (1, 2, 3)]
        ep_keys = [self._ekey(endpoint, "reg"), self._ekey(endpoint, "n"), rk[t - 1], *rk]
        blob = pack_keys(keys)
        ep_args = [t, self.anchor_depth, blob, *starts_args(chain_starts)]
        field = f"{endpoint}\x1f{t};"
        guess = self._guess_tags(model, endpoint, t, blob, chain_starts)
        if guess is not None:
            done = self._add_at_once(model, endpoint, t, field, ep_keys, ep_args, guess)
            if done is not None:
                return done
        out = self._call(self._ep_add, ep_keys, ep_args)
        return self._added(out, model, endpoint, t, field, holders_done=False)

    def _added(self, out: list, model: str, endpoint: str, t: int, field: str, holders_done: bool) -> int:
        """Book an ``_EP_ADD`` answer: counters, the chain tails' tags, and (unless the holder calls
        already ran with the right tags) one holder call per tag, in one pipeline."""
        new, orphans, first, ndirty = int(out[0]), int(out[1]), int(out[2]), int(out[3])
        self.orphans += orphans
        if first:
            self._call(self.r.sadd, f"{self.namespace}:endpoints", endpoint)
            self._call(self.r.sadd, f"{self.namespace}:models", model)
        if not holders_done:
            dirty = set(out[6:6 + ndirty])
            calls = []
            for i in range(6 + ndirty, len(out), 2):
                tag8 = out[i]
                tag = _hex(tag8)
                calls.append(([self._hkey(tag, model), self._dkey(tag, model)],
                              [field, out[i + 1], endpoint, "1" if tag8 in dirty else "0"]))
            self._per_tag(self._hold_add, calls)
        tails = self._tails.setdefault(endpoint, {})
        raw = out[5]
        for i in range(0, len(raw), 24):
            tails[(model, t, int.from_bytes(raw[i:i + 8], "big"))] = (raw[i + 8:i + 16], int(raw[i + 16:i + 24]))
        while len(tails) > self.TAILS_PER_ENDPOINT:
            del tails[next(iter(tails))]
        return new

    def _guess_tags(self, model: str, endpoint: str, t: int, blob: bytes,
                    chain_starts: Sequence[tuple[int, int | None]] | None) -> tuple[bytes, dict[bytes, list[bytes]]] | None:
        """Each key's tag, when every chain segment of the batch starts at a root or at a tail this
        process stored for the endpoint (the usual case: a request's next blocks): the tag rule of
        ``_EP_ADD`` applied from the parent's tag and depth. None when a parent is not known here."""
        if not chain_starts or chain_starts[0][0] != 0:
            return None
        tails = self._tails.get(endpoint, {})
        n, D = len(blob) // 8, self.anchor_depth
        ends = [off for off, _ in chain_starts[1:]] + [n]
        parts: list[bytes] = []
        groups: dict[bytes, list[bytes]] = {}
        for (off, parent), end in zip(chain_starts, ends, strict=True):
            if parent is None:
                ptag, d0 = blob[8 * off:8 * off + 8], -1   # a root: its own tag at depth 0
            else:
                got = tails.get((model, t, parent))
                if got is None:
                    return None
                ptag, d0 = got
            # keys [off, a) stay under the parent's tag; the key at depth D (position a) is the
            # anchor and tags the rest (a key's depth is d0 + 1 + its offset in the segment)
            a = min(end, off + D - d0 - 1) if d0 < D else end
            if a > off:
                parts.append(ptag * (a - off))
                groups.setdefault(ptag, []).append(blob[8 * off:8 * a])
            if a < end:
                anchor = blob[8 * a:8 * a + 8]
                parts.append(anchor * (end - a))
                groups.setdefault(anchor, []).append(blob[8 * a:8 * end])
        return b"".join(parts), groups

    def _add_at_once(self, model: str, endpoint: str, t: int, field: str, ep_keys: list[str], ep_args: list[Any],
                     guess: tuple[bytes, dict[bytes, list[bytes]]]) -> int | None:
        """The reverse-index call and the holder calls with guessed tags, in one pipeline (one round
        trip instead of two). The reverse-index script checks the guess; when it disagrees, or it
        did not run, the holder fields the guessed calls added are removed again (they return
        exactly those keys). Then None: the caller takes the two-step path (a disagreement) or the
        error is raised (the reverse index did not apply: the batch is re-synced, as before)."""
        hint, groups = guess
        hold = [(tag8, [self._hkey(_hex(tag8), model), self._dkey(_hex(tag8), model)]) for tag8 in groups]
        calls: list[tuple[Any, list[str], list[Any]]] = [(self._ep_add, ep_keys, [*ep_args, hint])]
        calls += [(self._hold_add, hk, [field, b"".join(groups[tag8]), endpoint, "0"]) for tag8, hk in hold]
        res = self._pipelined_calls(calls)
        ep_out, held = res[0], res[1:]
        ep_ok = not isinstance(ep_out, Exception)
        if ep_ok and int(ep_out[4]) == 0:
            failed = [(hk, [field, b"".join(groups[tag8]), endpoint, "0"])
                      for (tag8, hk), h in zip(hold, held, strict=True) if isinstance(h, Exception)]
            if failed:
                # the reverse index knows these blocks; put their holders (a master that lost its
                # scripts gets them loaded by a direct call)
                if any(not isinstance(h, redis.exceptions.NoScriptError) for h in held if isinstance(h, Exception)):
                    self._call(self._raise_first, [h for h in held if isinstance(h, Exception)])
                self._per_tag(self._hold_add, failed)
            return self._added(ep_out, model, endpoint, t, field, holders_done=True)
        undo = [(hk, [field, h, endpoint, ""]) for (_, hk), h in zip(hold, held, strict=True)
                if not isinstance(h, Exception) and h]
        try:
            self._per_tag(self._hold_del, undo)
        except (IndexUnavailable, redis.RedisError):
            log.warning("holder fields of a failed add could not be removed; a clear will not reach them",
                        extra={"endpoint": endpoint, "model": model})
            raise
        if ep_ok:
            return self._added(ep_out, model, endpoint, t, field, holders_done=False)
        if isinstance(ep_out, redis.exceptions.NoScriptError):
            return None   # a master without the script: the two-step path loads it
        self._call(self._raise_first, [ep_out])
        return None

    @staticmethod
    def _raise_first(errors: list[BaseException]) -> None:
        raise errors[0]

    def _pipelined_calls(self, calls: list[tuple[Any, list[str], list[Any]]]) -> list:
        """Like ``_pipelined`` with a script per call, answers and errors in place."""
        pipe = self.r.pipeline()
        for script, keys, args in calls:
            opts: dict[str, Any] = {}
            try:
                opts["target_nodes"] = self.r.get_node_from_key(keys[0])
            except redis.exceptions.RedisClusterException:
                pass
            pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args, **opts)
        return self._call(pipe.execute, raise_on_error=False)

    def remove(self, model: str, endpoint: str, tier: Tier, keys: Sequence[int]) -> int:
        if not keys:
            return 0
        self._check_layout()
        t = int(Tier(tier))
        tails = self._tails.get(endpoint)
        if tails:
            for k in keys:
                tails.pop((model, t, k), None)
        rkey = self._ekey(endpoint, f"r:{model}:{t}")
        keys8 = list(dict.fromkeys(k.to_bytes(8, "big") for k in keys))
        vals = self._call(self.r.hmget, rkey, keys8)
        held = {k: v for k, v in zip(keys8, vals, strict=True) if v is not None}
        # Children this endpoint keeps in the same tier become orphans: their tag may have a hole now.
        removed_children: collections.Counter[bytes] = collections.Counter()
        for v in held.values():
            if v[8:9] == b"p":
                removed_children[v[9:17]] += 1
        by_tag: dict[bytes, list[bytes]] = {}
        dirty: set[bytes] = set()
        for k, v in held.items():
            by_tag.setdefault(v[:8], []).append(k)
            depth, children = (int(x) for x in v[17 if v[8:9] == b"p" else 9:].split(b","))
            if children > removed_children[k] and depth != self.anchor_depth - 1:
                dirty.add(v[:8])     # (children of depth D-1 are anchors: a range start of their own tag)
        field = f"{endpoint}\x1f{t};"
        self._per_tag(self._hold_del, [([self._hkey(_hex(tag8), model), self._dkey(_hex(tag8), model)],
                                        [field, b"".join(ks), endpoint, "+" if tag8 in dirty else ""])
                                       for tag8, ks in by_tag.items()])
        gone = list(held)
        n = 0
        for lo in range(0, len(gone), 4000):
            n += int(self._call(self._ep_remove, [rkey, self._ekey(endpoint, "n")], [t, *gone[lo:lo + 4000]]))
        return n

    def _unlink(self, model: str, endpoint: str, t: int, rkey: str, by_tag: dict[bytes, list[bytes]],
                undirty: bool) -> int:
        field = f"{endpoint}\x1f{t};"
        self._per_tag(self._hold_del, [([self._hkey(_hex(tag8), model), self._dkey(_hex(tag8), model)],
                                        [field, b"".join(ks), endpoint, "-" if undirty else ""])
                                       for tag8, ks in by_tag.items()])
        gone = [k for ks in by_tag.values() for k in ks]
        n = 0
        for lo in range(0, len(gone), 4000):
            n += int(self._call(self._ep_del, [rkey, self._ekey(endpoint, "n")], [t, *gone[lo:lo + 4000]]))
        return n

    def _per_tag(self, script: Any, calls: list[tuple[list[str], list[Any]]]) -> None:
        """``script`` once per tag, all in one pipeline: the tags' shards work at once and the
        client waits one round trip, not one per tag (a vLLM step's batch stores a block or a few
        for each running request: a tag per chain). Runs after the reverse-index call, as before,
        so a failure still never leaves a holder the reverse index does not know; the holder
        scripts are idempotent, so a retry after a master lost its scripts may re-run some."""
        if len(calls) <= 1:
            for keys, args in calls:
                self._call(script, keys, args)
            return
        try:
            self._pipelined(script, calls)
        except redis.exceptions.NoScriptError:
            # a restarted or new master: one call per tag loads the script where the keys live
            for keys, args in calls:
                self._call(script, keys, args)

    def _pipelined(self, script: Any, calls: list[tuple[list[str], list[Any]]]) -> list:
        """EVALSHA of ``script`` per ``(keys, args)`` in one cluster pipeline: written to every
        shard first, then read. Each command names its node: without it redis-py's cluster
        pipeline asks a node ``COMMAND GETKEYS`` for every EVALSHA, a round trip each before
        anything is sent (measured: two per two-shard lookup, one per tag of a batch). A slot
        that moved since answers MOVED, and the pipeline retries that command by its key."""
        pipe = self.r.pipeline()
        for keys, args in calls:
            opts: dict[str, Any] = {}
            try:
                opts["target_nodes"] = self.r.get_node_from_key(keys[0])
            except redis.exceptions.RedisClusterException:
                pass   # slot map being refreshed: routed by key (the slow way)
            pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args, **opts)
        return self._call(pipe.execute)

    def clear_endpoint(self, endpoint: str, tier: Tier | None = None) -> int:
        self._tails.pop(endpoint, None)
        reg = self._ekey(endpoint, "reg")
        removed = 0
        for raw in self._call(self.r.smembers, reg):
            rkey = raw.decode()
            model_tier = rkey.split("}:r:", 1)[1]
            model, t = model_tier.rsplit(":", 1)
            if tier is not None and int(t) != int(tier):
                continue
            while True:
                got = self._call(self.r.hrandfield, rkey, self.clear_chunk, True)
                if not got:
                    break
                by_tag: dict[bytes, list[bytes]] = {}
                for i in range(0, len(got), 2):
                    by_tag.setdefault(got[i + 1][:8], []).append(got[i])
                # a whole-endpoint clear leaves nothing of it in these tags: clean there again
                removed += self._unlink(model, endpoint, int(t), rkey, by_tag, undirty=tier is None)
            self._call(self.r.srem, reg, rkey)
        if tier is None:
            self._call(self.r.srem, f"{self.namespace}:endpoints", endpoint)
            self._drop_speculative(endpoint)
        return removed

    def _drop_speculative(self, endpoint: str) -> None:
        """Drop ``endpoint``'s speculative entries: its engine was reset (or it is gone), so the
        picks made for it are void. They are spread over every root's slot: a SCAN of the
        masters (O(keys); clearing a whole endpoint is rare), then ``clear_chunk`` fields a call."""
        pattern = f"{self.namespace}:{{*}}:sp:*"
        skeys = self._call(lambda: list(self.r.scan_iter(match=pattern, count=1000,
                                                         target_nodes=RedisCluster.PRIMARIES)))
        for raw in dict.fromkeys(skeys):
            skey = raw.decode() if isinstance(raw, bytes) else raw
            if not skey.split("}:", 1)[1].startswith("sp:"):
                continue
            cursor: Any = b"0"
            while True:
                cursor = self._call(self._spec_drop, [skey], [cursor, endpoint, self.clear_chunk])
                if cursor in (b"0", 0, "0"):
                    break

    def put_speculative(self, model: str, endpoint: str, keys: Sequence[int], ttl_s: float) -> None:
        """``keys`` is a chain from its first block (what a router picked)."""
        if keys:
            root = f"{keys[0]:016x}"
            self._call(self._put_spec, [self._skey(root, model), self._skey(root, model, "spseq")],
                       [endpoint, max(1, int(ttl_s * 1000)), pack_keys(keys)])

    # ---- lookup --------------------------------------------------------------------
    def _node_of(self, key: str) -> str:
        try:
            return str(self.r.get_node_from_key(key).name)
        except Exception:  # noqa: BLE001 - a slot map being refreshed; counted as its own shard
            return key

    def lookup(self, model: str, keys: Sequence[int], endpoint_filter: Iterable[str] | None = None,
               include_speculative: bool = False, exclude: Iterable[str] | None = None,
               extra_models: Sequence[str] = ()) -> LookupResult:
        result = LookupResult(chain_length=len(keys))
        if not keys:
            return result
        self._check_layout()
        models = [model, *[m for m in dict.fromkeys(extra_models) if m != model]]
        filt = filter_args(endpoint_filter, exclude)
        n, D = len(keys), self.anchor_depth
        blob = pack_keys(keys)
        root = f"{keys[0]:016x}"
        hk = [k for m in models for k in (self._hkey(root, m), self._dkey(root, m))]
        # the speculative hash, then its pre-write-number form (read during a rolling upgrade)
        skeys = [self._skey(root, model), self._skey(root, model, "s")] if include_speculative else []
        runs: dict[bytes, int] = {}
        combined: dict[bytes, int] = {}
        first = min(n, D)
        args_a = [blob if include_speculative else blob[:8 * first], 0, "1" if n <= D else "0",
                  "1" if include_speculative else "0", first, self.probe_stride, *filt, *["-"] * len(models)]
        nodes = {self._node_of(hk[0])}
        if n <= D:
            out = self._call(self._walk, hk + skeys, args_a)
            self._merge(out, runs, combined)
        else:
            # Both shards at once: the anchor's shard walks from depth D as if the chain
            # started there, and only the runs alive at D on the root's shard take its answer.
            anchor = f"{keys[D]:016x}"
            hk2 = [k for m in models for k in (self._hkey(anchor, m), self._dkey(anchor, m))]
            args_b = [blob[8 * D:], D, "1", "0", n - D, self.probe_stride, *filt, *["-"] * len(models)]
            out, out2 = self._both(hk + skeys, args_a, hk2, args_b)
            nodes.add(self._node_of(hk2[0]))
            self._merge(out, runs, combined)
            for j, state in enumerate(out[2]):
                if not state:
                    continue
                fields, _, eps = state.partition(b"@")
                brun = dict(pairs_of(out2[0][j]))
                berun = dict(pairs_of(out2[1][j]))
                for f in fields.split(b";"):
                    if f:
                        runs[f] = max(runs.get(f, 0), int(brun.get(f, D)))
                for e in eps.split(b";"):
                    if e:
                        combined[e] = max(combined.get(e, 0), int(berun.get(e, D)))
        self.lookup_shards[len(nodes)] += 1
        self.last_lookup_shards = len(nodes)
        return add_matches(result, runs.items(), combined.items(), out[3])

    def _both(self, keys_a: list[str], args_a: list, keys_b: list[str], args_b: list) -> tuple[list, list]:
        """The two parts of a lookup in one pipeline: sent to both shards, then both read."""
        for attempt in (0, 1):
            try:
                a, b = self._pipelined(self._walk, [(keys_a, args_a), (keys_b, args_b)])
                return a, b
            except redis.exceptions.NoScriptError:
                if attempt:
                    raise
                # a restarted or new master: load the script where the keys live, then retry
                self._call(self._walk, keys_a, args_a)
                self._call(self._walk, keys_b, args_b)
        raise AssertionError("unreachable")

    @staticmethod
    def _merge(out: list, runs: dict[bytes, int], combined: dict[bytes, int]) -> None:
        for t in out[0]:
            for f, n in pairs_of(t):
                runs[f] = max(runs.get(f, 0), int(n))
        for e in out[1]:
            for ep, n in pairs_of(e):
                combined[ep] = max(combined.get(ep, 0), int(n))

    # ---- introspection ---------------------------------------------------------------
    def endpoint_blocks(self, endpoint: str) -> int:
        raw = self._call(self.r.hgetall, self._ekey(endpoint, "n"))
        return sum(int(v) for v in raw.values())

    def stats(self) -> IndexStats:
        """Entries from the per-endpoint counters; ``keys`` scans the holder hashes (O(tags), introspection)."""
        by_tier = {t: 0 for t in TIERS}
        eps = self.endpoints()
        for ep in eps:
            for k, v in self._call(self.r.hgetall, self._ekey(ep, "n")).items():
                by_tier[Tier(int(k))] += int(v)
        nkeys = 0
        for key in self._call(lambda: list(self.r.scan_iter(match=f"{self.namespace}:{{*}}:h:*", count=1000,
                                                            target_nodes=RedisCluster.PRIMARIES))):
            nkeys += int(self._call(self.r.hlen, key))
        counters = {f"lookups_touching_{k}_shards": v for k, v in sorted(self.lookup_shards.items())}
        counters["lookup_shards_max"] = max(self.lookup_shards, default=0)
        counters["orphans_filed_as_roots"] = self.orphans
        return IndexStats(backend=self.name, entries=sum(by_tier.values()), keys=nkeys, endpoints=len(eps),
                          entries_by_tier=by_tier, counters=counters)

    def ping(self) -> bool:
        try:
            return bool(self.r.ping(target_nodes=RedisCluster.PRIMARIES))
        except (redis.RedisError, OSError):
            return False

    def run_id(self) -> str | None:
        """The masters' run ids joined; changes when any master restarts (and lost its shard)."""
        try:
            info = self.r.info("server", target_nodes=RedisCluster.PRIMARIES)
            return ",".join(sorted(str(v.get("run_id")) for v in info.values()))
        except (redis.RedisError, OSError):
            return None
