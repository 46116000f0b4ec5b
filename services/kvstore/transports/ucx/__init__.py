"""Put/Get over UCX (ucx-py as `ucxx`): frames.py (the framing, shared), client.py (a
worker's transport), server.py (the kvstore's listener), runtime.py (the process's UCX loop)."""
