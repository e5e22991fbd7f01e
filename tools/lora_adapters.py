"""PEFT LoRA adapters of a model made on the spot, for the tests and the LoRA benchmark: random,
non-zero A and B (PEFT starts B at zero, which would make every adapter the base model), saved
as PEFT saves them. Needs the `test` extra (transformers, peft); nothing is downloaded."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    name: str
    rank: int
    target_modules: tuple[str, ...]
    lora_alpha: float = 16.0
    use_rslora: bool = False
    seed: int = 0


def make_peft_adapter(hf_folder: Path, spec: AdapterSpec, folder: Path):
    """Saves an adapter of the HF model in `hf_folder` to `folder`; returns the PEFT model
    (float32, eval mode) that runs it, the reference for the engine's tokens."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(hf_folder), dtype=torch.float32)
    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.lora_alpha,
        use_rslora=spec.use_rslora,
        target_modules=list(spec.target_modules),
        lora_dropout=0.0,
    )
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                fan_in = param.shape[1]
                param.copy_(torch.randn(param.shape, generator=generator) / fan_in**0.5)
    model.save_pretrained(str(folder))
    return model.eval()
