-- An entry a blocking XREADGROUP delivered to this node. KEYS: the stream; ARGV: entry, node, token, lease s,
-- prefix. Returns {'none'} (the entry is gone) or what take returns (a retry with the same token: the task its first
-- try claimed).
local again = claimed_before(ARGV[5], ARGV[3])
if again then return again end
local now = server_now()
local got = redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[1])
if #got == 0 then return {'none'} end
return take(KEYS[1], ARGV[1], got[1][2], ARGV[2], ARGV[3], now, now + tonumber(ARGV[4]), ARGV[5])
