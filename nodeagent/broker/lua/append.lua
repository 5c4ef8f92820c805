-- KEYS: a task's event log (a stream); ARGV: the event's JSON, its most entries. Appended only to a log that was
-- opened (a gateway waits on it): a task without one writes nothing. Returns the entry's id or false.
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
return redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', 'e', ARGV[1])
