-- KEYS: task hash, result key, side key (done counter, delayed set or dead set), the task's event log, the dead
-- letters of the error's code (a set); ARGV: token,
-- state, attempt, delay s (a retry's), error json or '', result json or '', retention s, id.
-- Writes the result once, acknowledges the entry, and moves the task to its next state; a retry is due after its
-- delay on the server's clock. An event log (a gateway waiting) gets a "finished" event in the same step.
local now = server_now()
local due = now + tonumber(ARGV[4])
local written = 0
if ARGV[6] ~= '' then
  if redis.call('SET', KEYS[2], ARGV[6], 'NX', 'EX', ARGV[7]) then written = 1 end
end
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return written end
local stream = redis.call('HGET', KEYS[1], 'stream')
local entry = redis.call('HGET', KEYS[1], 'entry')
local owner = redis.call('HGET', KEYS[1], 'token') == ARGV[1]
if state == 'done' or state == 'dead' or state == 'cancelled' then
  if entry then redis.call('XACK', stream, 'workers', entry); redis.call('XDEL', stream, entry) end
  return written
end
if ARGV[2] == 'delayed' and not owner then return written end
local history = cjson.decode(redis.call('HGET', KEYS[1], 'history'))
for i = #history, 1, -1 do
  if history[i]['attempt'] == tonumber(ARGV[3]) then
    history[i]['ended_at'] = now
    if ARGV[5] ~= '' then history[i]['error'] = cjson.decode(ARGV[5]) end
    break
  end
end
if entry then redis.call('XACK', stream, 'workers', entry); redis.call('XDEL', stream, entry) end
redis.call('HSET', KEYS[1], 'state', ARGV[2], 'token', '', 'history', cjson.encode(history), 'updated_at', now)
redis.call('HDEL', KEYS[1], 'entry', 'leased_until')
if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'last_error', ARGV[5]) end
if ARGV[2] == 'done' then redis.call('INCR', KEYS[3]) end
if ARGV[2] == 'done' or ARGV[2] == 'dead' then  -- an idempotency key lasts as long as its task's result
  local idem = redis.call('HGET', KEYS[1], 'idem')
  if idem and idem ~= '' then redis.call('EXPIRE', idem, ARGV[7]) end
end
if ARGV[2] == 'delayed' then
  redis.call('HSET', KEYS[1], 'ready_at', due)
  redis.call('ZADD', KEYS[3], due, ARGV[8])
end
if ARGV[2] == 'dead' then
  redis.call('ZADD', KEYS[3], now, ARGV[8])
  redis.call('ZADD', KEYS[5], now, ARGV[8])
end
if redis.call('EXISTS', KEYS[4]) == 1 then
  redis.call('XADD', KEYS[4], '*', 'e', cjson.encode({kind='finished', state=ARGV[2], attempt=tonumber(ARGV[3]),
                                                     node=redis.call('HGET', KEYS[1], 'node') or '', task=ARGV[8],
                                                     contract=CONTRACT}))
end
return written
