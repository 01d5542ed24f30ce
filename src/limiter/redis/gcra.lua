-- sluice: GCRA for one request's counters, all or nothing, inside Redis.
--
-- The same decision as the in-memory store (src/limiter/gcra.rs and store.rs), in integer
-- nanoseconds. Lua numbers are doubles, exact only below 2^53 (104 days in nanoseconds), so every
-- time is kept as a pair {seconds, nanoseconds} and the few operations GCRA needs (add, subtract,
-- compare, multiply by a count, divide into a count) are done exactly on pairs.
--
-- KEYS[i]  the counter of op i (a decimal TAT in nanoseconds, expiring at its millisecond)
-- ARGV[1]  "now" in nanoseconds, or "" to use Redis TIME (the one clock all nodes share); an
--          injected time is for tests, and then keys get no TTL
-- ARGV[2]  1 when the whole request is decided here; 0 when this call is one hash-slot group of
--          a Redis Cluster request: a denied enforced op still blocks the group, but whether all
--          quota-mode ops are over is for the caller to judge (and to compensate by refunds)
-- then 7 per op: T (ns), B*T (ns), B, cost, kind (0 enforce, 1 shadow, 2 quota; +4 refund,
--          +8 spend recorded), period (ns, the wait reported by a ban; with B*T it gives the debt
--          cap, B*T + max delay + 4 periods and at most 2^62 ns, as Quota::debt_cap), max delay
--          (ns: a charge that does not fit now is admitted at its slot when that comes within
--          it, as gcra::decide; its wait, the debt, then passes B*T by the time to its slot)
-- Returns { blocked, now, then per op: admitted (0/1), remaining, wait (ns, decimal string) },
--          and after them, when the call repaired counters, how many.
--
-- A counter that holds no TAT (anything but 1 to 19 decimal digits, which bound every TAT of a
-- quota's 2^62 ns, or a key of another type)
-- is a fact about that counter, not an error: it is deleted, read as absent (a full bucket) and
-- counted, and the call goes on.

local G = 1000000000

local function pair(s)
  local len = #s
  if len <= 9 then return { 0, tonumber(s) } end
  return { tonumber(string.sub(s, 1, len - 9)), tonumber(string.sub(s, len - 8)) }
end

local function text(a)
  if a[1] == 0 then return string.format('%.0f', a[2]) end
  return string.format('%.0f%09.0f', a[1], a[2])
end

local function cmp(a, b)
  if a[1] ~= b[1] then return a[1] < b[1] and -1 or 1 end
  if a[2] ~= b[2] then return a[2] < b[2] and -1 or 1 end
  return 0
end

local function add(a, b)
  local s, n = a[1] + b[1], a[2] + b[2]
  if n >= G then return { s + 1, n - G } end
  return { s, n }
end

-- a - b, or zero when b >= a
local function sub(a, b)
  if cmp(a, b) <= 0 then return { 0, 0 } end
  local s, n = a[1] - b[1], a[2] - b[2]
  if n < 0 then return { s - 1, n + G } end
  return { s, n }
end

local function max(a, b) if cmp(a, b) >= 0 then return a end return b end
local function min(a, b) if cmp(a, b) <= 0 then return a end return b end

-- x = q*G + r exactly, for an integer 0 <= x < 2^53
local function divmod(x)
  local q = math.floor(x / G)
  local r = x - q * G
  if r < 0 then q, r = q - 1, r + G elseif r >= G then q, r = q + 1, r - G end
  return q, r
end

-- a * k for an integer 0 <= k < 2^39 whose product stays below 2^63 ns
local function mul(a, k)
  local kh = math.floor(k / 65536)
  local kl = k - kh * 65536
  local hq, hr = divmod(kh * a[2])
  local tq, tr = divmod(hr * 65536 + kl * a[2])
  return { k * a[1] + hq * 65536 + tq, tr }
end

-- floor(x / t) for a result below 2^32
local function div(x, t)
  local q = math.floor((x[1] * G + x[2]) / (t[1] * G + t[2]))
  if q > 4294967296 then q = 4294967296 end
  while q > 0 and cmp(mul(t, q), x) > 0 do q = q - 1 end
  while cmp(mul(t, q + 1), x) <= 0 do q = q + 1 end
  return q
end

local ZERO = { 0, 0 }
-- 2^62 ns, the most debt any counter may carry.
local MAX_DEBT = { 4611686018, 427387904 }

-- min(a * k, cap) for a > 0 and a count k of any size: a product past cap is never formed, so
-- k stays below cap / a + 2 in mul (below 2^39 for every quota a policy can write, whose B and
-- requests per period are 32-bit counts, so that cap / T is below 2^35).
local function mulcap(a, k, cap)
  if k > (cap[1] * G + cap[2]) / (a[1] * G + a[2]) + 1 then return cap end
  return min(mul(a, k), cap)
end

local now
if ARGV[1] ~= '' then
  now = pair(ARGV[1])
else
  local t = redis.call('TIME')
  now = { tonumber(t[1]), tonumber(t[2]) * 1000 }
end
local whole = ARGV[2] == '1'

local ops = {}
for i = 1, #KEYS do
  local a = 2 + (i - 1) * 7
  local kind = tonumber(ARGV[a + 5])
  local op = {
    key = KEYS[i], t = pair(ARGV[a + 1]), tol = pair(ARGV[a + 2]), burst = tonumber(ARGV[a + 3]),
    cost = tonumber(ARGV[a + 4]), mode = kind % 4, refund = kind % 8 >= 4, spent = kind >= 8,
    period = pair(ARGV[a + 6]),
  }
  -- The most debt an admission may leave: the bucket and the delay.
  op.reach = add(op.tol, pair(ARGV[a + 7]))
  -- Refunds and spend are applied whatever the request's outcome.
  op.uncond = op.refund or op.spent
  -- The debt cap, B*T + max delay + 4 periods, at most 2^62 ns (a ban carries none).
  if op.burst > 0 then op.cap = min(add(op.reach, mul(op.period, 4)), MAX_DEBT) else op.cap = ZERO end
  ops[i] = op
end

local function remaining(op, tat)
  if op.burst == 0 then return 0 end
  local debt = sub(tat, now)
  if cmp(debt, op.tol) >= 0 then return 0 end
  return div(sub(op.tol, debt), op.t)
end

-- the in-memory store's gcra::decide
local function decide(op, tat, cost)
  if op.burst == 0 then return false, tat, 0, op.period end
  local base = max(min(tat, add(now, op.cap)), now)
  if cost > op.burst then return false, tat, remaining(op, base), sub(base, now) end
  local new = add(base, mul(op.t, cost))
  local debt = sub(new, now)
  if cmp(debt, op.reach) <= 0 then return true, new, div(sub(op.tol, debt), op.t), debt end
  return false, tat, remaining(op, base), sub(debt, op.tol)
end

local repaired = 0

local function read(key)
  local v = redis.pcall('GET', key)
  if type(v) == 'string' and #v >= 1 and #v <= 19 and not string.find(v, '%D') then
    return pair(v)
  end
  if v then
    redis.call('DEL', key)
    repaired = repaired + 1
  end
  return ZERO
end

-- With Redis TIME, a key lives exactly as long as it carries debt. With an injected time (tests),
-- an expiry in real time would mean nothing, so none is set.
local injected = ARGV[1] ~= ''

local function write(key, tat)
  local debt = sub(tat, now)
  if cmp(debt, ZERO) == 0 then
    redis.call('DEL', key)
  elseif injected then
    redis.call('SET', key, text(tat))
  else
    -- Expires no earlier than the TAT's millisecond, as in gcra_lean.lua: PX of the debt's whole
    -- milliseconds + 2 (PXAT needs Redis 6.2).
    redis.call('SET', key, text(tat), 'PX', string.format('%d', debt[1] * 1000 + math.floor(debt[2] / 1000000) + 2))
  end
end

-- the in-memory store's gcra::record: the debt, cost included, cut to the cap, written whatever
-- the outcome; it fits when the debt is within B*T, else its wait is the time until it is.
local function record(op, tat, cost)
  if op.burst == 0 then return false, tat, 0, op.period end
  local debt = sub(max(min(tat, add(now, op.cap)), now), now)
  debt = min(add(debt, mulcap(op.t, cost, op.cap)), op.cap)
  local new = add(now, debt)
  if cmp(debt, op.tol) <= 0 then return true, new, remaining(op, new), debt end
  return false, new, 0, sub(debt, op.tol)
end

-- the in-memory store's gcra::refund: TAT = max(now, TAT cut to the cap - cost*T)
local function refund(op, tat, cost)
  if op.burst == 0 then return false, tat, 0, op.period end
  local debt = sub(min(tat, add(now, op.cap)), now)
  local back = add(now, sub(debt, mulcap(op.t, cost, debt)))
  return true, back, remaining(op, back), sub(back, now)
end

local out = {}

-- Refunds and spend first, exactly once, whatever the outcome.
for i, op in ipairs(ops) do
  if op.uncond then
    local tat = read(op.key)
    local ok, new, rem, wait
    if op.spent then
      ok, new, rem, wait = record(op, tat, op.cost)
    else
      ok, new, rem, wait = refund(op, tat, op.cost)
    end
    if cmp(new, tat) ~= 0 then write(op.key, new) end
    out[i] = { ok, new, rem, wait }
  end
end

-- Plan the charges in order, as if each admitted one had been applied.
local overlay = {}
local before = {}
for i, op in ipairs(ops) do
  if not op.uncond then
    local tat = overlay[op.key] or read(op.key)
    before[i] = tat
    local ok, new, rem, wait = decide(op, tat, op.cost)
    out[i] = { ok, new, rem, wait }
    if ok then overlay[op.key] = new end
  end
end

local blocked = false
local quota_ops, quota_denied = 0, 0
for i, op in ipairs(ops) do
  if not op.refund then
    if op.mode == 2 then
      quota_ops = quota_ops + 1
      if not out[i][1] then quota_denied = quota_denied + 1 end
    elseif op.mode == 0 and not out[i][1] then
      blocked = true
    end
  end
end
if whole and quota_ops > 0 and quota_denied == quota_ops then blocked = true end

if blocked then
  -- Nothing is charged: an op that fit reports the state it found.
  for i, op in ipairs(ops) do
    if not op.uncond and out[i][1] then
      local ok, new, rem, wait = decide(op, before[i], 0)
      out[i] = { ok, new, rem, wait }
    end
  end
else
  for i, op in ipairs(ops) do
    if not op.uncond and out[i][1] and op.cost > 0 and overlay[op.key] then
      write(op.key, overlay[op.key])
      overlay[op.key] = nil
    end
  end
end

local reply = { blocked and 1 or 0, text(now) }
for i = 1, #ops do
  reply[#reply + 1] = out[i][1] and 1 or 0
  reply[#reply + 1] = out[i][3]
  reply[#reply + 1] = text(out[i][4])
end
if repaired > 0 then reply[#reply + 1] = repaired end
return reply
