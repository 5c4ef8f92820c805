-- KEYS: task hash, stream; ARGV: entry id, envelope json, queue, node, token, lease s.
local now = server_now()
return claim_entry(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], now, now + tonumber(ARGV[6]))
