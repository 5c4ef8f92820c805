-- KEYS: task hash, result key, side key (done counter, delayed set or dead set), the event log told how it ends
-- (the task's own, or the gateway's it names), the dead letters of the error's code (a set), the registry of
-- dead-letter sets; ARGV: token, state, attempt, delay s (a retry's), error json or '', result json or '',
-- retention s, id, that log's most entries, the time its retention counts from when later than now (a batch
-- line's: its batch's deadline, so that its result outlives the batch that points at it) or ''.
-- Only the claim that holds the task finishes it: an attempt cut off past its lease (another claim took the task,
-- or it was cancelled or given back) writes nothing, so the result, its usage and a stored response are the
-- holder's. The result is written once, the entry acknowledged, and the task moves to its next state; a retry is
-- due after its delay on the server's clock. A finished task's hash, its result and its idempotency key expire
-- after the retention, and its dead-letter indexes drop what is older: nothing waits for a scan. An event log (a
-- gateway waiting) gets a "finished" event in the same step.
local now = server_now()
local due = now + tonumber(ARGV[4])
local keep = tonumber(ARGV[7])  -- kept the retention from now, or from the later time it counts from
if ARGV[10] ~= '' and tonumber(ARGV[10]) > now then keep = keep + math.ceil(tonumber(ARGV[10]) - now) end
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return 0 end
local stream = redis.call('HGET', KEYS[1], 'stream')
local entry = redis.call('HGET', KEYS[1], 'entry')
if state == 'done' or state == 'dead' or state == 'cancelled' then
  if entry then redis.call('XACK', stream, 'workers', entry); redis.call('XDEL', stream, entry) end
  return 0
end
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then return 0 end
local written = 0
if ARGV[6] ~= '' then
  if redis.call('SET', KEYS[2], ARGV[6], 'NX', 'EX', keep) then written = 1 end
end
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
if ARGV[2] == 'done' or ARGV[2] == 'dead' then  -- kept as long as its result, then gone on its own
  redis.call('EXPIRE', KEYS[1], keep)
  local idem = redis.call('HGET', KEYS[1], 'idem')
  if idem and idem ~= '' then
    if ARGV[5] ~= '' and cjson.decode(ARGV[5])['code'] == 'deadline_exceeded' then
      -- its deadline ended it unrun: the verdict of whoever set the deadline (a gateway's request), as its own
      -- cancel would be; the key is freed, and a retry with it runs the work
      if redis.call('GET', idem) == ARGV[8] then redis.call('DEL', idem) end
      redis.call('HSET', KEYS[1], 'idem', '')
    else
      redis.call('EXPIRE', idem, keep)
    end
  end
end
if ARGV[2] == 'delayed' then
  redis.call('HSET', KEYS[1], 'ready_at', due)
  redis.call('ZADD', KEYS[3], due, ARGV[8])
end
if ARGV[2] == 'dead' then
  local past = now - tonumber(ARGV[7])
  for _, set in ipairs({KEYS[3], KEYS[5]}) do
    redis.call('ZADD', set, now, ARGV[8])
    redis.call('ZREMRANGEBYSCORE', set, '-inf', past)
    redis.call('SADD', KEYS[6], set)
  end
end
if redis.call('EXISTS', KEYS[4]) == 1 then
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[9], '*', 'e',
             cjson.encode({kind='finished', state=ARGV[2], attempt=tonumber(ARGV[3]),
                           node=redis.call('HGET', KEYS[1], 'node') or '', task=ARGV[8], contract=CONTRACT}))
end
return 1 + written
