"""The Lua scripts behind RedisBlockStore: each store operation is one script, so it is
atomic across every kvstore replica sharing the Redis (Redis runs one script at a time).

Every script takes ARGV[1] = key prefix, ARGV[2] = now in ms (the caller's wall clock:
replicas must keep their clocks in sync to well under a lease TTL), and first ends the
leases due by then. Its reply starts with the number of leases it ended that way, so the
replica that noticed can count them in its metrics.

Block bytes do not pass through the scripts (Lua would copy each one twice): a Put first
SETs each block's bytes under a staging key of its own, pipelined with the script, which
RENAMEs the staged bytes into place (O(1), no copy) or deletes them; a Get runs its
script (recency, counters, headers) and GETs the bytes in the same MULTI transaction.

Keys under the prefix P:
    P b:<key>      hash  h = header, n = len(data), p = pin count
    P d:<key>      str   the block's bytes
    P s:<id>:<i>   str   bytes staged by a Put in flight (with a TTL, in case it never runs)
    P lru          zset  <key> -> recency tick (lower = less recent); every stored block
    P clock        int   the recency tick, incremented per touch
    P leases       zset  lease id -> expiry ms; an active lease is a member
    P lease:<id>   set   keys the lease pins
    P ltail:<id>   set   tail keys written under the lease
    P lwrite       hash  lease id -> 'pending' | 'failed' (no field: its write is done)
    P stats        hash  used, pinned, hits, misses, evictions
"""

PRELUDE = r"""
local P = ARGV[1]
local NOW = tonumber(ARGV[2])

local function num(x) return tonumber(x) or 0 end
local function is_tail(key) return string.sub(key, 1, 2) == 't:' end

local function touch(key)
  redis.call('ZADD', P .. 'lru', redis.call('INCR', P .. 'clock'), key)
end

local function drop(key)
  local size = num(redis.call('HGET', P .. 'b:' .. key, 'n'))
  redis.call('DEL', P .. 'b:' .. key, P .. 'd:' .. key)
  redis.call('ZREM', P .. 'lru', key)
  redis.call('HINCRBY', P .. 'stats', 'used', -size)
end

local function end_lease(id, drop_tail)
  for _, key in ipairs(redis.call('SMEMBERS', P .. 'lease:' .. id)) do
    if redis.call('HINCRBY', P .. 'b:' .. key, 'p', -1) == 0 then
      redis.call('HINCRBY', P .. 'stats', 'pinned', -1)
    end
  end
  if drop_tail then
    for _, key in ipairs(redis.call('SMEMBERS', P .. 'ltail:' .. id)) do
      if num(redis.call('HGET', P .. 'b:' .. key, 'p')) == 0 and redis.call('EXISTS', P .. 'b:' .. key) == 1 then
        drop(key)
      end
    end
  end
  redis.call('DEL', P .. 'lease:' .. id, P .. 'ltail:' .. id)
  redis.call('ZREM', P .. 'leases', id)
  redis.call('HDEL', P .. 'lwrite', id)
end

local function pin(lease, key)
  if redis.call('SADD', P .. 'lease:' .. lease, key) == 1 and redis.call('HINCRBY', P .. 'b:' .. key, 'p', 1) == 1 then
    redis.call('HINCRBY', P .. 'stats', 'pinned', 1)
  end
end

local function is_lease(id) return redis.call('ZSCORE', P .. 'leases', id) end

local function expire_due()
  local due = redis.call('ZRANGEBYSCORE', P .. 'leases', '-inf', NOW)
  for _, id in ipairs(due) do end_lease(id, false) end
  return #due
end
"""

# ARGV[3] capacity, ARGV[4] lease id or '', then (key, header, size, staging key) per block.
# Reply: {expired, 'ok', num_stored, num_evicted} | {expired, 'full', need, freed} | {expired, 'lease'}
PUT = PRELUDE + r"""
local expired = expire_due()
local capacity, lease = tonumber(ARGV[3]), ARGV[4]
local n = (#ARGV - 4) / 4
local function unstage()
  for i = 0, n - 1 do redis.call('DEL', ARGV[8 + 4 * i]) end
end
if lease ~= '' and not is_lease(lease) then unstage(); return {expired, 'lease'} end
local own, growth = {}, 0
for i = 0, n - 1 do
  local key, size = ARGV[5 + 4 * i], tonumber(ARGV[7 + 4 * i])
  own[key] = true
  local old = redis.call('HGET', P .. 'b:' .. key, 'n')
  if not old then growth = growth + size
  elseif is_tail(key) then growth = growth + size - tonumber(old) end
end
local need = num(redis.call('HGET', P .. 'stats', 'used')) + growth - capacity
local victims, freed, start = {}, 0, 0
while need > 0 and freed < need do
  local batch = redis.call('ZRANGE', P .. 'lru', start, start + 127)
  if #batch == 0 then break end
  for _, key in ipairs(batch) do
    if not own[key] then
      local f = redis.call('HMGET', P .. 'b:' .. key, 'n', 'p')
      if num(f[2]) == 0 then
        victims[#victims + 1] = key
        freed = freed + num(f[1])
        if freed >= need then break end
      end
    end
  end
  start = start + 128
end
if need > 0 and freed < need then unstage(); return {expired, 'full', need, freed} end
for _, key in ipairs(victims) do drop(key) end
redis.call('HINCRBY', P .. 'stats', 'evictions', #victims)
for i = 0, n - 1 do
  local key, header, size, staged = ARGV[5 + 4 * i], ARGV[6 + 4 * i], tonumber(ARGV[7 + 4 * i]), ARGV[8 + 4 * i]
  local bkey = P .. 'b:' .. key
  local old = redis.call('HGET', bkey, 'n')
  if not old or is_tail(key) then
    redis.call('RENAME', staged, P .. 'd:' .. key)
    redis.call('PERSIST', P .. 'd:' .. key)
    redis.call('HSET', bkey, 'h', header, 'n', size)
    redis.call('HSETNX', bkey, 'p', 0)
    redis.call('HINCRBY', P .. 'stats', 'used', size - num(old))
  else
    redis.call('DEL', staged)  -- a full block keeps the bytes it has: its hash fixes them
  end
  touch(key)
  if lease ~= '' then
    pin(lease, key)
    if is_tail(key) then redis.call('SADD', P .. 'ltail:' .. lease, key) end
  end
end
return {expired, 'ok', n, #victims}
"""

# ARGV[3..] keys. Reply: {expired, then per key its header, or '' when not stored}.
# The bytes are GETs of P d:<key> in the same transaction (see the module's docstring).
GET = PRELUDE + r"""
local expired = expire_due()
local out, hits = {expired}, 0
for i = 3, #ARGV do
  local header = redis.call('HGET', P .. 'b:' .. ARGV[i], 'h')
  if header then
    touch(ARGV[i])
    hits = hits + 1
    out[#out + 1] = header
  else
    out[#out + 1] = ''
  end
end
redis.call('HINCRBY', P .. 'stats', 'hits', hits)
redis.call('HINCRBY', P .. 'stats', 'misses', #ARGV - 2 - hits)
return out
"""

# ARGV[3] lease id or '' (pins what is found), ARGV[4..] keys.
# Reply: {expired, num_prefix_found} | {expired, 'lease'}
LOOKUP = PRELUDE + r"""
local expired = expire_due()
local lease = ARGV[3]
if lease ~= '' and not is_lease(lease) then return {expired, 'lease'} end
for i = 4, #ARGV do
  if redis.call('EXISTS', P .. 'b:' .. ARGV[i]) == 0 then return {expired, i - 4} end
  touch(ARGV[i])
  if lease ~= '' then pin(lease, ARGV[i]) end
end
return {expired, #ARGV - 3}
"""

# ARGV[3] lease id, ARGV[4] ttl ms, ARGV[5] write pending (0/1). Reply: {expired}
CREATE_LEASE = PRELUDE + r"""
local expired = expire_due()
redis.call('ZADD', P .. 'leases', NOW + tonumber(ARGV[4]), ARGV[3])
if ARGV[5] == '1' then redis.call('HSET', P .. 'lwrite', ARGV[3], 'pending') end
return {expired}
"""

# ARGV[3] lease id, ARGV[4] failed (0/1). Reply: {expired, ended (0/1)}
END_WRITE = PRELUDE + r"""
local expired = expire_due()
if not is_lease(ARGV[3]) or redis.call('HGET', P .. 'lwrite', ARGV[3]) ~= 'pending' then return {expired, 0} end
if ARGV[4] == '1' then redis.call('HSET', P .. 'lwrite', ARGV[3], 'failed')
else redis.call('HDEL', P .. 'lwrite', ARGV[3]) end
return {expired, 1}
"""

# ARGV[3] lease id. Reply: {expired, 'pending' | 'failed' | 'done' | ''} ('': no such lease)
WRITE_STATE = PRELUDE + r"""
local expired = expire_due()
if not is_lease(ARGV[3]) then return {expired, ''} end
return {expired, redis.call('HGET', P .. 'lwrite', ARGV[3]) or 'done'}
"""

# ARGV[3] lease id, ARGV[4] drop_tail (0/1). Reply: {expired, released (0/1)}
RELEASE_LEASE = PRELUDE + r"""
local expired = expire_due()
if not redis.call('ZSCORE', P .. 'leases', ARGV[3]) then return {expired, 0} end
end_lease(ARGV[3], ARGV[4] == '1')
return {expired, 1}
"""

# Reply: {expired}
EXPIRE = PRELUDE + r"""
return {expire_due()}
"""

# Reply: {expired, used, num_blocks, pinned, num_leases, hits, misses, evictions}
STATS = PRELUDE + r"""
local expired = expire_due()
local s = redis.call('HMGET', P .. 'stats', 'used', 'pinned', 'hits', 'misses', 'evictions')
return {expired, num(s[1]), redis.call('ZCARD', P .. 'lru'), num(s[2]), redis.call('ZCARD', P .. 'leases'),
        num(s[3]), num(s[4]), num(s[5])}
"""
