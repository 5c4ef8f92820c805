-- KEYS: task hash, stream, idem key (its prefix alone when the task has none: no empty key name, which an ACL
-- limited to the prefix would refuse); ARGV: id, envelope json, queue, the log told how it ends (or ""), '1' when
-- the task has an idempotency key. Returns the task's id (the first one's for an idempotency key already used), or
-- {'exists', envelope} when a task with this id is already there.
local now = server_now()
local idem = ARGV[5] == '1'
if idem then
  local first = redis.call('GET', KEYS[3])
  if first then return first end
end
if redis.call('EXISTS', KEYS[1]) == 1 then return {'exists', redis.call('HGET', KEYS[1], 'envelope') or ''} end
if idem then redis.call('SET', KEYS[3], ARGV[1]) end
local entry = redis.call('XADD', KEYS[2], '*', 'envelope', ARGV[2])
redis.call('HSET', KEYS[1], 'envelope', ARGV[2], 'queue', ARGV[3], 'stream', KEYS[2], 'entry', entry,
           'state', 'ready', 'attempts', 0, 'history', '[]', 'created_at', now, 'updated_at', now,
           'idem', idem and KEYS[3] or '', 'notify', ARGV[4])
return ARGV[1]
