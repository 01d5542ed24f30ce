-- sluice: a node's share of a contended counter, after prelude.lua and slice.lua. The counter's
-- share table holds one entry per node that shares it; a call renews this node's entry with its
-- demand, works out its share of the rate and of the burst, and takes the share's tokens for the
-- next renewal period from the counter, as a lease take does (so the counter's TAT stays the one
-- account of what the fleet may admit).
--
-- KEYS[1]  the counter
-- KEYS[2]  its share table, a hash: node id -> "demand rate burst expiry carry", the demand in
--          thousandths of a hit per second, the rate in millionths of the counter's, the burst
--          in tokens, the expiry in milliseconds of the script's clock, the fraction of a token
--          (millionths) owed to the holder's next take
-- ARGV[1]  "now" (prelude.lua)
-- ARGV[2]  "share", or "quota" for an RLQS bucket's table (below)
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
-- Entries past their expiry are deleted first, and so are entries no renewal could have written
-- (not four or five numbers, an expiry more than a minute or L ahead, a rate past the whole,
-- numbers past 10^15): those count as a repair, as a counter that holds no TAT does, and so does
-- a table that is not a hash, deleted whole.
-- The share: with R the counter's rate and D the live entries' demand (this node's included), a
-- node is due its part of R water-filled by demand (part, below): small demands are met, the
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
-- With ARGV[2] "quota" the table divides the rate of a rule whose buckets Envoys enforce
-- themselves (RLQS), among the sluice nodes handing out its assignments: KEYS[1] is not read,
-- nothing is taken and the entry stays until it lapses or leaves (ARGV[3] to ARGV[5], ARGV[8]
-- and ARGV[9] are ignored).
--
-- Returns {tokens taken, debt after (ns), wait until one token can be reserved when none was
-- taken though some were wanted (ns), rate (millionths), burst, D (thousandths), 1 while shared
-- else 0}, and an eighth value 1 when a counter or table was repaired.

local quota = argv[2] == 'quota'
local T, tol, H = tonumber(argv[3]), tonumber(argv[4]), tonumber(argv[5])
local me, mine, held = argv[6], tonumber(argv[7]), tonumber(argv[8])
local P, L = tonumber(argv[9]), tonumber(argv[10])
local tkey = keys[2]
local now_ms = now_s * 1000 + floor(now_ns / 1000000)
-- The furthest expiry a renewal writes, for any node's L (nodes of one fleet may differ during a
-- change of `max_age_ms`): a minute, or this node's L when longer.
local ceiling = 60000
if L > ceiling then ceiling = L end
local MILLION = 1000000

local function reply(g, debt, wait, rate, burst, total, shared)
  if repaired > 0 then return { g, debt, wait, rate, burst, total, shared, 1 } end
  return { g, debt, wait, rate, burst, total, shared }
end

-- This holder's part of a rate R when it asks for `mine` and the others for `others`, as
-- limiter::share::divide works it out: while some holder asks no more than an equal part of what
-- is left, each such holder is met, with 1.25 times its demand but at most that equal part, and
-- leaves; the holders left split what remains by demand, each at most 1.25 times it.
local function part(others, mine, R)
  if mine <= 0 then return 0 end
  local open, left = others, R
  while true do
    local level = left / (#open + 1)
    if mine <= level then
      if 1.25 * mine < level then return 1.25 * mine end
      return level
    end
    local kept = {}
    for i = 1, #open do
      if open[i] <= level then
        if 1.25 * open[i] < level then left = left - 1.25 * open[i] else left = left - level end
      else
        kept[#kept + 1] = open[i]
      end
    end
    if #kept == #open then
      local total = mine
      for i = 1, #kept do total = total + kept[i] end
      local p = left * (mine / total)
      if p > 1.25 * mine then p = 1.25 * mine end
      if p < 0 then p = 0 end
      return p
    end
    open = kept
  end
end

local entries = pcall_('HGETALL', tkey)
if entries.err then
  call('DEL', tkey)
  entries, repaired = {}, 1
end
local demand, rates, bursts, carry, others = 0, 0, 0, 0, {}
for i = 1, #entries, 2 do
  local id = entries[i]
  local ed, er, eb, ee, ec = string.match(entries[i + 1], '^(%d+) (%d+) (%d+) (%d+) ?(%d*)$')
  ed, er, eb, ee, ec = tonumber(ed), tonumber(er), tonumber(eb), tonumber(ee), tonumber(ec)
  if not ee or ee <= now_ms or ee > now_ms + ceiling or er > MILLION or ed > 1e15 or eb > 1e15 then
    call('HDEL', tkey, id)
    -- Lapsed is ordinary; anything else no renewal wrote.
    if not ee or ee > now_ms then repaired = 1 end
  elseif id ~= me then
    demand, rates, bursts = demand + ed, rates + er, bursts + eb
    if ed > 0 then others[#others + 1] = ed end
  elseif ec and ec < MILLION then
    carry = ec
  end
end
demand = demand + mine

local R = 1e12 / T
local B = floor(tol / T + 0.5)
if argv[11] == 'leave' or (not quota and (d <= tol / 2 or (demand < 0.9 * R and d <= tol))) then
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
if quota then
  call('HSET', tkey, me, format('%d %d %d %d', mine, rate, burst, now_ms + L))
  if not injected then call('PEXPIRE', tkey, L) end
  return reply(0, 0, 0, rate, burst, demand, 1)
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
