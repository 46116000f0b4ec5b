"""The router's calls to workers and to the kvstore, each tied to the request's
cancellation: cancelling the request cancels the gRPC call, which aborts the request on
the worker (it frees its blocks, and a decode releases its lease)."""
from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc

from pdserve.services.kvstore.client import KVStoreClient
from pdserve.services.pb import common_pb2, decode_pb2, prefill_pb2
from pdserve.services.router.core.cancel import Cancellation, Cancelled
from pdserve.services.router.core.migration import LostStream
from pdserve.services.router.state.discovery import DECODE, PREFILL
from pdserve.services.router.state.workers import WorkerRegistry

# A failed worker call worth one more try on another worker. CANCELLED here means the
# worker aborted the request (e.g. it is shutting down), not our client: that case is
# told apart by the request's own Cancellation.
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED,
                       grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED,
                       grpc.StatusCode.ABORTED})
# ...and those that say the worker itself is gone: it is not chosen again until it answers a poll
WORKER_DOWN = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL})


class WorkerCalls:
    def __init__(self, registry: WorkerRegistry, release_timeout_s: float = 5.0):
        self._registry = registry
        self._kvstores: dict[str, KVStoreClient] = {}
        self._lock = threading.Lock()
        self._release_timeout_s = release_timeout_s

    def prefill(self, address: str, request: prefill_pb2.PrefillRequest, timeout_s: float | None,
                cancel: Cancellation) -> prefill_pb2.PrefillResponse:
        """Raises grpc.RpcError for a failed call, Cancelled when the request was cancelled."""
        future = self._registry.stub(PREFILL, address).Prefill.future(request, timeout=timeout_s)
        unregister = cancel.on_cancel(future.cancel)
        try:
            return future.result()
        except grpc.FutureCancelledError:
            raise Cancelled() from None
        except grpc.RpcError:
            cancel.raise_if_cancelled()
            raise
        finally:
            unregister()

    def decode(self, address: str, request: decode_pb2.DecodeRequest, timeout_s: float | None,
               cancel: Cancellation) -> Iterator[common_pb2.GenerateResponse]:
        """The decode's messages; raises as `prefill` does. A stream whose worker a poll finds
        unreachable (hung, or cut off without the connection closing: its tokens would never
        come) is cancelled and raises LostStream. Closing the iterator early cancels the call."""
        call = self._registry.stub(DECODE, address).Decode(request, timeout=timeout_s)
        unregister = cancel.on_cancel(call.cancel)
        lost = threading.Event()

        def on_lost() -> None:
            lost.set()
            call.cancel()
        unwatch = self._registry.on_lost(address, on_lost)
        try:
            for msg in call:
                yield msg
        except grpc.RpcError:
            cancel.raise_if_cancelled()
            if lost.is_set():
                raise LostStream(f"decode worker {address} stopped answering its polls") from None
            raise
        finally:
            unregister()
            unwatch()
            call.cancel()  # a no-op when the stream already ended

    def release_lease(self, kvstore_address: str, lease_id: str) -> None:
        """Unpin the KV a prefill left for a decode that never took it. Failing here only
        delays the release: the lease expires by itself."""
        self._kvstore(kvstore_address).release_lease_quietly(lease_id)

    def close(self) -> None:
        with self._lock:
            clients, self._kvstores = list(self._kvstores.values()), {}
        for client in clients:
            client.close()

    def _kvstore(self, address: str) -> KVStoreClient:
        with self._lock:
            if address not in self._kvstores:
                self._kvstores[address] = KVStoreClient(address, timeout_s=self._release_timeout_s,
                                                        security=self._registry.security)
            return self._kvstores[address]
