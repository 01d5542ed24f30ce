local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000000 + tonumber(t[2]) * 1000
local v = redis.call('GET', KEYS[1])
local tat = now
if v then tat = tonumber(v) end
if tat < now then tat = now end
local new = tat + tonumber(ARGV[3])
if new - now <= tonumber(ARGV[4]) then
  redis.call('SET', KEYS[1], string.format('%.0f', new), 'PX', math.ceil((new - now) / 1000000))
  return {0, 0, 1, 0, 0}
end
return {1, 0, 0, 0, 0}
