-- KEYS: task hash; ARGV: token. Gives a leased task back unrun: a new entry, the attempt uncounted.
local now = server_now()
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then return 0 end
local stream = redis.call('HGET', KEYS[1], 'stream')
local entry = redis.call('HGET', KEYS[1], 'entry')
redis.call('XACK', stream, 'workers', entry)
redis.call('XDEL', stream, entry)
local history = cjson.decode(redis.call('HGET', KEYS[1], 'history'))
table.remove(history)
local fresh = redis.call('XADD', stream, '*', 'envelope', redis.call('HGET', KEYS[1], 'envelope'))
redis.call('HSET', KEYS[1], 'state', 'ready', 'token', '', 'entry', fresh, 'history',
           #history == 0 and '[]' or cjson.encode(history), 'updated_at', now)
redis.call('HINCRBY', KEYS[1], 'attempts', -1)
return 1
