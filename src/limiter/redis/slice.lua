-- sluice: what lease.lua and share.lua share, after prelude.lua: the counter's debt, how many of
-- its tokens a take may have, and writing its TAT back. The same stored TAT and the same
-- arithmetic on debts as gcra_lean.lua, for counters whose B*T + T is below 2^52 ns (the only
-- ones the caller leases).

local floor = math.floor
local key = keys[1]

local d = one or 0
if d < 0 then d = 0 end

-- Writes TAT = now + debt, to expire no earlier than the TAT's millisecond (as gcra_lean.lua); a
-- debt of 0 is a full bucket, the same as no key.
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
    redis.call('SET', key, tat, 'PX', string.format('%d', (debt - debt % 1000000) / 1000000 + 2))
  end
end

-- The tokens due by now + H, floor((tol + H - d) / T), corrected for the rounding of the division:
-- what a take may have, reserving up to H past the tolerance.
local function takeable(T, tol, H)
  local a = tol + H - d
  if a <= 0 then return 0 end
  local avail = floor(a / T)
  if avail * T > a then avail = avail - 1 elseif (avail + 1) * T <= a then avail = avail + 1 end
  return avail
end
