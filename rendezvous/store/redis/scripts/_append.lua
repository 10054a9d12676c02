-- Append one event to an engine's stream; the stream id is the engine's next event sequence. The peer
-- engine an event carries is its own field, so readers decode each distinct peer once. An entry's
-- fields: e (event), p (peer, "" for none), g (its sequence number in the namespace, from `es`: its age).
-- Bounds, each trimming oldest first: an engine's stream keeps at most maxlen events and maxbytes bytes (the
-- e: hash's `b`: each entry's event and peer text plus EVENT_OVERHEAD); the streams of an owner's engines at
-- most max_owner_bytes together (the `eb` hash's o:<owner>), all streams at most max_total_bytes (its `t`).
-- The oldest event of an owner's streams, or of all, is found through the sorted sets eo:<owner> and eo
-- (engine id by the g of its stream's oldest entry). The event just appended always stays.
local EVENT_OVERHEAD = 64

local function entry_bytes(fields)
  return EVENT_OVERHEAD + #fields[2] + #(fields[4] or '')
end

-- Put (or, with remove, take) a stream in the sorted sets by its oldest entry; nothing for an empty stream.
local function list_oldest(eid, owner, remove)
  local head = redis.call('XRANGE', P .. 's:' .. eid, '-', '+', 'COUNT', 1)[1]
  for _, key in ipairs(owner ~= '' and {P .. 'eo', P .. 'eo:' .. owner} or {P .. 'eo'}) do
    if remove or not head then
      redis.call('ZREM', key, eid)
    else
      redis.call('ZADD', key, tonumber(head[2][6]) or 0, eid)
    end
  end
end

-- Add n (maybe negative) to the bytes counted for an owner's streams and all streams.
local function count_event_bytes(owner, n)
  if n == 0 then
    return -- (and "-0" is no integer to Redis)
  end
  redis.call('HINCRBY', P .. 'eb', 't', n)
  if owner ~= '' and redis.call('HINCRBY', P .. 'eb', 'o:' .. owner, n) == 0 then
    redis.call('HDEL', P .. 'eb', 'o:' .. owner)
  end
end

-- Drop an engine's oldest event.
local function trim_oldest(eid, owner)
  local sk = P .. 's:' .. eid
  local oldest = redis.call('XRANGE', sk, '-', '+', 'COUNT', 1)[1]
  if not oldest then
    list_oldest(eid, owner, true) -- listed, yet empty (deleted by hand)
    return
  end
  local size = entry_bytes(oldest[2])
  redis.call('XDEL', sk, oldest[1])
  redis.call('HINCRBY', P .. 'e:' .. eid, 'b', -size)
  count_event_bytes(owner, -size)
  list_oldest(eid, owner)
end

-- Drop the oldest event of the streams in a sorted set, unless it is the one just appended (number).
local function trim_set(key, number)
  local first = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
  if not first[1] or tonumber(first[2]) >= number then
    return false
  end
  trim_oldest(first[1], redis.call('HGET', P .. 'e:' .. first[1], 'o') or '')
  return true
end

local function append(eid, payload, peer, maxlen, maxbytes, max_owner_bytes, max_total_bytes)
  local ek = P .. 'e:' .. eid
  if redis.call('EXISTS', ek) == 0 then
    return
  end
  local sk = P .. 's:' .. eid
  local r = redis.call('HINCRBY', ek, 'r', 1)
  local number = redis.call('INCR', P .. 'es')
  local fields = {'e', payload, 'p', peer, 'g', number}
  local added = redis.pcall('XADD', sk, r .. '-0', unpack(fields))
  if type(added) == 'table' and added.err then
    -- The stream is ahead of the counter (the hash was replaced by hand): continue after the stream.
    local last = redis.call('XREVRANGE', sk, '+', '-', 'COUNT', 1)
    r = tonumber(string.match(last[1][1], '^(%d+)')) + 1
    redis.call('HSET', ek, 'r', r)
    redis.call('XADD', sk, r .. '-0', unpack(fields))
  end
  local owner = redis.call('HGET', ek, 'o') or ''
  local size = entry_bytes(fields)
  local bytes = redis.call('HINCRBY', ek, 'b', size)
  count_event_bytes(owner, size)
  local count = redis.call('XLEN', sk)
  if not redis.call('ZSCORE', P .. 'eo', eid) then
    -- A new (or emptied) stream, or one written before these bounds: count what it held before this event.
    count_event_bytes(owner, bytes - size)
    list_oldest(eid, owner)
  end
  local most, limit = tonumber(maxlen), tonumber(maxbytes)
  while count > 1 and (count > most or bytes > limit) do
    trim_oldest(eid, owner)
    bytes = tonumber(redis.call('HGET', ek, 'b'))
    count = count - 1
  end
  if owner ~= '' then
    local owner_limit = tonumber(max_owner_bytes)
    while tonumber(redis.call('HGET', P .. 'eb', 'o:' .. owner) or '0') > owner_limit do
      if not trim_set(P .. 'eo:' .. owner, number) then
        break
      end
    end
  end
  local total_limit = tonumber(max_total_bytes)
  while tonumber(redis.call('HGET', P .. 'eb', 't') or '0') > total_limit do
    if not trim_set(P .. 'eo', number) then
      break
    end
  end
end

-- Forget an engine's stream (its record is deleted, or is rewritten for another owner: then put it back
-- under the new one with list_events).
local function unlist_events(eid, owner)
  list_oldest(eid, owner, true)
  count_event_bytes(owner, -(tonumber(redis.call('HGET', P .. 'e:' .. eid, 'b')) or 0))
end

local function list_events(eid, owner)
  list_oldest(eid, owner)
  count_event_bytes(owner, tonumber(redis.call('HGET', P .. 'e:' .. eid, 'b')) or 0)
end
