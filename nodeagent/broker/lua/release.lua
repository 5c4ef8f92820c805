-- KEYS: task hash, the queue's delayed set; ARGV: token, delay s, id. Gives a leased task back unrun, the attempt
-- uncounted: a new entry at once, or after the delay (through the delayed set, as a retry).
local now = server_now()
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then return 0 end
local stream = redis.call('HGET', KEYS[1], 'stream')
local entry = redis.call('HGET', KEYS[1], 'entry')
redis.call('XACK', stream, 'workers', entry)
redis.call('XDEL', stream, entry)
local history = cjson.decode(redis.call('HGET', KEYS[1], 'history'))
table.remove(history)
redis.call('HSET', KEYS[1], 'token', '', 'history', #history == 0 and '[]' or cjson.encode(history), 'updated_at', now)
redis.call('HDEL', KEYS[1], 'leased_until')
redis.call('HINCRBY', KEYS[1], 'attempts', -1)
local delay = tonumber(ARGV[2])
if delay > 0 then
  redis.call('HSET', KEYS[1], 'state', 'delayed', 'ready_at', now + delay)
  redis.call('HDEL', KEYS[1], 'entry')
  redis.call('ZADD', KEYS[2], now + delay, ARGV[3])
else
  local fresh = redis.call('XADD', stream, '*', 'envelope', redis.call('HGET', KEYS[1], 'envelope'))
  redis.call('HSET', KEYS[1], 'state', 'ready', 'entry', fresh)
end
return 1
