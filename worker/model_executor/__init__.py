"""The model a worker runs: its config (`model_config.py`), the layers with tensor-parallel
sharding (`layers.py`, with CPU-packed linears in `cpu_linear.py`), the model classes
(`models/`), and loading them from a Hugging Face folder or a GGUF file (`model_loader.py`,
`safetensors_loader.py`, `gguf_loader.py`)."""
