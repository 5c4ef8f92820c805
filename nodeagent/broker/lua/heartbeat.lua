-- KEYS: node key; ARGV: record json, retention s. The record refreshed and its heartbeat stamped on the server's
-- clock, if the node is registered. Returns that time, or false.
if redis.call('TYPE', KEYS[1])['ok'] ~= 'hash' then return false end
local now = server_now()
redis.call('HSET', KEYS[1], 'record', ARGV[1], 'heartbeat_at', now)
redis.call('EXPIRE', KEYS[1], ARGV[2])
return tostring(now)
