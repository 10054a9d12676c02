-- Reply: flat (version, record) of the engine's transfers, tombstones included.
return add_transfers({}, redis.call('SMEMBERS', P .. 'et:' .. engine_id))
