from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SubscribeKVEventsRequest(_message.Message):
    __slots__ = ("tiers",)
    TIERS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedScalarFieldContainer[KVEvent.Tier]
    def __init__(self, tiers: _Optional[_Iterable[_Union[KVEvent.Tier, str]]] = ...) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("kind", "block_hashes", "tier")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[KVEvent.Kind]
        STORED: _ClassVar[KVEvent.Kind]
        REMOVED: _ClassVar[KVEvent.Kind]
    KIND_UNSPECIFIED: KVEvent.Kind
    STORED: KVEvent.Kind
    REMOVED: KVEvent.Kind
    class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        DEVICE: _ClassVar[KVEvent.Tier]
        HOST: _ClassVar[KVEvent.Tier]
    DEVICE: KVEvent.Tier
    HOST: KVEvent.Tier
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    kind: KVEvent.Kind
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    tier: KVEvent.Tier
    def __init__(self, kind: _Optional[_Union[KVEvent.Kind, str]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., tier: _Optional[_Union[KVEvent.Tier, str]] = ...) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("source_id", "seq", "snapshot", "events", "block_size", "root_hash")
    SOURCE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ROOT_HASH_FIELD_NUMBER: _ClassVar[int]
    source_id: str
    seq: int
    snapshot: bool
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    block_size: int
    root_hash: bytes
    def __init__(self, source_id: _Optional[str] = ..., seq: _Optional[int] = ..., snapshot: _Optional[bool] = ..., events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ..., block_size: _Optional[int] = ..., root_hash: _Optional[bytes] = ...) -> None: ...
