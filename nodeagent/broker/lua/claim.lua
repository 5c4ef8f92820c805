-- KEYS: task hash, stream; ARGV: entry id, envelope json, queue, node, token, now, lease_until
return claim_entry(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7])
