-- Free the concurrency slots of gateway processes that died (a SIGKILL, an OOM kill, a lost node).
--
-- A slot's member is "<gateway instance>.<admission id>"; a live gateway keeps the key
-- ARGV[1] .. instance refreshed (gateway/limits/liveness.py). A slot whose gateway's key is gone
-- can never be settled, so it is removed instead of holding its key for the slot TTL.
--
-- Layout (built by gateway/keyspace.py; tests/gateway/test_keyspace.py checks these lines):
-- KEYS[1] slots
-- ARGV[1] alive_prefix
-- ARGV[2] instance
-- slots: a scope's concurrency slots; alive_prefix: the liveness keys'; instance: the caller's (alive).
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
