-- KEYS: task hash, dead set, result key, the dead letters of its error's code; ARGV: id. A dead task goes back to
-- its stream (and is kept again: a finished task's hash expires).
local now = server_now()
if redis.call('HGET', KEYS[1], 'state') ~= 'dead' then return 0 end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
redis.call('DEL', KEYS[3])
local stream = redis.call('HGET', KEYS[1], 'stream')
local entry = redis.call('XADD', stream, '*', 'envelope', redis.call('HGET', KEYS[1], 'envelope'))
redis.call('HSET', KEYS[1], 'state', 'ready', 'attempts', 0, 'entry', entry, 'updated_at', now)
redis.call('PERSIST', KEYS[1])
local idem = redis.call('HGET', KEYS[1], 'idem')
if idem and idem ~= '' then redis.call('PERSIST', idem) end
return 1
