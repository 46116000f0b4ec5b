"""The KV cache service: prefill workers put KV blocks, decode workers get them.

Two axes, two rooms, and the plane that wires them at the top:

    stores/       where blocks live: the contract and each backend
        base.py            the storage contract (BlockStore), keys, StoreEvents
        memory.py          in-process memory (default); disk_tier.py its optional disk
                           tier, disk_files.py the tier's files, disk_folder.py their
                           folder (0700, ours, every file opened relative to it)
        redis_store.py     Redis (redis_scripts.py: its Lua scripts)
        mooncake_index.py  the index over bytes kept in Mooncake Store
    transports/   how block bytes move between a worker and the kvstore
        base.py            the client's contract (BlockTransport) and the gRPC transport
        reused_buffers.py  host buffers reused once nothing views them
        tcp/               raw TCP block frames: frames, client, server
        ucx/               UCX: frames, client, server, the process's UCX loop (runtime)
        mooncake/          Mooncake Store's transfer engine: the plane (connection,
                           object keys, the store nodes), client, buffers, and the
                           same-host shared-memory path (local)

    validate.py       wire blocks -> stored blocks, bad fields refused by name
    batch_codec.py    many blocks per message, their bytes never copied through protobuf
    handlers.py       the API on protobuf messages, for every transport's server
    grpc_servicer.py  the gRPC service
    server.py         config, serve(): a store and the transports' servers
    client.py         KVStoreClient (the worker side: never imports the server side)
    main.py           `pdserve kvstore`
    block_events.py   the store's full blocks as KV events for routers
    kv_metrics.py     Prometheus metrics;  heap.py: the process keeps freed memory;
    errors.py         the service's errors

Direction (tests/test_import_graph.py): stores never import a transport's server or the
service's server side; the worker side (client.py, the transports' clients) never imports
the server side. docs/kvstore.md has the map and what each backend and transport does.
"""
