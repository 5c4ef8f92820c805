-- Claiming an entry: count the attempt, open it in the history (closing the previous one as lease_expired when
-- its holder died), stamp the lease token, and leave the marker ``marker`` naming the task for one lease (a retry
-- of the same claim finds it: claimed.lua). Returns {status, attempts, envelope}: 'ok'; 'skip' (finished or
-- cancelled: acknowledged and dropped); 'held' (reclaimed by idle time while its holder's lease still runs:
-- handed back untouched).
local function claim_entry(key, stream, entry, envelope, queue, node, token, now, lease_until, marker)
  local state = redis.call('HGET', key, 'state')
  if not state then
    redis.call('HSET', key, 'envelope', envelope, 'queue', queue, 'stream', stream, 'state', 'ready',
               'attempts', 0, 'history', '[]', 'created_at', now)
    state = 'ready'
  end
  if state == 'done' or state == 'dead' or state == 'cancelled' then
    redis.call('XACK', stream, 'workers', entry)
    redis.call('XDEL', stream, entry)
    return {'skip', 0, ''}
  end
  local holder = redis.call('HGET', key, 'node')
  if state == 'leased' and tonumber(redis.call('HGET', key, 'leased_until') or '0') > tonumber(now)
     and redis.call('HGET', key, 'entry') == entry and holder and holder ~= node then
    redis.call('XCLAIM', stream, 'workers', holder, 0, entry, 'JUSTID')
    return {'held', 0, ''}
  end
  local attempts = redis.call('HINCRBY', key, 'attempts', 1)
  local history = cjson.decode(redis.call('HGET', key, 'history'))
  local last = history[#history]
  if last and (last['ended_at'] == nil or last['ended_at'] == cjson.null) then
    last['ended_at'] = tonumber(now)
    last['error'] = {code='lease_expired', retryable=true,
                     message='the worker stopped renewing its lease (crashed or lost)'}
  end
  table.insert(history, {attempt=attempts, node=node, started_at=tonumber(now)})
  redis.call('HSET', key, 'state', 'leased', 'token', token, 'node', node, 'entry', entry, 'stream', stream,
             'leased_until', lease_until, 'history', cjson.encode(history), 'updated_at', now)
  redis.call('SET', marker, key, 'PX', math.max(1, math.floor((lease_until - now) * 1000)))
  return {'ok', attempts, redis.call('HGET', key, 'envelope')}
end
