-- (Every script is preceded by `local CONTRACT = '<the contract version>'`, which the events it writes carry.)
-- The server's time in seconds: every instant the fleet compares is the broker's, never a client's (scripts are
-- replicated by their effects, so reading TIME before writing is allowed).
local function server_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
