-- Reply: flat (engine id, version, record) of every engine.
return add_engines({}, redis.call('SMEMBERS', P .. 'engines'))
