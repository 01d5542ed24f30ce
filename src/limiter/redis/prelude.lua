-- sluice: after now.lua, the start of gcra_lean.lua, lease.lua and share.lua: a call's one counter
-- read as its debt.
--
-- KEYS     the counters: each a decimal TAT in nanoseconds, expiring no earlier than the TAT's millisecond
--
-- A counter's debt is TAT - now: 0 for none, exact below 2^53 ns; beyond, only its sign and that
-- it exceeds every tolerance matter, and both hold. A counter that holds no TAT (not a number,
-- not finite, more than 2^62 ns ahead, or a key of another type) is a fact about that counter,
-- not an error: it is deleted, read as absent (a full bucket) and counted in `repaired`.

-- A call of one key reads it here, by GET: its reply is a string, nil (false) or, for a key of
-- another type, a table with `err` (indexing a string with `err` gives nil). `one` is then its
-- debt, false when it is absent. A share call (ARGV[2] "share") reads its first key here too:
-- its second is the counter's share table. Any other call of several keys reads them itself.
local nk = #keys
local one = false
local repaired = 0
if nk == 1 or argv[2] == 'share' then
  local key = keys[1]
  local v = pcall_('GET', key)
  if v then
    local d
    if not v.err then
      local len = #v
      if len <= 9 then
        d = tonumber(v)
        if d then d = d - now_ns - now_s * G end
      else
        local s, ns = tonumber(sub(v, 1, len - 9)), tonumber(sub(v, len - 8))
        d = s and ns and (s - now_s) * G + (ns - now_ns)
      end
    end
    -- `d - d == 0` holds for every finite number.
    if not d or d - d ~= 0 or d > MAX_DEBT then
      call('DEL', key)
      d, repaired = 0, 1
    end
    one = d
  end
end
