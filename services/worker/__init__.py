"""The runtime the prefill and decode workers share: the engine on its own loop thread,
the worker config and flags, the servicer base, metrics and KV blocks on the wire.
Unlike services/common (plumbing), this room needs torch and the engine."""
