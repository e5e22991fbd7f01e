"""The `.cu` sources: NVRTC-safe text, nvcc and NVRTC compiles, constants shared with Python.

nvcc (`-arch=sm_90 -ptx`) compiles each file as is and with the template instances the backend
asks for. NVRTC itself (the compiler CuPy uses) compiles the loader's inlined source with the
same name expressions when libnvrtc is found: $NVRTC_LIBRARY, the `nvidia-cuda-nvrtc` wheel, or
the CUDA toolkit. Neither needs a GPU.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from core_engine.kernels.cuda import launch_config as lc
from core_engine.kernels.cuda import lora_launch
from core_engine.kernels.cuda.module_loader import KERNEL_DIR, NVRTC_OPTIONS, load_source

SOURCES = sorted(p.name for p in KERNEL_DIR.glob("*.cu"))
HEADERS = sorted(p.name for p in KERNEL_DIR.glob("*.cuh"))
DTYPES = ("float32", "float16", "bfloat16")

# The template instances the backend requests, for a representative set of models:
# (dtype, head_dim, group size), each through the launcher's kernel choice.
DECODE_CONFIGS = [
    ("bfloat16", 128, 4),
    ("bfloat16", 256, 8),
    ("float16", 64, 3),
    ("float16", 128, 7),
    ("float32", 64, 1),
    ("float32", 256, 8),
    ("bfloat16", 80, 6),
    ("bfloat16", 96, 2),
    ("float16", 256, 1),
]
NAME_EXPRESSIONS = {
    "decode_attention.cu": [
        lc.decode_launch(1, g, 1, hd, 16, 132, dtype_name=d).kernel_name
        for d, hd, g in DECODE_CONFIGS
    ],
    "prefill_attention.cu": [lc.prefill_kernel_name(d, hd) for d in DTYPES for hd in (64, 128, 256)]
    + [lc.prefill_kernel_name("float16", 80)],
    "prefill_attention_tc.cu": [
        lc.prefill_tc_kernel_name(d, hd)
        for d in lc.TENSOR_CORE_DTYPES
        for hd in (64, 80, 96, 128, 256)
    ],
    "merge_attention_states.cu": [lc.merge_kernel_name(d) for d in DTYPES],
    "reshape_and_cache.cu": [lc.CACHE_WRITE_KERNEL_NAME],
    lora_launch.SOURCE_NAME: [
        name(d)
        for d in DTYPES
        for name in (lora_launch.shrink_kernel_name, lora_launch.expand_kernel_name)
    ],
}

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")


def test_every_source_has_name_expressions():
    assert set(SOURCES) == set(NAME_EXPRESSIONS)


@pytest.mark.parametrize("name", SOURCES + HEADERS)
def test_sources_are_nvrtc_safe_text(name):
    text = (KERNEL_DIR / name).read_text()
    code = re.sub(r"//[^\n]*", "", text)
    assert not re.search(r"#\s*include\s*<", code), "NVRTC has no host headers"
    for forbidden in (r"\bINFINITY\b", r"\bNAN\b", r"\bprintf\b", r"\bstd::", r"\bassert\s*\("):
        assert not re.search(forbidden, code), f"{forbidden} is not available under NVRTC"
    for header in re.findall(r'#\s*include\s+"([^"]+)"', code):
        assert header in HEADERS, f"{name} includes {header}, which is not a kernels/ header"


@pytest.mark.parametrize("name", SOURCES)
def test_loader_inlines_local_headers(name):
    source = load_source(name)
    assert "#include" not in re.sub(r"//[^\n]*", "", source)
    assert "#pragma once" not in source


def test_loader_inlines_a_header_once(tmp_path):
    (tmp_path / "a.cuh").write_text('#pragma once\n#include "b.cuh"\nint a;\n')
    (tmp_path / "b.cuh").write_text("#pragma once\nint b;\n")
    (tmp_path / "k.cu").write_text('#include "a.cuh"\n#include "b.cuh"\nint k;\n')
    code = re.sub(r"//[^\n]*", "", load_source("k.cu", tmp_path))
    assert code.split() == ["int", "b;", "int", "a;", "int", "k;"]


def test_loader_reports_a_missing_header(tmp_path):
    (tmp_path / "k.cu").write_text('#include "missing.cuh"\n')
    with pytest.raises(FileNotFoundError):
        load_source("k.cu", tmp_path)


@pytest.mark.parametrize(
    ("source", "constant", "value"),
    [
        ("decode_attention.cu", "kDecodeThreads", lc.DECODE_THREADS),
        ("decode_attention.cu", "kDecodeTcKeys", lc.DECODE_TC_KEYS),
        ("prefill_attention.cu", "kPrefillThreads", lc.PREFILL_THREADS),
        ("prefill_attention.cu", "kPrefillRows", lc.PREFILL_ROWS),
        ("prefill_attention.cu", "kPrefillKeys", lc.PREFILL_KEYS),
        ("prefill_attention.cu", "kPrefillRowPad", lc.PREFILL_ROW_PAD),
        ("prefill_attention_tc.cu", "kTcThreads", lc.PREFILL_TC_THREADS),
        ("prefill_attention_tc.cu", "kTcRows", lc.PREFILL_TC_ROWS),
        ("prefill_attention_tc.cu", "kTcKeys", lc.PREFILL_TC_KEYS),
        ("prefill_attention_tc.cu", "kTcPad", lc.PREFILL_TC_PAD),
        ("prefill_attention_tc.cu", "kTcStages", lc.PREFILL_TC_STAGES),
        ("prefill_attention_tc.cu", "kTcMaxRegisterQDim", lc.PREFILL_TC_MAX_REGISTER_Q_DIM),
    ],
)
def test_python_launch_constants_match_the_kernels(source, constant, value):
    text = (KERNEL_DIR / source).read_text()
    match = re.search(rf"constexpr int {constant} = (\d+);", text)
    assert match, f"{constant} not found in {source}"
    assert int(match.group(1)) == value


@needs_nvcc
@pytest.mark.parametrize("name", SOURCES)
def test_nvcc_compiles_each_source_to_ptx(name, tmp_path):
    _nvcc_ptx(KERNEL_DIR / name, tmp_path / "out.ptx")


@needs_nvcc
@pytest.mark.parametrize("name", SOURCES)
def test_nvcc_compiles_the_requested_template_instances(name, tmp_path):
    names = NAME_EXPRESSIONS[name]
    wrapper = tmp_path / "instances.cu"
    addresses = ", ".join(f"(void*)&{n}" for n in names)
    wrapper.write_text(
        f'#include "{KERNEL_DIR / name}"\nvoid* const kernel_instances[] = {{{addresses}}};\n'
    )
    ptx = _nvcc_ptx(wrapper, tmp_path / "out.ptx")
    assert len(re.findall(r"^\.visible \.entry", ptx, re.MULTILINE)) >= len(names)


def _nvcc_ptx(source: Path, output: Path) -> str:
    result = subprocess.run(
        ["nvcc", "-arch=sm_90", "-ptx", *NVRTC_OPTIONS, str(source), "-o", str(output)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return output.read_text()


def find_nvrtc() -> ctypes.CDLL | None:
    """libnvrtc from $NVRTC_LIBRARY, the nvidia-cuda-nvrtc wheel, or the CUDA toolkit."""
    import os

    candidates = []
    if os.environ.get("NVRTC_LIBRARY"):
        candidates.append(Path(os.environ["NVRTC_LIBRARY"]))
    spec = importlib.util.find_spec("nvidia")
    for root in spec.submodule_search_locations if spec and spec.submodule_search_locations else []:
        candidates += sorted(Path(root).glob("*/lib/libnvrtc.so*"))
    candidates += sorted(Path("/usr/local/cuda/lib64").glob("libnvrtc.so*"))
    found = ctypes.util.find_library("nvrtc")
    if found:
        candidates.append(Path(found))
    for path in candidates:
        if path.name.startswith("libnvrtc.") and ".alt." not in path.name:
            try:
                for builtins in sorted(path.parent.glob("libnvrtc-builtins.so*")):
                    if ".alt." not in builtins.name:
                        ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
                return ctypes.CDLL(str(path))
            except OSError:
                continue
    return None


def nvrtc_compile(lib: ctypes.CDLL, source: str, names: list[str]) -> dict[str, str]:
    """Compiles like CuPy's RawModule (NVRTC, name expressions); returns name -> lowered name."""
    program = ctypes.c_void_p()
    assert (
        lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), b"k.cu", 0, None, None) == 0
    )
    try:
        for name in names:
            assert lib.nvrtcAddNameExpression(program, name.encode()) == 0
        options = [o.encode() for o in NVRTC_OPTIONS] + [b"--gpu-architecture=compute_90"]
        result = lib.nvrtcCompileProgram(
            program, len(options), (ctypes.c_char_p * len(options))(*options)
        )
        log_size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(program, ctypes.byref(log_size))
        log = ctypes.create_string_buffer(log_size.value)
        lib.nvrtcGetProgramLog(program, log)
        assert result == 0, log.value.decode(errors="replace")[-4000:]
        lowered = {}
        for name in names:
            mangled = ctypes.c_char_p()
            assert lib.nvrtcGetLoweredName(program, name.encode(), ctypes.byref(mangled)) == 0
            lowered[name] = mangled.value.decode()
        return lowered
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))


@pytest.mark.parametrize("name", SOURCES)
def test_nvrtc_compiles_the_loader_source_with_name_expressions(name):
    lib = find_nvrtc()
    if lib is None:
        pytest.skip("libnvrtc not found (pip install nvidia-cuda-nvrtc, or set NVRTC_LIBRARY)")
    lowered = nvrtc_compile(lib, load_source(name), NAME_EXPRESSIONS[name])
    assert set(lowered) == set(NAME_EXPRESSIONS[name])
    assert all(lowered.values())
