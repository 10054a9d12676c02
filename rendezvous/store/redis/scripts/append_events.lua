-- Append events to engines' streams once per operation id (a retried call whose reply was lost
-- applies once). Reply: OK rev | N (applied before) | E epoch | R rev epoch.
local bad = guard_failed(guard)
if bad then
  return bad
end
if not redis.call('SET', P .. 'op:' .. operation, '1', 'NX', 'EX', remember_s) then
  return {'N'}
end
local rev = redis.call('INCR', P .. 'rev')
for _, ev in ipairs(events) do
  append(ev.engine_id, ev.event, ev.peer, max_events, max_event_bytes, max_owner_event_bytes, max_total_event_bytes)
end
return {'OK', rev}
