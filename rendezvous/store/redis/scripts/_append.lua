-- Append one event to an engine's stream; the stream id is the engine's next revision. The peer
-- engine an event carries is its own field, so readers decode each distinct peer once.
local function append(eid, payload, peer, maxlen)
  local ek = P .. 'e:' .. eid
  if redis.call('EXISTS', ek) == 0 then
    return
  end
  local sk = P .. 's:' .. eid
  local r = redis.call('HINCRBY', ek, 'r', 1)
  local fields = {'e', payload}
  if peer ~= '' then
    fields[3] = 'p'
    fields[4] = peer
  end
  local added = redis.pcall('XADD', sk, 'MAXLEN', '~', maxlen, r .. '-0', unpack(fields))
  if type(added) == 'table' and added.err then
    -- The stream is ahead of the counter (the hash was replaced by hand): continue after the stream.
    local last = redis.call('XREVRANGE', sk, '+', '-', 'COUNT', 1)
    r = tonumber(string.match(last[1][1], '^(%d+)')) + 1
    redis.call('HSET', ek, 'r', r)
    redis.call('XADD', sk, 'MAXLEN', '~', maxlen, r .. '-0', unpack(fields))
  end
end
