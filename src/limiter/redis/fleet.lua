-- sluice: a node's parts of RLQS rules, after now.lua and entries.lua. Each rule's fleet table
-- divides the rule's rate among the sluice nodes handing out its assignments to Envoys (which
-- enforce them themselves): one call renews, or gives up, this node's entry in each of N tables.
-- Nothing is taken from or read of the rules' counters.
--
-- KEYS[i]    rule i's fleet table (entries.lua), beside its counter, one entry per node
-- ARGV[1]    "now" (now.lua)
-- ARGV[2]    "renew", or "leave" to give the parts up
-- ARGV[3]    this node's id
-- ARGV[4]    L (ms): how long an entry lives unrenewed
-- ARGV[3+2i] rule i's T (ns), when renewing
-- ARGV[4+2i] this node's demand of rule i, in thousandths of a token per second, when renewing
--
-- A renewal reads and repairs the table as entries.lua says (an expiry more than a minute or L
-- ahead is one no renewal wrote), works out this node's part of the rule's rate R = 1e12 / T
-- (thousandths of a token per second) water-filled by demand (part, entries.lua), grants as much
-- of it as the other live entries leave, so that the rates in a table never add up past the
-- whole, and writes the entry "demand rate 0 expiry": the burst of the entry format is not
-- divided for a rule (Envoys are sent their buckets' shape), and written as 0.
--
-- Returns {part of rule 1, ..., part of rule N, tables repaired}, each part in millionths of its
-- rule, or -1 when its entry could not be written (then the part is not renewed); a leave
-- answers 0 for each.

local floor = math.floor
local leave = argv[2] == 'leave'
local me, L = argv[3], tonumber(argv[4])
local now_ms = now_s * 1000 + floor(now_ns / 1000000)
-- The furthest expiry a renewal writes, for any node's L (nodes of one fleet may differ during a
-- change of `assignment_ttl_ms`): a minute, or this node's L when longer.
local ceiling = 60000
if L > ceiling then ceiling = L end

local out, repairs = {}, 0
for i = 1, #keys do
  local tkey = keys[i]
  if leave then
    call('HDEL', tkey, me)
    out[i] = 0
  else
    local T, mine = tonumber(argv[3 + 2 * i]), tonumber(argv[4 + 2 * i])
    local demand, rates, _, _, others, fixed = entries(tkey, me, now_ms, ceiling)
    repairs = repairs + fixed
    demand = demand + mine
    local R = 1e12 / T
    local rate = 0
    if demand > 0 then
      rate = floor(MILLION * part(others, mine, R) / R)
      if rate > MILLION - rates then rate = MILLION - rates end
      if rate < 0 then rate = 0 end
    end
    local written = pcall_('HSET', tkey, me, format('%d %d 0 %d', mine, rate, now_ms + L))
    if type(written) == 'table' and written.err then
      out[i] = -1
    else
      out[i] = rate
      if not injected then call('PEXPIRE', tkey, L) end
    end
  end
end
out[#keys + 1] = repairs
return out
