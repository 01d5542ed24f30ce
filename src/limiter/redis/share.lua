-- sluice: a node's share of a contended counter, after now.lua, prelude.lua, slice.lua and
-- entries.lua. The counter's share table holds one entry per node that shares it; a call renews
-- this node's entry with its demand, works out its share of the rate and of the burst, and takes
-- the share's tokens for the next renewal period from the counter, as a lease take does (so the
-- counter's TAT stays the one account of what the fleet may admit). An RLQS rule's fleet table
-- has the same entries and is fleet.lua's.
--
-- KEYS[1]  the counter
-- KEYS[2]  its share table (entries.lua), one entry per node
-- ARGV[1]  "now" (now.lua)
-- ARGV[2]  "share"
-- ARGV[3]  T (ns)
-- ARGV[4]  B*T (ns)
-- ARGV[5]  H (ns): how far past the bucket's tolerance a take may reserve
-- ARGV[6]  this node's id
-- ARGV[7]  this node's demand: hits offered per second, admitted and refused, in thousandths
-- ARGV[8]  tokens this node holds due and unused (those reserved ahead are not counted)
-- ARGV[9]  P (ns): the renewal period
-- ARGV[10] L (ms): how long an entry lives unrenewed
-- ARGV[11] "leave" to give the share up, else ""
--
-- Entries are read and repaired as entries.lua says (an expiry more than a minute or L ahead is
-- one no renewal wrote); a repair counts as a counter that holds no TAT does.
-- The share: with R the counter's rate and D the live entries' demand (this node's included), a
-- node is due its part of R water-filled by demand (part, entries.lua): small demands are met, the
-- large ones share the rest by demand, and none holds much more than it asks for. It is granted
-- that much of what the other live entries leave, so the rates in the table never add up past R,
-- nor the bursts past B (burst: floor(B * d / D)).
-- The take: due * P tokens for the part due (granted or not yet), less what the node holds due
-- and unused past that, plus its part (d / D) of the tokens the bucket holds now, at most what is
-- due by now + H, charged on the counter as lease.lua's take charges them. While reservations
-- stand the take shrinks by up to a tenth, so the debt drifts down to the tolerance.
-- The counter stays shared while its bucket is less than half full (a debt past half the
-- tolerance), and, once no reservation stands (a debt within the tolerance), while D is at least
-- 90 % of R. Past that demand is below the rate, and slices, which can spend the burst, serve it
-- better (they reserve nothing then, so the counter is not shared again at once): this node's
-- entry is deleted and nothing is taken, as on "leave".
--
-- Returns {tokens taken, debt after (ns), wait until one token can be reserved when none was
-- taken though some were wanted (ns), rate (millionths), burst, D (thousandths), 1 while shared
-- else 0}, and an eighth value 1 when a counter or table was repaired.

local T, tol, H = tonumber(argv[3]), tonumber(argv[4]), tonumber(argv[5])
local me, mine, held = argv[6], tonumber(argv[7]), tonumber(argv[8])
local P, L = tonumber(argv[9]), tonumber(argv[10])
local tkey = keys[2]
local now_ms = now_s * 1000 + floor(now_ns / 1000000)
-- The furthest expiry a renewal writes, for any node's L (nodes of one fleet may differ during a
-- change of `max_age_ms`): a minute, or this node's L when longer.
local ceiling = 60000
if L > ceiling then ceiling = L end

local function reply(g, debt, wait, rate, burst, total, shared)
  if repaired > 0 then return { g, debt, wait, rate, burst, total, shared, 1 } end
  return { g, debt, wait, rate, burst, total, shared }
end

local demand, rates, bursts, carry, others, fixed = entries(tkey, me, now_ms, ceiling)
if fixed > 0 then repaired = 1 end
demand = demand + mine

local R = 1e12 / T
local B = floor(tol / T + 0.5)
if argv[11] == 'leave' or d <= tol / 2 or (demand < 0.9 * R and d <= tol) then
  call('HDEL', tkey, me)
  return reply(0, d, 0, 0, 0, demand, 0)
end

local due, rate, burst = 0, 0, 0
if demand > 0 then
  local fair = part(others, mine, R)
  due = floor(MILLION * fair / R)
  rate = due
  if rate > MILLION - rates then rate = MILLION - rates end
  if rate < 0 then rate = 0 end
  burst = floor(B * mine / demand)
  if burst > B - bursts then burst = B - bursts end
  if burst < 0 then burst = 0 end
end
-- The tokens for the period, due * P / T, less what is held past them: sized by the part due,
-- not the part granted, so a node new to the counter is not starved until the others renew (they
-- take less at their next renewal, and the TAT bounds what all take meanwhile). The fraction of a
-- token left over is carried to the next renewal in the entry, so that the shares together take
-- no more than the refill and leave the horizon free for a newcomer's first take.
-- While reservations stand the take shrinks a little, by up to a tenth at the whole horizon, so
-- the debt drifts down to the tolerance: tokens then come due soon after they are taken, and a
-- node new to the counter finds room for its first take. A little, so that which node renews
-- while the debt stands high changes its part by a few hundredths at most.
local exact = due * P / (MILLION * T) + carry / MILLION
if d > tol then exact = exact * (1 - 0.1 * (d - tol) / H) end
if exact < 0 then exact = 0 end
local want = floor(exact)
carry = floor((exact - want) * MILLION)
call('HSET', tkey, me, format('%d %d %d %d %d', mine, rate, burst, now_ms + L, carry))
if not injected then call('PEXPIRE', tkey, L) end

if held > want then want = 2 * want - held end
-- Tokens the bucket holds now, past every reservation, are the shares' too: this node takes its
-- part of them by demand, so that none is left for requests to reach one at a time.
if d < tol and demand > 0 then
  local spare = floor(floor((tol - d) / T) * mine / demand)
  if spare > 0 and want >= 0 then want = want + spare end
end
local g = takeable(T, tol, H)
if want < g then g = want end
if g <= 0 then
  local wait = 0
  if want > 0 then wait = d + T - tol - H end
  return reply(0, d, wait, rate, burst, demand, 1)
end
write(d + g * T)
return reply(g, d + g * T, 0, rate, burst, demand, 1)
