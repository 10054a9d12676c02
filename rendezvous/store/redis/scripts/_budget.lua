-- The memory budget's tallies (rendezvous.core.budget), kept in the hash `budget`: e engines, b block ids of
-- live transfers, m agent metadata bytes; each over the whole namespace and, as `<kind>:<owner>`, per owner.
-- A record stores what it charged (and to whom), so a rewrite takes exactly that back.
local function budget_add(owner, kind, n)
  n = tonumber(n) or 0
  if n == 0 then
    return
  end
  redis.call('HINCRBY', P .. 'budget', kind, n)
  if owner and owner ~= '' then
    local f = kind .. ':' .. owner
    if redis.call('HINCRBY', P .. 'budget', f, n) == 0 then
      redis.call('HDEL', P .. 'budget', f)
    end
  end
end

-- The tallies usage.lua answers: e, b, m over the namespace, then of owner (none when owner is "").
local function budget_tallies(owner)
  local f = {'e', 'b', 'm'}
  if owner ~= '' then
    f[4], f[5], f[6] = 'e:' .. owner, 'b:' .. owner, 'm:' .. owner
  end
  return redis.call('HMGET', P .. 'budget', unpack(f))
end
