-- Give back the budget reservations of gateway processes that died (they will never settle).
--
-- Like reap.lua for concurrency slots: a reservation is "<gateway instance>.<admission id> tokens
-- nano" and a live gateway keeps ARGV[1] .. instance refreshed (gateway/limits/liveness.py).
--
-- Layout (built by gateway/keyspace.py; tests/gateway/test_keyspace.py checks these lines):
-- KEYS[1] held
-- KEYS[2] held_exp
-- ARGV[1] alive_prefix
-- ARGV[2] instance
-- held: reservation sums (hash "__tok", "__spend"), held_exp: the reservations (zset -> expiry);
-- alive_prefix: the liveness keys', instance: the caller's (alive).
-- Returns the number of reservations given back.

local freed, tok, nano = 0, 0, 0
local alive = {[ARGV[2]] = true}
for _, held in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  local instance, a, b = string.match(held, '^([^.]+)%.%S* (%d+) (%d+)$')
  if instance then
    if alive[instance] == nil then
      alive[instance] = redis.call('EXISTS', ARGV[1] .. instance) == 1
    end
    if not alive[instance] then
      tok, nano = tok + tonumber(a), nano + tonumber(b)
      redis.call('ZREM', KEYS[2], held)
      freed = freed + 1
    end
  end
end
if tok ~= 0 then redis.call('HINCRBY', KEYS[1], '__tok', -tok) end
if nano ~= 0 then redis.call('HINCRBY', KEYS[1], '__spend', -nano) end
return freed
