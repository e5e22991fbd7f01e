"""Cases and the float64 check of the batched LoRA shrink+expand kernels (CPU and CUDA).

A case is y [T, OUT] (nonzero: the kernels accumulate), x [T, IN], S slots of lora_a [W, IN]
and lora_b [OUT, W] and int32 token slots with -1 for tokens without an adapter, laid out in
runs (a prompt's tokens share an adapter), alternations (a decode batch of many adapters) or at
random. The reference is y + B[s] (A[s] x) in float64 from the same (rounded) inputs.

Tolerance, per element, from the float32 arithmetic the kernels do:
- float32: the shrink sums IN products and the expand W more, then y is added: in any order,
  a float32 sum of n terms is within n * 2^-24 of the sum of their magnitudes (Higham's
  gamma_n, to first order), so |error| <= (IN + W + 2) * 2^-24 * (|y| + |B| (|A| |x|)).
- bf16 (and fp16) outputs: that, plus the one rounding of the result to 8 (11) significant
  bits, at most 2^-8 (2^-11) of its magnitude: 2^-8 |expected| + 2 * the float32 bound.
An error past these means a wrong product, not a rounding difference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NO_SLOT = -1
# Round to nearest: at most half a unit in the last place, 2^-p of the value for p significant
# bits (float32's own rounding is in the float32 bound).
UNIT_ROUNDOFF = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


@dataclass(frozen=True, slots=True)
class LoRACase:
    x: torch.Tensor
    y: torch.Tensor
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    token_slots: torch.Tensor

    @property
    def operands(self) -> tuple[torch.Tensor, ...]:
        """(x, y, lora_a, lora_b, token_slots): the kernels' arguments, y updated in place."""
        return (self.x, self.y, self.lora_a, self.lora_b, self.token_slots)

    def clone(self) -> LoRACase:
        return LoRACase(*(t.clone() for t in self.operands))


def slot_pattern(kind: str, num_tokens: int, num_slots: int, seed: int = 0) -> list[int]:
    """Token slots: `runs` (random-length runs of one slot or -1), `alternating` (t % (S + 1)
    - 1: every slot and -1 side by side), `random` (each token any of -1 .. S - 1), `all` (every
    token slot S - 1) or `none` (every token -1)."""
    generator = torch.Generator().manual_seed(seed)
    if kind == "alternating":
        return [t % (num_slots + 1) - 1 for t in range(num_tokens)]
    if kind == "all":
        return [num_slots - 1] * num_tokens
    if kind == "none":
        return [NO_SLOT] * num_tokens
    if kind == "random":
        return torch.randint(-1, num_slots, (num_tokens,), generator=generator).tolist()
    if kind != "runs":
        raise ValueError(f"unknown slot pattern {kind!r}")
    slots: list[int] = []
    while len(slots) < num_tokens:
        length = int(torch.randint(1, 40, (1,), generator=generator))
        slots += [int(torch.randint(-1, num_slots, (1,), generator=generator))] * length
    return slots[:num_tokens]


def make_case(
    num_tokens: int,
    in_features: int,
    out_features: int,
    width: int,
    num_slots: int,
    dtype: torch.dtype,
    slots: str | list[int] = "random",
    seed: int = 0,
    device: str = "cpu",
) -> LoRACase:
    """A case of these sizes; `slots` a pattern name (see slot_pattern) or the slots."""
    generator = torch.Generator().manual_seed(seed)

    def random(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale).to(dtype).to(device)

    token_slots = (
        slot_pattern(slots, num_tokens, num_slots, seed) if isinstance(slots, str) else slots
    )
    return LoRACase(
        x=random(num_tokens, in_features),
        y=random(num_tokens, out_features),
        lora_a=random(num_slots, width, in_features, scale=max(in_features, 1) ** -0.5),
        lora_b=random(num_slots, out_features, width, scale=max(width, 1) ** -0.5),
        token_slots=torch.tensor(token_slots, dtype=torch.int32, device=device),
    )


def reference(case: LoRACase) -> tuple[torch.Tensor, torch.Tensor]:
    """(expected y, the float32 error bound per element), in float64 on the CPU."""
    x, y = case.x.cpu().double(), case.y.cpu().double()
    lora_a, lora_b = case.lora_a.cpu().double(), case.lora_b.cpu().double()
    slots = case.token_slots.cpu().long()
    expected = y.clone()
    magnitude = torch.zeros_like(y)
    for slot in range(lora_a.shape[0]):
        rows = slots == slot
        a, b, x_rows = lora_a[slot], lora_b[slot], x[rows]
        expected[rows] += (x_rows @ a.T) @ b.T
        magnitude[rows] = y[rows].abs() + (x_rows.abs() @ a.abs().T) @ b.abs().T
    in_features, width = x.shape[1], lora_a.shape[1]
    return expected, (in_features + width + 2) * 2.0**-24 * magnitude


def assert_matches_reference(case: LoRACase, before: LoRACase) -> None:
    """`case.y` (after the kernel) is `before`'s y plus the adapters within the bound above,
    and the rows of tokens without a slot are bit for bit what they were."""
    expected, float32_bound = reference(before)
    actual = case.y.cpu().double()
    dtype = case.y.dtype
    bound = UNIT_ROUNDOFF[dtype] * expected.abs() + (2 if dtype != torch.float32 else 1) * (
        float32_bound
    )
    error = (actual - expected).abs()
    worst = int(torch.argmax(error - bound))
    row, column = divmod(worst, expected.shape[1])
    assert bool((error <= bound).all()), (
        f"y[{row}, {column}] = {float(actual[row, column])}, expected "
        f"{float(expected[row, column])} within {float(bound[row, column]):.3g} "
        f"(slot {int(before.token_slots[row])})"
    )
    unrouted = before.token_slots.cpu() < 0
    assert torch.equal(case.y.cpu()[unrouted], before.y.cpu()[unrouted]), "a -1 row was written"
