-- Raise an admitted request's reservation to its exact worst case, atomically, or refuse it.
--
-- Admission reserved an estimate of the prompt; the engine counted it exactly before any work and
-- found more. This grows the request's reservation in every scope (its tokens in the tpm log, its
-- member of the budget reservations and their sums) by the difference, if it fits under every tpm
-- limit and every budget as admission would have checked it; otherwise nothing changes and the
-- caller refuses the request (settling it for 0 gives the old reservation back).
-- Rate and concurrency limits are not looked at again: the request already counts there.
--
-- Layout (built by gateway/keyspace.py; tests/gateway/test_keyspace.py checks these lines):
-- KEYS per scope: requests tokens slots held held_exp, then one counter per period
-- ARGV[1] request_id
-- ARGV[2] old_tokens
-- ARGV[3] old_nano
-- ARGV[4] new_tokens
-- ARGV[5] new_nano
-- ARGV[6] window_ms
-- ARGV[7] slot_ttl_ms
-- ARGV[8..] limits: n_scopes, then per scope its scope fields, then per budget of it its budget fields:
--   scope: rpm tpm concurrency n_periods n_budgets
--   budget: period_index metric limit alert_at
-- The keys and limits are admit.lua's.
--
-- Returns admit.lua's shape: "ok now_ms" then per scope: -1 0 0 tok_limit tok_remaining tok_reset_ms
--         (the request fields unchanged), then per budget what it has left after the new reservation;
--      or "deny scope_index reason retry_after_ms budget_index"; or "seed scope_index period_index".

local rid = ARGV[1]
local old_tok, old_nano = tonumber(ARGV[2]), tonumber(ARGV[3])
local new_tok, new_nano = tonumber(ARGV[4]), tonumber(ARGV[5])
local window, slot_ttl = tonumber(ARGV[6]), tonumber(ARGV[7])
local n = tonumber(ARGV[8])
local dtok, dnano = new_tok - old_tok, new_nano - old_nano
local old_held = rid .. ' ' .. ARGV[2] .. ' ' .. ARGV[3]
local new_held = rid .. ' ' .. ARGV[4] .. ' ' .. ARGV[5]

local function reply(fields)
  for j, v in ipairs(fields) do
    if type(v) == 'number' then fields[j] = string.format('%d', v) end
  end
  return table.concat(fields, ' ')
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local state = {}
local argi, keyi = 9, 1
for i = 1, n do
  local tpm = tonumber(ARGV[argi + 1])
  local np, nb = tonumber(ARGV[argi + 3]), tonumber(ARGV[argi + 4])
  argi = argi + 5
  local rkey, tkey, sumkey, expkey = KEYS[keyi], KEYS[keyi + 1], KEYS[keyi + 3], KEYS[keyi + 4]
  local pbase = keyi + 4
  keyi = keyi + 5 + np
  local s = {tpm = tpm, nb = nb, left = {}, tkey = tkey, sumkey = sumkey, expkey = expkey, total = 0}

  if nb > 0 then
    local sums = redis.call('HMGET', sumkey, '__tok', '__spend')
    local held_tok, held_nano = tonumber(sums[1] or 0), tonumber(sums[2] or 0)
    for j = 1, nb do
      local p, metric, limit = tonumber(ARGV[argi]), tonumber(ARGV[argi + 1]), tonumber(ARGV[argi + 2])
      argi = argi + 4
      local c = redis.call('HMGET', KEYS[pbase + p], 'tok', 'spend')
      if not c[1] then return reply({'seed', i, p}) end
      -- The sums hold the old reservation already: only the difference must still fit.
      if metric == 0 then s.left[j] = limit - tonumber(c[1]) - held_tok - dtok
      else s.left[j] = limit - tonumber(c[2] or 0) - held_nano - dnano end
      if s.left[j] < 0 then
        return reply({'deny', i, metric == 0 and 'token_budget' or 'spend_budget', 0, j})
      end
    end
  end

  if tpm >= 0 then
    s.mine = redis.call('HGET', tkey, rid)
    s.total = tonumber(redis.call('HGET', tkey, '__total') or 0)
    if new_tok > tpm then return reply({'deny', i, 'tpm_too_large', 0, 0}) end
    if s.mine and s.total + dtok > tpm then
      -- Retry after the oldest request leaves the window (this one is refused, and its tokens go).
      local oldest = redis.call('ZRANGE', rkey, 0, 0, 'WITHSCORES')
      return reply({'deny', i, 'tpm', math.max(0, tonumber(oldest[2] or now) + window - now), 0})
    end
  end
  state[i] = s
end

local out = {'ok', now}
for i = 1, n do
  local s = state[i]
  local tok_remaining = -1
  if s.tpm >= 0 then
    if s.mine then
      redis.call('HSET', s.tkey, rid, new_tok)
      redis.call('HINCRBY', s.tkey, '__total', dtok)
      s.total = s.total + dtok
    end
    tok_remaining = math.max(0, s.tpm - s.total)
  end
  if s.nb > 0 then
    local expiry = redis.call('ZSCORE', s.expkey, old_held) or (now + slot_ttl)
    if redis.call('ZREM', s.expkey, old_held) == 0 then
      dtok, dnano = new_tok, new_nano  -- expired and given back meanwhile: hold all of it again
    end
    redis.call('ZADD', s.expkey, expiry, new_held)
    if dtok ~= 0 then redis.call('HINCRBY', s.sumkey, '__tok', dtok) end
    if dnano ~= 0 then redis.call('HINCRBY', s.sumkey, '__spend', dnano) end
    dtok, dnano = new_tok - old_tok, new_nano - old_nano
  end
  table.insert(out, -1)
  table.insert(out, 0)
  table.insert(out, 0)
  table.insert(out, s.tpm)
  table.insert(out, tok_remaining)
  table.insert(out, 0)
  for j = 1, s.nb do table.insert(out, s.left[j]) end
end
return reply(out)
