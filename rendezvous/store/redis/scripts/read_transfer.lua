-- Reply: snapshot (see _snapshot.lua) of the transfer.
return snapshot(transfer_id)
