-- Drop a transfer id's credit reservation; with expected (not ""), only if it is still that record (compared byte
-- for byte, as put_credit compares its holder). Reply: OK record | N (none, or another) | E epoch | R rev epoch.
local bad = guard_failed(guard)
if bad then
  return bad
end
local record = redis.call('HGET', P .. 'crt', transfer_id)
if not record or (expected ~= '' and record ~= expected) then
  return {'N'}
end
local engine_id = cjson.decode(record)[2]
redis.call('HDEL', P .. 'crt', transfer_id)
redis.call('ZREM', P .. 'crd', transfer_id)
if redis.call('HDEL', P .. 'cr:' .. engine_id, transfer_id) == 1 then
  redis.call('INCR', P .. 'crv:' .. engine_id)
end
return {'OK', record}
