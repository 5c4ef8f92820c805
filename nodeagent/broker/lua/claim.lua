-- KEYS: task hash, stream; ARGV: entry id, envelope json, queue, node, token, lease s, prefix.
local again = claimed_before(ARGV[7], ARGV[5])
if again then return {again[1], again[2], again[3]} end
local now = server_now()
return claim_entry(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], now, now + tonumber(ARGV[6]),
                   ARGV[7] .. 'claimed:' .. ARGV[5])
