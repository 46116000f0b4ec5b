"""Block bytes in Mooncake Store, moved by its transfer engine: plane.py (the connection,
object keys, store nodes; shared by the kvstore's index and the workers), client.py (a
worker's transport), buffers.py (registered memory kept between calls), local.py (a worker
on a store node's host moves bytes through shared memory)."""
