"""What the router knows of its workers, kept up to date in the background:

    discovery.py       where they are (static; file_discovery.py, k8s_discovery.py)
    workers.py         the registry: channels, stubs, each worker's WorkerView
    poller.py          each worker's load and health, every poll interval
    readiness.py       ready when a decode worker is reachable
    kv_index.py        which KV blocks each worker holds (kv_subscriber.py feeds it)
"""
