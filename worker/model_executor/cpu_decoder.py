"""A decode step with little Python: a Llama-family model from its token ids to its final norm
in one C call.

`CpuDecoderStack.of(model)` describes the embedding and the layers to
`kernels/cpu/decode_layers.c` once, at load, when every layer is a plain pre-norm Llama layer
whose parts the C driver calls the same kernels for: RMSNorm weights in float32, linears on the
GGUF-block or float32 kernels, a SiLU MLP, no q/k norm, no sliding window, one tensor-parallel
rank, an embedding of float32 rows or one GGUF segment. `run` takes a step whose attention is
all the decode kernel's (every request's query short: a decode step, small chunks) over float32
caches and returns None for the others, which the Python layers run.

The C driver calls the entry points the Python layers call, with the same arguments and thread
count, and reads the rotary angles from the table `RotaryEmbedding` indexes on a CPU, so its
output is the Python layers' bit for bit (tests/worker/test_cpu_decoder.py); it only leaves out
the per-call tensor bookkeeping, which at batch 1 costs more than the kernels. Its scratch rows
and step struct are kept across steps, so a step allocates only its output.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch
from torch import nn

from core_engine.kernels.attention_metadata import AttentionMetadata
from core_engine.kernels.cpu import decode_layers as c_decode
from core_engine.kernels.cpu import kernel_loader as cpu_kernel_loader
from core_engine.kernels.cpu.attention_args import AttentionArgs
from core_engine.kernels.cpu.backend import (
    DecodeKernelRoute,
    decode_kernel_plan,
    decode_kernel_route,
)
from core_engine.worker.model_executor.layers import RMSNorm, SiluAndMul

FLOAT32 = torch.float32


class CpuDecoderStack:
    """The C description of a model's embedding and decoder layers; `run` runs one step.

    Invariant: the model's weights outlive this object (the structs hold their addresses).
    """

    def __init__(self, model: nn.Module, structs: ctypes.Array, embedding: dict) -> None:
        layers = list(model.layers)
        first = layers[0].self_attn
        proj = first.qkv_proj
        self.num_q_heads, self.num_kv_heads = proj.num_heads, proj.num_kv_heads
        self.head_dim = first.head_dim
        self.hidden_size = layers[0].input_layernorm.weight.shape[0]
        self.intermediate_size = layers[0].mlp.gate_up_proj.output_size_per_rank // 2
        self.rotary = model.rotary_emb
        self.layer_structs = structs
        self.stack = c_decode.DecoderStack(
            layers=ctypes.addressof(structs),
            num_layers=len(layers),
            hidden_size=self.hidden_size,
            num_q_heads=self.num_q_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            rms_norm_eps=layers[0].input_layernorm.eps,
            attention_scale=first.scale,
            final_norm=model.norm.weight.data_ptr(),
            **embedding,
        )
        self._bound_caches: list = []  # the bound caches' addresses, then shape and dtype
        self._route: DecodeKernelRoute | None = None
        self._scratch = StepScratch(self._scratch_widths())
        self._step = c_decode.DecodeStep()
        # The LoRA step the layers' adapters read (None without LoRA): its token slots go to
        # the driver, which adds each linear's adapters as the Python layers do.
        lora = first.qkv_proj.lora
        self.lora_step = lora.step if lora is not None else None
        # Set by benchmarks.micro.profile_step: a (c_double * len(PART_NAMES)) array the C
        # driver adds each part's seconds to.
        self.part_seconds: ctypes.Array | None = None

    @staticmethod
    def of(model: nn.Module) -> CpuDecoderStack | None:
        """The stack of a Llama-family decoder `model` (`embed_tokens`, `layers` packed for
        the CPU, `norm`, `rotary_emb`), or None when the C kernels are not loaded or any part
        is not one the C driver runs (every norm an RMSNorm of float32 weights and the first
        one's eps; a float32 embedding of one rank, as float32 rows or one GGUF segment)."""
        library = cpu_kernel_loader.load()
        layers = list(model.layers)
        if library is None or not layers or not c_decode.layout_matches(library):
            return None
        eps = layers[0].input_layernorm.eps
        norms = [model.norm, *(n for layer in layers for n in _layer_norms(layer))]
        if not all(type(n) is RMSNorm and _is_float32(n.weight) and n.eps == eps for n in norms):
            return None
        embedding = _embedding_fields(model.embed_tokens)
        if embedding is None:
            return None
        structs = (c_decode.DecoderLayer * len(layers))()
        for struct, layer in zip(structs, layers, strict=True):
            if not _describe_layer(layer, struct):
                return None
        return CpuDecoderStack(model, structs, embedding)

    def takes(
        self,
        input_ids: torch.Tensor,
        kv_caches: Sequence[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> bool:
        """Whether `run` takes this step: int64 token ids on the CPU, float32 caches,
        attention that is all the decode kernel's, and adapters (if any token runs one) added
        by the shrink/expand kernel, as the Python layers would."""
        return self._plan(input_ids, kv_caches, metadata) is not None

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor | None:
        """The model from the step's int64 `input_ids` [T] at `positions` [T] to the final
        norm's output [T, hidden], as LlamaModel.forward's Python layers give it, for a step
        it `takes`; None (and nothing computed) for any other. IndexError for a token id
        outside the vocabulary, ValueError for a position the step's max_seq_len does not
        cover (the caches untouched)."""
        plan = self._plan(input_ids, kv_caches, metadata)
        if plan is None:
            return None
        if positions.shape != input_ids.shape or not _is_int64(positions):
            raise ValueError("positions must be int64 [T] like the step's token ids")
        tokens = input_ids.shape[0]
        scratch = self._scratch.rows(tokens)
        step = self._fill_step(input_ids, positions, metadata, plan, scratch)
        out = torch.empty(tokens, self.hidden_size, dtype=FLOAT32)
        status = cpu_kernel_loader.load().decode_layers(
            ctypes.byref(self.stack),
            ctypes.byref(step),
            scratch.residual,
            scratch.normed,
            scratch.projected,
            out.data_ptr(),
        )
        if status != 0:
            raise self._error(status, input_ids, positions)
        return out

    def _error(self, status: int, input_ids: torch.Tensor, positions: torch.Tensor) -> Exception:
        """The exception for a failed driver call, naming the value and the limit."""
        if status == c_decode.ERROR_TOKEN_ID:
            limit = self.stack.vocab_rows
            bad = input_ids[(input_ids < 0) | (input_ids >= limit)][0]
            return IndexError(f"token id {int(bad)} is outside the vocabulary [0, {limit})")
        if status == c_decode.ERROR_POSITION:
            limit = self._step.angle_rows
            bad = positions[(positions < 0) | (positions >= limit)][0]
            return ValueError(
                f"position {int(bad)} is outside the rotary angle table's [0, {limit}) (the "
                "step's max_seq_len sizes it)"
            )
        return MemoryError("CPU attention could not allocate its scores")

    def _fill_step(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata, plan, scratch
    ) -> c_decode.DecodeStep:
        """The kept step struct, pointed at this step's tokens, angles, slots, attention
        plan and scratch rows."""
        tokens = input_ids.shape[0]
        angle_cos, angle_sin = self.rotary.angle_table(metadata.max_seq_len)
        step = self._step
        step.num_tokens = tokens
        step.token_ids = input_ids.data_ptr()
        step.positions = positions.data_ptr()
        step.slot_mapping = metadata.slot_mapping.data_ptr()
        step.angle_cos, step.angle_sin = angle_cos.data_ptr(), angle_sin.data_ptr()
        step.angle_rows = angle_cos.shape[0]
        step.num_threads = torch.get_num_threads()
        self._set_attention(step.attention, plan, step.num_threads)
        step.attention_scratch_floats = plan.max_query_x_seq_len * self.num_q_heads
        timing = self.part_seconds
        step.part_seconds = None if timing is None else ctypes.addressof(timing)
        step.lora_token_slots = self._lora_token_slots(tokens)
        for name, address in scratch.step_fields.items():
            setattr(step, name, address)
        return step

    def _scratch_widths(self) -> dict[str, int]:
        """Float32 values per token of each scratch buffer the driver writes."""
        q_width = self.num_q_heads * self.head_dim
        return {
            "qkv": q_width + 2 * self.num_kv_heads * self.head_dim,
            "query": q_width,
            "attended": q_width,
            "gate_up": 2 * self.intermediate_size,
            "activation": self.intermediate_size,
            "cos": self.head_dim // 2,
            "sin": self.head_dim // 2,
            "residual": self.hidden_size,
            "normed": self.hidden_size,
            "projected": self.hidden_size,
        }

    def _lora_token_slots(self, num_tokens: int) -> int | None:
        """The address of the step's int32 token slots when some token runs an adapter."""
        step = self.lora_step
        if step is None or not step.active:
            return None
        if step.token_slots.shape != (num_tokens,) or step.token_slots.dtype != torch.int32:
            raise ValueError("the LoRA step's token slots do not match the step's tokens")
        return step.token_slots.data_ptr()

    def _plan(self, input_ids: torch.Tensor, kv_caches, metadata):
        """The attention plan when the driver takes a step of these token ids over these
        caches (bound to the structs on the way), else None."""
        if not (input_ids.dim() == 1 and _is_int64(input_ids) and _is_int64(metadata.slot_mapping)):
            return None
        if self.lora_step is not None and self.lora_step.runs_matmul(input_ids.shape[0]):
            return None
        route = self._bind(kv_caches)
        return None if route is None else decode_kernel_plan(metadata, route)

    def _bind(self, kv_caches: Sequence[torch.Tensor]) -> DecodeKernelRoute | None:
        """Points each layer's struct at its cache and the step at the caches' shape, when the
        driver takes them (one float32 contiguous cache per layer, all of one shape, that the
        decode kernel reads); their attention route, or None. Only when the caches change
        (their addresses, or the first one's shape and dtype: a model's caches are allocated
        and replaced together) does this do more than compare them."""
        addresses = list(map(torch.Tensor.data_ptr, kv_caches))
        if addresses:
            addresses += (kv_caches[0].shape, kv_caches[0].dtype)
        if addresses == self._bound_caches:
            return self._route
        self._bound_caches, self._route = [], None
        if len(kv_caches) != self.stack.num_layers or not _one_float32_shape(kv_caches):
            return None
        route = decode_kernel_route(self.num_q_heads, kv_caches[0])
        if route is None:
            return None
        for struct, address in zip(self.layer_structs, addresses[: len(kv_caches)], strict=True):
            struct.kv_cache = address
        attention = self._step.attention
        _, num_cache_blocks, block_size, num_kv_heads, head_dim = kv_caches[0].shape
        attention.num_cache_blocks, attention.block_size = num_cache_blocks, block_size
        attention.num_kv_heads, attention.head_dim = num_kv_heads, head_dim
        attention.num_q_heads = self.num_q_heads
        attention.scale = self.stack.attention_scale
        self._bound_caches, self._route = addresses, route
        return route

    @staticmethod
    def _set_attention(attention: AttentionArgs, plan, num_threads: int) -> None:
        """The step's part of the attention arguments every layer shares (query, out and the
        cache are set per layer by the driver; the shapes by `_bind`), as
        backend.paged_attention fills them."""
        attention.block_table = plan.block_table.data_ptr()
        attention.seq_lens = plan.seq_lens.data_ptr()
        attention.query_start = plan.query_start.data_ptr()
        attention.requests = plan.short_requests.data_ptr()
        attention.block_table_stride = plan.block_table.shape[1]
        attention.num_requests = len(plan.short_requests)
        attention.num_threads = num_threads


class StepScratch:
    """The float32 rows the driver writes during a step, kept across steps: one buffer per name
    with room for the most tokens a step has had (regrown, never shrunk), of which the driver
    uses the first T rows."""

    def __init__(self, widths: dict[str, int]) -> None:
        self.widths = widths
        self.capacity = 0
        self.buffers: dict[str, torch.Tensor] = {}
        self.step_fields: dict[str, int] = {}
        self.residual = self.normed = self.projected = 0

    def rows(self, num_tokens: int) -> StepScratch:
        """Itself, with room for `num_tokens` rows in every buffer."""
        if num_tokens > self.capacity:
            self.capacity = max(num_tokens, 2 * self.capacity)
            self.buffers = {
                name: torch.empty(self.capacity, width, dtype=FLOAT32)
                for name, width in self.widths.items()
            }
            addresses = {name: buffer.data_ptr() for name, buffer in self.buffers.items()}
            self.residual = addresses.pop("residual")
            self.normed = addresses.pop("normed")
            self.projected = addresses.pop("projected")
            self.step_fields = addresses
        return self


def _describe_layer(layer: nn.Module, struct: c_decode.DecoderLayer) -> bool:
    """Fills `struct` from a LlamaDecoderLayer; False when a part is not the driver's."""
    attention, mlp = layer.self_attn, layer.mlp
    norms = _layer_norms(layer)
    if attention.q_norm is not None or attention.sliding_window is not None:
        return False
    if type(mlp.act_fn) is not SiluAndMul or attention.o_proj.tp_size != 1:
        return False
    projections = {
        "qkv": (attention.qkv_proj, False),
        "o": (attention.o_proj, False),
        "gate_up": (mlp.gate_up_proj, mlp.gate_up_proj.fuses_silu_and_mul),
        "down": (mlp.down_proj, False),
    }
    for name, (projection, fuses) in projections.items():
        if projection.bias is not None and not _is_float32(projection.bias):
            return False
        linear = c_decode.linear_of(projection.kernel_weight, projection.bias, fuses)
        if linear is None:
            return False
        lora = projection.lora
        if lora is not None:
            if not (_is_float32(lora.lora_a) and _is_float32(lora.lora_b)):
                return False
            c_decode.add_lora_slots(linear, lora.lora_a, lora.lora_b)
        setattr(struct, name, linear)
    struct.input_norm = norms[0].weight.data_ptr()
    struct.post_attention_norm = norms[1].weight.data_ptr()
    return True


def _layer_norms(layer: nn.Module) -> tuple[nn.Module, nn.Module]:
    return layer.input_layernorm, layer.post_attention_layernorm


def _embedding_fields(embedding: nn.Module) -> dict | None:
    """DecoderStack's embedding fields for a VocabParallelEmbedding of one rank, or None
    where its rows are not float32 (the model's dtype) or span several GGUF segments."""
    if getattr(embedding, "tp_size", None) != 1 or embedding.weight.dtype != FLOAT32:
        return None
    gguf = embedding.gguf_weight
    if gguf is None:
        if not _is_float32(embedding.weight):
            return None
        return {
            "embedding_type": c_decode.EMBEDDING_F32,
            "embedding_rows": embedding.weight.data_ptr(),
            "vocab_rows": embedding.weight.shape[0],
        }
    if len(gguf.segments) != 1:
        return None
    segment = gguf.segments[0]
    return {
        "embedding_type": segment.type_id,
        "embedding_blocks": segment.blocks.data_ptr(),
        "vocab_rows": segment.num_rows,
    }


def _is_float32(tensor: torch.Tensor) -> bool:
    return tensor.dtype == FLOAT32 and tensor.is_cpu and tensor.is_contiguous()


def _one_float32_shape(kv_caches: Sequence[torch.Tensor]) -> bool:
    shape = kv_caches[0].shape
    return all(_is_float32(cache) and cache.shape == shape for cache in kv_caches)


def _is_int64(tensor: torch.Tensor) -> bool:
    return tensor.dtype == torch.int64 and tensor.is_cpu and tensor.is_contiguous()


def enable_cpu_decoder(model: nn.Module) -> bool:
    """Gives a packed CPU causal LM's decoder (`model.model`, where it has layers the driver
    can describe) its C stack; whether it got one."""
    decoder = getattr(model, "model", None)
    return hasattr(decoder, "enable_cpu_decoder") and decoder.enable_cpu_decoder()
