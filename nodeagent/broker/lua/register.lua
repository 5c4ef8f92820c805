-- KEYS: node key, the set of nodes; ARGV: node id, record json, retention s. A node's record, its start and its
-- heartbeat stamped on the server's clock. Returns that time.
local now = server_now()
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'record', ARGV[2], 'started_at', now, 'heartbeat_at', now)
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('SADD', KEYS[2], ARGV[1])
return tostring(now)
