-- sluice: GCRA for a batch of requests, each all or nothing, inside Redis: the lean form, after
-- prelude.lua. The same decisions as gcra.lua and the in-memory store, to the nanosecond, for
-- requests whose every counter has a debt cap (B*T + delay + 4 periods, as Quota::debt_cap) plus
-- T below 2^52 ns (the caller sends the others to gcra.lua): every quantity is a debt relative to now,
-- an integer a Lua double holds exactly. A product cost*T past that is formed only to be cut to
-- the cap, and a double's rounding never takes a product across it.
--
-- One call carries one request or several (concurrent requests coalesced by the caller), decided
-- one after the other in their order, each all or nothing, each seeing what the ones before it
-- charged: the same as separate calls in that order. The writes come after the last request, one
-- per counter that moved, so a counter the whole batch shares is written once a call.
--
-- KEYS     the counters of every op of every request, in order. A write sets the TAT with a TTL
--          of the debt's whole milliseconds + 2 (`SET ... PX`, Redis 2.6.12 or later): it expires
--          no earlier than the TAT's millisecond, so a key is never gone while its TAT is ahead.
--          Redis TIME, read first, is at most 1 ms past the clock the TTL counts from (a script's
--          start, Redis 7), and floor(now + d) <= floor(now) + floor(d) + 1 (in ms).
-- ARGV[1]  "now" (now.lua)
-- ARGV[2]  the number of requests
-- ARGV[3]  the requests, as little-endian doubles (every value an integer below 2^53, so each is
--          exact): per request whole (1 when the whole request is decided here, 0 for one
--          hash-slot group of a cluster request, whose quota-mode verdict is the caller's) and its
--          number of ops, then 7 per op: T (ns), B*T (ns), B, cost, kind (0 enforce, 1 shadow,
--          2 quota; +4 refund, +8 spend recorded), period (ns: the wait reported by a ban, and
--          the debt cap B*T + delay + 4 periods), and the delay (ns): how far past B*T a charge
--          may be admitted at its slot (0 for none). Binary, so that no argument goes through a
--          decimal parse. A charge admitted past B*T reports that debt as its wait, and the
--          caller holds its answer until the slot.
-- Returns, per request: blocked, then per op: admitted (0/1), remaining, wait (ns); as one string
--          of little-endian doubles: one bulk reply, not an integer reply per value. When the call
--          repaired counters, one more double follows: how many.
--
-- Several counters are read by MGET, which reads a key of another type as none; such a key is
-- replaced when it is written, and counted. A stored value is told from a TAT as in prelude.lua.

-- floor(x) is written x - x % 1, and a debt's whole seconds (d - d % G) / G: exact for these
-- values, and arithmetic in Lua's VM rather than a call of math.floor.
local unpack_args, pack = struct.unpack, struct.pack
local args = argv[3]

-- One request of one charge (Envoy's usual request): straight-line, nothing allocated but the
-- reply. A denial writes nothing, so deciding it is the whole plan, as in the store's one-op
-- path. Its TAT write is the batch's (at the end of this script), written out again here.
local w1, n1, mode, burst, period, T, tol, c, delay
if argv[2] == '1' and nk == 1 then
  w1, n1, T, tol, burst, c, mode, period, delay = unpack_args('<ddddddddd', args)
end
if mode and mode < 4 then
  local whole = w1 == 1
  if burst == 0 then
    local answer = pack('<dddd', (mode == 0 or (mode == 2 and whole)) and 1 or 0, 0, 0, period)
    if repaired > 0 then return answer .. pack('<d', repaired) end
    return answer
  end
  local key = keys[1]
  local d = 0
  if one then
    d = one
    -- The debt cap: spend recorded may leave a debt past the bucket, up to it.
    local cap = tol + delay + 4 * period
    if d > cap then d = cap elseif d < 0 then d = 0 end
  end
  local new = d + c * T
  if c > burst or new > tol + delay then
    local q = 0
    if d < tol then
      q = (tol - d) / T
      q = q - q % 1
      if q * T > tol - d then q = q - 1 elseif (q + 1) * T <= tol - d then q = q + 1 end
    end
    local w = new - tol
    if c > burst then w = d end
    local answer = pack('<dddd', (mode == 0 or (mode == 2 and whole)) and 1 or 0, 0, q, w)
    if repaired > 0 then return answer .. pack('<d', repaired) end
    return answer
  end
  if c > 0 and new > 0 then
    local r = new % G
    local s = now_s + (new - r) / G
    local ns = now_ns + r
    if ns >= G then s, ns = s + 1, ns - G end
    local tat
    if s == 0 then tat = format('%d', ns) else tat = format('%d%09d', s, ns) end
    -- The prelude's GET found a string or nothing (a key of another type was deleted).
    if injected then
      call('SET', key, tat)
    else
      call('SET', key, tat, 'PX', format('%d', (new - new % 1000000) / 1000000 + 2))
    end
  end
  local q = 0
  if new < tol then
    q = (tol - new) / T
    q = q - q % 1
    if q * T > tol - new then q = q - 1 elseif (q + 1) * T <= tol - new then q = q + 1 end
  end
  local answer = pack('<dddd', 0, 1, q, new)
  if repaired > 0 then return answer .. pack('<d', repaired) end
  return answer
end

-- One request of 2 to 16 plain charges (enforced, cost at least 1, no refund) on distinct
-- counters, the usual multi-descriptor request: `plain` below, written out again without the
-- tables, closures and batch loop a coalesced call needs. A request of any other kind goes on to the batch path, which then
-- reads its counters again: nothing is written before every op is known to be plain.
if argv[2] == '1' and nk >= 2 and nk <= 16 then
  -- p[1] whole (one request is whole), p[2] the op count, then op i's seven values from
  -- p[7i - 4]; `out` packs the reply's 1 + 3 * nk values.
  local layout, out
  if nk == 2 then
    layout, out = '<dddddddddddddddd', '<ddddddd'
  elseif nk == 3 then
    layout, out = '<ddddddddddddddddddddddd', '<dddddddddd'
  else
    layout, out = '<dd' .. string.rep('ddddddd', nk), '<' .. string.rep('d', 1 + 3 * nk)
  end
  local p = { unpack_args(layout, args) }
  -- The counters as read, then each op's debt found; false once the request is known not to be
  -- of plain charges.
  local stored = p[2] == nk and call('MGET', unpack(keys))
  -- The counters MGET read as none: absent, or a key of another type (told apart when written).
  local none
  -- reply[1] blocked, then op i's admitted, remaining and wait from reply[3i - 1]; made at its
  -- size for up to three ops (only the first 1 + 3 * nk entries are sent).
  local reply = { 0, 0, 0, 0, 0, 0, 0, 0, 0, 0 }
  local blocked = false
  for i = 1, nk do
    local o = 7 * i - 4
    local T, tol, b, c = p[o], p[o + 1], p[o + 2], p[o + 3]
    if not stored or p[o + 4] ~= 0 or c < 1 or b == 0 then
      stored = false
      break
    end
    for j = 1, i - 1 do
      if keys[j] == keys[i] then stored = false end
    end
    if not stored then break end
    local d = 0
    local v = stored[i]
    if v then
      local len = #v
      if len <= 9 then
        d = tonumber(v)
        if d then d = d - now_ns - now_s * G end
      else
        local s, ns = tonumber(sub(v, 1, len - 9)), tonumber(sub(v, len - 8))
        d = s and ns and (s - now_s) * G + (ns - now_ns)
      end
      if not d or d - d ~= 0 or d > MAX_DEBT then
        call('DEL', keys[i])
        d, repaired = 0, repaired + 1
      else
        local cap = tol + p[o + 6] + 4 * p[o + 5]
        if d > cap then d = cap elseif d < 0 then d = 0 end
      end
    else
      none = none or {}
      none[i] = true
    end
    -- The debt found, for a refused request's restatement below.
    stored[i] = d
    local debt = d + c * T
    local r = 3 * i - 1
    if c > b or debt > tol + p[o + 6] then
      blocked = true
      local a = tol - d
      local q = 0
      if a > 0 then
        q = a / T
        q = q - q % 1
        if q * T > a then q = q - 1 elseif (q + 1) * T <= a then q = q + 1 end
      end
      if c > b then debt = d else debt = debt - tol end
      reply[r], reply[r + 1], reply[r + 2] = 0, q, debt
    else
      local a = tol - debt
      local q = 0
      if a > 0 then
        q = a / T
        q = q - q % 1
        if q * T > a then q = q - 1 elseif (q + 1) * T <= a then q = q + 1 end
      end
      reply[r], reply[r + 1], reply[r + 2] = 1, q, debt
    end
  end
  if stored then
    if blocked then
      -- Nothing is charged: an op that fit reports the state it found (a check of cost 0).
      reply[1] = 1
      for i = 1, nk do
        local r = 3 * i - 1
        if reply[r] == 1 then
          local o = 7 * i - 4
          -- An op that fit found a debt within the bucket and its delay.
          local T, d = p[o], stored[i]
          local a = p[o + 1] - d
          local q = 0
          if a > 0 then
            q = a / T
            q = q - q % 1
            if q * T > a then q = q - 1 elseif (q + 1) * T <= a then q = q + 1 end
          end
          reply[r + 1], reply[r + 2] = q, d
        end
      end
    end
    -- The reply is made before anything is written, so that nothing is charged for a request
    -- whose answer could not be.
    local answer = pack(out, unpack(reply, 1, 1 + 3 * nk))
    if blocked then
      if repaired > 0 then return answer .. pack('<d', repaired) end
      return answer
    end
    for i = 1, nk do
      local debt = reply[3 * i + 1]
      local r = debt % G
      local s = now_s + (debt - r) / G
      local ns = now_ns + r
      if ns >= G then s, ns = s + 1, ns - G end
      local tat
      if s == 0 then tat = format('%d', ns) else tat = format('%d%09d', s, ns) end
      -- A key of another type (MGET reads it as none) is replaced, and counted.
      if none and none[i] and call('EXISTS', keys[i]) == 1 then repaired = repaired + 1 end
      if injected then
        call('SET', keys[i], tat)
      else
        call('SET', keys[i], tat, 'PX', format('%d', (debt - debt % 1000000) / 1000000 + 2))
      end
    end
    if repaired > 0 then return answer .. pack('<d', repaired) end
    return answer
  end
end

-- Every counter of the batch read in one call (past 4,096, in one call per 4,096: one unpack of
-- more would pass the Lua stack's limit). `cur` then holds each counter's debt (TAT - now) as
-- the batch's decisions move it, and `base` the debt each key of KEYS had when read: 0 for
-- none, exact while below 2^53; beyond, only its sign and that it exceeds every tolerance here
-- matter, and both hold. Nothing is written until every request is decided (below, at the end):
-- a counter that several requests of the batch charge is written once.
local stored
if #keys <= 4096 then
  stored = call('MGET', unpack(keys))
else
  stored = {}
  for i = 1, #keys, 4096 do
    local j = i + 4095
    if j > #keys then j = #keys end
    local part = call('MGET', unpack(keys, i, j))
    for x = 1, j - i + 1 do stored[i + x - 1] = part[x] end
  end
end
local cur, base = {}, {}
for i = 1, #keys do
  local key = keys[i]
  local d = cur[key]
  if d == nil then
    d = 0
    local v = stored[i]
    if v then
      local len = #v
      if len <= 9 then
        d = tonumber(v)
        if d then d = d - now_ns - now_s * G end
      else
        local s, ns = tonumber(sub(v, 1, len - 9)), tonumber(sub(v, len - 8))
        d = s and ns and (s - now_s) * G + (ns - now_ns)
      end
      if not d or d - d ~= 0 or d > MAX_DEBT then
        call('DEL', key)
        d, repaired = 0, repaired + 1
      end
    end
    cur[key] = d
  end
  base[i] = d
end

-- floor(a / t) for integers a < 2^52, t >= 1, corrected for the rounding of the division; 0
-- for a <= 0 (no whole request left in a bucket in debt)
local function quot(a, t)
  if a <= 0 then return 0 end
  local q = a / t
  q = q - q % 1
  if q * t > a then return q - 1 end
  if (q + 1) * t <= a then return q + 1 end
  return q
end

local reply = {}
local k = 0 -- keys before this request's
local pos = 1 -- this request's first byte in args
-- One charge of a batch: the straight path above, on the batch's view of its counter.
local function one(whole, T, tol, burst, c, mode, period, delay, key)
  local blocked = (mode == 0 or (mode == 2 and whole)) and 1 or 0
  if burst == 0 then return blocked, 0, 0, period end
  local d = cur[key]
  local cap = tol + delay + 4 * period
  if d > cap then d = cap elseif d < 0 then d = 0 end
  local new = d + c * T
  if c > burst or new > tol + delay then
    local w = new - tol
    if c > burst then w = d end
    return blocked, 0, quot(tol - d, T), w
  end
  if c > 0 then cur[key] = new end
  return 0, 1, quot(tol - new, T), new
end

-- A request of several plain charges (enforced, cost >= 1, no refund) on distinct counters, the
-- usual multi-descriptor request: the general path below without its tables. Every charge is
-- decided against the counter as it is; if one does not fit, nothing is written and each that
-- fit reports the state it found; else every charge is written. Returns false, leaving the reply
-- untouched, when the request is not of that kind. `p` holds the request's ops, 7 values each.
local function plain(n, p, k)
  for i = 1, n do
    local oi = (i - 1) * 7
    if p[oi + 5] ~= 0 or p[oi + 4] < 1 or p[oi + 3] == 0 then
      return false
    end
    for j = 1, i - 1 do
      if keys[k + j] == keys[k + i] then return false end
    end
  end
  local at = #reply + 1
  reply[at] = 0
  local blocked = false
  for i = 1, n do
    local oi = (i - 1) * 7
    local T, tol, burst, c = p[oi + 1], p[oi + 2], p[oi + 3], p[oi + 4]
    local d = cur[keys[k + i]]
    local cap = tol + p[oi + 7] + 4 * p[oi + 6]
    if d > cap then d = cap elseif d < 0 then d = 0 end
    local debt = d + c * T
    local r = at + 1 + (i - 1) * 3
    if c > burst or debt > tol + p[oi + 7] then
      blocked = true
      reply[r], reply[r + 1] = 0, quot(tol - d, T)
      if c > burst then reply[r + 2] = d else reply[r + 2] = debt - tol end
    else
      -- An admitted op's wait is its new debt, the value to write. Its remaining is quot()
      -- inlined: this is the hot loop of a multi-descriptor request.
      local a = tol - debt
      local q = 0
      if a > 0 then
        q = a / T
        q = q - q % 1
        if q * T > a then q = q - 1 elseif (q + 1) * T <= a then q = q + 1 end
      end
      reply[r], reply[r + 1], reply[r + 2] = 1, q, debt
    end
  end
  if blocked then
    reply[at] = 1
    -- Nothing is charged: an op that fit reports the state it found (a check of cost 0).
    for i = 1, n do
      if reply[at + 1 + (i - 1) * 3] == 1 then
        local oi = (i - 1) * 7
        local T, tol = p[oi + 1], p[oi + 2]
        local d = cur[keys[k + i]]
        -- It fit, so the debt it found is within the bucket and its delay.
        if d < 0 then d = 0 end
        local r = at + 1 + (i - 1) * 3
        reply[r + 1], reply[r + 2] = quot(tol - d, T), d
      end
    end
  else
    for i = 1, n do cur[keys[k + i]] = reply[at + (i - 1) * 3 + 3] end
  end
  return true
end

-- The unpack format of n ops' values, made once per op count.
local layouts = {}
for _ = 1, tonumber(argv[2]) do
  local w, n
  w, n, pos = unpack_args('<dd', args, pos)
  local whole = w == 1
  local p
  if n == 1 then
    local T1, tol1, burst1, c1, mode1, period1, delay1
    T1, tol1, burst1, c1, mode1, period1, delay1, pos = unpack_args('<ddddddd', args, pos)
    if mode1 < 4 then
      local at = #reply
      reply[at + 1], reply[at + 2], reply[at + 3], reply[at + 4] =
        one(whole, T1, tol1, burst1, c1, mode1, period1, delay1, keys[k + 1])
      k = k + 1
    else
      p = { T1, tol1, burst1, c1, mode1, period1, delay1 }
    end
  else
    if n <= 256 then
      -- All 7n values at once, into a table made at its size.
      local layout = layouts[n]
      if not layout then
        layout = '<' .. string.rep('d', 7 * n)
        layouts[n] = layout
      end
      p = { unpack_args(layout, args, pos) }
      pos = p[7 * n + 1]
    else
      -- Op by op: one unpack of thousands of values would pass the Lua stack's limit
      -- (about 8,000); past 256 ops, well before it, the values are taken one op at a time.
      p = {}
      for o = 0, 7 * (n - 1), 7 do
        p[o + 1], p[o + 2], p[o + 3], p[o + 4], p[o + 5], p[o + 6], p[o + 7], pos =
          unpack_args('<ddddddd', args, pos)
      end
    end
    if plain(n, p, k) then
      k = k + n
      p = nil
    end
  end
  if p then
  local T, tol, burst, cost, mode, refund, period, key = {}, {}, {}, {}, {}, {}, {}, {}
  -- delay[i]: how far past the bucket a charge may be admitted at its slot.
  local delay = {}
  -- spent[i]: spend recorded; uncond[i]: a refund or spend, applied whatever the outcome;
  -- cap[i]: the debt cap.
  local spent, uncond, cap = {}, {}, {}
  for i = 1, n do
    local o = (i - 1) * 7
    local kind = p[o + 5]
    T[i], tol[i], burst[i] = p[o + 1], p[o + 2], p[o + 3]
    cost[i], mode[i], refund[i], period[i] = p[o + 4], kind % 4, kind % 8 >= 4, p[o + 6]
    spent[i] = kind >= 8
    uncond[i] = refund[i] or spent[i]
    delay[i] = p[o + 7]
    cap[i] = tol[i] + delay[i] + 4 * period[i]
    key[i] = keys[k + i]
  end
  k = k + n

  -- The in-memory store's gcra::decide on a debt d (may be negative: no debt).
  local function decide(i, d, c)
    if burst[i] == 0 then return false, d, 0, period[i] end
    local base = d
    if base > cap[i] then base = cap[i] end
    if base < 0 then base = 0 end
    if c > burst[i] then return false, d, quot(tol[i] - base, T[i]), base end
    local new = base + c * T[i]
    if new <= tol[i] + delay[i] then return true, new, quot(tol[i] - new, T[i]), new end
    return false, d, quot(tol[i] - base, T[i]), new - tol[i]
  end

  -- Per op: admitted, remaining, wait.
  local ok, rem, wait = {}, {}, {}

  -- Refunds and spend first, exactly once, whatever the outcome.
  for i = 1, n do
    if uncond[i] then
      local d = cur[key[i]]
      if burst[i] == 0 then
        ok[i], rem[i], wait[i] = false, 0, period[i]
      else
        if d > cap[i] then d = cap[i] elseif d < 0 then d = 0 end
        if spent[i] then
          -- The in-memory store's gcra::record: the debt cut to the cap, written whatever the
          -- outcome; it fits when within B*T, else its wait is the time until it is.
          local debt = d + cost[i] * T[i]
          if debt > cap[i] then debt = cap[i] end
          cur[key[i]] = debt
          if debt <= tol[i] then
            ok[i], rem[i], wait[i] = true, quot(tol[i] - debt, T[i]), debt
          else
            ok[i], rem[i], wait[i] = false, 0, debt - tol[i]
          end
        else
          local back = d - cost[i] * T[i]
          if back < 0 then back = 0 end
          cur[key[i]] = back
          ok[i], rem[i], wait[i] = true, quot(tol[i] - back, T[i]), back
        end
      end
    end
  end

  -- Plan the charges in order, as if each admitted one had been applied.
  local overlay, before = {}, {}
  for i = 1, n do
    if not uncond[i] then
      local d = overlay[key[i]]
      if d == nil then d = cur[key[i]] end
      before[i] = d
      local admitted, new, r, w = decide(i, d, cost[i])
      ok[i], rem[i], wait[i] = admitted, r, w
      if admitted then overlay[key[i]] = new end
    end
  end

  local blocked = false
  local quota_ops, quota_denied = 0, 0
  for i = 1, n do
    if not refund[i] then
      if mode[i] == 2 then
        quota_ops = quota_ops + 1
        if not ok[i] then quota_denied = quota_denied + 1 end
      elseif mode[i] == 0 and not ok[i] then
        blocked = true
      end
    end
  end
  if whole and quota_ops > 0 and quota_denied == quota_ops then blocked = true end

  if blocked then
    -- Nothing is charged: an op that fit reports the state it found.
    for i = 1, n do
      if not uncond[i] and ok[i] then
        local admitted, _, r, w = decide(i, before[i], 0)
        ok[i], rem[i], wait[i] = admitted, r, w
      end
    end
  else
    for i = 1, n do
      if not uncond[i] and ok[i] and cost[i] > 0 and overlay[key[i]] then
        cur[key[i]] = overlay[key[i]]
        overlay[key[i]] = nil
      end
    end
  end

  reply[#reply + 1] = blocked and 1 or 0
  for i = 1, n do
    reply[#reply + 1] = ok[i] and 1 or 0
    reply[#reply + 1] = rem[i]
    reply[#reply + 1] = wait[i]
  end
  end
end
-- The reply, made before anything is written (nothing is charged for requests whose answer could
-- not be). Past 4,096 values it is packed 4,096 at a time, since one unpack of more would pass
-- the Lua stack's limit (about 8,000), which one request of some thousands of descriptors
-- reaches; a coalesced call stays below (MAX_KEYS), and joining parts would copy its reply again.
local answer
if #reply <= 4096 then
  answer = pack('<' .. string.rep('d', #reply), unpack(reply))
else
  local parts = {}
  for i = 1, #reply, 4096 do
    local j = i + 4095
    if j > #reply then j = #reply end
    parts[#parts + 1] = pack('<' .. string.rep('d', j - i + 1), unpack(reply, i, j))
  end
  answer = table.concat(parts)
end

-- The writes: each counter whose debt moved, once, in the order of KEYS. TAT = now + debt,
-- expiring no earlier than the TAT's millisecond; a debt of 0 is a full bucket, the same as no key. The
-- decimal seconds of the batch's TATs are each formatted once: a batch's TATs fall in a few
-- seconds, so most writes format only their nanoseconds.
local seconds = {}
for i = 1, #keys do
  local key = keys[i]
  local d = cur[key]
  if d and d ~= base[i] then
    if d <= 0 then
      call('DEL', key)
    else
      local r = d % G
      local s = now_s + (d - r) / G
      local ns = now_ns + r
      if ns >= G then s, ns = s + 1, ns - G end
      local tat
      if s == 0 then
        tat = format('%d', ns)
      else
        local prefix = seconds[s]
        if not prefix then
          prefix = format('%d', s)
          seconds[s] = prefix
        end
        tat = prefix .. format('%09d', ns)
      end
      -- A key of another type (MGET reads it as none) is replaced, and counted.
      if not stored[i] and call('EXISTS', key) == 1 then repaired = repaired + 1 end
      if injected then
        call('SET', key, tat)
      else
        call('SET', key, tat, 'PX', format('%d', (d - d % 1000000) / 1000000 + 2))
      end
    end
  end
  -- A key that KEYS names again is written here or not at all.
  cur[key] = false
end
if repaired > 0 then return answer .. pack('<d', repaired) end
return answer
