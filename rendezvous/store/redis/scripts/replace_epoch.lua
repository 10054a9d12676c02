-- Start new_epoch if the epoch is still the one the caller saw lose writes.
-- Reply: the epoch now (the caller's new one, or the one another replica put in place first).
if redis.call('GET', P .. 'epoch') == lost_epoch then
  redis.call('SET', P .. 'epoch', new_epoch)
end
return redis.call('GET', P .. 'epoch')
