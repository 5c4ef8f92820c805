-- A claim this lease token made already: a retried call whose first reply was lost (a dropped connection, a
-- failover) gets the task that try claimed, if the token still holds it, instead of claiming a second one. Returns
-- what take returns, or nil. (claim_entry leaves the marker, prefix .. 'claimed:' .. token, for one lease.)
local function claimed_before(prefix, token)
  local key = redis.call('GET', prefix .. 'claimed:' .. token)
  if not key then return nil end
  local h = redis.call('HMGET', key, 'token', 'attempts', 'envelope', 'stream', 'entry')
  if h[1] ~= token then return nil end
  return {'ok', h[2], h[3], h[4], h[5], string.sub(key, #prefix + 6)}
end
