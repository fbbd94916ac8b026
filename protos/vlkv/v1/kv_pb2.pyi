from vlkv.v1 import generate_pb2 as _generate_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVTensor(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_TENSOR_KEY: _ClassVar[KVTensor]
    KV_TENSOR_VALUE: _ClassVar[KVTensor]
    KV_TENSOR_KEY_SCALE: _ClassVar[KVTensor]
    KV_TENSOR_VALUE_SCALE: _ClassVar[KVTensor]
KV_TENSOR_KEY: KVTensor
KV_TENSOR_VALUE: KVTensor
KV_TENSOR_KEY_SCALE: KVTensor
KV_TENSOR_VALUE_SCALE: KVTensor

class KVChunk(_message.Message):
    __slots__ = ("header", "data", "trailer", "bundle")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_FIELD_NUMBER: _ClassVar[int]
    header: KVHeader
    data: KVData
    trailer: KVTrailer
    bundle: KVBundle
    def __init__(self, header: _Optional[_Union[KVHeader, _Mapping]] = ..., data: _Optional[_Union[KVData, _Mapping]] = ..., trailer: _Optional[_Union[KVTrailer, _Mapping]] = ..., bundle: _Optional[_Union[KVBundle, _Mapping]] = ...) -> None: ...

class KVBundle(_message.Message):
    __slots__ = ("header", "data", "trailer")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    header: KVHeader
    data: _containers.RepeatedCompositeFieldContainer[KVData]
    trailer: KVTrailer
    def __init__(self, header: _Optional[_Union[KVHeader, _Mapping]] = ..., data: _Optional[_Iterable[_Union[KVData, _Mapping]]] = ..., trailer: _Optional[_Union[KVTrailer, _Mapping]] = ...) -> None: ...

class KVHeader(_message.Message):
    __slots__ = ("format_version", "request_id", "model_fingerprint", "dtype", "num_layers", "num_kv_heads", "head_dim", "layer_lengths", "prompt_length", "first_token_id", "sampling", "eos_token_ids", "prompt_tokens", "vision_tokens", "policy", "kv_dtype", "prompt_scores")
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    LAYER_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VISION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_SCORES_FIELD_NUMBER: _ClassVar[int]
    format_version: int
    request_id: str
    model_fingerprint: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layer_lengths: _containers.RepeatedScalarFieldContainer[int]
    prompt_length: int
    first_token_id: int
    sampling: _generate_pb2.SamplingParams
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_tokens: int
    vision_tokens: int
    policy: str
    kv_dtype: str
    prompt_scores: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, format_version: _Optional[int] = ..., request_id: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., layer_lengths: _Optional[_Iterable[int]] = ..., prompt_length: _Optional[int] = ..., first_token_id: _Optional[int] = ..., sampling: _Optional[_Union[_generate_pb2.SamplingParams, _Mapping]] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., prompt_tokens: _Optional[int] = ..., vision_tokens: _Optional[int] = ..., policy: _Optional[str] = ..., kv_dtype: _Optional[str] = ..., prompt_scores: _Optional[_Iterable[bytes]] = ...) -> None: ...

class KVData(_message.Message):
    __slots__ = ("layer", "tensor", "offset", "data", "crc32c")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    layer: int
    tensor: KVTensor
    offset: int
    data: bytes
    crc32c: int
    def __init__(self, layer: _Optional[int] = ..., tensor: _Optional[_Union[KVTensor, str]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32c: _Optional[int] = ...) -> None: ...

class KVTrailer(_message.Message):
    __slots__ = ("num_chunks", "total_bytes")
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_chunks: int
    total_bytes: int
    def __init__(self, num_chunks: _Optional[int] = ..., total_bytes: _Optional[int] = ...) -> None: ...
