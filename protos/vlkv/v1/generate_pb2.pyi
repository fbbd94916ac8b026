from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_STOP_STRING: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_STOP_STRING: FinishReason

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "images", "text", "chat", "sampling", "compression", "reuse")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    REUSE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    images: _containers.RepeatedScalarFieldContainer[bytes]
    text: str
    chat: ChatPrompt
    sampling: SamplingParams
    compression: CompressionParams
    reuse: ReuseParams
    def __init__(self, request_id: _Optional[str] = ..., images: _Optional[_Iterable[bytes]] = ..., text: _Optional[str] = ..., chat: _Optional[_Union[ChatPrompt, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., compression: _Optional[_Union[CompressionParams, _Mapping]] = ..., reuse: _Optional[_Union[ReuseParams, _Mapping]] = ...) -> None: ...

class ReuseParams(_message.Message):
    __slots__ = ("reuse", "recompute_ratio", "mode", "conversation")
    REUSE_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_RATIO_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_FIELD_NUMBER: _ClassVar[int]
    reuse: str
    recompute_ratio: float
    mode: str
    conversation: str
    def __init__(self, reuse: _Optional[str] = ..., recompute_ratio: _Optional[float] = ..., mode: _Optional[str] = ..., conversation: _Optional[str] = ...) -> None: ...

class ChatPrompt(_message.Message):
    __slots__ = ("messages", "add_generation_prompt")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: _containers.RepeatedCompositeFieldContainer[ContentPart]
    def __init__(self, role: _Optional[str] = ..., content: _Optional[_Iterable[_Union[ContentPart, _Mapping]]] = ...) -> None: ...

class ContentPart(_message.Message):
    __slots__ = ("text", "image")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    text: str
    image: ImagePlaceholder
    def __init__(self, text: _Optional[str] = ..., image: _Optional[_Union[ImagePlaceholder, _Mapping]] = ...) -> None: ...

class ImagePlaceholder(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ...) -> None: ...

class CompressionParams(_message.Message):
    __slots__ = ("policy", "budget", "threshold", "allocator", "exact_budget", "lookahead", "lookahead_weight", "verify", "fidelity_floor", "max_budget")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    ALLOCATOR_FIELD_NUMBER: _ClassVar[int]
    EXACT_BUDGET_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    FIDELITY_FLOOR_FIELD_NUMBER: _ClassVar[int]
    MAX_BUDGET_FIELD_NUMBER: _ClassVar[int]
    policy: str
    budget: float
    threshold: float
    allocator: str
    exact_budget: bool
    lookahead: int
    lookahead_weight: float
    verify: str
    fidelity_floor: float
    max_budget: float
    def __init__(self, policy: _Optional[str] = ..., budget: _Optional[float] = ..., threshold: _Optional[float] = ..., allocator: _Optional[str] = ..., exact_budget: _Optional[bool] = ..., lookahead: _Optional[int] = ..., lookahead_weight: _Optional[float] = ..., verify: _Optional[str] = ..., fidelity_floor: _Optional[float] = ..., max_budget: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token", "finished")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token: TokenChunk
    finished: Finished
    def __init__(self, request_id: _Optional[str] = ..., token: _Optional[_Union[TokenChunk, _Mapping]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "text")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("reason", "usage")
    REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    reason: FinishReason
    usage: Usage
    def __init__(self, reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "vision_tokens", "generated_tokens", "kv_bytes_kept", "kv_bytes_full", "compression_ratio", "layer_budgets", "ttft_ms", "policy", "image_cache_hit", "recomputed_image_tokens", "recompute_ratio", "compression_profile", "verified_candidate", "verified_agreement", "verified_kl", "budget_raises", "floor_met", "verify", "verified_budget", "draft_tokens", "kv_bytes_window_saved", "cached_prompt_tokens", "continued_tokens", "continue_refused", "continued_on")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VISION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_KEPT_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FULL_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_RATIO_FIELD_NUMBER: _ClassVar[int]
    LAYER_BUDGETS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
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
    CONTINUED_ON_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    vision_tokens: int
    generated_tokens: int
    kv_bytes_kept: int
    kv_bytes_full: int
    compression_ratio: float
    layer_budgets: _containers.RepeatedScalarFieldContainer[int]
    ttft_ms: float
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
    continued_on: str
    def __init__(self, prompt_tokens: _Optional[int] = ..., vision_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., kv_bytes_kept: _Optional[int] = ..., kv_bytes_full: _Optional[int] = ..., compression_ratio: _Optional[float] = ..., layer_budgets: _Optional[_Iterable[int]] = ..., ttft_ms: _Optional[float] = ..., policy: _Optional[str] = ..., image_cache_hit: _Optional[bool] = ..., recomputed_image_tokens: _Optional[int] = ..., recompute_ratio: _Optional[float] = ..., compression_profile: _Optional[str] = ..., verified_candidate: _Optional[str] = ..., verified_agreement: _Optional[float] = ..., verified_kl: _Optional[float] = ..., budget_raises: _Optional[int] = ..., floor_met: _Optional[bool] = ..., verify: _Optional[str] = ..., verified_budget: _Optional[float] = ..., draft_tokens: _Optional[int] = ..., kv_bytes_window_saved: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., continued_tokens: _Optional[int] = ..., continue_refused: _Optional[bool] = ..., continued_on: _Optional[str] = ...) -> None: ...
