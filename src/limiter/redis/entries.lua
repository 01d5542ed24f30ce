-- sluice: the entries of a share table (share.lua) or a fleet table (fleet.lua), after now.lua:
-- each read with its repair, and the water-fill that divides a rate among them. A table is a
-- hash: holder id -> "demand rate burst expiry carry", the demand in thousandths of a hit per
-- second, the rate in millionths of the counter's, the burst in tokens, the expiry in
-- milliseconds of the script's clock, and (share tables only) the fraction of a token
-- (millionths) owed to the holder's next take.
--
-- Entries past their expiry are deleted, and so are entries no renewal could have written (not
-- four or five numbers, an expiry more than `ceiling` ms ahead, a rate past the whole, numbers
-- past 10^15): those count as a repair, and so does a table that is not a hash, deleted whole.

local MILLION = 1000000

-- The live entries of table `tkey` at `now_ms` other than holder `me`'s: their demand, rates and
-- bursts summed, each positive demand, `me`'s carry (0 without), and 1 when the table was
-- repaired, else 0.
local function entries(tkey, me, now_ms, ceiling)
  local fixed = 0
  local all = pcall_('HGETALL', tkey)
  if all.err then
    call('DEL', tkey)
    all, fixed = {}, 1
  end
  local demand, rates, bursts, carry, others = 0, 0, 0, 0, {}
  for i = 1, #all, 2 do
    local id = all[i]
    local ed, er, eb, ee, ec = string.match(all[i + 1], '^(%d+) (%d+) (%d+) (%d+) ?(%d*)$')
    ed, er, eb, ee, ec = tonumber(ed), tonumber(er), tonumber(eb), tonumber(ee), tonumber(ec)
    if not ee or ee <= now_ms or ee > now_ms + ceiling or er > MILLION or ed > 1e15 or eb > 1e15 then
      call('HDEL', tkey, id)
      -- Lapsed is ordinary; anything else no renewal wrote.
      if not ee or ee > now_ms then fixed = 1 end
    elseif id ~= me then
      demand, rates, bursts = demand + ed, rates + er, bursts + eb
      if ed > 0 then others[#others + 1] = ed end
    elseif ec and ec < MILLION then
      carry = ec
    end
  end
  return demand, rates, bursts, carry, others, fixed
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

