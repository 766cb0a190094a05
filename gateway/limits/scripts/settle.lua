-- Settle one admitted request: replace its token reservation with the real count, free its
-- concurrency slot and add its usage to this month's budget counters.
--
-- ARGV: request_id, actual_tokens, spend_nano, n_scopes
-- KEYS per scope (4): request log, tokens, slots, month  (same as admit.lua)
--
-- A reservation that already left the window is not touched (the window total no longer holds it).
-- Budget counters are only incremented when they exist: a missing counter is seeded from Postgres,
-- which already holds this request's usage row or will.

local rid = ARGV[1]
local actual = tonumber(ARGV[2])
local spend = tonumber(ARGV[3])
local n = tonumber(ARGV[4])

for i = 1, n do
  local k = (i - 1) * 4
  local tkey, ckey, mkey = KEYS[k + 2], KEYS[k + 3], KEYS[k + 4]
  local reserved = redis.call('HGET', tkey, rid)
  if reserved then
    redis.call('HSET', tkey, rid, actual)
    redis.call('HINCRBY', tkey, '__total', actual - tonumber(reserved))
  end
  redis.call('ZREM', ckey, rid)
  if redis.call('EXISTS', mkey) == 1 then
    redis.call('HINCRBY', mkey, 'tok', actual)
    redis.call('HINCRBY', mkey, 'spend', spend)
  end
end
return 1
