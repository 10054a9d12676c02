-- One SSCAN page of every transfer. Reply: {next cursor, flat (version, record)...}.
local page = redis.call('SSCAN', P .. 'transfers', cursor, 'COUNT', tonumber(count))
return add_transfers({page[1]}, page[2])
