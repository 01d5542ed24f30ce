-- sluice: leased counting inside Redis, after prelude.lua and slice.lua: take a slice of up to k
-- tokens of one counter, or give unused tokens back.
--
-- KEYS[1]  the counter
-- ARGV[1]  "now" (now.lua)
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

local T, tol, n, H = tonumber(argv[3]), tonumber(argv[4]), tonumber(argv[5]), tonumber(argv[6])

-- The reply, marked when the counter was repaired.
local function reply(g, debt, wait)
  if repaired > 0 then return { g, debt, wait, 1 } end
  return { g, debt, wait }
end

if argv[2] == 'give' then
  local back = d - n * T
  if back < 0 then back = 0 end
  if back ~= d then write(back) end
  return reply(0, back, 0)
end

local g = takeable(T, tol, H)
if n < g then g = n end
if g <= 0 then
  return reply(0, d, d + T - tol - H)
end
write(d + g * T)
return reply(g, d + g * T, 0)
