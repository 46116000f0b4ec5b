"""How KV bytes move between a worker and the kvstore: the client's contract and the gRPC
transport (base.py); raw TCP (tcp/), UCX (ucx/) and Mooncake Store's transfer engine
(mooncake/), each with its client side and, where the kvstore receives bytes itself, its
server side. Lookup, leases and stats always go over gRPC."""
