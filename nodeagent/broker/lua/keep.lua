-- KEYS: none (the keys are made from the prefix, as the ids are only known here); ARGV: the time the retention
-- counts from, the retention s, the key prefix, then task ids. Each task's hash, its result and its idempotency key
-- kept at least until that time plus the retention (EXPIREAT ... GT: never sooner than they were; a key without an
-- expiry, a task still running, keeps none). Returns the tasks found.
local at = math.ceil(tonumber(ARGV[1]) + tonumber(ARGV[2]))
local found = 0
for i = 4, #ARGV do
  local hash = ARGV[3] .. 'task:' .. ARGV[i]
  if redis.call('EXISTS', hash) == 1 then
    found = found + 1
    redis.call('EXPIREAT', hash, at, 'GT')
    redis.call('EXPIREAT', ARGV[3] .. 'result:' .. ARGV[i], at, 'GT')
    local idem = redis.call('HGET', hash, 'idem')
    if idem and idem ~= '' then redis.call('EXPIREAT', idem, at, 'GT') end
  end
end
return found
