"""The Lua scripts of the Redis KV-block index (`redis.py`): one lookup per request in one
round trip, and the batched writes. Kept apart from the Python so each reads on its own.
"""

from __future__ import annotations

import hashlib

# ARGV[1] = little-endian uint64 block keys. Returns [start, value, start, value, ..., walked]:
# one (start, value) per run of equal values, stopping at the first block nobody holds.
#
# Exact linear walks cost ~470 ns per block server-side (2048 keys: 0.98 ms, of which the
# 2048-field HMGET is 0.7 ms: Redis renders every ~200-byte value as RESP and Lua parses it
# back). Chains instead rely on how they are written: `record` stores whole prefixes and
# capacity evicts tails first, so every entry's holdings along a path are a prefix of it and
# a value seen at two blocks is the value of every block between them. The script then finds
# the end of the walk and each run boundary by bisection, O(runs x log n) single-field probes
# (2048 keys, 2 runs: ~13 probes). Writes that can break the prefix shape (see WRITE) flag
# the chain in field '~'; flagged chains, and any probe pair showing an entry at a later block
# that the earlier block lacks, are walked linearly, so answers equal the exact walk.
LOOKUP = """
local key, blob = KEYS[1], ARGV[1]
local n = #blob / 8
local out, prev, walked, stopped = {}, false, 0, false
local function emit(pos, v)
  if v ~= prev then
    out[#out + 1] = pos
    out[#out + 1] = v
    prev = v
  end
end
local function field(i) return string.sub(blob, i * 8 + 1, i * 8 + 8) end
-- the exact walk over blocks a..b (0-based, inclusive); stops the lookup at a missing block
local function linear(a, b)
  local c = a
  while c <= b do
    local last = math.min(b, c + 3999)
    local fields = {}
    for i = c, last do fields[#fields + 1] = field(i) end
    local vals = redis.call('HMGET', key, unpack(fields))
    for i = 1, #vals do
      local v = vals[i]
      if not v then
        walked, stopped = c + i - 1, true
        return
      end
      emit(c + i - 1, v)
    end
    c = last + 1
  end
end
local tagsets = {}
local function tags(v)
  local t = tagsets[v]
  if not t then
    t = {}
    for tag in string.gmatch(v, "([^\\n=]+)=%d+") do t[tag] = true end
    tagsets[v] = t
  end
  return t
end
-- true when every entry of later value w is also on earlier value v (the prefix shape)
local function shrinks(v, w)
  local tv = tags(v)
  for tag in pairs(tags(w)) do
    if not tv[tag] then return false end
  end
  return true
end
-- runs of blocks lo+1..hi, given the values at lo (already emitted) and hi
local function fill(lo, vlo, hi, vhi)
  if stopped or vlo == vhi then return end
  if hi == lo + 1 then
    emit(hi, vhi)
    return
  end
  if not shrinks(vlo, vhi) then return linear(lo + 1, hi) end
  local mid = math.floor((lo + hi) / 2)
  local vmid = redis.call('HGET', key, field(mid))
  if not vmid then return linear(lo + 1, hi) end
  fill(lo, vlo, mid, vmid)
  fill(mid, vmid, hi, vhi)
end
local head = redis.call('HMGET', key, '~', field(0), field(n - 1))
local flag, v0, vlast = head[1], head[2], head[3]
if not v0 then return {0} end
if n <= 8 or (flag and string.find(flag, 'i', 1, true)) then
  linear(0, n - 1)
  if not stopped then walked = n end
  out[#out + 1] = walked
  return out
end
emit(0, v0)
walked = n
if not vlast then
  -- the blocks anyone holds form a prefix: bisect for its end
  local lo, hi = 0, n - 1
  vlast = v0
  while hi - lo > 1 do
    local mid = math.floor((lo + hi) / 2)
    local v = redis.call('HGET', key, field(mid))
    if v then lo, vlast = mid, v else hi = mid end
  end
  walked = hi
end
if walked > 1 then fill(0, v0, walked - 1, vlast) end
out[#out + 1] = walked
return out
"""

# ARGV[1] = key ttl ms, ARGV[2] = the chain's root key (8 bytes), then (op, tag, deadline,
# blob) quads; op s = set tag, r = remove tag, x = remove every tag of endpoint `tag` (the
# endpoint left), e = the same for capacity eviction.
# Field '~' flags what LOOKUP must know: 'i' = holdings may not be prefixes, walk linearly
# (a removal of single blocks, a sliding-window or recurrent-state group, or one entry that is
# both precise and approximate along the chain); 'c' = some store did not start at the root
# or was longer than the 4096 distinct eviction scores, so capacity eviction may cut a hole
# and then sets 'i'. Eviction of whole-prefix writes (record) keeps holdings prefixes.
WRITE = """
local key, root = KEYS[1], ARGV[2]
local flag = redis.call('HGET', key, '~') or ''
local irregular = string.find(flag, 'i', 1, true) ~= nil
local continued = string.find(flag, 'c', 1, true) ~= nil
local function parse(v)
  local t = {}
  for tag, dl in string.gmatch(v, "([^\\n=]+)=(%d+)") do t[tag] = dl end
  return t
end
local function ser(t)
  local ks = {}
  for k in pairs(t) do ks[#ks + 1] = k end
  if #ks == 0 then return false end
  table.sort(ks)
  for i, k in ipairs(ks) do ks[i] = k .. '=' .. t[k] end
  return table.concat(ks, '\\n')
end
for j = 3, #ARGV, 4 do
  local op, tag, dl, blob = ARGV[j], ARGV[j + 1], ARGV[j + 2], ARGV[j + 3]
  local plen = #tag
  if op == 's' then
    if string.find(tag, '#%d+:[sm]') then irregular = true end
    if string.sub(blob, 1, 8) ~= root or #blob > 8 * 4096 then continued = true end
  elseif op == 'e' and continued then
    irregular = true
  end
  local first, prev_old, prev_new = true, false, false
  for i = 1, #blob / 8 do
    local f = string.sub(blob, i * 8 - 7, i * 8)
    local old = redis.call('HGET', key, f)
    local new
    if not first and old == prev_old then
      new = prev_new
    else
      local t = old and parse(old) or {}
      if op == 's' then
        local was = t[tag]
        if was and (was == '0') ~= (dl == '0') then irregular = true end
        t[tag] = dl
      elseif op == 'r' then
        if t[tag] then irregular = true end
        t[tag] = nil
      else
        for k in pairs(t) do
          local c = string.sub(k, plen + 1, plen + 1)
          if string.sub(k, 1, plen) == tag and (c == '' or c == '#' or c == '@') then t[k] = nil end
        end
      end
      new = ser(t)
      first, prev_old, prev_new = false, old, new
    end
    if new then
      if new ~= old then redis.call('HSET', key, f, new) end
    elseif old then
      redis.call('HDEL', key, f)
    end
  end
end
local newflag = (continued and 'c' or '') .. (irregular and 'i' or '')
if redis.call('HLEN', key) <= (flag ~= '' and 1 or 0) then
  -- nothing left but the flag: the chain is gone
  redis.call('DEL', key)
  return 0
end
if newflag ~= flag then redis.call('HSET', key, '~', newflag) end
redis.call('PEXPIRE', key, ARGV[1])
return 0
"""

# ARGV = score base, capacity (0 = none), key ttl ms, then (op, blob) pairs; op a = touch,
# d = forget; blob = 16-byte (root, key) members, head first. Returns evicted members.
# ZADD GT keeps each member's highest score: a replica whose clock lags must not score a
# refreshed head below its tail, or eviction would cut holes that LOOKUP does not expect.
TRACK = """
local key = KEYS[1]
local base, cap = tonumber(ARGV[1]), tonumber(ARGV[2])
for j = 4, #ARGV, 2 do
  local op, blob = ARGV[j], ARGV[j + 1]
  local cmd = op == 'a' and 'ZADD' or 'ZREM'
  local args = op == 'a' and {'GT'} or {}
  local base_len = #args
  for i = 1, #blob / 16 do
    local m = string.sub(blob, i * 16 - 15, i * 16)
    if op == 'a' then args[#args + 1] = base + 4095 - math.min(i - 1, 4095) end
    args[#args + 1] = m
    if #args >= 4000 then
      redis.call(cmd, key, unpack(args))
      args = op == 'a' and {'GT'} or {}
    end
  end
  if #args > base_len then redis.call(cmd, key, unpack(args)) end
end
local evicted = {}
if cap > 0 then
  local size = redis.call('ZCARD', key)
  if size > cap then
    evicted = redis.call('ZRANGE', key, 0, size - cap - 1)
    redis.call('ZREMRANGEBYRANK', key, 0, size - cap - 1)
  end
end
if redis.call('EXISTS', key) == 1 then redis.call('PEXPIRE', key, ARGV[3]) end
return evicted
"""


SHA = {s: hashlib.sha1(s.encode()).hexdigest() for s in (LOOKUP, WRITE, TRACK)}
