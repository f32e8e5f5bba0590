"""The buffer's Lua scripts (run atomically by Redis), composed from one definition of how an entry is released.

KEYS[1] is the stream, KEYS[2] the hash counting acknowledgements per entry id (`<stream>:acks`). An entry's
payload may live in chunk keys `<chunk_prefix>:<i>` (fields `chunks`, `chunk_prefix`): releasing an entry deletes
them with it.
"""

from __future__ import annotations

# release_entry: delete one entry, its chunks and its acknowledgement count; returns XDEL's count (0 if gone).
# count_ack: one more group is done with the entry; release it once all `ngroups` are (returns whether it did).
_RELEASE = """
local function release_entry(stream, acks, id)
  local removed = 0
  local entry = redis.call('XRANGE', stream, id, id)
  if #entry == 1 then
    local fields = entry[1][2]
    local nchunks, prefix = 0, nil
    for j = 1, #fields, 2 do
      if fields[j] == 'chunks' then nchunks = tonumber(fields[j + 1]) end
      if fields[j] == 'chunk_prefix' then prefix = fields[j + 1] end
    end
    if prefix then
      for c = 0, nchunks - 1 do redis.call('DEL', prefix .. ':' .. c) end
    end
    removed = redis.call('XDEL', stream, id)
  end
  redis.call('HDEL', acks, id)
  return removed
end

local function count_ack(stream, acks, id, ngroups)
  if redis.call('HINCRBY', acks, id, 1) >= ngroups then
    release_entry(stream, acks, id)
    return true
  end
  return false
end
"""

# Acknowledge for one group (ARGV = group, ngroups, ids...); released once all groups have acknowledged.
ACK = (
    _RELEASE
    + """
local stream, acks = KEYS[1], KEYS[2]
local group, ngroups = ARGV[1], tonumber(ARGV[2])
local done = 0
for i = 3, #ARGV do
  local id = ARGV[i]
  if redis.call('XACK', stream, group, id) == 1 then
    done = done + 1
    count_ack(stream, acks, id, ngroups)
  end
end
return done
"""
)

# A group gives up entries it will never train (the actor during PPO's critic-only steps): acknowledged if
# pending there, else counted once (the set KEYS[3] makes a repeated call harmless); released when complete.
SKIP = (
    _RELEASE
    + """
local stream, acks, skipped = KEYS[1], KEYS[2], KEYS[3]
local group, ngroups = ARGV[1], tonumber(ARGV[2])
local done = 0
for i = 3, #ARGV do
  local id = ARGV[i]
  local counted = redis.call('XACK', stream, group, id) == 1
  if not counted and #redis.call('XRANGE', stream, id, id) == 1 then
    counted = redis.call('SADD', skipped, id) == 1
  end
  if counted then
    done = done + 1
    if count_ack(stream, acks, id, ngroups) then redis.call('SREM', skipped, id) end
  end
end
return done
"""
)

# Remove entries outright (chunks too), acknowledging them in every group: ARGV = ngroups, groups..., ids...
DELETE = (
    _RELEASE
    + """
local stream, acks = KEYS[1], KEYS[2]
local ngroups = tonumber(ARGV[1])
local removed = 0
for i = 2 + ngroups, #ARGV do
  local id = ARGV[i]
  removed = removed + release_entry(stream, acks, id)
  for g = 2, 1 + ngroups do redis.call('XACK', stream, ARGV[g], id) end
end
return removed
"""
)

# XADD only while fewer than ARGV[1] entries wait, so concurrent producers cannot overshoot the bound.
# KEYS[2] makes a retried call (redis-py retries on timeouts) return the id of the first XADD instead of
# adding the batch twice; KEYS[3..] are the chunk keys, which must all exist and become persistent.
BOUNDED_XADD = """
local done = redis.call('GET', KEYS[2])
if done then return done end
if redis.call('XLEN', KEYS[1]) >= tonumber(ARGV[1]) then return false end
for i = 3, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then return redis.error_reply('TANDEM_CHUNK_MISSING ' .. KEYS[i]) end
end
for i = 3, #KEYS do redis.call('PERSIST', KEYS[i]) end
local fields = {}
for i = 2, #ARGV do fields[#fields + 1] = ARGV[i] end
local id = redis.call('XADD', KEYS[1], '*', unpack(fields))
redis.call('SET', KEYS[2], id, 'EX', 3600)
return id
"""

# Move one entry to the dead-letter stream (fields copied server-side, plus original_id and reason),
# acknowledge it in every group and remove it from the live stream; its chunks stay for inspection. A no-op
# when it is already gone, so two consumers that both find the entry corrupted record it once.
# KEYS = stream, dead stream, acks; ARGV = id, reason, dead_at_ns, groups...
DEAD_LETTER = """
local stream, dead, acks = KEYS[1], KEYS[2], KEYS[3]
local id = ARGV[1]
local entry = redis.call('XRANGE', stream, id, id)
if #entry == 0 then return 0 end
local fields = entry[1][2]
fields[#fields + 1] = 'original_id'
fields[#fields + 1] = id
fields[#fields + 1] = 'reason'
fields[#fields + 1] = ARGV[2]
fields[#fields + 1] = 'dead_at_ns'
fields[#fields + 1] = ARGV[3]
redis.call('XADD', dead, '*', unpack(fields))
for i = 4, #ARGV do redis.call('XACK', stream, ARGV[i], id) end
redis.call('XDEL', stream, id)
redis.call('HDEL', acks, id)
return 1
"""
