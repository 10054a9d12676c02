-- Append to out (engine id, version, record) of every engine of ids that exists.
local function add_engines(out, ids)
  for _, eid in ipairs(ids) do
    local en = redis.call('HMGET', P .. 'e:' .. eid, 'v', 'd')
    if en[1] then
      out[#out + 1] = eid
      out[#out + 1] = en[1]
      out[#out + 1] = en[2]
    end
  end
  return out
end

-- Append to out (version, record) of every transfer of ids that exists.
local function add_transfers(out, ids)
  for _, tid in ipairs(ids) do
    local t = redis.call('HMGET', P .. 't:' .. tid, 'v', 'd')
    if t[1] then
      out[#out + 1] = t[1]
      out[#out + 1] = t[2]
    end
  end
  return out
end
