-- Engines that may have lapsed, by index only (the core's rule decides): live ones whose lease
-- expiry is at or before now, ended ones whose end time is at or before tombstone_cutoff.
-- Reply: flat (engine id, version, record).
local out = add_engines({}, redis.call('ZRANGEBYSCORE', P .. 'leases', '-inf', now))
return add_engines(out, redis.call('ZRANGEBYSCORE', P .. 'ended', '-inf', tombstone_cutoff))
