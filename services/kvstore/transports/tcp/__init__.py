"""PutBlocks/GetBlocks over a raw TCP connection: frames.py (the framing, shared), client.py
(a worker's transport), server.py (the kvstore's listener)."""
