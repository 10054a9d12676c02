-- Commit transfer transitions, in order, under one epoch guard: each writes a transfer (or deletes it, or
-- only verifies what was read), its indexes and its events, if the transfer and its engines are still at the
-- versions the caller computed its transition on. items: JSON (one argument, decoded here, so that a batch
-- is a few arguments to send and parse, not hundreds), [peers, [item, ...]]: peers the encoded peer engines
-- the events carry, each once (peers[1] is "", no peer); per item, strings but for peer indexes:
--   [transfer_id, version, op, record, consumer, producer, state, unsettled, deadline, target_blocks,
--    source_blocks, checks (flat: engine id, version, ...), events (flat: engine id, event, peer index, ...)]
-- An event that carries the item's record comes as [before, after], its text around the record's.
-- op: w write | d delete | n verify only. Reply: OK, then per item OK rev | N | C snapshot... | B budget scope
-- limit have adding (the write would pass the live-block budget: not written);
-- or E epoch | R rev epoch (the guard refused the whole call).
local function members(a, b)
  local m = {}
  if a and a ~= '' then m[a] = true end
  if b and b ~= '' then m[b] = true end
  return m
end
-- Unsettled transfers (the core decides: live, or awaiting a revocation) are indexed per engine.
-- A record without the flag was written before it existed: then only a live state is unsettled.
local function was_unsettled(flag, s)
  if flag then return flag == '1' end
  return s ~= '5' and s ~= '6'
end

local function commit(item, peers)
  local transfer_id, version, op, record = item[1], item[2], item[3], item[4]
  local consumer, producer, state, unsettled, deadline = item[5], item[6], item[7], item[8], item[9]
  local target_blocks, source_blocks, checks, events = item[10], item[11], item[12], item[13]
  local tk = P .. 't:' .. transfer_id
  local old = redis.call('HMGET', tk, 'v', 'c', 'p', 's', 'l')
  local conflict = (old[1] or '0') ~= version
  for i = 1, #checks, 2 do
    if conflict then
      break
    end
    conflict = (redis.call('HGET', P .. 'e:' .. checks[i], 'v') or '0') ~= checks[i + 1]
  end
  if conflict then
    local snap = snapshot(transfer_id)
    table.insert(snap, 1, 'C')
    return snap
  end
  if op == 'n' then
    return {'N'}
  end
  -- The owners the new record charges (those its engines were registered by); a growth past the live-block
  -- budget is refused here (B), so replicas writing at once never pass it together.
  local oc = consumer ~= '' and (redis.call('HGET', P .. 'e:' .. consumer, 'o') or '') or ''
  local op_owner = producer ~= '' and (redis.call('HGET', P .. 'e:' .. producer, 'o') or '') or ''
  if op == 'w' then
    local was = redis.call('HMGET', tk, 'oc', 'bc', 'os', 'bs')
    local refusal = blocks_refusal(was, oc, target_blocks, op_owner, source_blocks, max_blocks, max_blocks_per_identity)
    if refusal then
      return refusal
    end
  end
  local rev = redis.call('INCR', P .. 'rev')

  local existed = old[1] ~= false
  local write = op == 'w'
  local before = existed and members(old[2], old[3]) or {}
  local after = write and members(consumer, producer) or {}
  local before_live = (existed and was_unsettled(old[5], old[4])) and before or {}
  local after_live = (write and unsettled == '1') and after or {}
  for e in pairs(before) do
    if not after[e] then redis.call('SREM', P .. 'et:' .. e, transfer_id) end
  end
  for e in pairs(after) do
    if not before[e] then redis.call('SADD', P .. 'et:' .. e, transfer_id) end
  end
  for e in pairs(before_live) do
    if not after_live[e] then redis.call('SREM', P .. 'el:' .. e, transfer_id) end
  end
  for e in pairs(after_live) do
    if not before_live[e] then redis.call('SADD', P .. 'el:' .. e, transfer_id) end
  end
  if existed then
    redis.call('HINCRBY', P .. 'states', old[4], -1)
    -- The budget: what the record charged (bc block ids to owner oc, bs to os) goes.
    local charged = redis.call('HMGET', tk, 'oc', 'bc', 'os', 'bs')
    budget_add(charged[1], 'b', -(tonumber(charged[2]) or 0))
    budget_add(charged[3], 'b', -(tonumber(charged[4]) or 0))
  end
  if write then
    -- ... and the new record's comes, to the owners its engines were registered by.
    budget_add(oc, 'b', target_blocks)
    budget_add(op_owner, 'b', source_blocks)
    redis.call(
      'HSET', tk, 'v', rev, 'd', record, 'c', consumer, 'p', producer, 's', state, 'l', unsettled,
      'oc', oc, 'bc', target_blocks, 'os', op_owner, 'bs', source_blocks
    )
    redis.call('ZADD', P .. 'deadlines', deadline, transfer_id)
    redis.call('HINCRBY', P .. 'states', state, 1)
    if not existed then
      redis.call('SADD', P .. 'transfers', transfer_id)
      redis.call('ZADD', P .. 'transfer_ids', 0, transfer_id)
    end
    -- The id index of live transfers (ListTransfers' default listing, page_transfers.lua).
    local was_live = existed and old[4] ~= '5' and old[4] ~= '6'
    local is_live = state ~= '5' and state ~= '6'
    if is_live and not was_live then
      redis.call('ZADD', P .. 'live_ids', 0, transfer_id)
    elseif was_live and not is_live then
      redis.call('ZREM', P .. 'live_ids', transfer_id)
    end
  elseif existed then
    redis.call('DEL', tk)
    redis.call('ZREM', P .. 'deadlines', transfer_id)
    redis.call('SREM', P .. 'transfers', transfer_id)
    redis.call('ZREM', P .. 'transfer_ids', transfer_id)
    redis.call('ZREM', P .. 'live_ids', transfer_id)
  end
  for i = 1, #events, 3 do
    local event = events[i + 1]
    if type(event) == 'table' then
      event = event[1] .. record .. event[2]
    end
    append(
      events[i], event, peers[events[i + 2] + 1], max_events, max_event_bytes, max_owner_event_bytes,
      max_total_event_bytes
    )
  end
  return {'OK', rev}
end

local bad = guard_failed(guard)
if bad then
  return bad
end
local out = {'OK'}
local batch = cjson.decode(items)
for k, item in ipairs(batch[2]) do
  out[k + 1] = commit(item, batch[1])
end
return out
