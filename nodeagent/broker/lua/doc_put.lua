-- KEYS: the document's hash, its kind's index (a sorted set), the documents' counter; ARGV: id, data json, the
-- version read ('' for a new document), body, '1' when the body is given. A new document (0 when one exists), or a
-- write over the version read (0 when another writer changed it since: the writer reads again). Returns 1 when
-- written.
local current = redis.call('HGET', KEYS[1], 'version')
if ARGV[3] == '' then
  if current then return 0 end
  redis.call('HSET', KEYS[1], 'data', ARGV[2], 'version', 1)
  if ARGV[5] == '1' then redis.call('HSET', KEYS[1], 'body', ARGV[4]) end
  redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[3]), ARGV[1])
  return 1
end
if current ~= ARGV[3] then return 0 end
redis.call('HSET', KEYS[1], 'data', ARGV[2], 'version', tonumber(ARGV[3]) + 1)
return 1
