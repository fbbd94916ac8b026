from vlkv.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("kind", "address", "state", "running", "waiting", "free_blocks", "total_blocks", "in_flight", "swapped", "preemptions", "image_cache", "kv_dtype", "block_bytes", "compression_profile", "verifier", "kv_bytes_window_saved", "prefix_cache", "retained", "retained_blocks")
    KIND_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    SWAPPED_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_CACHE_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_PROFILE_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_WINDOW_SAVED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    RETAINED_FIELD_NUMBER: _ClassVar[int]
    RETAINED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    address: str
    state: str
    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    in_flight: int
    swapped: int
    preemptions: int
    image_cache: _worker_pb2.ImageCacheStats
    kv_dtype: str
    block_bytes: int
    compression_profile: str
    verifier: _worker_pb2.VerifierStats
    kv_bytes_window_saved: int
    prefix_cache: _worker_pb2.PrefixCacheStats
    retained: int
    retained_blocks: int
    def __init__(self, kind: _Optional[str] = ..., address: _Optional[str] = ..., state: _Optional[str] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., in_flight: _Optional[int] = ..., swapped: _Optional[int] = ..., preemptions: _Optional[int] = ..., image_cache: _Optional[_Union[_worker_pb2.ImageCacheStats, _Mapping]] = ..., kv_dtype: _Optional[str] = ..., block_bytes: _Optional[int] = ..., compression_profile: _Optional[str] = ..., verifier: _Optional[_Union[_worker_pb2.VerifierStats, _Mapping]] = ..., kv_bytes_window_saved: _Optional[int] = ..., prefix_cache: _Optional[_Union[_worker_pb2.PrefixCacheStats, _Mapping]] = ..., retained: _Optional[int] = ..., retained_blocks: _Optional[int] = ...) -> None: ...

class ScalingEvent(_message.Message):
    __slots__ = ("unix_time", "kind", "action", "replicas", "reason")
    UNIX_TIME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    unix_time: float
    kind: str
    action: str
    replicas: int
    reason: str
    def __init__(self, unix_time: _Optional[float] = ..., kind: _Optional[str] = ..., action: _Optional[str] = ..., replicas: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class ClusterStatus(_message.Message):
    __slots__ = ("workers", "requests_in_flight", "requests_total", "events", "admission_queue")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_QUEUE_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    requests_in_flight: int
    requests_total: int
    events: _containers.RepeatedCompositeFieldContainer[ScalingEvent]
    admission_queue: int
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., requests_in_flight: _Optional[int] = ..., requests_total: _Optional[int] = ..., events: _Optional[_Iterable[_Union[ScalingEvent, _Mapping]]] = ..., admission_queue: _Optional[int] = ...) -> None: ...
