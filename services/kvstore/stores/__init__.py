"""Where the kvstore's blocks live: the contract (base.py) and its backends: memory (with an
optional disk tier), Redis, and an index over bytes kept in Mooncake Store. A store knows
nothing of how bytes reach it (services/kvstore/transports/)."""
