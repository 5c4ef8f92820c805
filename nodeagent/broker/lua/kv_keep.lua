-- A value kept in a bounded collection (the stored responses). KEYS: the value's key, the collection's index (a
-- sorted set of its keys by expiry), their sizes (a hash), the collection's bytes (a counter); ARGV: value, ttl s,
-- most values, most bytes, the key's name (without the prefix), the values' key prefix. What expired leaves the
-- index; then the value is written; then the oldest go first while the collection holds more than it may.
local now = server_now()
local function forget(member)
  local size = tonumber(redis.call('HGET', KEYS[3], member) or '0')
  redis.call('HDEL', KEYS[3], member)
  redis.call('ZREM', KEYS[2], member)
  redis.call('DECRBY', KEYS[4], size)
end
for _, member in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)) do forget(member) end
if redis.call('ZSCORE', KEYS[2], ARGV[5]) then forget(ARGV[5]) end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[5])
redis.call('HSET', KEYS[3], ARGV[5], #ARGV[1])
redis.call('INCRBY', KEYS[4], #ARGV[1])
local most, bytes = tonumber(ARGV[3]), tonumber(ARGV[4])
while redis.call('ZCARD', KEYS[2]) > most or tonumber(redis.call('GET', KEYS[4]) or '0') > bytes do
  local oldest = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
  if not oldest then break end
  redis.call('DEL', ARGV[6] .. oldest)
  forget(oldest)
end
return 1
