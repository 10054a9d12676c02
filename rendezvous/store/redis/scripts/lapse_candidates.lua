-- Engines that may have lapsed, by index only (the core's rule decides): ids of live ones whose lease expiry is at
-- or before now, then of ended ones whose end time is at or before tombstone_cutoff. Ids only: the caller reads
-- their records a few at a time (read_engines.lua), so that no reply carries the records of a whole fleet that
-- lapsed at once (an outage longer than the leases). Reply: flat engine ids.
local out = redis.call('ZRANGEBYSCORE', P .. 'leases', '-inf', now)
for _, eid in ipairs(redis.call('ZRANGEBYSCORE', P .. 'ended', '-inf', tombstone_cutoff)) do
  out[#out + 1] = eid
end
return out
