-- KEYS: task hash, result key, the task's event log; ARGV: id, the key prefix, seconds to keep it. A finished task
-- whose answer went to the request that waited for it (a gateway's), when no idempotency key names it: its hash,
-- result and log kept only that long more (never longer than they were; at once at 0) instead of the retention, and
-- it leaves the dead-letter sets. Returns 1 when it was let go.
local state = redis.call('HGET', KEYS[1], 'state')
if state ~= 'done' and state ~= 'dead' and state ~= 'cancelled' then return 0 end
local idem = redis.call('HGET', KEYS[1], 'idem')
if idem and idem ~= '' then return 0 end
if state == 'dead' then
  local queue = redis.call('HGET', KEYS[1], 'queue') or ''
  local code = 'unknown'
  local err = redis.call('HGET', KEYS[1], 'last_error')
  if err and err ~= '' then
    local ok, decoded = pcall(cjson.decode, err)
    if ok and type(decoded) == 'table' and decoded['code'] and decoded['code'] ~= '' then code = decoded['code'] end
  end
  redis.call('ZREM', ARGV[2] .. 'dead:' .. queue, ARGV[1])
  redis.call('ZREM', ARGV[2] .. 'deadby:' .. code, ARGV[1])
end
local keep = math.floor(tonumber(ARGV[3]))
for _, key in ipairs(KEYS) do
  if keep <= 0 then redis.call('DEL', key) else redis.call('EXPIRE', key, keep, 'LT') end
end
return 1
