from vlkv.v1 import generate_pb2 as _generate_pb2
from vlkv.v1 import kv_pb2 as _kv_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Refusal(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REFUSAL_UNSPECIFIED: _ClassVar[Refusal]
    REFUSAL_POOL_FULL: _ClassVar[Refusal]
    REFUSAL_NEVER_FITS: _ClassVar[Refusal]
    REFUSAL_FINGERPRINT_MISMATCH: _ClassVar[Refusal]
    REFUSAL_LAYOUT_MISMATCH: _ClassVar[Refusal]
    REFUSAL_HAND_OFF_FAILED: _ClassVar[Refusal]
    REFUSAL_SUPERSEDED: _ClassVar[Refusal]
    REFUSAL_TRANSPORT_UNAVAILABLE: _ClassVar[Refusal]
REFUSAL_UNSPECIFIED: Refusal
REFUSAL_POOL_FULL: Refusal
REFUSAL_NEVER_FITS: Refusal
REFUSAL_FINGERPRINT_MISMATCH: Refusal
REFUSAL_LAYOUT_MISMATCH: Refusal
REFUSAL_HAND_OFF_FAILED: Refusal
REFUSAL_SUPERSEDED: Refusal
REFUSAL_TRANSPORT_UNAVAILABLE: Refusal

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "sampling", "compression", "decode_address", "input_ids", "vision_spans", "model_inputs", "image_hashes", "reuse")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    VISION_SPANS_FIELD_NUMBER: _ClassVar[int]
    MODEL_INPUTS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_HASHES_FIELD_NUMBER: _ClassVar[int]
    REUSE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sampling: _generate_pb2.SamplingParams
    compression: _generate_pb2.CompressionParams
    decode_address: str
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    vision_spans: _containers.RepeatedScalarFieldContainer[int]
    model_inputs: _containers.RepeatedCompositeFieldContainer[Tensor]
    image_hashes: _containers.RepeatedScalarFieldContainer[str]
    reuse: _generate_pb2.ReuseParams
    def __init__(self, request_id: _Optional[str] = ..., sampling: _Optional[_Union[_generate_pb2.SamplingParams, _Mapping]] = ..., compression: _Optional[_Union[_generate_pb2.CompressionParams, _Mapping]] = ..., decode_address: _Optional[str] = ..., input_ids: _Optional[_Iterable[int]] = ..., vision_spans: _Optional[_Iterable[int]] = ..., model_inputs: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., image_hashes: _Optional[_Iterable[str]] = ..., reuse: _Optional[_Union[_generate_pb2.ReuseParams, _Mapping]] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("name", "dtype", "shape", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PrefillReply(_message.Message):
    __slots__ = ("prompt_tokens", "vision_tokens", "post_vision_tokens", "first_token_id", "kv_bytes_kept", "kv_bytes_full", "compression_ratio", "layer_budgets", "prefill_ms", "transfer_ms", "policy", "image_cache_hit", "recomputed_image_tokens", "recompute_ratio", "compression_profile", "verified_candidate", "verified_agreement", "verified_kl", "budget_raises", "floor_met", "verify", "verified_budget", "draft_tokens", "kv_bytes_window_saved", "cached_prompt_tokens", "continued_tokens", "continue_refused")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VISION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    POST_VISION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_KEPT_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FULL_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_RATIO_FIELD_NUMBER: _ClassVar[int]
    LAYER_BUDGETS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    IMAGE_CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_IMAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_RATIO_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_PROFILE_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_CANDIDATE_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_AGREEMENT_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_KL_FIELD_NUMBER: _ClassVar[int]
    BUDGET_RAISES_FIELD_NUMBER: _ClassVar[int]
    FLOOR_MET_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_BUDGET_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_WINDOW_SAVED_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTINUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_REFUSED_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    vision_tokens: int
    post_vision_tokens: int
    first_token_id: int
    kv_bytes_kept: int
    kv_bytes_full: int
    compression_ratio: float
    layer_budgets: _containers.RepeatedScalarFieldContainer[int]
    prefill_ms: float
    transfer_ms: float
    policy: str
    image_cache_hit: bool
    recomputed_image_tokens: int
    recompute_ratio: float
    compression_profile: str
    verified_candidate: str
    verified_agreement: float
    verified_kl: float
    budget_raises: int
    floor_met: bool
    verify: str
    verified_budget: float
    draft_tokens: int
    kv_bytes_window_saved: int
    cached_prompt_tokens: int
    continued_tokens: int
    continue_refused: bool
    def __init__(self, prompt_tokens: _Optional[int] = ..., vision_tokens: _Optional[int] = ..., post_vision_tokens: _Optional[int] = ..., first_token_id: _Optional[int] = ..., kv_bytes_kept: _Optional[int] = ..., kv_bytes_full: _Optional[int] = ..., compression_ratio: _Optional[float] = ..., layer_budgets: _Optional[_Iterable[int]] = ..., prefill_ms: _Optional[float] = ..., transfer_ms: _Optional[float] = ..., policy: _Optional[str] = ..., image_cache_hit: _Optional[bool] = ..., recomputed_image_tokens: _Optional[int] = ..., recompute_ratio: _Optional[float] = ..., compression_profile: _Optional[str] = ..., verified_candidate: _Optional[str] = ..., verified_agreement: _Optional[float] = ..., verified_kl: _Optional[float] = ..., budget_raises: _Optional[int] = ..., floor_met: _Optional[bool] = ..., verify: _Optional[str] = ..., verified_budget: _Optional[float] = ..., draft_tokens: _Optional[int] = ..., kv_bytes_window_saved: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., continued_tokens: _Optional[int] = ..., continue_refused: _Optional[bool] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "wait_ms", "retain_key", "continue_from")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    RETAIN_KEY_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FROM_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    wait_ms: int
    retain_key: str
    continue_from: ContinueFrom
    def __init__(self, request_id: _Optional[str] = ..., wait_ms: _Optional[int] = ..., retain_key: _Optional[str] = ..., continue_from: _Optional[_Union[ContinueFrom, _Mapping]] = ...) -> None: ...

class ContinueFrom(_message.Message):
    __slots__ = ("key", "keep_positions", "input_ids", "sampling", "prompt_tokens", "continued_tokens")
    KEY_FIELD_NUMBER: _ClassVar[int]
    KEEP_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTINUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    key: str
    keep_positions: int
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generate_pb2.SamplingParams
    prompt_tokens: int
    continued_tokens: int
    def __init__(self, key: _Optional[str] = ..., keep_positions: _Optional[int] = ..., input_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generate_pb2.SamplingParams, _Mapping]] = ..., prompt_tokens: _Optional[int] = ..., continued_tokens: _Optional[int] = ...) -> None: ...

class TransferAck(_message.Message):
    __slots__ = ("bytes_received", "blocks_allocated")
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_ALLOCATED_FIELD_NUMBER: _ClassVar[int]
    bytes_received: int
    blocks_allocated: int
    def __init__(self, bytes_received: _Optional[int] = ..., blocks_allocated: _Optional[int] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("address", "running", "waiting", "free_blocks", "total_blocks", "block_size", "draining", "model_fingerprint", "admit_blocks", "reserves_new_tokens", "swapped", "preemptions", "image_cache", "kv_dtype", "block_bytes", "images_added", "images_evicted", "images_full", "compression_profile", "verifier", "kv_bytes_window_saved", "prefix_cache", "retained", "retained_blocks")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ADMIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RESERVES_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SWAPPED_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_CACHE_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    IMAGES_ADDED_FIELD_NUMBER: _ClassVar[int]
    IMAGES_EVICTED_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FULL_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_PROFILE_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_WINDOW_SAVED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    RETAINED_FIELD_NUMBER: _ClassVar[int]
    RETAINED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    address: str
    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    block_size: int
    draining: bool
    model_fingerprint: str
    admit_blocks: int
    reserves_new_tokens: bool
    swapped: int
    preemptions: int
    image_cache: ImageCacheStats
    kv_dtype: str
    block_bytes: int
    images_added: _containers.RepeatedCompositeFieldContainer[ImageDigest]
    images_evicted: _containers.RepeatedCompositeFieldContainer[ImageDigest]
    images_full: bool
    compression_profile: str
    verifier: VerifierStats
    kv_bytes_window_saved: int
    prefix_cache: PrefixCacheStats
    retained: int
    retained_blocks: int
    def __init__(self, address: _Optional[str] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., draining: _Optional[bool] = ..., model_fingerprint: _Optional[str] = ..., admit_blocks: _Optional[int] = ..., reserves_new_tokens: _Optional[bool] = ..., swapped: _Optional[int] = ..., preemptions: _Optional[int] = ..., image_cache: _Optional[_Union[ImageCacheStats, _Mapping]] = ..., kv_dtype: _Optional[str] = ..., block_bytes: _Optional[int] = ..., images_added: _Optional[_Iterable[_Union[ImageDigest, _Mapping]]] = ..., images_evicted: _Optional[_Iterable[_Union[ImageDigest, _Mapping]]] = ..., images_full: _Optional[bool] = ..., compression_profile: _Optional[str] = ..., verifier: _Optional[_Union[VerifierStats, _Mapping]] = ..., kv_bytes_window_saved: _Optional[int] = ..., prefix_cache: _Optional[_Union[PrefixCacheStats, _Mapping]] = ..., retained: _Optional[int] = ..., retained_blocks: _Optional[int] = ...) -> None: ...

class PrefixCacheStats(_message.Message):
    __slots__ = ("blocks", "bytes_held", "capacity_bytes", "lookups", "hits", "hit_tokens", "lookup_tokens", "evictions", "rejected", "block_tokens")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_HELD_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    bytes_held: int
    capacity_bytes: int
    lookups: int
    hits: int
    hit_tokens: int
    lookup_tokens: int
    evictions: int
    rejected: int
    block_tokens: int
    def __init__(self, blocks: _Optional[int] = ..., bytes_held: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., lookups: _Optional[int] = ..., hits: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., lookup_tokens: _Optional[int] = ..., evictions: _Optional[int] = ..., rejected: _Optional[int] = ..., block_tokens: _Optional[int] = ...) -> None: ...

class VerifierStats(_message.Message):
    __slots__ = ("verified", "budget_raises", "floor_misses", "wins", "mean_agreement", "bucket_requests", "learned_profile")
    class WinsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class MeanAgreementEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class BucketRequestsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    BUDGET_RAISES_FIELD_NUMBER: _ClassVar[int]
    FLOOR_MISSES_FIELD_NUMBER: _ClassVar[int]
    WINS_FIELD_NUMBER: _ClassVar[int]
    MEAN_AGREEMENT_FIELD_NUMBER: _ClassVar[int]
    BUCKET_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    LEARNED_PROFILE_FIELD_NUMBER: _ClassVar[int]
    verified: int
    budget_raises: int
    floor_misses: int
    wins: _containers.ScalarMap[str, int]
    mean_agreement: _containers.ScalarMap[str, float]
    bucket_requests: _containers.ScalarMap[str, int]
    learned_profile: str
    def __init__(self, verified: _Optional[int] = ..., budget_raises: _Optional[int] = ..., floor_misses: _Optional[int] = ..., wins: _Optional[_Mapping[str, int]] = ..., mean_agreement: _Optional[_Mapping[str, float]] = ..., bucket_requests: _Optional[_Mapping[str, int]] = ..., learned_profile: _Optional[str] = ...) -> None: ...

class ImageDigest(_message.Message):
    __slots__ = ("image_hash", "tenant")
    IMAGE_HASH_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    image_hash: str
    tenant: str
    def __init__(self, image_hash: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class ImageCacheStats(_message.Message):
    __slots__ = ("entries", "bytes_held", "capacity_bytes", "hits", "misses", "evictions", "hint_mismatches")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BYTES_HELD_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    HINT_MISMATCHES_FIELD_NUMBER: _ClassVar[int]
    entries: int
    bytes_held: int
    capacity_bytes: int
    hits: int
    misses: int
    evictions: int
    hint_mismatches: int
    def __init__(self, entries: _Optional[int] = ..., bytes_held: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., hint_mismatches: _Optional[int] = ...) -> None: ...

class NixlTransferRequest(_message.Message):
    __slots__ = ("open", "done")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    open: NixlOpen
    done: NixlDone
    def __init__(self, open: _Optional[_Union[NixlOpen, _Mapping]] = ..., done: _Optional[_Union[NixlDone, _Mapping]] = ...) -> None: ...

class NixlOpen(_message.Message):
    __slots__ = ("header", "known_agent")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    KNOWN_AGENT_FIELD_NUMBER: _ClassVar[int]
    header: _kv_pb2.KVHeader
    known_agent: str
    def __init__(self, header: _Optional[_Union[_kv_pb2.KVHeader, _Mapping]] = ..., known_agent: _Optional[str] = ...) -> None: ...

class NixlDone(_message.Message):
    __slots__ = ("layer_crc32c", "key_scales", "value_scales")
    LAYER_CRC32C_FIELD_NUMBER: _ClassVar[int]
    KEY_SCALES_FIELD_NUMBER: _ClassVar[int]
    VALUE_SCALES_FIELD_NUMBER: _ClassVar[int]
    layer_crc32c: _containers.RepeatedScalarFieldContainer[int]
    key_scales: _containers.RepeatedScalarFieldContainer[bytes]
    value_scales: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, layer_crc32c: _Optional[_Iterable[int]] = ..., key_scales: _Optional[_Iterable[bytes]] = ..., value_scales: _Optional[_Iterable[bytes]] = ...) -> None: ...

class NixlTransferReply(_message.Message):
    __slots__ = ("regions", "ack")
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    regions: NixlRegions
    ack: TransferAck
    def __init__(self, regions: _Optional[_Union[NixlRegions, _Mapping]] = ..., ack: _Optional[_Union[TransferAck, _Mapping]] = ...) -> None: ...

class NixlRegions(_message.Message):
    __slots__ = ("agent_name", "agent_metadata", "mem_type", "device_id", "block_size", "write_window_ms", "layers")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    MEM_TYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    WRITE_WINDOW_MS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    agent_metadata: bytes
    mem_type: str
    device_id: int
    block_size: int
    write_window_ms: int
    layers: _containers.RepeatedCompositeFieldContainer[NixlLayerRegions]
    def __init__(self, agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., mem_type: _Optional[str] = ..., device_id: _Optional[int] = ..., block_size: _Optional[int] = ..., write_window_ms: _Optional[int] = ..., layers: _Optional[_Iterable[_Union[NixlLayerRegions, _Mapping]]] = ...) -> None: ...

class NixlLayerRegions(_message.Message):
    __slots__ = ("key_addrs", "value_addrs", "lengths")
    KEY_ADDRS_FIELD_NUMBER: _ClassVar[int]
    VALUE_ADDRS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    key_addrs: _containers.RepeatedScalarFieldContainer[int]
    value_addrs: _containers.RepeatedScalarFieldContainer[int]
    lengths: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, key_addrs: _Optional[_Iterable[int]] = ..., value_addrs: _Optional[_Iterable[int]] = ..., lengths: _Optional[_Iterable[int]] = ...) -> None: ...
