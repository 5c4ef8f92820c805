-- KEYS: task hash, delayed set, the task's event log; ARGV: id, retention s, the logs' key prefix. A task whose
-- end another log is told of (a gateway's) tells that one.
local now = server_now()
local state = redis.call('HGET', KEYS[1], 'state')
if state ~= 'ready' and state ~= 'delayed' and state ~= 'leased' then return 0 end
redis.call('HSET', KEYS[1], 'state', 'cancelled', 'token', '', 'updated_at', now)
redis.call('ZREM', KEYS[2], ARGV[1])
local idem = redis.call('HGET', KEYS[1], 'idem')
if idem and idem ~= '' then redis.call('EXPIRE', idem, ARGV[2]) end
local notify = redis.call('HGET', KEYS[1], 'notify')
local log = (notify and notify ~= '') and (ARGV[3] .. notify) or KEYS[3]
if redis.call('EXISTS', log) == 1 then
  redis.call('XADD', log, '*', 'e', cjson.encode({kind='cancelled', task=ARGV[1], contract=CONTRACT}))
end
return 1
