-- Reply: flat (engine id, version, record) of each of the given engines that exists, in the order given.
return add_engines({}, ids)
