-- KEYS: task hash, delayed set; ARGV: id, retention s.
local now = server_now()
local state = redis.call('HGET', KEYS[1], 'state')
if state ~= 'ready' and state ~= 'delayed' and state ~= 'leased' then return 0 end
redis.call('HSET', KEYS[1], 'state', 'cancelled', 'token', '', 'updated_at', now)
redis.call('ZREM', KEYS[2], ARGV[1])
local idem = redis.call('HGET', KEYS[1], 'idem')
if idem and idem ~= '' then redis.call('EXPIRE', idem, ARGV[2]) end
return 1
