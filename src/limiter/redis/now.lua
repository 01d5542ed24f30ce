-- sluice: the start of every script but gcra.lua: the time, and locals for the globals used.
-- Straight-line code, no function: Lua makes a function anew at every call.
--
-- ARGV[1]  "now" in nanoseconds, or "" to use Redis TIME (the one clock all nodes share); an
--          injected time is for tests, and then keys get no TTL

local G = 1000000000
-- 2^62 ns bounds every debt a quota can leave.
local MAX_DEBT = 4611686018427387904
-- Locals for the globals the scripts use: a global is a table lookup at every use.
local keys, argv, call, pcall_ = KEYS, ARGV, redis.call, redis.pcall
local format, sub, tonumber = string.format, string.sub, tonumber

local now_s, now_ns
local injected = argv[1] ~= ''
if injected then
  local s = argv[1]
  local len = #s
  if len <= 9 then
    now_s, now_ns = 0, tonumber(s)
  else
    now_s, now_ns = tonumber(sub(s, 1, len - 9)), tonumber(sub(s, len - 8))
  end
else
  local t = call('TIME')
  now_s, now_ns = tonumber(t[1]), tonumber(t[2]) * 1000
end

