-- Give back the budget reservations of gateway processes that died (they will never settle).
--
-- Like reap.lua for concurrency slots: a reservation's id is "<gateway instance>.<admission id>" and
-- a live gateway keeps ARGV[1] .. instance refreshed (gateway/limits/liveness.py).
--
-- KEYS[1]: reservations hash (rid -> "tokens nano", "__tok", "__spend"), KEYS[2]: their expiry zset.
-- ARGV[1]: the liveness key prefix, ARGV[2]: the caller's instance (alive).
-- Returns the number of reservations given back.

local freed, tok, nano = 0, 0, 0
local alive = {[ARGV[2]] = true}
for _, rid in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  local instance = string.match(rid, '^([^.]+)%.')
  if instance then
    if alive[instance] == nil then
      alive[instance] = redis.call('EXISTS', ARGV[1] .. instance) == 1
    end
    if not alive[instance] then
      local held = redis.call('HGET', KEYS[1], rid)
      if held then
        local a, b = string.match(held, '(%d+) (%d+)')
        tok, nano = tok + tonumber(a), nano + tonumber(b)
        redis.call('HDEL', KEYS[1], rid)
      end
      redis.call('ZREM', KEYS[2], rid)
      freed = freed + 1
    end
  end
end
if freed > 0 then
  redis.call('HINCRBY', KEYS[1], '__tok', -tok)
  redis.call('HINCRBY', KEYS[1], '__spend', -nano)
end
return freed
