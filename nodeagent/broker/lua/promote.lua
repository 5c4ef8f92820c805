-- Moves due retries of one delayed set back into their streams.
local function promote(delayed, now, prefix)
  local due = redis.call('ZRANGEBYSCORE', delayed, '-inf', now, 'LIMIT', 0, 100)
  for _, id in ipairs(due) do
    local key = prefix .. 'task:' .. id
    redis.call('ZREM', delayed, id)
    if redis.call('HGET', key, 'state') == 'delayed' then
      local stream = redis.call('HGET', key, 'stream')
      local entry = redis.call('XADD', stream, '*', 'envelope', redis.call('HGET', key, 'envelope'))
      redis.call('HSET', key, 'state', 'ready', 'entry', entry, 'updated_at', now)
    end
  end
end
