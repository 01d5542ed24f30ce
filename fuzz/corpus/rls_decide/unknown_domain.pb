
nope

kv