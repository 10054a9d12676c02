-- Append one event to an engine's stream; the stream id is the engine's next revision. The peer
-- engine an event carries is its own field, so readers decode each distinct peer once. The stream keeps
-- at most maxlen events and maxbytes bytes (the e: hash's `b`: each entry's event and peer text plus
-- EVENT_OVERHEAD); past either the oldest go (a reader behind them resyncs), the newest always stays.
local EVENT_OVERHEAD = 64

local function entry_bytes(fields)
  return EVENT_OVERHEAD + #fields[2] + #(fields[4] or '')
end

local function append(eid, payload, peer, maxlen, maxbytes)
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
  local added = redis.pcall('XADD', sk, r .. '-0', unpack(fields))
  if type(added) == 'table' and added.err then
    -- The stream is ahead of the counter (the hash was replaced by hand): continue after the stream.
    local last = redis.call('XREVRANGE', sk, '+', '-', 'COUNT', 1)
    r = tonumber(string.match(last[1][1], '^(%d+)')) + 1
    redis.call('HSET', ek, 'r', r)
    redis.call('XADD', sk, r .. '-0', unpack(fields))
  end
  local bytes = redis.call('HINCRBY', ek, 'b', entry_bytes(fields))
  local count = redis.call('XLEN', sk)
  local most, limit = tonumber(maxlen), tonumber(maxbytes)
  while count > 1 and (count > most or bytes > limit) do
    local oldest = redis.call('XRANGE', sk, '-', '+', 'COUNT', 1)[1]
    redis.call('XDEL', sk, oldest[1])
    bytes = redis.call('HINCRBY', ek, 'b', -entry_bytes(oldest[2]))
    count = count - 1
  end
end
