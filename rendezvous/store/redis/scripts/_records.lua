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

-- Append to out (version, record) of the first `limit` transfers of ids (in their order) that exist in one of
-- `states` ("1,2,..."); the others' records are not read. `passed(tid, state)`, if given, is called for each id
-- looked at and not taken (state: its `s` field, nil when the transfer is gone).
local function add_selected(out, ids, states, limit, passed)
  local wanted = {}
  for s in string.gmatch(states, '%d+') do
    wanted[s] = true
  end
  local left = tonumber(limit)
  for _, tid in ipairs(ids) do
    if left <= 0 then
      break
    end
    local tk = P .. 't:' .. tid
    local s = redis.call('HGET', tk, 's')
    if s and wanted[s] then
      local t = redis.call('HMGET', tk, 'v', 'd')
      out[#out + 1] = t[1]
      out[#out + 1] = t[2]
      left = left - 1
    elseif passed then
      passed(tid, s)
    end
  end
  return out
end
