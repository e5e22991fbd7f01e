"""Kernel resources on sm_90 without a GPU: every configuration the launcher can pick compiles
with no spills, at most 255 registers, shared memory within the limits the launcher opts into, and
the occupancy the code assumes.

The configurations come from `kernels.cuda.launch_config`'s own launch functions
(`benchmarks.micro.kernels_static.enumerate_configs`), so a new one is covered automatically. They are
compiled once per session (nvcc -ptx as NVRTC would, then ptxas -v), in parallel batches; the
parsers of the static report (ptxas log, PTX directives, symbol names, SASS key loop) are tested
here on captured snippets and need no compiler.
"""

from __future__ import annotations

import os
import shutil

import pytest

from core_engine.kernels.cuda import launch_config as lc
from core_engine.kernels.cuda import occupancy
from core_engine.kernels.cuda.module_loader import KERNEL_DIR
from tools import kernel_resources as kr
from tools import sass_analysis as sa

CONFIGS = kr.enumerate_configs()
needs_compiler = pytest.mark.skipif(
    shutil.which("nvcc") is None or shutil.which("ptxas") is None,
    reason="nvcc / ptxas (CUDA toolkit) are not installed",
)

pytestmark = pytest.mark.slow  # nvcc and ptxas over every kernel instance


@pytest.fixture(scope="module")
def resources(tmp_path_factory):
    found, _ = kr.compile_configs(
        CONFIGS, tmp_path_factory.mktemp("kernel_resources"), len(os.sched_getaffinity(0))
    )
    return found


# ---- the configuration set ---------------------------------------------------------------------


def test_every_source_is_enumerated():
    assert {c.source_name for c in CONFIGS} == {p.name for p in KERNEL_DIR.glob("*.cu")}


def test_every_dtype_head_dim_and_group_is_covered():
    decode = {
        (c.dtype_name, c.head_dim, c.heads_per_cta) for c in CONFIGS if c.kind.startswith("decode")
    }
    for dtype in lc.DTYPE_TO_CUDA_TYPE:
        for head_dim in (64, 80, 96, 128, 256):
            for group in range(1, 9):
                assert (dtype, head_dim, group) in decode
    kinds = {(c.kind, c.dtype_name, c.head_dim) for c in CONFIGS}
    assert ("prefill_tc", "bfloat16", 128) in kinds
    assert ("prefill", "bfloat16", 72) in kinds  # not a multiple of 16: CUDA cores
    assert ("prefill", "float32", 128) in kinds
    assert {c.name_expression for c in CONFIGS if c.kind == "merge"} == {
        lc.merge_kernel_name(d) for d in lc.DTYPE_TO_CUDA_TYPE
    }
    assert [c.name_expression for c in CONFIGS if c.kind == "reshape_and_cache"] == [
        lc.CACHE_WRITE_KERNEL_NAME
    ]


def test_configs_carry_the_launchers_requests():
    by_name = {c.name_expression: c for c in CONFIGS}
    decode = [c for c in CONFIGS if c.kind.startswith("decode") and c.heads_per_cta == 4]
    assert all(c.dynamic_shared_bytes == lc.decode_shared_mem_bytes(4, c.head_dim) for c in decode)
    assert all(c.threads_per_cta == lc.DECODE_THREADS for c in decode)
    # group 12 runs as two chunks of 6 heads
    six = [c for c in CONFIGS if c.kind.startswith("decode") and c.heads_per_cta == 6]
    assert all(12 in c.group_sizes for c in six)
    prefill = by_name[lc.prefill_kernel_name("float32", 256)]
    assert prefill.dynamic_shared_bytes == lc.prefill_shared_mem_bytes(256)


# ---- the compiled kernels ----------------------------------------------------------------------


@needs_compiler
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name_expression.replace(" ", ""))
def test_kernel_fits_sm90(config, resources):
    value = resources[config.key]
    assert (value.spill_store_bytes, value.spill_load_bytes) == (0, 0), (
        f"{config.name_expression} spills {value.spill_store_bytes} bytes "
        f"(stack frame {value.stack_frame_bytes} bytes) at {value.registers} registers"
    )
    assert value.registers <= occupancy.MAX_REGISTERS_PER_THREAD
    if value.max_threads_per_cta is not None:
        assert config.threads_per_cta <= value.max_threads_per_cta, "above __launch_bounds__"
    shared = value.static_shared_bytes + config.dynamic_shared_bytes
    limit = kr.shared_limit_bytes(config.dynamic_shared_bytes)
    assert shared <= limit, (
        f"{config.name_expression}: {value.static_shared_bytes} static + "
        f"{config.dynamic_shared_bytes} dynamic bytes of shared memory exceed {limit}"
    )
    ctas = occupancy.ctas_per_sm(value.registers, config.threads_per_cta, shared)
    assumed = kr.assumed_ctas_per_sm(config, value)
    assert ctas >= assumed, (
        f"{config.name_expression}: {value.registers} registers x {config.threads_per_cta} "
        f"threads and {shared} bytes of shared memory allow {ctas} CTAs per SM, "
        f"the code assumes {assumed}"
    )


# ---- occupancy arithmetic ----------------------------------------------------------------------


def test_ctas_per_sm_follows_the_sm90_allocation_rules():
    # 240 registers -> 7680 per warp -> 8 warps -> two 4-warp CTAs.
    assert occupancy.ctas_per_sm(240, 128, 16640) == 2
    assert occupancy.ctas_per_sm(255, 128, 0) == 2  # 255 rounds to 256 per thread
    assert occupancy.ctas_per_sm(32, 128, 0) == 16  # thread limit
    assert occupancy.ctas_per_sm(16, 32, 0) == 32  # CTA slots
    assert occupancy.ctas_per_sm(64, 128, 100 * 1024) == 2  # shared memory, 1 KB reserved per CTA
    assert occupancy.ctas_per_sm(64, 128, 113 * 1024) == 2  # 2 x 114 KB = 228 KB, the SM's all
    assert occupancy.ctas_per_sm(64, 128, 114 * 1024) == 1


def test_shared_limit_follows_the_loaders_opt_in():
    assert kr.shared_limit_bytes(0) == 48 * 1024
    assert kr.shared_limit_bytes(48 * 1024) == 48 * 1024
    assert kr.shared_limit_bytes(48 * 1024 + 16) == 227 * 1024


# ---- parsers, on captured output ---------------------------------------------------------------

PTXAS_LOG = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z16decode_attentionI6bf16_tLi128ELi4EEvPKT_xS3_' for 'sm_90'
ptxas info    : Function properties for _Z16decode_attentionI6bf16_tLi128ELi4EEvPKT_xS3_
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers
ptxas info    : Compile time = 183.769 ms
ptxas info    : Compiling entry function 'reshape_and_cache' for 'sm_90'
ptxas info    : Function properties for reshape_and_cache
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 22 registers, used 0 barriers, 1024 bytes smem, 416 bytes cmem[0]
"""


def test_parse_ptxas_verbose():
    parsed = kr.parse_ptxas_verbose(PTXAS_LOG)
    decode = parsed["_Z16decode_attentionI6bf16_tLi128ELi4EEvPKT_xS3_"]
    assert (decode.registers, decode.stack_frame_bytes) == (128, 8)
    assert (decode.spill_store_bytes, decode.spill_load_bytes, decode.spill_bytes) == (4, 4, 8)
    assert decode.static_shared_bytes == 0
    cache = parsed["reshape_and_cache"]
    assert (cache.registers, cache.spill_bytes, cache.static_shared_bytes) == (22, 0, 1024)


def test_parse_ptx_entries():
    ptx = """
.visible .entry _Z17prefill_attentionIfLi64EEvPKT_(
	.param .u64 _Z17prefill_attentionIfLi64EEvPKT__param_0
)
.maxntid 256, 1, 1
.minnctapersm 2
{
	ret;
}
.visible .entry reshape_and_cache(
	.param .u64 reshape_and_cache_param_0
)
{
	ret;
}
"""
    assert kr.parse_ptx_entries(ptx) == {
        "_Z17prefill_attentionIfLi64EEvPKT_": (256, 2),
        "reshape_and_cache": (None, None),
    }


@pytest.mark.parametrize(
    ("mangled", "name"),
    [
        ("_Z16decode_attentionI6bf16_tLi128ELi4EEvPKT_xS3_S3_PKiiS5_", "decode_attention<bf16_t,128,4>"),
        ("_Z17prefill_attentionIfLi64EEvPKT_xS2_", "prefill_attention<float,64>"),
        ("_Z22merge_attention_statesI6half_tEvPKfS2_PT_", "merge_attention_states<half_t>"),
        ("_Z1kIiLin3ELb1EEvv", "k<int,-3,true>"),
        ("reshape_and_cache", "reshape_and_cache"),
    ],
)  # fmt: skip
def test_kernel_name_demangles_the_kernels_symbols(mangled, name):
    assert kr.kernel_name(mangled) == name


# A decode key loop in miniature, as nvdisasm prints it: a prologue load, the loop (16-byte
# K/V loads, a shuffle whose divergent fallback sits after EXIT and jumps back into the loop),
# then the epilogue.
SASS = """\
//--------------------- .text._Z1kv --------------------------
.text._Z1kv:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/               @P1 LDG.E.128.CONSTANT R20, desc[UR10][R16.64] ;
.L_x_7:
        /*0020*/                   LDG.E.CONSTANT R27, desc[UR10][R26.64] ;
        /*0030*/              @!P4 LDG.E.128.CONSTANT R28, desc[UR10][R34.64] ;
        /*0040*/              @!P4 LDG.E.128.CONSTANT R24, desc[UR10][R32.64] ;
        /*0050*/                   FFMA R3, R28, R20, RZ ;
        /*0060*/                   BRA.DIV UR7, `(.L_x_9) ;
        /*0070*/                   SHFL.BFLY PT, R4, R3, 0x1, 0x1f ;
.L_x_8:
        /*0080*/                   MUFU.EX2 R5, R4 ;
        /*0090*/                   IMAD.WIDE R2, R5, 0x4, R2 ;
        /*00a0*/              @!P0 BRA `(.L_x_7) ;
        /*00b0*/                   STS [R0], R5 ;
        /*00c0*/                   EXIT ;
.L_x_9:
        /*00d0*/                   WARPSYNC.ALL ;
        /*00e0*/                   SHFL.BFLY PT, R4, R3, 0x1, 0x1f ;
        /*00f0*/                   BRA `(.L_x_8) ;
"""


def test_find_key_loop_takes_the_loading_loop_not_the_divergent_fallback():
    functions = sa.parse_sass(SASS)
    loop = sa.find_key_loop(functions["_Z1kv"])
    assert loop == [
        "LDG.E.CONSTANT", "LDG.E.128.CONSTANT", "LDG.E.128.CONSTANT", "FFMA", "BRA.DIV",
        "SHFL.BFLY", "MUFU.EX2", "IMAD.WIDE", "BRA",
    ]  # fmt: skip
    classes = sa.instruction_classes(loop)
    assert (classes["LDG"], classes["MUFU"], classes["SHFL"], classes["IMAD"]) == (3, 1, 1, 1)
    assert sum(classes.values()) == len(loop)


def test_decode_layout_matches_the_kernel():
    bf16 = sa.DecodeLayout(dtype_bytes=2, head_dim=128)
    # 16 vectors per row -> 16 lanes per key, 2 keys per warp pass; 4 passes = 8 loads, 8 keys.
    assert (bf16.lanes_per_key, bf16.vecs_per_lane, bf16.keys_per_warp_pass) == (16, 1, 2)
    assert bf16.keys_per_iteration(8) == 8
    bf16_80 = sa.DecodeLayout(dtype_bytes=2, head_dim=80)  # 10 vectors on 16 lanes
    assert (bf16_80.lanes_per_key, bf16_80.keys_per_warp_pass) == (16, 2)
    fp32_256 = sa.DecodeLayout(dtype_bytes=4, head_dim=256)  # 64 vectors on 32 lanes
    assert (fp32_256.lanes_per_key, fp32_256.vecs_per_lane) == (32, 2)
    assert fp32_256.keys_per_iteration(8) == 2


def test_decode_loop_cost_divides_by_the_bytes_one_iteration_reads():
    loop = ["LDG.E.128"] * 16 + ["FFMA"] * 84  # bf16 D=128: 16 loads = 16 keys = 8 KB
    cost = sa.decode_loop_cost(loop, dtype_bytes=2, head_dim=128)
    assert (cost["keys_per_iteration"], cost["bytes_per_iteration"]) == (16, 8192)
    assert cost["instructions_per_4kb"] == 50
    assert cost["classes_per_4kb"]["FFMA"] == 42
    tc = sa.decode_loop_cost(loop, dtype_bytes=2, head_dim=128, tc_keys=16)
    assert tc["bytes_per_iteration"] == 8192
