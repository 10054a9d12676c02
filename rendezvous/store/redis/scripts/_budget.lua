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

-- Whether a record that charged `charged` (HMGET o n m of the record) may charge owner `engines` and `metadata`
-- instead, in the same step that writes it, so that replicas never admit past a budget together: nil, or the
-- refusal {'B', budget, scope, limit, have, adding} of the first budget a growth would pass, in the order of
-- rendezvous.core.budget.check_usage (the server's, then the owner's; engines, then agent metadata bytes).
local function budget_refusal(charged, owner, engines, metadata, limits)
  local was_mine = (charged[1] or '') == owner
  local kinds = {
    {'e', 'engines', tonumber(engines) or 0, tonumber(charged[2]) or 0},
    {'m', 'agent_metadata_bytes', tonumber(metadata) or 0, tonumber(charged[3]) or 0},
  }
  local scopes = {{'server', ''}, {'identity', owner}}
  for s, scope in ipairs(scopes) do
    if s == 1 or owner ~= '' then
      for k, kind in ipairs(kinds) do
        local field = scope[2] == '' and kind[1] or (kind[1] .. ':' .. owner)
        local before = (s == 1 or was_mine) and kind[4] or 0
        local adding = kind[3] - before
        local limit = tonumber(limits[(s - 1) * 2 + k])
        if adding > 0 then
          local have = tonumber(redis.call('HGET', P .. 'budget', field) or '0')
          if have + adding > limit then
            return {'B', kind[2], scope[1], limit, have, adding}
          end
        end
      end
    end
  end
  return nil
end

-- Whether a transfer record that charged block ids `charged` (HMGET oc bc os bs of the record) may charge
-- `target` to owner oc and `source` to owner os instead, in the step that writes it: nil, or the refusal
-- {'B', 'live_blocks', scope, limit, have, adding} of the first budget a growth would pass (the server's,
-- then each owner's), as rendezvous.core.budget.BlockBudget.
local function blocks_refusal(charged, oc, target, os, source, max_blocks, max_blocks_per_identity)
  local old = {}
  local old_total = 0
  for i = 1, 3, 2 do
    local n = tonumber(charged[i + 1]) or 0
    local owner = charged[i] or ''
    old[owner] = (old[owner] or 0) + n
    old_total = old_total + n
  end
  local new = {}
  new[oc] = (new[oc] or 0) + (tonumber(target) or 0)
  new[os] = (new[os] or 0) + (tonumber(source) or 0)
  local adding = (tonumber(target) or 0) + (tonumber(source) or 0) - old_total
  if adding > 0 then
    local have = tonumber(redis.call('HGET', P .. 'budget', 'b') or '0')
    if have + adding > tonumber(max_blocks) then
      return {'B', 'live_blocks', 'server', tonumber(max_blocks), have, adding}
    end
  end
  for _, owner in ipairs({oc, os}) do
    local mine = (new[owner] or 0) - (old[owner] or 0)
    if owner ~= '' and mine > 0 then
      local have = tonumber(redis.call('HGET', P .. 'budget', 'b:' .. owner) or '0')
      if have + mine > tonumber(max_blocks_per_identity) then
        return {'B', 'live_blocks', 'identity', tonumber(max_blocks_per_identity), have, mine}
      end
    end
  end
  return nil
end
