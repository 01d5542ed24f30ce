-- sluice: leased counting inside Redis, after prelude.lua: take a slice of up to k tokens of one
-- counter, or give unused tokens back. The same stored TAT and the same arithmetic on debts as
-- gcra_lean.lua, for counters whose B*T + T is below 2^52 ns (the only ones the caller leases).
--
-- KEYS[1]  the counter
-- ARGV[1]  "now" (prelude.lua)
-- ARGV[2]  "take" or "give"
-- ARGV[3]  T (ns)
-- ARGV[4]  B*T (ns)
-- ARGV[5]  n: the most tokens to take, or the tokens to give back
-- ARGV[6]  H (ns): how far past the bucket's tolerance a take may reserve
--
-- take: grants g = min(n, the tokens due by now + H) and charges them, TAT' = max(TAT, now) +
--       g*T. Tokens past those in the bucket now are reserved: the i-th granted token is due when
--       the exact path would have admitted it, now + max(0, d + i*T - B*T) for a debt d before
--       the take, and the caller uses none before then. So when demand exceeds the rate the
--       bucket's refill is handed out ahead in slices instead of a token at a time, and the TAT
--       may stand up to H past the tolerance.
--       Returns {g, debt after (ns), wait until one token can be reserved when g = 0 (ns)}.
-- give: TAT' = max(TAT - n*T, now) (a refund never makes the bucket exceed its burst). A debt
--       past the tolerance (other nodes' reservations) is kept: it is not cut to B*T first.
--       Returns {0, debt after (ns), 0}.
-- Either reply has a fourth value, 1, when the prelude repaired the counter.

local floor = math.floor
local key = keys[1]
local T, tol, n, H = tonumber(argv[3]), tonumber(argv[4]), tonumber(argv[5]), tonumber(argv[6])

local d = one or 0
if d < 0 then d = 0 end

-- The reply, marked when the counter was repaired.
local function reply(g, debt, wait)
  if repaired > 0 then return { g, debt, wait, 1 } end
  return { g, debt, wait }
end

-- Writes TAT = now + debt, to expire at the TAT's millisecond (as gcra_lean.lua); a debt of 0 is a
-- full bucket, the same as no key.
local function write(debt)
  if debt <= 0 then
    redis.call('DEL', key)
    return
  end
  local s = now_s + floor(debt / G)
  local ns = now_ns + debt % G
  if ns >= G then s, ns = s + 1, ns - G end
  local tat
  if s == 0 then tat = string.format('%d', ns) else tat = string.format('%d%09d', s, ns) end
  if injected then
    redis.call('SET', key, tat)
  else
    redis.call('SET', key, tat, 'PXAT', string.sub(tat, 1, -7))
  end
end

if argv[2] == 'give' then
  local back = d - n * T
  if back < 0 then back = 0 end
  if back ~= d then write(back) end
  return reply(0, back, 0)
end

-- floor((tol + H - d) / T), corrected for the rounding of the division: the tokens due by now + H
local a = tol + H - d
local avail = 0
if a > 0 then
  avail = floor(a / T)
  if avail * T > a then avail = avail - 1 elseif (avail + 1) * T <= a then avail = avail + 1 end
end
local g = n
if avail < g then g = avail end
if g <= 0 then
  return reply(0, d, d + T - tol - H)
end
write(d + g * T)
return reply(g, d + g * T, 0)
