-- Reply: the budget's tallies (_budget.lua): e, b, m over the namespace, then of owner (0 when "").
local f = {'e', 'b', 'm'}
if owner ~= '' then
  f[4], f[5], f[6] = 'e:' .. owner, 'b:' .. owner, 'm:' .. owner
end
return redis.call('HMGET', P .. 'budget', unpack(f))
