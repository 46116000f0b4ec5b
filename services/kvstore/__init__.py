"""The KV cache service: prefill workers put KV blocks, decode workers get them.

    store.py          the storage contract (BlockStore), keys, StoreEvents
    memory_store.py   the in-process backend (default)
    disk_tier.py      its optional disk tier; the files in disk_files.py
    redis_store.py    the Redis backend; its Lua scripts in redis_scripts.py
    validate.py       wire blocks -> stored blocks, bad fields refused by name
    batch_codec.py    many blocks per message, their bytes never copied through protobuf
    handlers.py       the API on protobuf messages, for every transport
    grpc_servicer.py  the gRPC service           ucx_server.py  Put/Get over UCX
    transport.py      client transports (gRPC)   ucx_client.py  the UCX one
    ucx_frames.py     the UCX framing            ucx_runtime.py the process's UCX loop
    tcp_frames.py     raw TCP block frames       tcp_server.py  PutBlocks/GetBlocks over TCP
    tcp_client.py     the TCP transport          heap.py        the process keeps freed memory
    kv_metrics.py     Prometheus metrics         server.py      config, serve()
    client.py         KVStoreClient              main.py        `pdserve kvstore`

docs/kvstore.md tells what it stores, leases, eviction, backends and transports.
"""
