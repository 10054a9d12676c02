-- An engine's credit ledger: its version and its reservations, read at one instant. Reply: version, records.
return {redis.call('GET', P .. 'crv:' .. engine_id) or '0', redis.call('HVALS', P .. 'cr:' .. engine_id)}
