"""`EngineConfig`: the one flat, validated configuration the frontend hands to the engine core.

It crosses process boundaries twice (frontend -> core -> workers) as base64 msgpack on the
child's command line (or, to a worker on another host, inside `WorkerWelcome`), so it lives in
`proto/`. Every instance has passed `__post_init__`, whether built in Python, decoded from argv,
or assembled from CLI flags.
"""

from __future__ import annotations

import argparse
import base64
from collections.abc import Sequence
from typing import Any

import msgspec

from core_engine.common.dtypes import DTYPE_NAMES
from core_engine.common.human_readable_int import parse_human_readable_int
from core_engine.proto.endpoints import is_wildcard_host, parse_tcp_address
from core_engine.proto.kv_transfer import OFFLOADING_CONNECTOR, TCP_CONNECTOR, KVTransferConfig
from core_engine.proto.speculative_config import SpeculativeConfig

DEVICES = ("auto", "cpu", "cuda")
POLICIES = ("fcfs", "priority")
EXECUTOR_BACKENDS = ("mp", "ray")
RAY_PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
NULL_MODEL = "null"
# --quantization: "gguf" keeps a GGUF file's quantized weights as their blocks (CPU kernels);
# None lets the worker choose (worker/quantization_choice.py).
QUANTIZATIONS = ("gguf",)
MIN_FRAME_BYTES = 4096


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What to serve and how big the engine may get.

    model: a Hugging Face folder or GGUF file; None = the default SmolLM2-135M-Instruct GGUF;
    "null" = the model-free NullWorker (tests, IPC benchmarks).
    max_model_len: None = the model's own context length (the minimum over workers).
    max_num_batched_tokens: None = the worker's default for its device (the minimum over
    workers; see `worker.worker.DEFAULT_MAX_NUM_BATCHED_TOKENS`).
    num_gpu_blocks_override: use exactly this many KV blocks instead of what workers measured.
    *_timeout_s: every wait for another process is bounded by one of these.
    max_frame_bytes: the engine core refuses larger frames from the frontend (and the client
    larger frames from the core); the core <-> worker link is internal and has no frame limit
    of its own below the pipe's payload cap (`MessagePipe`: 4 GiB - 1, a u32 length).
    num_local_workers: ranks 0..K-1 are the core's child processes; ranks K..N-1 (N =
    tensor_parallel_size) run on other hosts and connect to `worker_address` (tcp://HOST:PORT
    the core listens on). None = every rank local.
    dist_init_address: tcp://HOST:PORT of torch.distributed's rendezvous, served by rank 0's host;
    None = 127.0.0.1 with a free port when every rank is local, else `worker_address`'s host.
    """

    model: str | None = None
    device: str = "auto"
    dtype: str | None = None
    quantization: str | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    num_local_workers: int | None = None
    worker_address: str | None = None
    dist_init_address: str | None = None
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    seed: int = 0
    startup_timeout_s: float = 300.0
    step_timeout_s: float = 300.0
    shutdown_timeout_s: float = 5.0
    max_frame_bytes: int = 64 * 1024 * 1024
    enforce_eager: bool = False
    cuda_graph_sizes: list[int] | None = None
    async_scheduling: bool = False
    disable_hybrid_kv_cache: bool = False
    distributed_executor_backend: str = "mp"
    data_parallel_backend: str = "mp"
    ray_placement_strategy: str = "PACK"
    ray_cpus_per_worker: int = 1
    speculative_config: SpeculativeConfig | None = None
    kv_transfer_config: KVTransferConfig | None = None
    kv_offloading_size: float | None = None
    kv_offloading_path: str | None = None
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        _check(self.device in DEVICES, f"device must be one of {DEVICES}, got {self.device!r}")
        dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)  # vLLM's spellings: auto, half, float
        _check(
            dtype is None or dtype in DTYPE_NAMES,
            f"dtype must be auto (None) or one of {(*DTYPE_NAMES, *DTYPE_ALIASES)}, got "
            f"{self.dtype!r}",
        )
        msgspec.structs.force_setattr(self, "dtype", dtype)
        _check(
            self.quantization is None or self.quantization in QUANTIZATIONS,
            f"quantization must be None or one of {QUANTIZATIONS}, got {self.quantization!r}",
        )
        _check(
            self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
            f"block_size must be a power of two, got {self.block_size}",
        )
        _check(self.max_num_seqs >= 1, f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        _check(
            self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
            f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}",
        )
        _check(
            self.max_model_len is None or self.max_model_len >= 1,
            f"max_model_len must be at least 1, got {self.max_model_len}",
        )
        _check(
            0.0 < self.gpu_memory_utilization <= 1.0,
            f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}",
        )
        _check(
            self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 2,
            "num_gpu_blocks_override must be at least 2 (block 0 is reserved), "
            f"got {self.num_gpu_blocks_override}",
        )
        _check(
            self.tensor_parallel_size >= 1,
            f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}",
        )
        _check(
            self.data_parallel_size >= 1,
            f"data_parallel_size must be at least 1, got {self.data_parallel_size}",
        )
        _check(
            0 <= self.data_parallel_rank < self.data_parallel_size,
            f"data_parallel_rank must be in [0, data_parallel_size={self.data_parallel_size}), "
            f"got {self.data_parallel_rank}",
        )
        self._check_worker_placement()
        self._check_ray_placement()
        msgspec.structs.force_setattr(  # a dict or JSON from Python callers, validated here
            self, "speculative_config", SpeculativeConfig.parse(self.speculative_config)
        )
        self._check_kv_transfer()
        _check(
            self.long_prefill_token_threshold >= 0,
            f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}",
        )
        self._check_unchunked_prefill()
        self._check_lora()
        self._check_async_scheduling()
        self._check_cuda_graph_sizes()
        _check(self.policy in POLICIES, f"policy must be one of {POLICIES}, got {self.policy!r}")
        for name in ("startup_timeout_s", "step_timeout_s", "shutdown_timeout_s"):
            value = getattr(self, name)
            _check(value > 0, f"{name} must be positive, got {value}")
        _check(
            self.max_frame_bytes >= MIN_FRAME_BYTES,
            f"max_frame_bytes must be at least {MIN_FRAME_BYTES}, got {self.max_frame_bytes}",
        )

    def _check_kv_transfer(self) -> None:
        """`kv_offloading_size` alone means the OffloadingConnector (vLLM's native offloading);
        that connector needs it, and `kv_offloading_path` needs that connector."""
        transfer = KVTransferConfig.parse(self.kv_transfer_config)
        size = self.kv_offloading_size
        _check(size is None or size > 0, f"kv_offloading_size must be positive GiB, got {size}")
        if transfer is None and size is not None:
            transfer = KVTransferConfig.offloading()
        msgspec.structs.force_setattr(self, "kv_transfer_config", transfer)
        offloading = transfer is not None and transfer.kv_connector == OFFLOADING_CONNECTOR
        _check(
            not offloading or size is not None,
            f"kv_transfer_config names {OFFLOADING_CONNECTOR}, which needs kv_offloading_size "
            "(GiB of host memory for offloaded KV blocks)",
        )
        _check(
            self.kv_offloading_path is None or offloading,
            f"kv_offloading_path={self.kv_offloading_path!r} adds a disk tier to "
            f"{OFFLOADING_CONNECTOR}: set kv_offloading_size too",
        )
        _check(
            transfer is None or not self.is_null_model,
            "kv_transfer_config: the null model has no KV cache to transfer",
        )
        _check(
            not offloading or self.enable_prefix_caching,
            f"{OFFLOADING_CONNECTOR} extends prefix-cache hits beyond the pool: it needs "
            "enable_prefix_caching (drop --no-enable-prefix-caching or kv_offloading_size)",
        )
        if transfer is not None and transfer.kv_connector == TCP_CONNECTOR:
            self._check_tcp_connector(transfer)

    def _check_async_scheduling(self) -> None:
        """Async scheduling plans a step before the last one's tokens are back: drafts (made
        from those tokens) and KV connectors (which ship blocks by the finished requests' last
        tokens) would read a history one token short, so neither runs with it."""
        if not self.async_scheduling:
            return
        _check(
            self.speculative_config is None,
            "async_scheduling cannot run with speculative_config (drafts are proposed from the "
            "tokens of the step in flight): drop --async-scheduling or --speculative-config",
        )
        _check(
            self.kv_transfer_config is None,
            "async_scheduling cannot run with a KV connector (kv_transfer_config or "
            "kv_offloading_size): drop --async-scheduling or the connector",
        )

    def _check_cuda_graph_sizes(self) -> None:
        """Batch sizes of the decode CUDA graphs: positive; those above max_num_seqs (or the
        step budget) are dropped by the worker (no step fills them). An empty list captures
        none."""
        for size in self.cuda_graph_sizes or ():
            _check(size >= 1, f"cuda_graph_sizes must be positive batch sizes, got {size}")

    def _check_lora(self) -> None:
        """vLLM's limits: at least one adapter per step, a positive rank, and at least as many
        adapters kept in host memory as one step runs (`max_cpu_loras` None: `max_loras`)."""
        _check(self.max_loras >= 1, f"max_loras must be at least 1, got {self.max_loras}")
        _check(
            self.max_lora_rank >= 1, f"max_lora_rank must be at least 1, got {self.max_lora_rank}"
        )
        _check(
            self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
            f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})",
        )

    @property
    def cpu_lora_capacity(self) -> int:
        """Adapters a worker keeps loaded in host memory (least recently used evicted)."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    def _check_tcp_connector(self, transfer: KVTransferConfig) -> None:
        _check(
            self.tensor_parallel_size == 1,
            f"{TCP_CONNECTOR} serves one worker's KV: it needs tensor_parallel_size 1, got "
            f"{self.tensor_parallel_size}",
        )
        _check(
            not transfer.is_kv_consumer or self.enable_prefix_caching,
            f"{TCP_CONNECTOR} as {transfer.kv_role} admits pulled blocks as prefix-cache hits: "
            "it needs enable_prefix_caching (drop --no-enable-prefix-caching)",
        )
        port = transfer.tcp_option("port")
        _check(
            self.data_parallel_size == 1 or port == 0,
            f"{TCP_CONNECTOR}: every data-parallel engine core serves its own KV, so "
            f"kv_connector_extra_config.port must be 0 (a free port each), got {port}",
        )

    def _check_unchunked_prefill(self) -> None:
        """Without chunked prefill a prompt is prefilled in one step: the step budget must hold
        the longest one (checked here when both are given, else by the core at start-up)."""
        if self.enable_chunked_prefill:
            return
        _check(
            self.long_prefill_token_threshold == 0,
            f"long_prefill_token_threshold={self.long_prefill_token_threshold} chunks long "
            "prompts, which enable_chunked_prefill=False forbids: leave it 0 or enable chunked "
            "prefill",
        )
        budget, max_model_len = self.max_num_batched_tokens, self.max_model_len
        _check(
            budget is None or max_model_len is None or budget >= max_model_len,
            f"max_num_batched_tokens={budget} is below max_model_len={max_model_len}: with "
            "enable_chunked_prefill=False a prompt is prefilled in one step, so the step budget "
            f"must be at least max_model_len; raise max_num_batched_tokens to {max_model_len}, "
            "lower max_model_len, or enable chunked prefill",
        )

    def step_token_budget(self, worker_default: int, max_model_len: int | None = None) -> int:
        """A worker's step budget: `max_num_batched_tokens` when given, else `worker_default`,
        raised to `max_model_len` (once the worker knows it) with chunked prefill off, where a
        prompt is prefilled in one step (vLLM does the same)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        if self.enable_chunked_prefill or max_model_len is None:
            return worker_default
        return max(worker_default, max_model_len)

    @property
    def is_null_model(self) -> bool:
        return self.model == NULL_MODEL

    @property
    def num_local_ranks(self) -> int:
        """Ranks the core starts as its own children: 0..num_local_ranks-1."""
        if self.num_local_workers is None:
            return self.tensor_parallel_size
        return self.num_local_workers

    @property
    def remote_ranks(self) -> range:
        """Ranks that join from other hosts over TCP at `worker_address`."""
        return range(self.num_local_ranks, self.tensor_parallel_size)

    def _check_worker_placement(self) -> None:
        tp = self.tensor_parallel_size
        _check(
            self.num_local_workers is None or 0 <= self.num_local_workers <= tp,
            f"num_local_workers must be in [0, tensor_parallel_size={tp}], "
            f"got {self.num_local_workers}",
        )
        if self.dist_init_address is not None:
            parse_tcp_address(self.dist_init_address, "dist_init_address")
        if not self.remote_ranks:
            _check(
                self.worker_address is None,
                f"worker_address={self.worker_address!r} is set, but every rank is local "
                f"(num_local_workers={self.num_local_ranks}, tensor_parallel_size={tp}); "
                "lower num_local_workers to have the other ranks join over TCP",
            )
            return
        _check(
            self.worker_address is not None,
            f"{describe_ranks(self.remote_ranks)} of {tp} run on other hosts "
            f"(num_local_workers={self.num_local_ranks} < tensor_parallel_size={tp}), so "
            "worker_address (tcp://HOST:PORT for the core to listen on) must be set",
        )
        host, _ = parse_tcp_address(self.worker_address, "worker_address")
        _check(
            self.data_parallel_size == 1,
            "workers on other hosts join one engine core (one worker_address), so "
            f"data_parallel_size must be 1 with num_local_workers < tensor_parallel_size, "
            f"got {self.data_parallel_size}",
        )
        if self.dist_init_address is not None:
            return
        _check(
            self.num_local_ranks > 0,
            "num_local_workers=0 puts rank 0, whose host serves the torch.distributed "
            "rendezvous, on another host: set dist_init_address=tcp://RANK0_HOST:PORT",
        )
        _check(
            not is_wildcard_host(host),
            f"worker_address={self.worker_address!r} listens on every interface, so it names "
            "no address the other hosts can reach for the torch.distributed rendezvous: set "
            "dist_init_address=tcp://HOST:PORT (HOST an address of this host they reach), or "
            "listen on that address",
        )

    def _check_ray_placement(self) -> None:
        """With the "ray" backend Ray places every rank and the core picks both addresses."""
        for name in ("distributed_executor_backend", "data_parallel_backend"):
            value = getattr(self, name)
            _check(
                value in EXECUTOR_BACKENDS,
                f"{name} must be one of {EXECUTOR_BACKENDS}, got {value!r}",
            )
        strategy = self.ray_placement_strategy
        _check(
            strategy in RAY_PLACEMENT_STRATEGIES,
            f"ray_placement_strategy must be one of {RAY_PLACEMENT_STRATEGIES}, got {strategy!r}",
        )
        _check(
            self.ray_cpus_per_worker >= 1,
            f"ray_cpus_per_worker must be at least 1, got {self.ray_cpus_per_worker}",
        )
        _check(
            self.data_parallel_backend == "mp" or self.distributed_executor_backend == "ray",
            "data_parallel_backend='ray' places each replica's workers with Ray too: set "
            f"distributed_executor_backend='ray', got {self.distributed_executor_backend!r}",
        )
        if self.distributed_executor_backend != "ray":
            return
        for name in ("num_local_workers", "worker_address", "dist_init_address"):
            value = getattr(self, name)
            _check(
                value is None,
                f"{name}={value!r} is set, but with distributed_executor_backend='ray' Ray "
                "places every rank and the engine core chooses the addresses: leave it unset",
            )

    def to_b64(self) -> str:
        """Base64 msgpack, safe to pass as one argv element."""
        return base64.b64encode(msgspec.msgpack.encode(self)).decode("ascii")

    @classmethod
    def from_b64(cls, text: str) -> EngineConfig:
        """Inverse of `to_b64`; raises ValueError on anything that is not a valid config."""
        try:
            return msgspec.msgpack.decode(base64.b64decode(text, validate=True), type=cls)
        except (ValueError, msgspec.DecodeError) as exc:
            raise ValueError(f"invalid encoded EngineConfig: {exc}") from exc

    @classmethod
    def add_cli_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Adds one `--field-name` flag per field (default: unset, so the config default wins),
        except the INTERNAL_FIELDS the engine sets itself."""
        for field in msgspec.structs.fields(cls):
            if field.name in INTERNAL_FIELDS:
                continue
            flag = "--" + field.name.replace("_", "-")
            help_text = f"{FIELD_HELP.get(field.name, '')} (default: {field.default})".lstrip()
            if field.type is bool:
                parser.add_argument(
                    flag, action=argparse.BooleanOptionalAction, default=None, help=help_text
                )
            elif field.name in LIST_FIELDS:
                parser.add_argument(flag, nargs="*", default=None, metavar="N", help=help_text)
            else:
                parser.add_argument(flag, default=None, metavar=field.name.upper(), help=help_text)

    @classmethod
    def from_cli_args(
        cls, args: argparse.Namespace, base: EngineConfig | None = None
    ) -> EngineConfig:
        """`base` (or the defaults) with every flag the user set applied; "none" unsets a field.
        A value its field cannot take is a ValueError naming the flag and the value."""
        values: dict[str, Any] = msgspec.structs.asdict(base) if base is not None else {}
        for field in msgspec.structs.fields(cls):
            value = getattr(args, field.name, None)
            if value is not None:
                values[field.name] = _field_value(field, value)
        return cls(**values)


# Fields the engine fills in for its own processes, never a user's flag.
INTERNAL_FIELDS = frozenset({"data_parallel_rank"})

# vLLM's other names of dtypes: "auto" is None (the engine picks per device).
DTYPE_ALIASES = {"auto": None, "half": "float16", "float": "float32"}

# Token counts whose flag takes vLLM's human-readable integers (16k, 16K) and "auto" (None).
HUMAN_READABLE_INT_FIELDS = frozenset({"max_model_len", "max_num_batched_tokens"})

# Fields whose flag takes a list of values, space- or comma-separated (`--cuda-graph-sizes 1 2 4`).
LIST_FIELDS = frozenset({"cuda_graph_sizes"})

# Fields whose flag takes a JSON object, each with the parser that validates it.
JSON_FIELDS = {
    "speculative_config": SpeculativeConfig.parse,
    "kv_transfer_config": KVTransferConfig.parse,
}

FIELD_HELP = {
    "model": "HF folder or .gguf file (None: the default SmolLM2-135M-Instruct; 'null': no model)",
    "device": "auto, cpu or cuda",
    "dtype": (
        "auto, float32 (float), float16 (half) or bfloat16 (auto or None: bfloat16 on CUDA and "
        "on CPUs with avx512_bf16 or AMX, float32 on other CPUs and with --quantization gguf)"
    ),
    "quantization": (
        "gguf: compute a GGUF file's quantized weights (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) from their "
        "blocks on the CPU, the weights' memory the file's size (None: the same for a GGUF file "
        "on a CPU whose kernels are the AVX2 build, unless --dtype, LoRA, speculative decoding, "
        "tensor parallelism or --enforce-eager is asked; otherwise dequantize them at load)"
    ),
    "block_size": "tokens per KV cache block",
    "max_num_seqs": "most requests running in one step",
    "max_num_batched_tokens": (
        "token budget of one step; longer prompts are chunked; 8k = 8,000, 8K = 8,192 (None: "
        "2048 on CUDA, 1024 on CPU)"
    ),
    "max_model_len": "context window; 16k = 16,000, 16K = 16,384 (auto or None: the model's)",
    "gpu_memory_utilization": "share of GPU memory the worker may use",
    "num_gpu_blocks_override": "exact number of KV blocks, instead of profiling",
    "enable_prefix_caching": "reuse the KV of shared prompt prefixes",
    "tensor_parallel_size": "worker processes (devices) to shard the model over",
    "data_parallel_size": (
        "engine cores, each with its own workers, behind this frontend; prompts go to the core "
        "holding their prefix, else the least loaded"
    ),
    "data_parallel_rank": "which of the data-parallel engine cores this is (set by the frontend)",
    "num_local_workers": (
        "ranks started here (0..K-1); the others join from other hosts at --worker-address "
        "(None: every rank)"
    ),
    "worker_address": "tcp://HOST:PORT to listen on for workers on other hosts",
    "dist_init_address": (
        "tcp://HOST:PORT of torch.distributed's rendezvous on rank 0's host (None: 127.0.0.1, "
        "or --worker-address's host when ranks are remote; a free port)"
    ),
    "long_prefill_token_threshold": "most prompt tokens one request gets per step (0: no cap)",
    "enable_chunked_prefill": (
        "split long prompts over several steps; off, a prompt is prefilled in one step, so "
        "max_num_batched_tokens must be at least max_model_len"
    ),
    "policy": "fcfs or priority",
    "seed": "engine seed",
    "startup_timeout_s": "seconds to wait for workers to load and profile (with "
    "--frontend-address: for an engine core to connect)",
    "step_timeout_s": "seconds to wait for one step's result",
    "shutdown_timeout_s": "seconds a stop waits: for running requests to finish (core-serve), "
    "and for each process to exit cleanly before it is killed",
    "max_frame_bytes": "largest accepted request frame",
    "disable_hybrid_kv_cache": (
        "one KV cache group of every layer: sliding-window layers keep their whole context's KV"
    ),
    "distributed_executor_backend": (
        "mp: workers are the core's processes (and --worker-address joins); ray: Ray places "
        "each rank as an actor on a placement group's bundle (RAY_ADDRESS, else a local Ray)"
    ),
    "data_parallel_backend": (
        "mp: engine cores are this frontend's processes; ray: each replica (core and workers) "
        "is placed by Ray (needs --distributed-executor-backend ray)"
    ),
    "ray_placement_strategy": "PACK, SPREAD, STRICT_PACK or STRICT_SPREAD: how Ray places ranks",
    "ray_cpus_per_worker": "CPUs in a CPU worker's Ray bundle: its torch threads",
    "speculative_config": (
        'JSON, vLLM\'s: {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": N} '
        'or {"method": "suffix"} (None: no speculative decoding)'
    ),
    "kv_transfer_config": (
        'JSON, vLLM\'s: {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", '
        '"kv_connector_extra_config": {"disk_size_gib": 16}}, or {"kv_connector": "TcpConnector", '
        '"kv_role": "kv_producer"} (or kv_consumer, kv_both) for prefill/decode disaggregation '
        "(None: no connector; --kv-offloading-size alone implies the OffloadingConnector)"
    ),
    "kv_offloading_size": (
        "GiB of host memory (all tensor-parallel ranks together) keeping KV blocks that leave "
        "the pool, for later prefix hits (None: no offloading)"
    ),
    "kv_offloading_path": (
        "folder of a disk tier below the host tier, kept across restarts when "
        "CORE_ENGINE_PREFIX_HASH_SEED fixes the block hash seed"
    ),
    "enable_lora": "serve LoRA adapters beside the base model (requests name them in `model`)",
    "max_loras": "most distinct LoRA adapters in one step's batch (others wait, in order)",
    "max_lora_rank": "largest LoRA rank an adapter may have",
    "max_cpu_loras": (
        "LoRA adapters each worker keeps loaded in host memory, least recently used evicted "
        "(None: max_loras)"
    ),
    "async_scheduling": (
        "plan step N+1 while the workers run step N (vLLM's async scheduling): the host's "
        "scheduling and IPC leave the step's critical path"
    ),
    "enforce_eager": (
        "run every step eagerly: no CUDA graphs on a GPU; on a CPU plain torch ops only, no C "
        "kernels (matmuls, attention, fused ops)"
    ),
    "cuda_graph_sizes": (
        "batch sizes whose decode steps are captured as CUDA graphs, a smaller batch padded to "
        "the next one, a larger one eager (None: 1 2 4 8 16 24 ... max_num_seqs, or the step "
        "budget if smaller; no values: none)"
    ),
}


def _field_value(field: msgspec.structs.FieldInfo, text: Any) -> Any:
    """A flag's value converted to its field's type; ValueError naming the flag and value."""
    flag = "--" + field.name.replace("_", "-")
    try:
        if text in ("none", "None"):
            return None
        if field.name in LIST_FIELDS:
            items = [item for part in text for item in part.split(",") if item]
            return msgspec.convert(items, field.type, strict=False)
        if field.name in JSON_FIELDS:
            return msgspec.structs.asdict(JSON_FIELDS[field.name](text))
        if field.name in HUMAN_READABLE_INT_FIELDS and isinstance(text, str):
            return None if text == "auto" else parse_human_readable_int(text)
        return msgspec.convert(text, field.type, strict=False)
    except msgspec.ValidationError as exc:
        expected = str(exc).split(" - at ")[0]
        raise ValueError(f"{flag} {text!r}: {expected}") from None
    except ValueError as exc:
        raise ValueError(f"{flag} {text!r}: {exc}") from None


def describe_ranks(ranks: Sequence[int]) -> str:
    """ "rank 3", "ranks 1..3" for a run, "ranks 1, 3" otherwise."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}..{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
