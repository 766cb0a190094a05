-- Settle one admitted request: replace its token reservation with the real count, free its
-- concurrency slot and budget reservation, and add its usage to its periods' budget counters.
--
-- Layout (built by gateway/keyspace.py; tests/gateway/test_keyspace.py checks these lines):
-- KEYS per scope: requests tokens slots held held_exp, then one counter per period
-- ARGV[1] request_id
-- ARGV[2] actual_tokens
-- ARGV[3] spend_nano
-- ARGV[4] reserved_tokens
-- ARGV[5] reserved_nano
-- ARGV[6..] settlement: n_scopes, then per scope its scope fields, then per budget of it its budget fields:
--   scope: n_periods n_budgets
--   budget: period_index metric limit alert_at
-- reserved_tokens and reserved_nano are as admit.lua got them: with request_id they name the reservation.
--
-- A reservation that already left the window (or expired) is not touched. Budget counters are only
-- incremented when they exist: a missing counter is seeded from Postgres, which already holds this
-- request's usage row or will.
--
-- Returns per scope and budget: "used alert" (used -1: no counter; alert 1: this settlement took the
-- budget past its alert threshold first in this period, so exactly one caller sends the alert).

local rid = ARGV[1]
local actual = tonumber(ARGV[2])
local spend = tonumber(ARGV[3])
local held_tok, held_nano = tonumber(ARGV[4]), tonumber(ARGV[5])
local held = rid .. ' ' .. ARGV[4] .. ' ' .. ARGV[5]
local n = tonumber(ARGV[6])

local out = {}
local argi, keyi = 7, 1
for i = 1, n do
  local np, nb = tonumber(ARGV[argi]), tonumber(ARGV[argi + 1])
  argi = argi + 2
  local tkey, ckey, sumkey, expkey = KEYS[keyi + 1], KEYS[keyi + 2], KEYS[keyi + 3], KEYS[keyi + 4]
  local pbase = keyi + 4
  keyi = keyi + 5 + np
  local reserved = redis.call('HGET', tkey, rid)
  if reserved then
    redis.call('HSET', tkey, rid, actual)
    redis.call('HINCRBY', tkey, '__total', actual - tonumber(reserved))
  end
  redis.call('ZREM', ckey, rid)
  if nb > 0 then
    if redis.call('ZREM', expkey, held) == 1 then
      if held_tok ~= 0 then redis.call('HINCRBY', sumkey, '__tok', -held_tok) end
      if held_nano ~= 0 then redis.call('HINCRBY', sumkey, '__spend', -held_nano) end
    end
    -- One EXISTS for all the periods' counters; one by one only when some are missing (rare).
    local counters = {}
    for p = 1, np do counters[p] = KEYS[pbase + p] end
    local all = redis.call('EXISTS', unpack(counters)) == np
    local used = {}
    for p = 1, np do
      if all or redis.call('EXISTS', counters[p]) == 1 then
        used[p] = {redis.call('HINCRBY', counters[p], 'tok', actual), redis.call('HINCRBY', counters[p], 'spend', spend)}
      end
    end
    for j = 1, nb do
      local p, metric, alert_at = tonumber(ARGV[argi]), tonumber(ARGV[argi + 1]), tonumber(ARGV[argi + 3])
      argi = argi + 4
      local u, alert = -1, 0
      if used[p] then
        u = used[p][metric + 1]
        if alert_at >= 0 and u >= alert_at then
          alert = redis.call('HSETNX', counters[p], 'alerted:' .. metric, 1)
        end
      end
      table.insert(out, string.format('%d %d', u, alert))
    end
  end
end
return table.concat(out, ' ')
