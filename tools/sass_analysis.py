"""Decode's SASS instruction cost per 4 KB of K+V, from an nvdisasm listing.

Per decode kernel the main key loop is found: among the loops closed by a backward branch (a
`BRA` to a label at or before it) whose range holds no EXIT/RET (those are the divergent-path
shuffle fallbacks nvcc places after the function's end, jumping back into the loop), the one
holding the most 16-byte global loads (`LDG*.128` / `LDGSTS*.128`, the K and V loads), ties to
the shortest. Its static instruction count equals the instructions one warp issues per iteration
when every key of its tile is valid (both sides of the per-key `valid` guards run then); it is
divided by the K+V bytes one iteration reads, keys * 2 * head_dim * dtype_bytes (one kv head).
Keys per iteration, from decode_attention.cu: each iteration loads one warp tile (the next one,
while computing the current one). `decode_attention` (CUDA cores): a tile is KPT passes of
kKeysPerWarpPass = 32 / kLanesPerKey keys, kLanesPerKey = next_pow2(min(head_dim / elements per
16-byte vector, 32)), and each pass costs every lane 2 * kVecsPerLane 16-byte loads (K and V),
so keys = loads in the loop / (2 * kVecsPerLane) * kKeysPerWarpPass. `decode_attention_tc`
(tensor cores): kDecodeTcKeys keys per tile. Instruction classes (MUFU, SHFL, LDG, FFMA, HMMA,
IMAD, ...) are counted per 4 KB the same way.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from core_engine.kernels.cuda import launch_config as lc
from core_engine.kernels.cuda.module_loader import KERNEL_DIR
from tools.kernel_resources import DECODE_SOURCE

# ---- SASS: the decode key loop ------------------------------------------------------------------


@dataclass(slots=True)
class SassFunction:
    """One function of an nvdisasm listing: instructions (address, mnemonic, branch label)."""

    name: str
    instructions: list[tuple[int, str, str | None]] = field(default_factory=list)
    labels: dict[str, int] = field(default_factory=dict)  # label -> address of what follows


_SASS_FUNCTION = re.compile(r"^\.text\.(\S+):\s*$")
_SASS_LABEL = re.compile(r"^(\.L_x_\d+):\s*$")
_SASS_INSTRUCTION = re.compile(
    r"^\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*)$"
)
_SASS_TARGET = re.compile(r"`\((\.L_x_\d+)\)")


def parse_sass(listing: str) -> dict[str, SassFunction]:
    """{mangled name: function} from `nvdisasm -c` output (labels as `.L_x_N`)."""
    functions: dict[str, SassFunction] = {}
    current = None
    pending: list[str] = []
    for line in listing.splitlines():
        if match := _SASS_FUNCTION.match(line):
            current = functions.setdefault(match.group(1), SassFunction(match.group(1)))
            pending = []
        elif current is None:
            continue
        elif match := _SASS_LABEL.match(line):
            pending.append(match.group(1))
        elif match := _SASS_INSTRUCTION.match(line):
            address = int(match.group(1), 16)
            for label in pending:
                current.labels[label] = address
            pending = []
            target = _SASS_TARGET.search(match.group(3))
            opcode = match.group(2)
            branch = target.group(1) if target and opcode.startswith("BRA") else None
            current.instructions.append((address, opcode, branch))
    return functions


def is_vector_global_load(opcode: str) -> bool:
    return opcode.split(".")[0] in ("LDG", "LDGSTS") and ".128" in opcode


def find_key_loop(function: SassFunction) -> list[str] | None:
    """The mnemonics of the loop that loads K/V (see the module docstring), None if no loop loads.

    Candidates: a `BRA` back to a label at or before it spans a loop; spans holding EXIT or RET
    are skipped (divergent-path fallbacks after the function's end that jump into a loop).
    """
    best = None
    for address, opcode, target in function.instructions:
        if target is None or opcode.startswith("BRA.DIV") or target not in function.labels:
            continue
        start = function.labels[target]
        if start > address:
            continue
        body = [op for a, op, _ in function.instructions if start <= a <= address]
        if any(op.split(".")[0] in ("EXIT", "RET") for op in body):
            continue
        loads = sum(is_vector_global_load(op) for op in body)
        if loads and (best is None or (loads, -len(body)) > (best[0], -len(best[1]))):
            best = (loads, body)
    return best[1] if best else None


INSTRUCTION_CLASSES = {
    "FFMA": ("FFMA",),
    "HMMA": ("HMMA",),
    "FMUL/FADD": ("FMUL", "FADD"),
    "FMNMX": ("FMNMX",),
    "MUFU": ("MUFU",),
    "SHFL": ("SHFL",),
    "LDG": ("LDG", "LDGSTS"),
    "IMAD": ("IMAD",),
    "int other": ("IADD3", "LEA", "LOP3", "SHF", "ISETP", "SEL", "IABS", "I2F", "F2I", "VIADD"),
}


def instruction_classes(mnemonics: Sequence[str]) -> dict[str, int]:
    """Counts per class of INSTRUCTION_CLASSES (by the mnemonic's first part), plus "other"."""
    counts = Counter()
    for mnemonic in mnemonics:
        base = mnemonic.split(".")[0]
        for name, bases in INSTRUCTION_CLASSES.items():
            if base in bases:
                counts[name] += 1
                break
        else:
            counts["other"] += 1
    return {name: counts.get(name, 0) for name in (*INSTRUCTION_CLASSES, "other")}


@dataclass(frozen=True, slots=True)
class DecodeLayout:
    """Python mirror of the lane layout of `decode_attention` (decode_attention.cu)."""

    dtype_bytes: int
    head_dim: int

    @property
    def vecs_per_row(self) -> int:
        return self.head_dim * self.dtype_bytes // lc.VECTOR_BYTES

    @property
    def lanes_per_key(self) -> int:
        lanes = min(self.vecs_per_row, 32)
        return 1 << (lanes - 1).bit_length()

    @property
    def vecs_per_lane(self) -> int:
        return -(-self.vecs_per_row // self.lanes_per_key)

    @property
    def keys_per_warp_pass(self) -> int:
        return 32 // self.lanes_per_key

    def keys_per_iteration(self, vector_loads: int) -> float:
        """Keys one loop iteration covers: it loads one warp tile, `KPT` passes of 2 x
        kVecsPerLane 16-byte loads (K and V) per lane, each pass kKeysPerWarpPass keys."""
        return vector_loads / (2 * self.vecs_per_lane) * self.keys_per_warp_pass


def decode_tc_keys(source_dir: Path = KERNEL_DIR) -> int | None:
    """`kDecodeTcKeys` (keys per warp tile of decode_attention_tc), None without that kernel."""
    text = (source_dir / DECODE_SOURCE).read_text()
    match = re.search(r"constexpr int kDecodeTcKeys = (\d+);", text)
    return int(match.group(1)) if match else None


def decode_loop_cost(
    mnemonics: Sequence[str], dtype_bytes: int, head_dim: int, tc_keys: int | None = None
) -> dict:
    """Instructions and classes per 4 KB of K+V for a decode key loop.

    Keys per iteration: `tc_keys` for the tensor-core kernel, else derived from the loop's
    16-byte loads and the CUDA-core layout (`DecodeLayout.keys_per_iteration`).
    """
    loads = sum(is_vector_global_load(op) for op in mnemonics)
    if tc_keys is not None:
        keys = float(tc_keys)
    else:
        keys = DecodeLayout(dtype_bytes, head_dim).keys_per_iteration(loads)
    loop_bytes = keys * 2 * head_dim * dtype_bytes
    return {
        "loop_instructions": len(mnemonics),
        "loop_vector_loads": loads,
        "keys_per_iteration": keys,
        "bytes_per_iteration": loop_bytes,
        "instructions_per_4kb": round(len(mnemonics) * 4096 / loop_bytes, 1),
        "classes_per_4kb": {
            name: round(count * 4096 / loop_bytes, 1)
            for name, count in instruction_classes(mnemonics).items()
        },
    }
