-- One budget-lease batch, atomically (maas_types::lease::apply_item, item by item).
-- KEYS[1]      the replicas ZSET (member: replica id, score: last call in Unix ms)
-- KEYS[2]      the batch's memory: maas:lease:v1:batch:<sha256(replica) hex>:<batchId>
--              (unused when ARGV[4] is 0: a batch without an id)
-- KEYS[2 + i]  item i's counter: maas:lease:v1:<sha256(subject) hex>:<kind>:<windowSeconds>:<windowStart>
-- ARGV[1] now (Unix ms), ARGV[2] replica id, ARGV[3] replica TTL (ms), ARGV[4] how long the
-- batch's answer is remembered (ms; 0: no batch id), then per item i, from
-- ARGV[4 + 6(i-1) + 1]: limit, need, want, debt, release, expire-at (Unix ms).
-- Answers {replicas, granted_1, taken_1, granted_2, taken_2, ...}; a batch id already applied
-- gets its first answer again and nothing is applied (exactly once across re-sends).
-- Numbers are doubles here: the companion refuses items above 2^53 so that all is exact.
local now = tonumber(ARGV[1])
local ttl = tonumber(ARGV[3])
local remember = tonumber(ARGV[4])
redis.call('ZADD', KEYS[1], now, ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. string.format('%d', now - ttl))
redis.call('PEXPIRE', KEYS[1], 2 * ttl)
if remember > 0 then
  local seen = redis.call('GET', KEYS[2])
  if seen then
    local again = {}
    for n in string.gmatch(seen, '%d+') do
      again[#again + 1] = tonumber(n)
    end
    return again
  end
end
local replicas = redis.call('ZCARD', KEYS[1])
if replicas < 1 then
  replicas = 1
end
local out = {replicas}
for i = 3, #KEYS do
  local a = 4 + 6 * (i - 3)
  local limit = tonumber(ARGV[a + 1])
  local need = tonumber(ARGV[a + 2])
  local want = tonumber(ARGV[a + 3])
  local debt = tonumber(ARGV[a + 4])
  local release = tonumber(ARGV[a + 5])
  local expire_at = ARGV[a + 6]
  local stored = redis.call('GET', KEYS[i])
  local taken = 0
  if stored then
    taken = tonumber(stored)
    if taken == nil then
      return redis.error_reply('maas lease counter ' .. KEYS[i] .. ' is not a number')
    end
  end
  -- 1. taken = max(0, taken - release) + debt
  taken = math.max(0, taken - release) + debt
  -- 2. remaining = max(0, limit - taken)
  local remaining = math.max(0, limit - taken)
  -- 3. grant when asked and the need fits
  local granted = 0
  if (need > 0 or want > 0) and remaining >= need then
    local fair = math.max(need, math.floor(remaining / replicas))
    granted = math.min(remaining, math.max(need, math.min(want, fair)))
  end
  -- 4. taken += granted; forget the counter a margin after the window's end
  taken = taken + granted
  redis.call('SET', KEYS[i], string.format('%d', taken))
  redis.call('PEXPIREAT', KEYS[i], expire_at)
  out[#out + 1] = granted
  out[#out + 1] = taken
end
if remember > 0 then
  local parts = {}
  for j = 1, #out do
    parts[j] = string.format('%d', out[j])
  end
  redis.call('SET', KEYS[2], table.concat(parts, ' '), 'PX', string.format('%d', remember))
end
return out
