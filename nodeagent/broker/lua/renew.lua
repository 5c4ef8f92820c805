-- KEYS: task hash; ARGV: token, node, lease_ms, lease s. 1 when renewed, 0 when the lease is lost.
local now = server_now()
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] or redis.call('HGET', KEYS[1], 'state') ~= 'leased' then
  return 0
end
local stream = redis.call('HGET', KEYS[1], 'stream')
local entry = redis.call('HGET', KEYS[1], 'entry')
local got = redis.call('XCLAIM', stream, 'workers', ARGV[2], 0, entry, 'JUSTID')
if #got == 0 then return 0 end
redis.call('HSET', KEYS[1], 'leased_until', now + tonumber(ARGV[4]), 'updated_at', now)
return 1
