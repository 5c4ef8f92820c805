-- The common case in one round trip: move due retries back into their streams, then take an entry whose lease
-- expired (its worker died: reclaimed first, as on SQLite, however long the backlog of new entries), else the
-- next new entry, and claim it. KEYS: the streams, then the delayed sets; ARGV: node, token, lease s, prefix,
-- number of streams, lease in ms. Returns {'none'} or what take returns (a retry with the same token: the task its
-- first try claimed).
local again = claimed_before(ARGV[4], ARGV[2])
if again then return again end
local now = server_now()
local lease_until = now + tonumber(ARGV[3])
local n = tonumber(ARGV[5])
for i = n + 1, #KEYS do promote(KEYS[i], now, ARGV[4]) end
for i = 1, n do
  local got = redis.call('XAUTOCLAIM', KEYS[i], 'workers', ARGV[1], ARGV[6], '0-0', 'COUNT', 1)
  local first = got[2][1]
  if first then return take(KEYS[i], first[1], first[2], ARGV[1], ARGV[2], now, lease_until, ARGV[4]) end
end
for i = 1, n do
  local got = redis.call('XREADGROUP', 'GROUP', 'workers', ARGV[1], 'COUNT', 1, 'STREAMS', KEYS[i], '>')
  if got then
    local e = got[1][2][1]
    return take(KEYS[i], e[1], e[2], ARGV[1], ARGV[2], now, lease_until, ARGV[4])
  end
end
return {'none'}
