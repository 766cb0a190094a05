-- Free the concurrency slots of gateway processes that died (a SIGKILL, an OOM kill, a lost node).
--
-- A slot's member is "<gateway instance>.<admission id>"; a live gateway keeps the key
-- ARGV[1] .. instance refreshed (gateway/limits/liveness.py). A slot whose gateway's key is gone
-- can never be settled, so it is removed instead of holding its key for the slot TTL.
--
-- KEYS[1]: a slots zset.  ARGV[1]: the liveness key prefix, ARGV[2]: the caller's instance (alive).
-- Returns the number of slots freed.

local freed = 0
local alive = {[ARGV[2]] = true}
for _, member in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local instance = string.match(member, '^([^.]+)%.')
  if instance then
    if alive[instance] == nil then
      alive[instance] = redis.call('EXISTS', ARGV[1] .. instance) == 1
    end
    if not alive[instance] then
      redis.call('ZREM', KEYS[1], member)
      freed = freed + 1
    end
  end
end
return freed
