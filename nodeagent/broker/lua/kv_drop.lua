-- A value dropped from its collection (a stored response deleted). KEYS: the value's key, the collection's index,
-- their sizes, the collection's bytes (as kv_keep.lua); ARGV: the key's name (without the prefix). It leaves the
-- index and the count of bytes in the same step, so a deleted value never holds a live one's room.
redis.call('DEL', KEYS[1])
if redis.call('ZSCORE', KEYS[2], ARGV[1]) then
  local size = tonumber(redis.call('HGET', KEYS[3], ARGV[1]) or '0')
  redis.call('HDEL', KEYS[3], ARGV[1])
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('DECRBY', KEYS[4], size)
end
return 1
