-- Admit one request against every scope that limits it (key, tenant, per-model), atomically.
--
-- Either every scope admits the request and all of them record it, or none changes.
-- Windows are sliding logs over the last `window_ms`, so the limit is exact, not per bucket.
--
-- ARGV: request_id, reserve_tokens, window_ms, slot_ttl_ms, n_scopes,
--       then per scope: rpm, tpm, concurrency, token_budget, spend_budget  (-1 = no limit)
-- KEYS per scope (4): request log (zset rid -> admit ms), tokens (hash rid -> tokens, "__total"),
--       slots (zset rid -> expiry ms), month (hash: tok, spend)
--
-- Returns one string of space-separated fields (one bulk reply is much cheaper for the client to parse
-- than an array of numbers):
--         "ok now_ms" then per scope: req_limit req_remaining req_reset_ms tok_limit tok_remaining
--                     tok_reset_ms budget_tokens_used budget_spend_used
--      or "deny scope_index reason retry_after_ms"
--      or "seed scope_index"  when a budget counter for this month is missing (Python seeds it).

local rid = ARGV[1]
local reserve = tonumber(ARGV[2])
local window = tonumber(ARGV[3])
local slot_ttl = tonumber(ARGV[4])
local n = tonumber(ARGV[5])

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

local state = {}
for i = 1, n do
  local a = 5 + (i - 1) * 5
  local rpm, tpm, conc = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  local tok_budget, spend_budget = tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5])
  local k = (i - 1) * 4
  local rkey, tkey, ckey, mkey = KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], KEYS[k + 4]
  local s = {rpm = rpm, tpm = tpm, conc = conc, count = 0, total = 0, tok_used = 0, spend_used = 0}

  if tok_budget >= 0 or spend_budget >= 0 then
    local month = redis.call('HMGET', mkey, 'tok', 'spend')
    if not month[1] then return reply({'seed', i}) end
    s.tok_used, s.spend_used = tonumber(month[1]), tonumber(month[2] or 0)
    if tok_budget >= 0 and s.tok_used >= tok_budget then return reply({'deny', i, 'token_budget', 0}) end
    if spend_budget >= 0 and s.spend_used >= spend_budget then return reply({'deny', i, 'spend_budget', 0}) end
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
      return reply({'deny', i, 'rpm', retry})
    end
    if tpm >= 0 and s.total + reserve > tpm then
      if reserve > tpm then return reply({'deny', i, 'tpm_too_large', 0}) end
      return reply({'deny', i, 'tpm', tokens_retry_ms(rkey, tkey, s.total, tpm, reserve)})
    end
  end

  if conc >= 0 then
    redis.call('ZREMRANGEBYSCORE', ckey, '-inf', now)
    if redis.call('ZCARD', ckey) >= conc then return reply({'deny', i, 'concurrency', 1000}) end
  end
  state[i] = {rkey = rkey, tkey = tkey, ckey = ckey}
  for key, v in pairs(s) do state[i][key] = v end
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
  local req_remaining, tok_remaining = -1, -1
  if s.rpm >= 0 then req_remaining = s.rpm - s.count - 1 end
  if s.tpm >= 0 then tok_remaining = math.max(0, s.tpm - s.total - reserve) end
  table.insert(out, s.rpm)
  table.insert(out, req_remaining)
  table.insert(out, req_reset)
  table.insert(out, s.tpm)
  table.insert(out, tok_remaining)
  table.insert(out, tok_reset)
  table.insert(out, s.tok_used)
  table.insert(out, s.spend_used)
end
return reply(out)
