-- Admit one request against every scope that limits it (key, tenant, per-model), atomically.
--
-- Either every scope admits the request and all of them record it, or none changes.
-- Windows are sliding logs over the last `window_ms`, so the limit is exact, not per bucket.
-- Budgets are strict: the request's worst case (tokens, and spend in nano-units) is reserved against
-- every budget of every scope, and admitted only if settled usage + outstanding reservations + it
-- fit under the limit. Reservations expire after `slot_ttl_ms` (a gateway that died never settles):
-- they are dropped when they would refuse a request. A reservation is one sorted-set member
-- "request_id tokens nano" (score: expiry), so recording and settling it touch no per-request hash.
--
-- Layout (built by gateway/keyspace.py; tests/gateway/test_keyspace.py checks these lines):
-- KEYS per scope: requests tokens slots held held_exp, then one counter per period
-- ARGV[1] request_id
-- ARGV[2] reserve_tokens
-- ARGV[3] window_ms
-- ARGV[4] slot_ttl_ms
-- ARGV[5] budget_tokens
-- ARGV[6] budget_nano
-- ARGV[7..] limits: n_scopes, then per scope its scope fields, then per budget of it its budget fields:
--   scope: rpm tpm concurrency n_periods n_budgets
--   budget: period_index metric limit alert_at
-- Limits are -1 for none; period_index counts from 1, metric is 0 tokens, 1 spend. The keys: request log
-- (zset rid -> admit ms), tokens (hash rid -> tokens, "__total"), slots (zset rid -> expiry ms),
-- reservation sums (hash "__tok", "__spend"), reservations (zset "rid tokens nano" -> expiry ms), then
-- one counter per period (hash: tok, spend).
--
-- Returns one string of space-separated fields (one bulk reply is much cheaper for the client to parse
-- than an array of numbers):
--         "ok now_ms" then per scope: req_limit req_remaining req_reset_ms tok_limit tok_remaining
--                     tok_reset_ms, then per budget: what it has left after this reservation
--      or "deny scope_index reason retry_after_ms budget_index"
--      or "seed scope_index period_index"  when a period's counter is missing (Python seeds it).

local rid = ARGV[1]
local reserve = tonumber(ARGV[2])
local window = tonumber(ARGV[3])
local slot_ttl = tonumber(ARGV[4])
local btok = tonumber(ARGV[5])
local bnano = tonumber(ARGV[6])
local n = tonumber(ARGV[7])
local held = rid .. ' ' .. ARGV[5] .. ' ' .. ARGV[6]  -- the reservation; settle.lua names it alike

local function reply(fields)
  for j, v in ipairs(fields) do
    if type(v) == 'number' then fields[j] = string.format('%d', v) end
  end
  return table.concat(fields, ' ')
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cutoff = now - window
local CHUNK = 500

-- Drop requests older than the window from the log and take their tokens off the total.
local function prune(rkey, tkey)
  while true do
    local old = redis.call('ZRANGEBYSCORE', rkey, '-inf', cutoff, 'LIMIT', 0, CHUNK)
    if #old == 0 then return end
    local vals = redis.call('HMGET', tkey, unpack(old))
    local freed = 0
    for _, v in ipairs(vals) do
      if v then freed = freed + tonumber(v) end
    end
    redis.call('ZREM', rkey, unpack(old))
    redis.call('HDEL', tkey, unpack(old))
    if freed ~= 0 then redis.call('HINCRBY', tkey, '__total', -freed) end
    if #old < CHUNK then return end
  end
end

-- How long until enough tokens leave the window for `need` more to fit under `limit`.
local function tokens_retry_ms(rkey, tkey, total, limit, need)
  local freed = 0
  local start = 0
  while true do
    local rows = redis.call('ZRANGE', rkey, start, start + CHUNK - 1, 'WITHSCORES')
    if #rows == 0 then return window end
    for i = 1, #rows, 2 do
      local v = redis.call('HGET', tkey, rows[i])
      if v then freed = freed + tonumber(v) end
      if total - freed + need <= limit then
        return tonumber(rows[i + 1]) + window - now
      end
    end
    start = start + CHUNK
  end
end

-- Give back the reservations of requests that never settled (their gateway died); how many.
local function expire_reservations(sumkey, expkey)
  local freed = 0
  while true do
    local old = redis.call('ZRANGEBYSCORE', expkey, '-inf', now, 'LIMIT', 0, CHUNK)
    if #old == 0 then return freed end
    local tok, nano = 0, 0
    for _, member in ipairs(old) do
      local a, b = string.match(member, ' (%d+) (%d+)$')
      if a then tok, nano = tok + tonumber(a), nano + tonumber(b) end
    end
    redis.call('ZREM', expkey, unpack(old))
    if tok ~= 0 then redis.call('HINCRBY', sumkey, '__tok', -tok) end
    if nano ~= 0 then redis.call('HINCRBY', sumkey, '__spend', -nano) end
    freed = freed + #old
    if #old < CHUNK then return freed end
  end
end

-- The first budget the request's worst case does not fit (nil: all fit); fills `left`.
local function misfit(budgets, used, sumkey, left)
  local sums = redis.call('HMGET', sumkey, '__tok', '__spend')
  local held_tok, held_nano = tonumber(sums[1] or 0), tonumber(sums[2] or 0)
  for j, b in ipairs(budgets) do
    if b.metric == 0 then left[j] = b.limit - used[b.p][1] - held_tok - btok
    else left[j] = b.limit - used[b.p][2] - held_nano - bnano end
    if left[j] < 0 then return j end
  end
  return nil
end

local state = {}
local argi, keyi = 8, 1
for i = 1, n do
  local rpm, tpm, conc = tonumber(ARGV[argi]), tonumber(ARGV[argi + 1]), tonumber(ARGV[argi + 2])
  local np, nb = tonumber(ARGV[argi + 3]), tonumber(ARGV[argi + 4])
  argi = argi + 5
  local rkey, tkey, ckey = KEYS[keyi], KEYS[keyi + 1], KEYS[keyi + 2]
  local sumkey, expkey = KEYS[keyi + 3], KEYS[keyi + 4]
  local pbase = keyi + 4
  keyi = keyi + 5 + np
  local s = {rpm = rpm, tpm = tpm, conc = conc, nb = nb, count = 0, total = 0, left = {}}

  if nb > 0 then
    local budgets = {}
    for j = 1, nb do
      budgets[j] = {p = tonumber(ARGV[argi]), metric = tonumber(ARGV[argi + 1]), limit = tonumber(ARGV[argi + 2])}
      argi = argi + 4
    end
    local used = {}
    for p = 1, np do
      local c = redis.call('HMGET', KEYS[pbase + p], 'tok', 'spend')
      if not c[1] then return reply({'seed', i, p}) end
      used[p] = {tonumber(c[1]), tonumber(c[2] or 0)}
    end
    local j = misfit(budgets, used, sumkey, s.left)
    -- Expired reservations only matter when they would refuse: drop them then, and look again.
    if j and expire_reservations(sumkey, expkey) > 0 then j = misfit(budgets, used, sumkey, s.left) end
    if j then
      return reply({'deny', i, budgets[j].metric == 0 and 'token_budget' or 'spend_budget', 0, j})
    end
  end

  if rpm >= 0 or tpm >= 0 then
    prune(rkey, tkey)
    s.count = redis.call('ZCARD', rkey)
    s.total = tonumber(redis.call('HGET', tkey, '__total') or 0)
    if rpm >= 0 and s.count >= rpm then
      local retry = window
      if rpm > 0 then
        local row = redis.call('ZRANGE', rkey, s.count - rpm, s.count - rpm, 'WITHSCORES')
        retry = tonumber(row[2]) + window - now
      end
      return reply({'deny', i, 'rpm', retry, 0})
    end
    if tpm >= 0 and s.total + reserve > tpm then
      if reserve > tpm then return reply({'deny', i, 'tpm_too_large', 0, 0}) end
      return reply({'deny', i, 'tpm', tokens_retry_ms(rkey, tkey, s.total, tpm, reserve), 0})
    end
  end

  if conc >= 0 then
    redis.call('ZREMRANGEBYSCORE', ckey, '-inf', now)
    if redis.call('ZCARD', ckey) >= conc then return reply({'deny', i, 'concurrency', 1000, 0}) end
  end
  s.rkey, s.tkey, s.ckey, s.sumkey, s.expkey = rkey, tkey, ckey, sumkey, expkey
  state[i] = s
end

-- Every scope admits: record the request everywhere.
local out = {'ok', now}
for i = 1, n do
  local s = state[i]
  local req_reset, tok_reset = 0, 0
  if s.rpm >= 0 or s.tpm >= 0 then
    redis.call('ZADD', s.rkey, now, rid)
    redis.call('HSET', s.tkey, rid, reserve)
    redis.call('HINCRBY', s.tkey, '__total', reserve)
    redis.call('PEXPIRE', s.rkey, window + 1000)
    redis.call('PEXPIRE', s.tkey, window + 1000)
    -- reset = when the oldest request in the window leaves it and frees capacity
    local oldest = redis.call('ZRANGE', s.rkey, 0, 0, 'WITHSCORES')
    req_reset = tonumber(oldest[2]) + window - now
    tok_reset = req_reset
  end
  if s.conc >= 0 then
    redis.call('ZADD', s.ckey, now + slot_ttl, rid)
    redis.call('PEXPIRE', s.ckey, slot_ttl + 1000)
  end
  if s.nb > 0 then
    -- No TTL on these two: one of each per scope with budgets, emptied as requests settle or expire.
    redis.call('ZADD', s.expkey, now + slot_ttl, held)
    if btok ~= 0 then redis.call('HINCRBY', s.sumkey, '__tok', btok) end
    if bnano ~= 0 then redis.call('HINCRBY', s.sumkey, '__spend', bnano) end
  end
  local req_remaining, tok_remaining = -1, -1
  if s.rpm >= 0 then req_remaining = s.rpm - s.count - 1 end
  if s.tpm >= 0 then tok_remaining = math.max(0, s.tpm - s.total - reserve) end
  table.insert(out, s.rpm)
  table.insert(out, req_remaining)
  table.insert(out, req_reset)
  table.insert(out, s.tpm)
  table.insert(out, tok_remaining)
  table.insert(out, tok_reset)
  for j = 1, s.nb do table.insert(out, s.left[j]) end
end
return reply(out)
