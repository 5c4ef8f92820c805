-- Claiming an entry read from a stream: its envelope names the task (the hash it is claimed in). Returns
-- {'raw', stream, entry, envelope} for an envelope that gives no id (Python parses it and claims it with CLAIM
-- under a name made from the entry), else {status, attempts, envelope, stream, entry, id}.
local function take(stream, entry, fields, node, token, now, lease_until, prefix)
  local envelope = ''
  for i = 1, #(fields or {}), 2 do if fields[i] == 'envelope' then envelope = fields[i + 1] end end
  local ok, decoded = pcall(cjson.decode, envelope)
  local id = ok and type(decoded) == 'table' and decoded['id'] or nil
  if not ok then  -- too deep or not Unicode for cjson: the id written first, as the contract's producers do
    id = string.match(envelope, '^%s*{%s*"id"%s*:%s*"([%w%-_%.:]+)"')
  end
  if type(id) ~= 'string' or #id == 0 or #id > 200 then
    return {'raw', stream, entry, envelope}
  end
  local queue = string.match(stream, '^' .. prefix .. 'q:([^@]+)')
  local r = claim_entry(prefix .. 'task:' .. id, stream, entry, envelope, queue, node, token, now, lease_until,
                        prefix .. 'claimed:' .. token)
  return {r[1], r[2], r[3], stream, entry, id}
end
