"""Static report of the CUDA kernels for sm_90 (H100/H200): resources and decode instruction cost.

    python -m benchmarks.micro.kernels_static [--head-dims 64,128] [--jobs 2] [--output-dir DIR] [--quick]

No GPU needed. Every kernel configuration the launcher can pick is compiled and assembled
(`tools.kernel_resources`: registers, spills, shared memory, CTAs per SM), and each decode
kernel's key loop is read from its SASS (`tools.sass_analysis`: instructions per 4 KB of K+V),
beside the targets of the kernels issue.

nvdisasm comes from the `nvidia-cuda-nvdisasm` wheel (`pip install nvidia-cuda-nvdisasm`), the
CUDA toolkit or PATH; without it the report leaves the SASS columns empty and says so. nvcc and
ptxas must be on PATH. Results: benchmarks/results/kernels_static[_quick].{json,md}.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

from benchmarks.harness.common import (
    RESULTS_DIR,
    machine_info,
    markdown_table,
    result_name,
    usable_cpu_ids,
    write_results,
)
from core_engine.kernels.cuda import launch_config as lc
from core_engine.kernels.cuda.occupancy import MAX_REGISTERS_PER_THREAD, ctas_per_sm
from tools.kernel_resources import (
    ARCH,
    DECODE_SOURCE,
    DEFAULT_HEAD_DIMS,
    DTYPE_BYTES,
    H100_SMS,
    QUICK_HEAD_DIMS,
    assumed_ctas_per_sm,
    compile_configs,
    enumerate_configs,
    find_tool,
    kernel_name,
    normalize_name_expression,
    run_tool,
    shared_limit_bytes,
)
from tools.sass_analysis import (
    SassFunction,
    decode_loop_cost,
    decode_tc_keys,
    find_key_loop,
    parse_sass,
)

# The budget a copy-speed decode has: a whole H100/H200 issues at most one warp instruction per
# scheduler per cycle (132 SMs x 4 schedulers x 1.98 GHz max boost); at the measured device-copy
# ceiling 4 KB take 4096 / ceiling seconds.
ISSUE_RATE_PER_S = H100_SMS * 4 * 1.98e9
COPY_CEILINGS_BYTES_PER_S = {"H100 (3.0 TB/s)": 3.0e12, "H200 (4.3 TB/s)": 4.3e12}
# What the review of the decode kernel found (bf16, head_dim 128), and the hard rule.
TARGETS = {
    "spill_bytes": 0,
    "review_instructions_per_4kb_group_4": 955,
    "review_registers_group_8": 240,
}


def issue_budgets() -> dict[str, float]:
    """Warp instructions per 4 KB a whole GPU can issue while copying at each ceiling."""
    return {
        name: round(ISSUE_RATE_PER_S * 4096 / ceiling)
        for name, ceiling in COPY_CEILINGS_BYTES_PER_S.items()
    }


# ---- the report ---------------------------------------------------------------------------------


def build_report(head_dims: Sequence[int], jobs: int, work_dir: Path) -> dict:
    """Compiles every configuration and measures it; returns the JSON-ready result."""
    configs = enumerate_configs(head_dims)
    resources, cubins = compile_configs(configs, work_dir, jobs)
    nvdisasm = find_tool("nvdisasm")
    sass: dict[str, SassFunction] = {}
    if nvdisasm:
        decode_cubins = cubins.get(DECODE_SOURCE, [])
        with ThreadPoolExecutor(max(1, jobs)) as pool:
            listings = pool.map(lambda c: run_tool([nvdisasm, "-c", str(c)]), decode_cubins)
            for listing in listings:
                sass.update(parse_sass(listing))
    tc_keys = decode_tc_keys()
    rows = []
    for config in configs:
        value = resources[config.key]
        row = {**asdict(config), **asdict(value)}
        shared = value.static_shared_bytes + config.dynamic_shared_bytes
        row["shared_bytes"] = shared
        row["shared_limit_bytes"] = shared_limit_bytes(config.dynamic_shared_bytes)
        row["ctas_per_sm"] = ctas_per_sm(value.registers, config.threads_per_cta, shared)
        row["assumed_ctas_per_sm"] = assumed_ctas_per_sm(config, value)
        if config.kind.startswith("decode") and sass:
            function = _by_name(sass).get(normalize_name_expression(config.name_expression))
            loop = find_key_loop(function) if function else None
            if loop:
                row["key_loop"] = decode_loop_cost(
                    loop,
                    DTYPE_BYTES[config.dtype_name],
                    config.head_dim,
                    tc_keys if config.kind == "decode_tc" else None,
                )
        rows.append(row)
    return {
        "arch": ARCH,
        "toolchain": _nvcc_release(),
        "nvdisasm": nvdisasm,
        "head_dims": list(head_dims),
        "targets": TARGETS,
        "issue_budget_instructions_per_4kb": issue_budgets(),
        "kernels": rows,
        "machine": machine_info(),
    }


def _nvcc_release() -> str:
    lines = run_tool(["nvcc", "--version"]).strip().splitlines()
    return next((line for line in lines if "release" in line), lines[-1])


def _by_name(sass: dict[str, SassFunction]) -> dict[str, SassFunction]:
    return {kernel_name(mangled): function for mangled, function in sass.items()}


def render_markdown(report: dict) -> str:
    rows = report["kernels"]
    budgets = report["issue_budget_instructions_per_4kb"]
    budget_text = ", ".join(f"{name}: {value}" for name, value in budgets.items())
    lines = [
        f"# CUDA kernels, static report ({report['arch']}, {report['toolchain']})",
        "",
        "Registers, spills and stack from `ptxas -v`; shared = static + the dynamic bytes the "
        "launcher requests; CTAs/SM from registers, threads and shared memory (sm_90 limits), "
        "beside the occupancy the code assumes (`__launch_bounds__` minimum; decode: "
        "`SplitPolicy.min_ctas_per_sm`). Groups: the GQA group sizes up to 8 that use a decode "
        "instance (+: larger groups too, split into head chunks). Instructions per 4 KB: SASS instructions of the decode "
        "kernel's key loop per 4 KB of K+V that one iteration (one warp tile) reads; see "
        "`benchmarks/micro/kernels_static.py` for the method.",
        "",
        "Targets: spills must be 0 everywhere. Decode should approach the device-copy ceiling: "
        "a whole GPU issues at most one warp instruction per scheduler per cycle, so at the "
        f"copy ceiling it can issue at most this many instructions per 4 KB ({budget_text}; 132 "
        "SMs x 4 schedulers x 1.98 GHz), and decode must stay well below that. The review found "
        f"about {TARGETS['review_instructions_per_4kb_group_4']} instructions per 4 KB for GQA "
        f"group 4 and {TARGETS['review_registers_group_8']} registers for group 8 (bf16, "
        "head_dim 128): the numbers to beat.",
        "",
    ]
    decode = [r for r in rows if r["kind"].startswith("decode")]
    if decode and not report["nvdisasm"]:
        lines += [
            "nvdisasm was not found, so the SASS columns are empty: "
            "`pip install nvidia-cuda-nvdisasm` (or put the CUDA toolkit's nvdisasm on PATH).",
            "",
        ]
    if decode:
        lines += _decode_pivots(decode) + ["", "## Decode", ""]
        lines.append(
            markdown_table(
                [
                    "kernel",
                    "groups",
                    "regs",
                    "spill st/ld B",
                    "stack B",
                    "shared B",
                    "CTAs/SM (assumed)",
                    "loop instr",
                    "instr / 4 KB",
                    "MUFU",
                    "SHFL",
                    "LDG",
                    "FFMA",
                    "HMMA",
                    "IMAD",
                    "int other",
                ],
                [
                    [
                        f"`{r['name_expression']}`",
                        _groups(r["group_sizes"]),
                        r["registers"],
                        f"{r['spill_store_bytes']}/{r['spill_load_bytes']}",
                        r["stack_frame_bytes"],
                        r["shared_bytes"],
                        f"{r['ctas_per_sm']} ({r['assumed_ctas_per_sm']})",
                        *_loop_cells(r),
                    ]
                    for r in decode
                ],
            )
        )
    others = [r for r in rows if not r["kind"].startswith("decode")]
    lines += ["", "## Prefill, merge, cache write", ""]
    lines.append(
        markdown_table(
            [
                "kernel",
                "kind",
                "threads",
                "regs",
                "spill st/ld B",
                "stack B",
                "shared B",
                "limit B",
                "CTAs/SM (assumed)",
            ],
            [
                [
                    f"`{r['name_expression']}`",
                    r["kind"],
                    r["threads_per_cta"],
                    r["registers"],
                    f"{r['spill_store_bytes']}/{r['spill_load_bytes']}",
                    r["stack_frame_bytes"],
                    r["shared_bytes"],
                    r["shared_limit_bytes"],
                    f"{r['ctas_per_sm']} ({r['assumed_ctas_per_sm']})",
                ]
                for r in others
            ],
        )
    )
    failing = [r["name_expression"] for r in rows if _problems(r)]
    lines += [
        "",
        f"{len(rows)} kernel instances; "
        + (
            f"failing the limits: {', '.join(f'`{n}`' for n in failing)}."
            if failing
            else "all within the limits."
        ),
    ]
    return "\n".join(lines) + "\n"


def _problems(row: dict) -> list[str]:
    """The limits a row breaks (the ones tests/kernels/test_kernel_resources.py asserts)."""
    problems = []
    if row["spill_store_bytes"] or row["spill_load_bytes"]:
        problems.append("spills")
    if row["registers"] > MAX_REGISTERS_PER_THREAD:
        problems.append("registers")
    if row["shared_bytes"] > row["shared_limit_bytes"]:
        problems.append("shared memory")
    if row["ctas_per_sm"] < row["assumed_ctas_per_sm"]:
        problems.append("occupancy")
    return problems


def _groups(group_sizes: Sequence[int]) -> str:
    small = [g for g in group_sizes if g <= lc.DECODE_MAX_HEADS_PER_CTA]
    return ",".join(str(g) for g in small) + ("+" if len(small) < len(group_sizes) else "")


def _loop_cells(row: dict) -> list[object]:
    loop = row.get("key_loop")
    if not loop:
        return [""] * 9
    classes = loop["classes_per_4kb"]
    per_4kb = loop["instructions_per_4kb"]
    return [
        loop["loop_instructions"],
        f"{per_4kb:.0f}",
        *(
            f"{classes[name]:.0f}"
            for name in ("MUFU", "SHFL", "LDG", "FFMA", "HMMA", "IMAD", "int other")
        ),
    ]


def _decode_pivots(decode: list[dict]) -> list[str]:
    heads = sorted({r["heads_per_cta"] for r in decode})
    keys = sorted({(r["dtype_name"], r["head_dim"]) for r in decode}, key=lambda k: (k[0], k[1]))
    cells = {(r["dtype_name"], r["head_dim"], r["heads_per_cta"]): r for r in decode}
    lines = []
    for title, cell in (
        ("Decode: SASS instructions per 4 KB of K+V (key loop), by heads per CTA", _per_4kb),
        ("Decode: registers (spill bytes if any), by heads per CTA", _registers),
    ):
        table = [
            [f"{dtype} D={head_dim}", *(cell(cells.get((dtype, head_dim, h))) for h in heads)]
            for dtype, head_dim in keys
        ]
        lines += ["", f"## {title}", "", markdown_table(["", *map(str, heads)], table)]
    lines += ["", "tc: the tensor-core decode kernel (`decode_attention_tc`)."]
    return lines


def _per_4kb(row: dict | None) -> str:
    loop = row and row.get("key_loop")
    return f"{loop['instructions_per_4kb']:.0f}{_tc_mark(row)}" if loop else ""


def _registers(row: dict | None) -> str:
    if row is None:
        return ""
    spills = row["spill_store_bytes"] + row["spill_load_bytes"]
    return f"{row['registers']}{_tc_mark(row)}" + (f" (spill {spills})" if spills else "")


def _tc_mark(row: dict) -> str:
    return " tc" if row["kind"] == "decode_tc" else ""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--head-dims",
        type=lambda text: tuple(int(x) for x in text.split(",")),
        default=None,
        help=f"comma-separated head dims (default {','.join(map(str, DEFAULT_HEAD_DIMS))})",
    )
    parser.add_argument("--jobs", type=int, default=len(usable_cpu_ids()), help="parallel compiles")
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument(
        "--quick", action="store_true", help=f"head dims {QUICK_HEAD_DIMS} only, *_quick files"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for tool in ("nvcc", "ptxas"):
        if shutil.which(tool) is None:
            print(f"{tool} is not on PATH: install the CUDA toolkit (13.x)", file=sys.stderr)
            return 1
    if find_tool("nvdisasm") is None:
        print(
            "nvdisasm not found: no SASS columns (pip install nvidia-cuda-nvdisasm)",
            file=sys.stderr,
        )
    head_dims = args.head_dims or (QUICK_HEAD_DIMS if args.quick else DEFAULT_HEAD_DIMS)
    for head_dim in head_dims:
        lc.check_head_dim(head_dim)
    with tempfile.TemporaryDirectory(prefix="kernels_static_") as work_dir:
        report = build_report(head_dims, args.jobs, Path(work_dir))
    path = write_results(
        report, render_markdown(report), args.output_dir, result_name("kernels_static", args.quick)
    )
    failing = [r["name_expression"] for r in report["kernels"] if _problems(r)]
    print(f"wrote {path} and {path.with_suffix('.md')}; {len(report['kernels'])} kernels")
    if failing:
        print(f"outside the limits: {', '.join(failing)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
