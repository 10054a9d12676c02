-- Up to `count` engines after `after`, in id order, from the id index `engine_ids` (a zset of score 0,
-- ordered by id), built here from the `engines` set the first time (a namespace written before the index).
-- Reply: {the last id looked at, or "" at the end; then flat (engine id, version, record) of each}.
local index = P .. 'engine_ids'
if redis.call('EXISTS', index) == 0 then
  local ids = redis.call('SMEMBERS', P .. 'engines')
  for i = 1, #ids, 1000 do
    local scored = {}
    for j = i, math.min(i + 999, #ids) do
      scored[#scored + 1] = 0
      scored[#scored + 1] = ids[j]
    end
    redis.call('ZADD', index, unpack(scored))
  end
end
local start = '-'
if after ~= '' then
  start = '(' .. after
end
local ids = redis.call('ZRANGEBYLEX', index, start, '+', 'LIMIT', 0, tonumber(count))
return add_engines({ids[#ids] or ''}, ids)
