"""Validated configuration of vlkv's servers.

Every value is checked where it enters (``__post_init__``), so a bad flag is a clear error at start-up
rather than a crash in the middle of a request.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from vlkv.common.compression.verify import VerifyConfig
from vlkv.common.errors import ConfigError
from vlkv.common.security import SecurityConfig, draw_internal_token

__all__ = ["ConfigError", "SecurityConfig"]  # re-exported: config is where callers look for them

DEFAULT_PROMPT_WEIGHT = 300.0  # PoolConfig.prompt_weight
DRAIN_BYTES = 64 << 20  # TransferConfig.drain_bytes
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "default_model"
KV_TRANSPORTS = ("auto", "grpc", "nixl")
KV_DTYPES = ("fp16", "int8", "fp8")  # handoff.quantize.KV_DTYPES
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass(slots=True)
class ModelConfig:
    """Which checkpoint to serve and how."""

    path: str = str(DEFAULT_MODEL_DIR)
    dtype: str = "float32"
    device: str = "cpu"
    torch_threads: int = 1

    def __post_init__(self) -> None:
        _check(Path(self.path).is_dir(), f"model path {self.path!r} is not a directory")
        _check((Path(self.path) / "config.json").is_file(), f"model path {self.path!r} has no config.json")
        _check(self.dtype in DTYPES, f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        _check(self.device == "cpu" or self.device.startswith("cuda"), f"unknown device {self.device!r}")
        _check(self.torch_threads >= 1, "torch_threads must be >= 1")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass(slots=True)
class Limits:
    """Input limits the gateway enforces before any work is scheduled."""

    max_images: int = 8
    max_image_bytes: int = 10 << 20
    max_image_pixels: int = 40_000_000  # decoded width * height (decompression bombs)
    max_request_pixels: int = 64_000_000  # width * height summed over a request's images (from the headers)
    max_prompt_bytes: int = 0  # UTF-8 bytes of the prompt text, checked before tokenizing; 0: 32 per token
    # of the model's context
    max_prompt_tokens: int = 0  # 0: the model's context length minus max_new_tokens
    max_new_tokens: int = 1024
    default_max_new_tokens: int = 64
    max_stop_strings: int = 16
    max_message_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        _check(self.max_images >= 0, "max_images must be >= 0")
        _check(self.max_image_bytes > 0, "max_image_bytes must be > 0")
        _check(self.max_image_pixels > 0, "max_image_pixels must be > 0")
        _check(self.max_request_pixels > 0, "max_request_pixels must be > 0")
        _check(self.max_prompt_bytes >= 0, "max_prompt_bytes must be >= 0")
        _check(self.max_prompt_tokens >= 0, "max_prompt_tokens must be >= 0")
        _check(self.max_new_tokens >= 1, "max_new_tokens must be >= 1")
        _check(
            1 <= self.default_max_new_tokens <= self.max_new_tokens,
            "default_max_new_tokens must be in [1, max_new_tokens]",
        )
        _check(self.max_message_bytes >= (1 << 20), "max_message_bytes must be >= 1 MiB")


@dataclass(slots=True)
class PoolConfig:
    """The decode worker's paged KV pool and batch."""

    pool_bytes: int = 256 << 20
    block_size: int = 16
    max_batch: int = 64
    cache_wait_ms: int = 60_000  # how long Decode waits for its cache, and the lease of an unclaimed cache
    # "grow": a cache takes blocks for its tokens only and grows a block at a time while decoding; when the
    # pool runs out, the newest sequence is preempted (swapped to host memory) and resumed first when
    # blocks free. "reserve": every cache also reserves max_new_tokens at admission (never preempts).
    admission: str = "grow"
    watermark: float = 0.01  # "grow": share of the pool a new cache must leave free (room to grow)
    swap_bytes: int = 0  # "grow": host memory for preempted sequences; 0 = as much as pool_bytes
    # Decode-phase re-compression (0: off): a layer keeps at most decode_budget x its prompt-time tokens +
    # decode_window (the most recent ones always kept), cut back by attention mass a block past that.
    decode_budget: float = 0.0
    decode_window: int = 32
    # What the prompt-time score of a kept token (its attention per post-vision row, KVHeader.prompt_scores)
    # counts for against attention mass accumulated while decoding: re-compression starts a token's mass at
    # prompt_weight x its score. Chosen on the task's training split (``vlkv eval kv-table``).
    prompt_weight: float = DEFAULT_PROMPT_WEIGHT
    # Each sequence's decode step runs as a batch of one: its tokens do not depend on what else is decoding
    # (bfloat16/float16 matmuls round differently with the batch's size), at the cost of throughput.
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        _check(self.pool_bytes > 0, "pool_bytes must be > 0")
        _check(1 <= self.block_size <= 1024, "block_size must be in [1, 1024]")
        _check(self.max_batch >= 1, "max_batch must be >= 1")
        _check(self.cache_wait_ms >= 1, "cache_wait_ms must be >= 1")
        _check(
            self.admission in ("grow", "reserve"),
            f"admission must be grow or reserve, not {self.admission!r}",
        )
        _check(0 <= self.watermark < 1, "watermark must be in [0, 1)")
        _check(self.swap_bytes >= 0, "swap_bytes must be >= 0")
        _check(self.decode_budget >= 0, "decode_budget must be >= 0 (0: off)")
        _check(self.decode_window >= 1, "decode_window must be >= 1")
        _check(self.prompt_weight >= 0, "prompt_weight must be >= 0 (0: decode mass alone)")


@dataclass(slots=True)
class QueueConfig:
    """The gateway's admission queue: requests wait here while no decode worker has room for them."""

    max_waiting: int = 256  # requests queued at most; more are refused with RESOURCE_EXHAUSTED
    admit_wait_s: float = 30.0  # how long a queued request waits for room before RESOURCE_EXHAUSTED

    def __post_init__(self) -> None:
        _check(self.max_waiting >= 0, "max_waiting must be >= 0")
        _check(self.admit_wait_s >= 0, "admit_wait_s must be >= 0")


@dataclass(slots=True)
class TransferConfig:
    """How compact caches travel from prefill to decode."""

    chunk_bytes: int = 4 << 20  # handoff.wire.DEFAULT_CHUNK_BYTES
    deadline_s: float = 60.0  # of one TransferKV call; the gateway allows 2x for a Prefill, 3x for the cache
    # "grpc": K/V in gRPC messages; "nixl": one-sided NIXL writes into the decode pool (unencrypted: trusted
    # fabrics only); "auto": NIXL where both workers have it and TLS is off, else gRPC.
    kv_transport: str = "auto"
    # Under "auto", caches smaller than this go over gRPC even where NIXL is offered: NIXL's extra round trip
    # (regions, then the completion notice) costs more than its faster copy saves on small caches (`vlkv
    # bench all --quick`, 2K prompt: 0.40 MiB took 4.5 ms over gRPC vs 14.9 ms over NIXL, 4 MiB 11.8 vs
    # 17.7 ms; `bench kv_wire`, 27 MB: 49 ms vs 40 ms). 0: NIXL for every size.
    nixl_min_bytes: int = 8 << 20
    # How compact caches travel and are stored: "fp16" (the model's dtype), "int8" (KIVI scales) or "fp8"
    # (E4M3, same scales): the prefill worker quantizes, the decode pool stores the bytes. Both workers of a
    # deployment must agree.
    kv_dtype: str = "fp16"
    idle_s: float = 10.0  # decode side: a hand-off with no message for this long ends and frees its blocks
    write_window_s: float = 10.0  # NIXL: the sender writes within this; blocks of a broken write wait it out
    max_transfers: int = 32  # decode side: hand-offs in progress at once (more: RESOURCE_EXHAUSTED)
    drain_bytes: int = (
        DRAIN_BYTES  # decode side: what a refused gRPC sender may still stream (to see the status)
    )
    unclaimed_lease_s: float = 5.0  # decode side: a cache no Decode call claims is freed after this
    max_unclaimed_per_sender: int = 8  # decode side: unclaimed caches one sending host may park at once
    # Prefill side: decode workers it may send to besides those registered at run time (allow_decode); in
    # local mode (no TLS) any loopback address is allowed too. Channels kept open: at most max_peers.
    decode_peers: tuple[str, ...] = ()
    max_peers: int = 64
    # Fault injection, for tests only (no CLI flag; keep 0): the prefill worker pauses this long before each
    # KV chunk after the header, so a test can kill or stop a process while a hand-off is in flight.
    fault_chunk_delay_ms: int = 0

    def __post_init__(self) -> None:
        _check(4096 <= self.chunk_bytes <= (32 << 20), "chunk_bytes must be in [4 KiB, 32 MiB]")
        _check(self.deadline_s > 0, "deadline_s must be > 0")
        _check(0 <= self.fault_chunk_delay_ms <= 60_000, "fault_chunk_delay_ms must be in [0, 60000]")
        _check(self.kv_transport in KV_TRANSPORTS, f"kv_transport must be one of {KV_TRANSPORTS}")
        _check(self.nixl_min_bytes >= 0, "nixl_min_bytes must be >= 0")
        _check(self.kv_dtype in KV_DTYPES, f"kv_dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}")
        for name in ("idle_s", "write_window_s", "unclaimed_lease_s"):
            _check(getattr(self, name) > 0, f"{name} must be > 0")
        _check(self.max_transfers >= 1 and self.max_peers >= 1, "max_transfers and max_peers must be >= 1")
        _check(self.drain_bytes >= 0 and self.max_unclaimed_per_sender >= 1, "bad drain or unclaimed limit")
        self.decode_peers = tuple(self.decode_peers)


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """What the gateway reads: input limits, its admission queue, the hand-off deadline it allows."""

    limits: Limits
    queue: QueueConfig
    transfer: TransferConfig
    security: SecurityConfig
    keepalive_s: float
    # The prefill workers' verification defaults: an unverified "continue" turn may be decoded on the decode
    # worker's kept cache; a verified one goes to the prefill worker, whose verifier checks it.
    verify: VerifyConfig = field(default_factory=VerifyConfig)


@dataclass(frozen=True, slots=True)
class PrefillConfig:
    """What a prefill worker reads: message limits, how it sends caches, how it reaches decode workers."""

    limits: Limits
    transfer: TransferConfig
    security: SecurityConfig
    keepalive_s: float
    image_cache_mb: int = 256  # the image cache (reused image K/V, LRU); 0 = off
    verify: VerifyConfig = field(default_factory=VerifyConfig)  # verified compression's server defaults
    learned_profile: str = ""  # where the verifier's outcomes are written as a profile ("": not written)
    concurrency: int = 1  # requests run at once; their drafts step as one batch (draft_batch.DraftBatcher)
    prefix_cache_mb: int = 256  # the prefix cache (prompts' full K/V by block, LRU); 0 = off
    prefix_block: int = 16  # tokens per prefix-cache block
    share_prefixes: bool = False  # one tenant's cached prefixes serve another's prompts


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """What a decode worker reads: its pool and batch, the device it holds them on, the sampling limits, how
    it receives caches (and whether TLS is on: ``auto`` offers NIXL only without it)."""

    limits: Limits
    pool: PoolConfig
    device: str
    transfer: TransferConfig = field(default_factory=TransferConfig)
    tls: bool = False


@dataclass(slots=True)
class ServerConfig:
    """One deployment's configuration (what the CLI builds and Ray ships to every process); each server
    takes only its role's part (``gateway()``, ``prefill()``, ``decode()``)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    limits: Limits = field(default_factory=Limits)
    pool: PoolConfig = field(default_factory=PoolConfig)
    queue: QueueConfig = field(default_factory=QueueConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    host: str = "127.0.0.1"
    grace_s: float = 5.0
    # Internal channels (gateway to workers, prefill to decode) ping their peer this often and drop the
    # connection when a ping goes unanswered as long: calls to a hung worker end with UNAVAILABLE. 0 = off.
    keepalive_s: float = 15.0
    image_cache_mb: int = 256  # each prefill worker's image cache (PrefillConfig.image_cache_mb)
    # Each prefill worker's prefix cache (PrefillConfig.prefix_cache_mb): a follow-up turn prefills only the
    # tokens after the longest cached prefix of its prompt; blocks of prefix_block tokens, per tenant unless
    # share_prefixes. Beside the image cache, with its own bound (prefill_worker/prefix_cache.py says why).
    prefix_cache_mb: int = 256
    prefix_block: int = 16
    share_prefixes: bool = False
    # The compression profile (vlkv calibrate) the prefill workers serve: a path, "" = the checkpoint's
    # compression_profile.json when there is one, "none" = no profile (deploy.servers.load_compression_profile).
    compression_profile: str = ""
    # Verified compression's server defaults (vlkv serve --verify, --fidelity-floor, --max-budget, ...) and
    # the file the prefill workers write their learned candidate order to ("": none; a restart loads it).
    verify: VerifyConfig = field(default_factory=VerifyConfig)
    learned_profile: str = ""
    # Requests each prefill worker runs at once (vlkv serve --prefill-concurrency); their greedy drafts (the
    # verifier's reference, lookahead's queries) step as one batch. 1: one request at a time.
    prefill_concurrency: int = 1
    # glibc's trim threshold in every worker (MiB): a thread arena's free top above it goes back to the OS
    # when a free reaches it; below it, it stays resident (malloc_trim never trims thread arenas' tops).
    # 4 MiB gives back what a burst of large inputs left (issue 33); a higher value keeps more memory and
    # re-faults less on very large hand-offs (docs/operations.md "Security": full 7B caches ~0.65x at 4 against 32).
    malloc_trim_mb: int = 4

    def __post_init__(self) -> None:
        _check(bool(self.host), "host must not be empty")
        _check(self.malloc_trim_mb >= 1, "malloc_trim_mb must be >= 1")
        _check(self.image_cache_mb >= 0, "image_cache_mb must be >= 0")
        _check(self.prefix_cache_mb >= 0, "prefix_cache_mb must be >= 0")
        _check(1 <= self.prefix_block <= 1024, "prefix_block must be in [1, 1024]")
        _check(self.grace_s >= 0, "grace_s must be >= 0")
        _check(1 <= self.prefill_concurrency <= 64, "prefill_concurrency must be in [1, 64]")
        _check(self.keepalive_s == 0 or self.keepalive_s >= 0.5, "keepalive_s must be 0 (off) or >= 0.5")
        if not self.security.authenticates_workers:  # every deployment authenticates its worker ports
            self.security = replace(self.security, internal_token=draw_internal_token())
        self.security.check_exposure(self.host)
        _check(  # one KV chunk plus its framing (grpc_transport.MESSAGE_OVERHEAD_BYTES) fits in a message
            self.transfer.chunk_bytes + (1 << 17) <= self.limits.max_message_bytes,
            "transfer.chunk_bytes + 128 KiB must be <= limits.max_message_bytes",
        )

    def gateway(self) -> GatewayConfig:
        return GatewayConfig(
            self.limits, self.queue, self.transfer, self.security, self.keepalive_s, self.verify
        )

    def prefill(self) -> PrefillConfig:
        return PrefillConfig(
            self.limits,
            self.transfer,
            self.security,
            self.keepalive_s,
            self.image_cache_mb,
            self.verify,
            self.learned_profile,
            self.prefill_concurrency,
            self.prefix_cache_mb,
            self.prefix_block,
            self.share_prefixes,
        )

    def decode(self) -> DecodeConfig:
        return DecodeConfig(self.limits, self.pool, self.model.device, self.transfer, self.security.tls)
