"""`LoRAManager`: a worker's adapters, from the checkpoint folder to the slots a step uses.

Three levels, as in vLLM: a checkpoint on disk (read with `common.lora_checkpoint`), up to
`max_cpu_loras` adapters loaded in host memory (least recently used evicted), and
`max_loras` slots beside every target linear that a step's tokens index. The scheduler never
runs more than `max_loras` distinct adapters at once, so a step's adapters always find slots:
a slot whose adapter the step does not use is overwritten, least recently used first.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from core_engine.common.lora_checkpoint import load_lora_checkpoint
from core_engine.proto.engine_config import EngineConfig
from core_engine.proto.lora_request import LoRARequest, LoRATargetShapes
from core_engine.worker.lora.linear_lora import LinearLoRA, LoRASlice
from core_engine.worker.lora.lora_step import NO_SLOT, LoRAStep

logger = logging.getLogger(__name__)

# (layer, module) -> (A [r, in], B [out, r] times the adapter's scaling), float32.
AdapterWeights = dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]


def lora_target_shapes(model_config, max_rank: int) -> LoRATargetShapes:
    """(in_features, out_features) of every projection an adapter may target, unsharded."""
    hidden, inner = model_config.hidden_size, model_config.intermediate_size
    q_size = model_config.num_attention_heads * model_config.head_dim
    kv_size = model_config.num_key_value_heads * model_config.head_dim
    return LoRATargetShapes(
        num_layers=model_config.num_hidden_layers,
        modules={
            "q_proj": (hidden, q_size),
            "k_proj": (hidden, kv_size),
            "v_proj": (hidden, kv_size),
            "o_proj": (q_size, hidden),
            "gate_proj": (hidden, inner),
            "up_proj": (hidden, inner),
            "down_proj": (inner, hidden),
        },
        max_rank=max_rank,
    )


class LoRAManager:
    """Attaches a `LinearLoRA` to every target linear of `model` (a Llama-family decoder) and
    maps each step's requests to slots. `set_step` before a forward, `clear_step` after."""

    def __init__(
        self, model: nn.Module, model_config, config: EngineConfig, dtype: torch.dtype
    ) -> None:
        self.max_rank = config.max_lora_rank
        self.shapes = lora_target_shapes(model_config, self.max_rank)
        self.num_slots = config.max_loras
        self.host_capacity = config.cpu_lora_capacity
        device = next(p.device for p in model.parameters() if p is not None)
        self.step = LoRAStep(device)
        self.layers = [
            _attach_layer(layer, self.step, self.max_rank, self.num_slots, dtype, device)
            for layer in model.model.layers
        ]
        self.host_cache: OrderedDict[int, AdapterWeights] = OrderedDict()
        self.slot_adapters: list[int | None] = [None] * self.num_slots
        self._slot_last_used = [0] * self.num_slots
        self._num_steps = 0

    def set_step(
        self, row_lora_requests: Sequence[LoRARequest | None], num_tokens_per_row: np.ndarray
    ) -> None:
        """Slots for the step's adapters (loading any not in a slot), then the token groups.
        RuntimeError when the step names more distinct adapters than there are slots."""
        self._num_steps += 1
        wanted = {r.lora_int_id: r for r in row_lora_requests if r is not None}
        if len(wanted) > self.num_slots:
            raise RuntimeError(
                f"a step runs {len(wanted)} LoRA adapters, above max_loras={self.num_slots}"
            )
        slot_of = {lora_id: self._slot_for(request, wanted) for lora_id, request in wanted.items()}
        row_slots = [
            slot_of[r.lora_int_id] if r is not None else NO_SLOT for r in row_lora_requests
        ]
        self.step.set_token_slots(row_slots, num_tokens_per_row)

    def clear_step(self) -> None:
        self.step.clear()

    def _slot_for(self, request: LoRARequest, wanted: dict[int, LoRARequest]) -> int:
        lora_id = request.lora_int_id
        if lora_id in self.slot_adapters:
            slot = self.slot_adapters.index(lora_id)
        else:
            slot = self._free_slot(wanted)
            self._write_slot(slot, self._host_weights(request))
            self.slot_adapters[slot] = lora_id
        self._slot_last_used[slot] = self._num_steps
        return slot

    def _free_slot(self, wanted: dict[int, LoRARequest]) -> int:
        """An empty slot, else the least recently used one whose adapter this step skips."""
        candidates = [
            slot for slot, lora_id in enumerate(self.slot_adapters) if lora_id not in wanted
        ]
        return min(candidates, key=lambda slot: (self.slot_adapters[slot] is not None,
                                                   self._slot_last_used[slot]))  # fmt: skip

    def _host_weights(self, request: LoRARequest) -> AdapterWeights:
        weights = self.host_cache.get(request.lora_int_id)
        if weights is None:
            weights = self._load(request)
            self.host_cache[request.lora_int_id] = weights
            while len(self.host_cache) > self.host_capacity:
                evicted, _ = self.host_cache.popitem(last=False)
                logger.debug("LoRA adapter id %d left host memory", evicted)
        self.host_cache.move_to_end(request.lora_int_id)
        return weights

    def _load(self, request: LoRARequest) -> AdapterWeights:
        checkpoint = load_lora_checkpoint(request.lora_path, self.shapes, self.max_rank)
        scaling = np.float32(checkpoint.config.scaling)
        logger.info(
            "loaded LoRA adapter %r (id %d, rank %d, %s) from %s", request.lora_name,
            request.lora_int_id, checkpoint.config.rank,
            ", ".join(checkpoint.config.target_modules), request.lora_path,
        )  # fmt: skip
        return {
            key: (lora_a.astype(np.float32), lora_b.astype(np.float32) * scaling)
            for key, (lora_a, lora_b) in checkpoint.weights.items()
        }

    def _write_slot(self, slot: int, weights: AdapterWeights) -> None:
        for index, linears in enumerate(self.layers):
            layer_weights = {
                module: pair for (layer, module), pair in weights.items() if layer == index
            }
            for linear in linears:
                linear.write_slot(slot, layer_weights)


def _attach_layer(
    layer: nn.Module,
    step: LoRAStep,
    max_rank: int,
    num_slots: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[LinearLoRA]:
    """A LinearLoRA on the layer's qkv, o, gate_up and down projections (set as each one's
    `lora`), sharded as the base linears are."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv, o_proj = attn.qkv_proj, attn.o_proj
    gate_up, down = mlp.gate_up_proj, mlp.down_proj
    q_rows = slice(qkv.tp_rank * qkv.q_size, (qkv.tp_rank + 1) * qkv.q_size)
    kv_start = qkv.kv_head_offset * qkv.head_dim
    kv_rows = slice(kv_start, kv_start + qkv.kv_size)
    half = gate_up.output_size_per_rank // 2
    mlp_rows = slice(gate_up.tp_rank * half, (gate_up.tp_rank + 1) * half)
    new = _linear_lora_factory(step, max_rank, num_slots, dtype, device)
    qkv.lora = new(
        qkv,
        [LoRASlice("q_proj", q_rows, 0), LoRASlice("k_proj", kv_rows, qkv.q_size),
         LoRASlice("v_proj", kv_rows, qkv.q_size + qkv.kv_size)],
    )  # fmt: skip
    gate_up.lora = new(
        gate_up, [LoRASlice("gate_proj", mlp_rows, 0), LoRASlice("up_proj", mlp_rows, half)]
    )
    o_proj.lora = new(o_proj, [LoRASlice("o_proj", slice(None), 0)], row_parallel=True)
    down.lora = new(down, [LoRASlice("down_proj", slice(None), 0)], row_parallel=True)
    return [qkv.lora, o_proj.lora, gate_up.lora, down.lora]


def _linear_lora_factory(step, max_rank, num_slots, dtype, device):
    def new(linear: nn.Module, slices: list[LoRASlice], row_parallel: bool = False) -> LinearLoRA:
        if row_parallel:
            in_rank = linear.input_size_per_rank
            out = linear.output_size
            columns = slice(linear.tp_rank * in_rank, (linear.tp_rank + 1) * in_rank)
        else:
            in_rank, out, columns = linear.input_size, linear.output_size_per_rank, None
        return LinearLoRA(
            step, slices, in_rank, out, max_rank, num_slots, dtype, device, input_columns=columns
        )

    return new
