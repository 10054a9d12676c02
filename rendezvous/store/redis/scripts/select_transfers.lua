-- Reply: flat (version, record) of the first `limit` of the given transfers (in the order given) that
-- exist and are in one of `states` ("1,2,..."); the others' records are not read.
return add_selected({}, ids, states, limit)
