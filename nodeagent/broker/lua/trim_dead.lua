-- KEYS: a dead-letter set, the registry of dead-letter sets; ARGV: the time before which its letters go. The set
-- trimmed, and unregistered only when that left it empty, in one step: a dead letter landing in it at the same time
-- (finish.lua adds it and registers the set in one step too) is never left in a set the registry forgot.
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[1])
if redis.call('ZCARD', KEYS[1]) == 0 then
  redis.call('SREM', KEYS[2], KEYS[1])
end
return 1
