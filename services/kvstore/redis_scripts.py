"""The Lua scripts behind RedisBlockStore: each store operation is one script, so it is
atomic across every kvstore replica sharing the Redis (Redis runs one script at a time).

Every script takes ARGV[1] = key prefix, ARGV[2] = now in ms (the caller's wall clock:
replicas must keep their clocks in sync to well under a lease TTL), and first ends the
leases due by then. Its reply starts with the number of leases it ended that way, so the
replica that noticed can count them in its metrics.

Keys under the prefix P:
    P b:<key>      hash  h = header, d = data, n = len(data), p = pin count
    P lru          zset  <key> -> recency tick (lower = less recent); every stored block
    P clock        int   the recency tick, incremented per touch
    P leases       zset  lease id -> expiry ms; an active lease is a member
    P lease:<id>   set   keys the lease pins
    P ltail:<id>   set   tail keys written under the lease
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
  redis.call('DEL', P .. 'b:' .. key)
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
end

local function expire_due()
  local due = redis.call('ZRANGEBYSCORE', P .. 'leases', '-inf', NOW)
  for _, id in ipairs(due) do end_lease(id, false) end
  return #due
end
"""

# ARGV[3] capacity, ARGV[4] lease id or '', then (key, header, data) per block.
# Reply: {expired, 'ok', num_stored, num_evicted} | {expired, 'full', need, freed} | {expired, 'lease'}
PUT = PRELUDE + r"""
local expired = expire_due()
local capacity, lease = tonumber(ARGV[3]), ARGV[4]
if lease ~= '' and not redis.call('ZSCORE', P .. 'leases', lease) then return {expired, 'lease'} end
local n = (#ARGV - 4) / 3
local own, growth = {}, 0
for i = 0, n - 1 do
  local key, data = ARGV[5 + 3 * i], ARGV[7 + 3 * i]
  own[key] = true
  local old = redis.call('HGET', P .. 'b:' .. key, 'n')
  if not old then growth = growth + #data
  elseif is_tail(key) then growth = growth + #data - tonumber(old) end
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
if need > 0 and freed < need then return {expired, 'full', need, freed} end
for _, key in ipairs(victims) do drop(key) end
redis.call('HINCRBY', P .. 'stats', 'evictions', #victims)
for i = 0, n - 1 do
  local key, header, data = ARGV[5 + 3 * i], ARGV[6 + 3 * i], ARGV[7 + 3 * i]
  local bkey = P .. 'b:' .. key
  local old = redis.call('HGET', bkey, 'n')
  if not old then
    redis.call('HSET', bkey, 'h', header, 'd', data, 'n', #data, 'p', 0)
    redis.call('HINCRBY', P .. 'stats', 'used', #data)
  elseif is_tail(key) then
    redis.call('HSET', bkey, 'h', header, 'd', data, 'n', #data)
    redis.call('HINCRBY', P .. 'stats', 'used', #data - tonumber(old))
  end
  touch(key)
  if lease ~= '' then
    if redis.call('SADD', P .. 'lease:' .. lease, key) == 1 and redis.call('HINCRBY', bkey, 'p', 1) == 1 then
      redis.call('HINCRBY', P .. 'stats', 'pinned', 1)
    end
    if is_tail(key) then redis.call('SADD', P .. 'ltail:' .. lease, key) end
  end
end
return {expired, 'ok', n, #victims}
"""

# ARGV[3..] keys. Reply: {expired, then per key: found (0/1), header, data}
GET = PRELUDE + r"""
local expired = expire_due()
local out, hits = {expired}, 0
for i = 3, #ARGV do
  local f = redis.call('HMGET', P .. 'b:' .. ARGV[i], 'h', 'd')
  if f[1] then
    touch(ARGV[i])
    hits = hits + 1
    out[#out + 1] = 1; out[#out + 1] = f[1]; out[#out + 1] = f[2]
  else
    out[#out + 1] = 0; out[#out + 1] = ''; out[#out + 1] = ''
  end
end
redis.call('HINCRBY', P .. 'stats', 'hits', hits)
redis.call('HINCRBY', P .. 'stats', 'misses', #ARGV - 2 - hits)
return out
"""

# ARGV[3..] keys. Reply: {expired, num_prefix_found}
LOOKUP = PRELUDE + r"""
local expired = expire_due()
for i = 3, #ARGV do
  if redis.call('EXISTS', P .. 'b:' .. ARGV[i]) == 0 then return {expired, i - 3} end
  touch(ARGV[i])
end
return {expired, #ARGV - 2}
"""

# ARGV[3] lease id, ARGV[4] ttl ms. Reply: {expired}
CREATE_LEASE = PRELUDE + r"""
local expired = expire_due()
redis.call('ZADD', P .. 'leases', NOW + tonumber(ARGV[4]), ARGV[3])
return {expired}
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
