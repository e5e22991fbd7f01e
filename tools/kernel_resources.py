"""What each CUDA kernel configuration costs on sm_90 (H100/H200), found without a GPU.

`enumerate_configs` maps every dtype, head dim and GQA group size through `launch_config`'s own
launch functions to the kernel name expressions the backend can request. `compile_configs`
compiles them as NVRTC does (the loader's inlined source, the name expressions as explicit
instances, `nvcc -arch=sm_90 -ptx -std=c++17`) and assembles them with `ptxas -arch=sm_90 -v`,
whose log gives registers, spill stores/loads, stack frame and static shared memory per kernel;
the PTX gives the `__launch_bounds__` (`.maxntid`, `.minnctapersm`). With the dynamic shared
memory and threads the launcher requests, `ctas_per_sm` gives the occupancy. Used by the CI guard
(tests/kernels/test_kernel_resources.py) and the static report (benchmarks/micro/kernels_static.py).
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from core_engine.kernels.cuda import launch_config as lc
from core_engine.kernels.cuda import lora_launch
from core_engine.kernels.cuda.module_loader import NVRTC_OPTIONS, load_source
from core_engine.kernels.cuda.occupancy import (
    DEFAULT_SHARED_BYTES,
    MAX_SHARED_BYTES_PER_CTA,
)

ARCH = "sm_90"
# The head dims every run covers: the common ones, 72 (a multiple of 8 but not of 16: the
# CUDA-core prefill for fp16/bf16, which the launcher special-cases) and the extremes.
DEFAULT_HEAD_DIMS = (64, 72, 80, 96, 128, 256)
QUICK_HEAD_DIMS = (128,)
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# GQA groups up to two decode head chunks: every heads_per_cta the launcher can pick.
GROUP_SIZES = tuple(range(1, 2 * lc.DECODE_MAX_HEADS_PER_CTA + 1))
# Sources the CUDA backend names for decode, merge and the cache write (prefill's comes from
# its launch).
DECODE_SOURCE = "decode_attention.cu"
MERGE_SOURCE = "merge_attention_states.cu"
CACHE_WRITE_SOURCE = "reshape_and_cache.cu"
# A decode launch that splits (one request, long context) and one that does not, on an H100.
H100_SMS = 132
SPLIT_LAUNCH = {"num_reqs": 1, "num_kv_heads": 1, "max_seq_len": 32768}
UNSPLIT_LAUNCH = {"num_reqs": 4 * H100_SMS, "num_kv_heads": 1, "max_seq_len": 4096}
INSTANCES_PER_COMPILE = 16


@dataclass(frozen=True, slots=True)
class KernelConfig:
    """One kernel instance the launcher can request, with the largest launch it gets."""

    kind: str  # decode, merge, prefill, prefill_tc, reshape_and_cache
    source_name: str
    name_expression: str
    threads_per_cta: int
    dynamic_shared_bytes: int
    dtype_name: str | None = None
    head_dim: int | None = None
    heads_per_cta: int | None = None
    group_sizes: tuple[int, ...] = ()

    @property
    def key(self) -> tuple[str, str]:
        return (self.source_name, self.name_expression)


@dataclass(frozen=True, slots=True)
class KernelResources:
    """What ptxas (-v) and the PTX directives say about one compiled kernel."""

    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    stack_frame_bytes: int
    static_shared_bytes: int
    max_threads_per_cta: int | None = None  # .maxntid (product), from __launch_bounds__
    min_ctas_per_sm: int | None = None  # .minnctapersm, from __launch_bounds__

    @property
    def spill_bytes(self) -> int:
        return self.spill_store_bytes + self.spill_load_bytes


# ---- the configurations -------------------------------------------------------------------------


def enumerate_configs(
    head_dims: Iterable[int] = DEFAULT_HEAD_DIMS,
    dtypes: Iterable[str] = tuple(lc.DTYPE_TO_CUDA_TYPE),
    group_sizes: Iterable[int] = GROUP_SIZES,
) -> list[KernelConfig]:
    """Every kernel instance the launcher picks for these shapes, through its own functions.

    Instances requested by several shapes are listed once, with the most threads and dynamic
    shared memory any of them asks for and the group sizes that request them.
    """
    found: dict[tuple[str, str], KernelConfig] = {}

    def add(config: KernelConfig) -> None:
        old = found.get(config.key)
        if old is not None:
            config = replace(
                old,
                threads_per_cta=max(old.threads_per_cta, config.threads_per_cta),
                dynamic_shared_bytes=max(old.dynamic_shared_bytes, config.dynamic_shared_bytes),
                group_sizes=tuple(sorted(set(old.group_sizes) | set(config.group_sizes))),
            )
        found[config.key] = config

    for dtype in dtypes:
        for head_dim in head_dims:
            for group in group_sizes:
                for shape in (SPLIT_LAUNCH, UNSPLIT_LAUNCH):
                    _add_decode(add, dtype, head_dim, group, shape)
                launch = lc.prefill_launch(
                    num_reqs=1,
                    num_heads=group,
                    num_kv_heads=1,
                    head_dim=head_dim,
                    max_query_len=lc.PREFILL_ROWS,
                    dtype_name=dtype,
                )
                add(
                    KernelConfig(
                        kind="prefill_tc" if launch.uses_tensor_cores else "prefill",
                        source_name=launch.source_name,
                        name_expression=launch.kernel_name,
                        threads_per_cta=math.prod(launch.block),
                        dynamic_shared_bytes=launch.shared_mem_bytes,
                        dtype_name=dtype,
                        head_dim=head_dim,
                        group_sizes=(group,),
                    )
                )
            for num_kv_heads in (1, 8):
                row_bytes = num_kv_heads * head_dim * DTYPE_BYTES[dtype]
                write = lc.cache_write_launch(num_tokens=1, row_bytes=row_bytes)
                add(
                    KernelConfig(
                        kind="reshape_and_cache",
                        source_name=CACHE_WRITE_SOURCE,
                        name_expression=lc.CACHE_WRITE_KERNEL_NAME,
                        threads_per_cta=math.prod(write.block),
                        dynamic_shared_bytes=0,
                    )
                )
        _add_lora(add, dtype)
    return sorted(found.values(), key=_config_order)


def _add_lora(add, dtype: str) -> None:
    """The LoRA shrink and expand instances of `dtype` (their launch shape is fixed)."""
    launch = lora_launch.LoRALaunch.of(1, 16, 1, DTYPE_BYTES[dtype], 0)
    for kind, name, block in (
        ("lora_shrink", lora_launch.shrink_kernel_name(dtype), launch.shrink_block),
        ("lora_expand", lora_launch.expand_kernel_name(dtype), launch.expand_block),
    ):
        add(
            KernelConfig(
                kind=kind,
                source_name=lora_launch.SOURCE_NAME,
                name_expression=name,
                threads_per_cta=math.prod(block),
                dynamic_shared_bytes=0,
                dtype_name=dtype,
            )
        )


def _add_decode(add, dtype: str, head_dim: int, group: int, shape: dict) -> None:
    kwargs = {"num_heads": group * shape["num_kv_heads"], "head_dim": head_dim, **shape}
    if "dtype_name" in inspect.signature(lc.decode_launch).parameters:
        kwargs["dtype_name"] = dtype
    launch = lc.decode_launch(num_sms=H100_SMS, **kwargs)
    name = getattr(launch, "kernel_name", None) or lc.decode_kernel_name(
        dtype, head_dim, launch.heads_per_cta
    )
    add(
        KernelConfig(
            kind="decode_tc" if "_tc<" in name else "decode",
            source_name=getattr(launch, "source_name", None) or DECODE_SOURCE,
            name_expression=name,
            threads_per_cta=math.prod(launch.block),
            dynamic_shared_bytes=launch.shared_mem_bytes,
            dtype_name=dtype,
            head_dim=head_dim,
            heads_per_cta=launch.heads_per_cta,
            group_sizes=(group,),
        )
    )
    if launch.needs_merge:
        add(
            KernelConfig(
                kind="merge",
                source_name=MERGE_SOURCE,
                name_expression=lc.merge_kernel_name(dtype),
                threads_per_cta=math.prod(launch.merge_block),
                dynamic_shared_bytes=0,
                dtype_name=dtype,
            )
        )


KIND_ORDER = (
    "decode",
    "decode_tc",
    "prefill",
    "prefill_tc",
    "merge",
    "reshape_and_cache",
    "lora_shrink",
    "lora_expand",
)


def _config_order(config: KernelConfig) -> tuple:
    kind = KIND_ORDER.index(config.kind) if config.kind in KIND_ORDER else len(KIND_ORDER)
    dtypes = tuple(lc.DTYPE_TO_CUDA_TYPE)
    dtype = dtypes.index(config.dtype_name) if config.dtype_name in dtypes else -1
    return (kind, dtype, config.head_dim or 0, config.heads_per_cta or 0, config.name_expression)


# ---- compiling and parsing ----------------------------------------------------------------------


def find_tool(name: str) -> str | None:
    """`name` on PATH, in an `nvidia-*` wheel (found without importing it) or the CUDA toolkit."""
    found = shutil.which(name)
    if found:
        return found
    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations or ()) if spec else []
    candidates = [p for root in roots for p in sorted(Path(root).glob(f"*/bin/{name}"))]
    candidates += [Path("/usr/local/cuda/bin") / name]
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return None


def compile_configs(
    configs: Sequence[KernelConfig], work_dir: Path, jobs: int
) -> tuple[dict[tuple[str, str], KernelResources], dict[str, list[Path]]]:
    """Compiles every config for sm_90, `INSTANCES_PER_COMPILE` instances per nvcc + ptxas run,
    `jobs` runs at a time. Returns the resources by config key and the cubins by source.

    Raises RuntimeError with the compiler's message when a compile fails or a kernel is missing.
    """
    batches: list[tuple[str, list[str]]] = []
    by_source: dict[str, list[str]] = {}
    for config in configs:
        by_source.setdefault(config.source_name, []).append(config.name_expression)
    for source, names in by_source.items():
        for start in range(0, len(names), INSTANCES_PER_COMPILE):
            batches.append((source, names[start : start + INSTANCES_PER_COMPILE]))
    work_dir.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        outputs = list(
            pool.map(
                lambda item: compile_instances(item[1][0], item[1][1], work_dir / f"b{item[0]}"),
                enumerate(batches),
            )
        )
    resources: dict[tuple[str, str], KernelResources] = {}
    cubins: dict[str, list[Path]] = {}
    for (source, _), (found, cubin) in zip(batches, outputs, strict=True):
        cubins.setdefault(source, []).append(cubin)
        for name, value in found.items():
            resources[(source, name)] = value
    return resources, cubins


def compile_instances(
    source_name: str, names: Sequence[str], out_stem: Path
) -> tuple[dict[str, KernelResources], Path]:
    """Compiles the loader's source of `source_name` with `names` instantiated, as NVRTC would;
    returns {name expression: resources} and the cubin."""
    wrapper = out_stem.with_suffix(".cu")
    addresses = ", ".join(f"(void*)&{name}" for name in names)
    wrapper.write_text(
        f"{load_source(source_name)}\nvoid* const kernel_instances[] = {{{addresses}}};\n"
    )
    ptx_path, cubin = out_stem.with_suffix(".ptx"), out_stem.with_suffix(".cubin")
    run_tool(
        ["nvcc", f"-arch={ARCH}", "-ptx", *NVRTC_OPTIONS, "-diag-suppress", "177",
         str(wrapper), "-o", str(ptx_path)]
    )  # fmt: skip
    log = run_tool(["ptxas", f"-arch={ARCH}", "-v", str(ptx_path), "-o", str(cubin)])
    entries = parse_ptx_entries(ptx_path.read_text())
    by_name: dict[str, KernelResources] = {}
    for mangled, value in parse_ptxas_verbose(log).items():
        maxntid, minnctapersm = entries.get(mangled, (None, None))
        by_name[kernel_name(mangled)] = replace(
            value, max_threads_per_cta=maxntid, min_ctas_per_sm=minnctapersm
        )
    result = {}
    for name in names:
        key = normalize_name_expression(name)
        if key not in by_name:
            raise RuntimeError(
                f"ptxas reported no kernel {name} for {source_name}: {sorted(by_name)}"
            )
        result[name] = by_name[key]
    return result, cubin


def run_tool(argv: list[str]) -> str:
    completed = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    if completed.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:3])} failed:\n{completed.stderr[-4000:]}")
    return completed.stdout + completed.stderr


_PTXAS_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PTXAS_FRAME = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)
_PTXAS_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def parse_ptxas_verbose(log: str) -> dict[str, KernelResources]:
    """{mangled kernel name: resources} from `ptxas -v` output (the "bytes smem" is static)."""
    result: dict[str, KernelResources] = {}
    current = None
    frame = (0, 0, 0)
    for line in log.splitlines():
        if match := _PTXAS_ENTRY.search(line):
            current, frame = match.group(1), (0, 0, 0)
        elif (match := _PTXAS_FRAME.search(line)) and current:
            frame = tuple(int(g) for g in match.groups())
        elif (match := _PTXAS_USED.search(line)) and current:
            result[current] = KernelResources(
                registers=int(match.group(1)),
                stack_frame_bytes=frame[0],
                spill_store_bytes=frame[1],
                spill_load_bytes=frame[2],
                static_shared_bytes=int(match.group(2) or 0),
            )
            current = None
    return result


_PTX_ENTRY = re.compile(r"\.entry\s+(\S+?)\s*\((.*?)\)\s*([^{]*)\{", re.DOTALL)


def parse_ptx_entries(ptx: str) -> dict[str, tuple[int | None, int | None]]:
    """{mangled entry: (threads of .maxntid, .minnctapersm)}, None where the directive is absent."""
    result = {}
    for match in _PTX_ENTRY.finditer(ptx):
        directives = match.group(3)
        maxntid = re.search(r"\.maxntid\s+([\d,\s]+)", directives)
        minctas = re.search(r"\.minnctapersm\s+(\d+)", directives)
        threads = (
            math.prod(int(x) for x in maxntid.group(1).split(",") if x.strip()) if maxntid else None
        )
        result[match.group(1)] = (threads, int(minctas.group(1)) if minctas else None)
    return result


_BUILTIN_TYPES = {
    "b": "bool", "c": "char", "a": "signed char", "h": "unsigned char", "s": "short",
    "t": "unsigned short", "i": "int", "j": "unsigned int", "l": "long", "m": "unsigned long",
    "x": "long long", "y": "unsigned long long", "f": "float", "d": "double",
}  # fmt: skip


def kernel_name(mangled: str) -> str:
    """The name expression of a kernel symbol, without spaces: `decode_attention<bf16_t,128,4>`.

    Handles what the kernels use: a plain (extern "C") name, or an Itanium-mangled global
    function template whose arguments are types (builtin or plain names) and integer literals.
    Raises ValueError for anything else.
    """
    if not mangled.startswith("_Z"):
        return mangled
    pos = 2
    name, pos = _source_name(mangled, pos)
    if pos >= len(mangled) or mangled[pos] != "I":
        return name
    pos += 1
    args = []
    while mangled[pos] != "E":
        if mangled[pos] == "L":
            end = mangled.index("E", pos)
            kind, digits = mangled[pos + 1], mangled[pos + 2 : end]
            digits = "-" + digits[1:] if digits.startswith("n") else digits
            args.append({"b": "true" if digits == "1" else "false"}.get(kind, digits))
            pos = end + 1
        elif mangled[pos].isdigit():
            arg, pos = _source_name(mangled, pos)
            args.append(arg)
        elif mangled[pos] in _BUILTIN_TYPES:
            args.append(_BUILTIN_TYPES[mangled[pos]])
            pos += 1
        else:
            raise ValueError(f"cannot demangle template argument at {pos} of {mangled}")
    return normalize_name_expression(f"{name}<{','.join(args)}>")


def _source_name(mangled: str, pos: int) -> tuple[str, int]:
    match = re.match(r"\d+", mangled[pos:])
    if not match:
        raise ValueError(f"expected a length at {pos} of {mangled}")
    length = int(match.group())
    start = pos + len(match.group())
    return mangled[start : start + length], start + length


def normalize_name_expression(name_expression: str) -> str:
    return re.sub(r"\s+", "", name_expression)


# ---- limits and occupancy -----------------------------------------------------------------------


def shared_limit_bytes(dynamic_bytes: int) -> int:
    """Static + dynamic shared memory a launch may use, given the loader's opt-in.

    `ModuleLoader.get_kernel` raises the kernel's dynamic limit to `dynamic_bytes` only above
    48 KB; below that the default 48 KB per CTA (static included) holds.
    """
    return (
        MAX_SHARED_BYTES_PER_CTA if dynamic_bytes > DEFAULT_SHARED_BYTES else DEFAULT_SHARED_BYTES
    )


def assumed_ctas_per_sm(config: KernelConfig, resources: KernelResources) -> int:
    """The occupancy the code assumes: the kernel's `__launch_bounds__` minimum, and for decode
    the `SplitPolicy.min_ctas_per_sm` at which the launcher deems the GPU full; at least 1."""
    assumed = resources.min_ctas_per_sm or 1
    if config.kind.startswith("decode"):
        assumed = max(assumed, lc.SplitPolicy().min_ctas_per_sm)
    return assumed
