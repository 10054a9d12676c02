-- A transfer (version, record) and the engines it names (id, version, record).
local function snapshot(tid)
  local t = redis.call('HMGET', P .. 't:' .. tid, 'v', 'd', 'c', 'p')
  local out = {t[1] or '0', t[2] or ''}
  for k = 3, 4 do
    local e = t[k]
    if e and e ~= '' then
      local en = redis.call('HMGET', P .. 'e:' .. e, 'v', 'd')
      out[#out + 1] = e
      out[#out + 1] = en[1] or '0'
      out[#out + 1] = en[2] or ''
    end
  end
  return out
end
