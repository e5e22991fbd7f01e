"""A decode step with little Python: a Llama-family model's decoder layers in one C call.

`CpuDecoderStack.of(layers)` describes the layers to `kernels/cpu/decode_layers.c` once, at
load, when every one of them is a plain pre-norm Llama layer whose parts the C driver calls the
same kernels for: RMSNorm weights in float32, linears on the GGUF-block or float32 kernels, a
SiLU MLP, no q/k norm, no sliding window, one tensor-parallel rank. It `takes` a step whose
attention is all the decode kernel's (every request's query short: a decode step, small
chunks) over float32 caches; the Python layers run the others.

The C driver calls the entry points the Python layers call, with the same arguments and thread
count, so its output is the Python layers' bit for bit (tests/worker/test_cpu_decoder.py); it
only leaves out the per-call tensor bookkeeping, which at batch 1 costs more than the kernels.
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
from core_engine.kernels.cpu.backend import decode_kernel_plan
from core_engine.worker.model_executor.layers import RMSNorm, SiluAndMul

FLOAT32 = torch.float32


class CpuDecoderStack:
    """The C description of a model's decoder layers; `run` runs one step through them.

    Invariant: the layers' weights outlive this object (the structs hold their addresses).
    """

    def __init__(
        self, layers: Sequence[nn.Module], final_norm: nn.Module, structs: ctypes.Array
    ) -> None:
        first = layers[0].self_attn
        proj = first.qkv_proj
        self.num_q_heads, self.num_kv_heads = proj.num_heads, proj.num_kv_heads
        self.head_dim = first.head_dim
        self.hidden_size = layers[0].input_layernorm.weight.shape[0]
        self.intermediate_size = layers[0].mlp.gate_up_proj.output_size_per_rank // 2
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
            final_norm=final_norm.weight.data_ptr(),
        )
        self._bound_caches: tuple[int, ...] = ()
        # The LoRA step the layers' adapters read (None without LoRA): its token slots go to
        # the driver, which adds each linear's adapters as the Python layers do.
        lora = first.qkv_proj.lora
        self.lora_step = lora.step if lora is not None else None
        # Set by benchmarks.micro.profile_step: a (c_double * len(PART_NAMES)) array the C
        # driver adds each part's seconds to.
        self.part_seconds: ctypes.Array | None = None

    @staticmethod
    def of(layers: Sequence[nn.Module], final_norm: nn.Module) -> CpuDecoderStack | None:
        """The stack of `layers` (LlamaDecoderLayer modules, packed for the CPU) and the
        model's `final_norm`, or None when the C kernels are not loaded or any part is not one
        the C driver runs (every norm an RMSNorm of float32 weights and the first one's eps)."""
        library = cpu_kernel_loader.load()
        if library is None or not layers or not c_decode.layout_matches(library):
            return None
        eps = layers[0].input_layernorm.eps
        norms = [final_norm, *(n for layer in layers for n in _layer_norms(layer))]
        if not all(type(n) is RMSNorm and _is_float32(n.weight) and n.eps == eps for n in norms):
            return None
        structs = (c_decode.DecoderLayer * len(layers))()
        for struct, layer in zip(structs, layers, strict=True):
            if not _describe_layer(layer, struct):
                return None
        return CpuDecoderStack(layers, final_norm, structs)

    def takes(
        self,
        hidden_states: torch.Tensor,
        kv_caches: Sequence[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> bool:
        """Whether `run` takes this step: float32 [T, hidden] embeddings on the CPU, float32
        caches, attention that is all the decode kernel's, and adapters (if any token runs
        one) added by the shrink/expand kernel, as the Python layers would."""
        if self.lora_step is not None and self.lora_step.runs_matmul(hidden_states.shape[0]):
            return False
        return self._plan(hidden_states, kv_caches, metadata) is not None

    def run(
        self,
        embeddings: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_caches: Sequence[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """The decoder over a step it `takes`, from its float32 `embeddings` [T, hidden] to
        the final norm's output [T, hidden], as LlamaModel.forward's Python layers give it."""
        plan = self._plan(embeddings, kv_caches, metadata)
        if plan is None:
            raise ValueError("CpuDecoderStack.run got a step it does not take (see takes)")
        self._bind(kv_caches)
        tokens = embeddings.shape[0]
        q_width = self.num_q_heads * self.head_dim
        qkv_width = q_width + 2 * self.num_kv_heads * self.head_dim
        scratch = {
            "qkv": torch.empty(tokens, qkv_width, dtype=FLOAT32),
            "query": torch.empty(tokens, q_width, dtype=FLOAT32),
            "attended": torch.empty(tokens, q_width, dtype=FLOAT32),
            "gate_up": torch.empty(tokens, 2 * self.intermediate_size, dtype=FLOAT32),
            "activation": torch.empty(tokens, self.intermediate_size, dtype=FLOAT32),
        }
        cos, sin = (angles.float().contiguous() for angles in cos_sin)
        step = c_decode.DecodeStep(
            num_tokens=tokens,
            cos=cos.data_ptr(),
            sin=sin.data_ptr(),
            slot_mapping=metadata.slot_mapping.data_ptr(),
            attention=self._attention_args(kv_caches[0], plan),
            attention_scratch_floats=plan.max_query_x_seq_len * self.num_q_heads,
            num_threads=torch.get_num_threads(),
            part_seconds=None if self.part_seconds is None else ctypes.addressof(self.part_seconds),
            lora_token_slots=self._lora_token_slots(tokens),
            **{name: tensor.data_ptr() for name, tensor in scratch.items()},
        )
        rows = torch.empty(4, tokens, self.hidden_size, dtype=FLOAT32)
        residual, normed, projected, out = rows
        status = cpu_kernel_loader.load().decode_layers(
            ctypes.byref(self.stack),
            ctypes.byref(step),
            embeddings.data_ptr(),
            residual.data_ptr(),
            normed.data_ptr(),
            projected.data_ptr(),
            out.data_ptr(),
        )
        if status != 0:
            raise MemoryError("CPU attention could not allocate its scores")
        return out

    def _lora_token_slots(self, num_tokens: int) -> int | None:
        """The address of the step's int32 token slots when some token runs an adapter."""
        step = self.lora_step
        if step is None or not step.active:
            return None
        if step.token_slots.shape != (num_tokens,) or step.token_slots.dtype != torch.int32:
            raise ValueError("the LoRA step's token slots do not match the step's tokens")
        return step.token_slots.data_ptr()

    def _plan(self, stream: torch.Tensor, kv_caches, metadata):
        """The attention plan when a step of this float32 residual stream (the embeddings)
        is one the driver takes, else None."""
        if not (
            stream.dim() == 2
            and stream.dtype == FLOAT32
            and stream.is_cpu
            and stream.is_contiguous()
            and stream.shape[1] == self.hidden_size
            and metadata.slot_mapping.dtype == torch.int64
            and metadata.slot_mapping.is_contiguous()
            and len(kv_caches) == self.stack.num_layers
            and kv_caches[0].dtype == FLOAT32
        ):
            return None
        return decode_kernel_plan(self.num_q_heads, kv_caches[0], metadata)

    def _bind(self, kv_caches: Sequence[torch.Tensor]) -> None:
        """Points each layer's struct at its cache (again only when the caches changed)."""
        addresses = tuple(cache.data_ptr() for cache in kv_caches)
        if addresses != self._bound_caches:
            shape = kv_caches[0].shape
            if any(c.shape != shape or not c.is_contiguous() for c in kv_caches):
                raise ValueError("every layer's KV cache must be contiguous and of one shape")
            for struct, address in zip(self.layer_structs, addresses, strict=True):
                struct.kv_cache = address
            self._bound_caches = addresses

    def _attention_args(self, kv_cache: torch.Tensor, plan) -> AttentionArgs:
        """The attention arguments every layer shares (query, out and the cache are set per
        layer by the driver), as backend.paged_attention fills them."""
        _, num_cache_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        return AttentionArgs(
            block_table=plan.block_table.data_ptr(),
            seq_lens=plan.seq_lens.data_ptr(),
            query_start=plan.query_start.data_ptr(),
            requests=plan.short_requests.data_ptr(),
            block_table_stride=plan.block_table.shape[1],
            num_cache_blocks=num_cache_blocks,
            num_requests=len(plan.short_requests),
            block_size=block_size,
            num_q_heads=self.num_q_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            scale=self.stack.attention_scale,
            num_threads=torch.get_num_threads(),
        )


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


def _is_float32(tensor: torch.Tensor) -> bool:
    return tensor.dtype == FLOAT32 and tensor.is_cpu and tensor.is_contiguous()


def enable_cpu_decoder(model: nn.Module) -> bool:
    """Gives a packed CPU causal LM's decoder (`model.model`, where it has layers the driver
    can describe) its C stack; whether it got one."""
    decoder = getattr(model, "model", None)
    return hasattr(decoder, "enable_cpu_decoder") and decoder.enable_cpu_decoder()
