"""LoRA adapters in the worker: their weights in slots beside the base linears, and each
step's mapping of tokens to slots (see `lora_manager.LoRAManager`)."""
