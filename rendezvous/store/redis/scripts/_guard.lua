-- A write's guard is "<epoch>:<revision>": the store's lifetime the writer knows, and the highest
-- revision it has seen. A lower revision now means Redis lost writes (a restart from an older
-- AOF or RDB, a failover to a lagging replica): the writer must start a new epoch.
local function guard_failed(expected)
  local epoch, seen = string.match(expected, '^(%d+):(%d+)$')
  local now = redis.call('MGET', P .. 'epoch', P .. 'rev')
  if now[1] ~= epoch then
    return {'E', now[1] or ''}
  end
  local rev = tonumber(now[2] or '0')
  if rev < tonumber(seen) then
    return {'R', rev, epoch}
  end
  return nil
end
