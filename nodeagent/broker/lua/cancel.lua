-- KEYS: task hash, delayed set, the task's event log; ARGV: id, retention s, the logs' key prefix, '1' to free
-- the task's idempotency key (a gateway's own verdict: a retry with the key runs the work again), the told log's
-- most entries. A waiting or running task is cancelled: its entry leaves the stream (no claim finds it again), its
-- hash expires after the retention, and a task whose end another log is told of (a gateway's) tells that one.
local now = server_now()
local state = redis.call('HGET', KEYS[1], 'state')
if state ~= 'ready' and state ~= 'delayed' and state ~= 'leased' then return 0 end
local stream = redis.call('HGET', KEYS[1], 'stream')
local entry = redis.call('HGET', KEYS[1], 'entry')
if stream and entry then
  redis.call('XACK', stream, 'workers', entry)
  redis.call('XDEL', stream, entry)
end
redis.call('HSET', KEYS[1], 'state', 'cancelled', 'token', '', 'updated_at', now)
redis.call('HDEL', KEYS[1], 'entry', 'leased_until')
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[2])
local idem = redis.call('HGET', KEYS[1], 'idem')
if idem and idem ~= '' then
  if ARGV[4] == '1' then
    if redis.call('GET', idem) == ARGV[1] then redis.call('DEL', idem) end
    redis.call('HSET', KEYS[1], 'idem', '')
  else
    redis.call('EXPIRE', idem, ARGV[2])
  end
end
local notify = redis.call('HGET', KEYS[1], 'notify')
local log = (notify and notify ~= '') and (ARGV[3] .. notify) or KEYS[3]
if redis.call('EXISTS', log) == 1 then
  redis.call('XADD', log, 'MAXLEN', '~', ARGV[5], '*', 'e',
             cjson.encode({kind='cancelled', task=ARGV[1], contract=CONTRACT}))
end
return 1
