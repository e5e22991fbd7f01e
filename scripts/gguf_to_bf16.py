"""Rewrites a GGUF file with every quantized or float tensor stored as bf16, metadata unchanged:
the same weights an engine dequantizes at load, in the form llama.cpp runs at bf16 speed (its
benchmark peer then does the arithmetic the engine and vLLM do, not its quantized kernels).

    python -m scripts.gguf_to_bf16 IN.gguf OUT.gguf      (default IN: the default model)
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np

from core_engine.common.model_files import default_model_path

FLOAT_TYPES_KEPT = (gguf.GGMLQuantizationType.F32,)  # norms and biases stay float32


def convert(source: Path, target: Path) -> None:
    reader = gguf.GGUFReader(source)
    architecture = reader.fields["general.architecture"]
    writer = gguf.GGUFWriter(target, str(bytes(architecture.parts[-1]), "utf-8"))
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value_type = field.types[0]
        if value_type == gguf.GGUFValueType.ARRAY:
            values = field.contents()
            writer.add_key_value(name, values, value_type, sub_type=field.types[-1])
        else:
            writer.add_key_value(name, field.contents(), value_type)
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        shape = tuple(int(n) for n in reversed(tensor.shape))
        values = np.asarray(values, dtype=np.float32).reshape(shape)
        if tensor.tensor_type in FLOAT_TYPES_KEPT or values.ndim == 1:
            writer.add_tensor(tensor.name, values)
        else:
            bf16 = gguf.quants.quantize(values, gguf.GGMLQuantizationType.BF16)
            writer.add_tensor(
                tensor.name, bf16, raw_shape=bf16.shape, raw_dtype=gguf.GGMLQuantizationType.BF16
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", nargs="?", type=Path, default=None)
    parser.add_argument("target", type=Path)
    args = parser.parse_args()
    convert(args.source or default_model_path(), args.target)
    print(f"wrote {args.target}")


if __name__ == "__main__":
    main()
