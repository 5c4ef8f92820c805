-- KEYS: node key, the set of nodes; ARGV: record json, retention s, node id. The record refreshed and its heartbeat
-- stamped on the server's clock, if the node is registered (and listed again, should a reader have unlisted it
-- between its record's expiry and its return). Returns that time, or false.
if redis.call('TYPE', KEYS[1])['ok'] ~= 'hash' then return false end
local now = server_now()
redis.call('HSET', KEYS[1], 'record', ARGV[1], 'heartbeat_at', now)
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('SADD', KEYS[2], ARGV[3])
return tostring(now)
