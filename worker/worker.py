"""`Worker`: one device's model, KV cache and model runner, driven one scheduler step at a time."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from core_engine.common.config_error import ConfigError
from core_engine.common.dtypes import DTYPE_NAMES, torch_dtype
from core_engine.common.kv_cache_groups import KVCacheGroup, group_layers, layers_per_group
from core_engine.common.math_utils import cdiv
from core_engine.kernels import can_capture_cuda_graphs
from core_engine.kernels.cpu import kernel_loader as cpu_kernel_loader
from core_engine.kernels.cpu.huge_pages import empty_on_huge_pages
from core_engine.kernels.cuda.warmup import warmup
from core_engine.proto import ModelRunnerOutput, SchedulerOutput, WorkerReady
from core_engine.proto.engine_config import DEVICES, EngineConfig
from core_engine.proto.kv_transfer import KVConnectorHandshake
from core_engine.proto.lora_request import LoRATargetShapes
from core_engine.worker.cpu_features import default_cpu_dtype
from core_engine.worker.decode_graphs import CudaGraphCapture, resolve_capture_sizes
from core_engine.worker.kv_connector.kv_block_layout import KVBlockLayout
from core_engine.worker.kv_connector.kv_connector_factory import make_kv_connector_worker
from core_engine.worker.kv_connector.kv_connector_worker import (
    KVConnectorWorker,
    execute_with_connector,
)
from core_engine.worker.lora.lora_manager import LoRAManager
from core_engine.worker.memory_profiler import (
    cpu_kv_cache_bytes,
    cuda_graph_bytes,
    cuda_kv_cache_bytes,
)
from core_engine.worker.model_executor.cpu_decoder import enable_cpu_decoder
from core_engine.worker.model_executor.cpu_linear import model_weight_bytes, pack_linears
from core_engine.worker.model_runner import ModelRunner
from core_engine.worker.parallel_state import init_distributed
from core_engine.worker.quantization_choice import resolve_quantization
from core_engine.worker.structured_outputs import StructuredOutputManager

logger = logging.getLogger(__name__)

DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cuda": 2048, "cpu": 1024}
"""Step token budget when none is given, by device type. A CPU prefills slowly, so a step of
thousands of tokens holds every running request for a long time; a smaller one returns a burst's
first tokens a step sooner and stalls decodes less, while its matmuls still have enough rows to
run at full speed (see benchmarks/results/linears.md)."""


class Worker:
    """A `WorkerProtocol` for a real model. Lifecycle: `load_model()` -> `determine_num_available_blocks()` -> `initialize_cache(n)`
    -> `execute_model(scheduler_output)` per step.

    `initialize_cache` may be called again to start over with a fresh KV cache and no request
    state (the model stays loaded). With `world_size > 1` each rank holds a tensor-parallel
    shard: `load_model` joins the process group (`worker.parallel_state.init_distributed`,
    rendezvous from `MASTER_ADDR`/`MASTER_PORT`) unless the caller already did, and from then on
    every rank must get the same calls in the same order (each forward runs collectives).
    Every rank sees full logits and samples, but only rank 0's samples are meant to be used;
    other ranks take token history from `CachedRequestData.new_token_ids`, or under async
    scheduling from their own samples, which equal rank 0's (the same logits, sampler seed and
    request generators on every rank).
    `kv_cache_memory_bytes` replaces the CPU KV budget (default min(4 GiB, 40% of MemAvailable)).
    The config's `max_num_batched_tokens` None takes DEFAULT_MAX_NUM_BATCHED_TOKENS for the device,
    raised to max_model_len (once known, in `load_model`) when chunked prefill is off.
    """

    def __init__(
        self,
        config: EngineConfig,
        rank: int = 0,
        world_size: int = 1,
        device_index: int | None = None,
        kv_cache_memory_bytes: int | None = None,
    ) -> None:
        """`config` is already validated (see `EngineConfig`); what is this worker's own:
        its tensor-parallel `rank` of `world_size`, `device_index` (which of the visible GPUs
        "cuda" means; default `rank`, and a data-parallel engine core's ranks come after the
        earlier cores' ranks) and the CPU KV budget `kv_cache_memory_bytes` (None: the default
        budget)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.config = config
        self.model_name = config.model
        self.device = resolve_device(config.device, rank if device_index is None else device_index)
        self.quantization = self._resolve_quantization()
        self.dtype = resolve_dtype(config.dtype, self.device, self.quantization)
        self.rank = rank
        self.world_size = world_size
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.step_token_budget(self._default_step_budget)
        self.kv_cache_memory_bytes = kv_cache_memory_bytes
        self.model = None
        self.model_path: Path | None = None
        self.model_config = None
        self.model_runner: ModelRunner | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.kv_connector: KVConnectorWorker | None = None
        self._max_model_len: int | None = None
        self.decodes_in_c = False  # decode steps run the layers in one C call (cpu_decoder.py)
        self.lora_manager: LoRAManager | None = None

    def _resolve_quantization(self) -> str | None:
        """`--quantization`, or the default `resolve_quantization` picks for the model (None
        where the model cannot be found: loading it says why)."""
        from core_engine.common.model_files import resolve_model_path

        if self.config.quantization is not None or self.device.type != "cpu":
            return self.config.quantization
        try:
            path = resolve_model_path(self.model_name)
        except (FileNotFoundError, ValueError):
            return None
        return resolve_quantization(self.config, self.device, path)

    def load_model(self) -> None:
        """Resolves the model path, loads this rank's weights (on a CPU, linears pre-packed for
        oneDNN), fixes max_model_len."""
        from core_engine.common.model_files import resolve_model_path
        from core_engine.worker.model_executor.model_loader import load_model

        torch.manual_seed(self.config.seed)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        init_distributed(self.rank, self.world_size, self.device)
        path = self.model_path = resolve_model_path(self.model_name)
        self.model, self.model_config = load_model(
            path,
            self.device,
            self.dtype,
            tp_rank=self.rank,
            tp_size=self.world_size,
            quantization=self.quantization,
        )
        if self.device.type == "cpu":
            cpu_kernel_loader.set_enabled(not self.config.enforce_eager)
            pack_linears(self.model)
        if self.config.enable_lora:  # before the C decoder, which reads the adapters' slots
            self.lora_manager = LoRAManager(self.model, self.model_config, self.config, self.dtype)
        if self.device.type == "cpu":
            self.decodes_in_c = enable_cpu_decoder(self.model)
        self._max_model_len = self._resolve_max_model_len()
        self.max_num_batched_tokens = self.config.step_token_budget(
            self._default_step_budget, self._max_model_len
        )
        self.model_runner = self._new_model_runner()
        if self.device.type == "cuda":
            self._warm_up_attention_kernels()
        if self.config.kv_transfer_config is not None:
            self.kv_connector = make_kv_connector_worker(
                self.config, self.kv_block_layout, self.dtype, self.device
            )

    def describe(self, ready: WorkerReady, load_s: float) -> str:
        """The start-up log line: what runs where, and how much KV fits."""
        threads = f", {torch.get_num_threads()} threads" if self.device.type == "cpu" else ""
        kv_bytes = ready.num_gpu_blocks * self.bytes_per_block
        groups = self.kv_cache_groups
        if len(groups) == 1:
            blocks = f"{ready.num_gpu_blocks * ready.block_size} tokens"
        else:  # a token takes a block slot in every group: the pool holds no fixed token count
            windows = sorted({g.sliding_window for g in groups if g.sliding_window is not None})
            blocks = (
                f"{len(groups[0].layer_indices)} layers each, shared by {len(groups)} KV cache "
                f"groups (sliding windows {windows} and full attention)"
            )
        dtype = str(self.dtype).removeprefix("torch.")
        quantized = ""
        if self.quantization is not None:
            default = (
                " (the default for a GGUF file here)" if self.config.quantization is None else ""
            )
            quantized = f", {self.quantization} weights{default}"
        in_c = ", decode layers in one C call" if self.decodes_in_c else ""
        if self.lora_manager is not None:
            in_c += (
                f", LoRA: {self.lora_manager.num_slots} adapter slots of rank "
                f"{self.lora_manager.max_rank}"
            )
        weight_gib = model_weight_bytes(self.model) / 2**30
        return (
            f"worker rank {ready.rank}: {self.model_path} ({self.model_config.architecture}) on "
            f"{self.device}, {dtype}{quantized}{threads}{in_c}, weights {weight_gib:.3f} GiB "
            "resident, "
            f"loaded in {load_s:.1f} s; room for a KV cache of "
            f"{kv_bytes / 2**30:.2f} GiB = {ready.num_gpu_blocks} blocks of {ready.block_size} = "
            f"{blocks}"
        )

    @property
    def _default_step_budget(self) -> int:
        return DEFAULT_MAX_NUM_BATCHED_TOKENS[self.device.type]

    @property
    def max_model_len(self) -> int:
        """min(requested, the model's max_position_embeddings); known after load_model."""
        if self._max_model_len is None:
            raise RuntimeError("max_model_len is known only after load_model()")
        return self._max_model_len

    @property
    def lora_target_shapes(self) -> LoRATargetShapes | None:
        """The shapes an adapter's matrices must have (None: LoRA off)."""
        return self.lora_manager.shapes if self.lora_manager is not None else None

    @property
    def vocab_size(self) -> int:
        if self.model_config is None:
            raise RuntimeError("vocab_size is known only after load_model()")
        return self.model_config.vocab_size

    @property
    def eos_token_ids(self) -> list[int]:
        if self.model_config is None:
            raise RuntimeError("eos_token_ids are known only after load_model()")
        return list(self.model_config.eos_token_ids)

    @property
    def num_kv_heads(self) -> int:
        """KV heads held by this rank (replicated when there are fewer heads than ranks)."""
        return max(1, self.model_config.num_key_value_heads // self.world_size)

    @property
    def layer_sliding_windows(self) -> list[int | None]:
        """Per layer, its attention window (None: full attention)."""
        self._require_loaded()
        return self.model_config.layer_sliding_windows

    @property
    def kv_cache_groups(self) -> list[KVCacheGroup]:
        """How the layers share KV blocks (one group of every layer unless the model mixes
        attention windows, and hybrid groups are not disabled); the core derives the same groups
        from `layer_sliding_windows` and the same flag."""
        hybrid = not self.config.disable_hybrid_kv_cache
        return group_layers(self.layer_sliding_windows, hybrid=hybrid)

    @property
    def bytes_per_block(self) -> int:
        """KV bytes of one block: 2 (K, V) * block_size * heads * head_dim for each of the
        layers a block holds (every layer, or a KV cache group's)."""
        config = self.model_config
        elements = 2 * self.block_size * self.num_kv_heads * config.head_dim
        return elements * layers_per_group(self.kv_cache_groups) * self.dtype.itemsize

    @property
    def kv_block_layout(self) -> KVBlockLayout:
        """What one KV block of this rank holds (the offloading tiers' file layout)."""
        config = self.model_config
        return KVBlockLayout(
            model=f"{self.model_path.resolve()} ({config.architecture})",
            dtype=str(self.dtype).removeprefix("torch."),
            block_size=self.block_size,
            num_layers=config.num_hidden_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=config.head_dim,
            tp_rank=self.rank,
            tp_size=self.world_size,
        )

    @property
    def kv_connector_handshake(self) -> KVConnectorHandshake | None:
        """This rank's side of the KV connector (None without one); reads the disk tier."""
        return self.kv_connector.handshake() if self.kv_connector is not None else None

    def determine_num_available_blocks(self) -> int:
        """How many KV blocks fit: measured on CUDA after a dummy step, budgeted on CPU."""
        self._require_loaded()
        if self.device.type == "cuda":
            budget = cuda_kv_cache_bytes(
                self.device, self.config.gpu_memory_utilization, self._profile_peak_step
            )
            if self.cuda_graph_sizes:
                budget = self._budget_after_graphs(budget)
        else:
            budget = cpu_kv_cache_bytes(self.kv_cache_memory_bytes)
        return budget // self.bytes_per_block

    def initialize_cache(self, num_gpu_blocks: int) -> None:
        """Allocates per layer [2, num_gpu_blocks, block_size, num_kv_heads, head_dim] and a fresh
        model runner (no request state). The core's block pool has checked `num_gpu_blocks`."""
        self._require_loaded()
        self.kv_caches = []
        self.model_runner = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.kv_caches = self._allocate_kv_caches(num_gpu_blocks)
        self.model_runner = self._new_model_runner()
        self.model_runner.initialize_kv_cache(self.kv_caches)
        if self.cuda_graph_sizes:
            graphs = self.model_runner.capture_decode_graphs(
                self.cuda_graph_sizes, CudaGraphCapture(self.device)
            )
            logger.info(
                "worker rank %d: decode steps of up to %d requests replay CUDA graphs (%d sizes "
                "from %d), captured in %.1f s",
                self.rank,
                graphs.max_size,
                len(graphs.sizes),
                graphs.sizes[0],
                graphs.capture_s,
            )
        if self.kv_connector is not None:
            self.kv_connector.register_kv_caches(self.kv_caches)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.model_runner is None or not self.kv_caches:
            raise RuntimeError("execute_model called before initialize_cache()")
        return execute_with_connector(
            self.kv_connector, scheduler_output, self.model_runner.execute_model
        )

    @property
    def cuda_graph_sizes(self) -> list[int]:
        """Batch sizes whose decode steps replay CUDA graphs: none on a CPU, with
        `enforce_eager`, with LoRA (whose per-step adapter slots the graphs would freeze) or
        when attention runs on the torch reference backend (no CuPy), which reads on the host."""
        if (
            self.config.enforce_eager
            or self.config.enable_lora
            or not can_capture_cuda_graphs(self.device)
        ):
            return []
        # A decode step of B requests schedules B tokens: no step is larger than the budget.
        largest_batch = min(self.max_num_seqs, self.max_num_batched_tokens)
        return resolve_capture_sizes(self.config.cuda_graph_sizes, largest_batch)

    def _allocate_kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        """Layer i's cache [2, num_blocks, block_size, num_kv_heads, head_dim]. Layers at the
        same position of different KV cache groups share one tensor: their groups own
        different blocks of it."""
        config = self.model_config
        shape = (2, num_blocks, self.block_size, self.num_kv_heads, config.head_dim)
        # On CPU, untouched pages of an empty tensor cost no memory; attention reads only
        # slots it wrote, so garbage in unused slots is never seen. Huge pages spare the
        # scattered block reads of attention most TLB misses (kernels/cpu/huge_pages.py).
        groups = self.kv_cache_groups
        slot_tensors = [
            torch.zeros(shape, dtype=self.dtype, device=self.device)
            if self.device.type == "cuda"
            else empty_on_huge_pages(shape, self.dtype)
            for _ in range(layers_per_group(groups))
        ]
        layer_caches: list[torch.Tensor | None] = [None] * config.num_hidden_layers
        for group in groups:
            for position, layer_index in enumerate(group.layer_indices):
                layer_caches[layer_index] = slot_tensors[position]
        return layer_caches  # type: ignore[return-value]

    def _profile_peak_step(self) -> None:
        """A forward of max_num_batched_tokens into a scratch KV cache just big enough."""
        num_tokens = self.max_num_batched_tokens
        num_seqs = cdiv(num_tokens, self.max_model_len)
        num_blocks = cdiv(num_tokens, self.block_size) + num_seqs
        scratch = self._allocate_kv_caches(num_blocks)
        self.model_runner.dummy_forward(num_tokens, scratch)
        del scratch

    def _budget_after_graphs(self, budget: int) -> int:
        """The KV budget less the decode graphs' memory; raises when they take all of it."""
        graph_bytes = cuda_graph_bytes(self.device, self._profile_decode_graphs)
        if graph_bytes >= budget:
            raise RuntimeError(
                f"no memory left for the KV cache on {self.device}: the decode CUDA graphs "
                f"({len(self.cuda_graph_sizes)} sizes up to {self.cuda_graph_sizes[-1]}) take "
                f"{graph_bytes / 2**30:.2f} GiB of the {budget / 2**30:.2f} GiB left; pass fewer "
                "--cuda-graph-sizes, --enforce-eager, or raise gpu_memory_utilization"
            )
        return budget - graph_bytes

    def _profile_decode_graphs(self) -> object:
        """The decode graphs captured over a one-block scratch KV cache (the padding rows'
        block 0 is all they read); the caller measures their memory while it holds them."""
        runner = self._new_model_runner()
        runner.initialize_kv_cache(self._allocate_kv_caches(1))
        runner.capture_decode_graphs(self.cuda_graph_sizes, CudaGraphCapture(self.device))
        return runner

    def _warm_up_attention_kernels(self) -> None:
        """Compiles every attention kernel configuration now, so no request pays for NVRTC."""
        config = self.model_config
        warmup(
            self.device,
            self.dtype,
            num_heads=config.num_attention_heads // self.world_size,
            num_kv_heads=self.num_kv_heads,
            head_dim=config.head_dim,
            block_size=self.block_size,
        )

    def _new_model_runner(self) -> ModelRunner:
        return ModelRunner(
            self.model,
            device=self.device,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            max_num_reqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            eos_token_ids=self.eos_token_ids,
            seed=self.config.seed,
            structured_outputs=StructuredOutputManager(
                self.model_path, self.vocab_size, self.eos_token_ids
            ),
            kv_cache_groups=self.kv_cache_groups,
            lora_manager=self.lora_manager,
            async_scheduling=self.config.async_scheduling,
        )

    def _resolve_max_model_len(self) -> int:
        model_max = self.model_config.max_position_embeddings
        requested = self.config.max_model_len
        if requested is None:
            return model_max
        if requested > model_max:
            raise ConfigError(
                f"max_model_len={requested} exceeds the model's context length "
                f"(max_position_embeddings={model_max}); pass max_model_len <= {model_max}"
            )
        return requested

    def _require_loaded(self) -> None:
        if self.model is None:
            raise RuntimeError("call load_model() first")


def resolve_device(device: str, rank: int = 0) -> torch.device:
    """ "auto" -> cuda if available else cpu; "cuda" -> GPU `rank` of those this host shows
    (ValueError when it shows fewer; ranks never share a GPU); "cuda:N" as given."""
    name = device.split(":", 1)[0]
    if name not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES} (or 'cuda:N'), got {device!r}")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"device {device!r} was requested but torch sees no CUDA GPU "
            f"(torch {torch.__version__}, torch.cuda.is_available() is False); "
            "use device='cpu' or 'auto'"
        )
    if ":" in device:
        return torch.device(device)
    num_gpus = torch.cuda.device_count()
    if rank >= num_gpus:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
        raise ConfigError(
            f"this worker needs GPU {rank} of its host (one GPU per rank: data_parallel_rank x "
            f"tensor_parallel_size + rank, or --local-rank for a worker started on another "
            f"host), but torch sees {num_gpus} (CUDA_VISIBLE_DEVICES={visible})"
        )
    return torch.device("cuda", rank)


def resolve_dtype(
    dtype: str | None, device: torch.device, quantization: str | None = None
) -> torch.dtype:
    """None -> float32 under quantization 'gguf' (its kernels take and give float32, and the
    decode layers run in one C call only in float32), else bfloat16 on CUDA and on CPUs with
    native bf16 (see `cpu_features`), float32 on other CPUs; otherwise the dtype of that name
    (`common.dtypes`)."""
    if dtype is None and quantization == "gguf":
        return torch.float32
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else default_cpu_dtype()
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {DTYPE_NAMES} or None, got {dtype!r}")
    return torch_dtype(dtype)
