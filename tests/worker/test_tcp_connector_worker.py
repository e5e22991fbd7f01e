"""The TcpConnector's worker side between two in-process KV caches: a producer's block server and
a consumer pulling from it over TCP on this host. Pulled blocks hold exactly the producer's
bytes; a block of other tokens, another layout or engine, a refused or cut connection give
nothing and fail the pull; the producer frees its blocks once released, or after its timeout."""

from __future__ import annotations

import dataclasses
import socket
import threading
import time

import pytest
import torch

from core_engine.proto.kv_pull_messages import KVPullReply, encode_frame
from core_engine.proto.kv_transfer import (
    KVTransferConfig,
    RequestPull,
    RequestSend,
    TcpConnectorMetadata,
)
from core_engine.worker.kv_connector.kv_block_layout import KVBlockLayout
from core_engine.worker.kv_connector.tcp_connector_worker import TcpConnectorWorker

LAYOUT = KVBlockLayout(
    model="/models/tiny.gguf (LlamaForCausalLM)",
    dtype="float32",
    block_size=4,
    num_layers=2,
    num_kv_heads=2,
    head_dim=8,
)
NUM_BLOCKS = 6
HASH_A, HASH_B = b"A" * 16, b"B" * 16
DEADLINE_S = 20.0


def caches(seed: int, layout: KVBlockLayout = LAYOUT) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (2, NUM_BLOCKS, layout.block_size, layout.num_kv_heads, layout.head_dim)
    return [torch.randn(shape, generator=generator) for _ in range(layout.num_layers)]


def block_of(kv_caches: list[torch.Tensor], block_id: int) -> torch.Tensor:
    return torch.stack([cache[:, block_id] for cache in kv_caches])


def make_worker(role: str, seed: int, layout: KVBlockLayout = LAYOUT, **options):
    extra = {"pull_timeout_s": 5.0, **options}
    transfer = KVTransferConfig(
        kv_connector="TcpConnector", kv_role=role, kv_connector_extra_config=extra
    )
    worker = TcpConnectorWorker(transfer, layout, torch.float32, torch.device("cpu"))
    kv_caches = caches(seed, layout)
    worker.register_kv_caches(kv_caches)
    return worker, kv_caches


def run_step(worker, metadata=None, finished_req_ids=()):
    worker.bind_connector_metadata(metadata or TcpConnectorMetadata(idle=True))
    worker.start_load_kv()
    worker.wait_for_save()
    worker.get_finished(list(finished_req_ids))
    output = worker.take_connector_output()
    worker.clear_connector_metadata()
    return output


def steps_until(worker, done, metadata=None):
    """Steps `worker` (the first step with `metadata`) until `done(output)`; the outputs."""
    outputs = [run_step(worker, metadata)]
    deadline = time.monotonic() + DEADLINE_S
    while not done(outputs[-1]):
        assert time.monotonic() < deadline, "the transfer never ended"
        outputs.append(run_step(worker))
    return outputs


def pull_of(producer, remote_ids, local_ids, hashes, request_id="p", port=None, engine_id=None):
    handshake = producer.handshake()
    return RequestPull(
        req_id="d",
        host="127.0.0.1",
        port=port or handshake.transfer_port,
        engine_id=engine_id or handshake.engine_id,
        remote_request_id=request_id,
        remote_block_ids=remote_ids,
        local_block_ids=local_ids,
        block_hashes=hashes,
    )


def hold(producer, block_ids=(1, 4), hashes=(HASH_A, HASH_B)):
    run_step(
        producer, TcpConnectorMetadata(sends=[RequestSend("p", list(block_ids), list(hashes))])
    )


def ended(output) -> bool:
    return bool(output.finished_recving or output.failed_recving)


def test_pulled_blocks_hold_exactly_the_producers_bytes_and_the_producer_frees_them():
    producer, producer_caches = make_worker("kv_producer", seed=0)
    consumer, consumer_caches = make_worker("kv_consumer", seed=1)
    untouched = [block_of(consumer_caches, b).clone() for b in range(NUM_BLOCKS)]
    hold(producer)
    pull = pull_of(producer, [4, 1], [2, 5], [HASH_B, HASH_A])
    outputs = steps_until(consumer, ended, TcpConnectorMetadata(pulls=[pull]))
    assert outputs[-1].finished_recving == ["d"] and outputs[-1].failed_recving == []
    assert outputs[-1].num_bytes_loaded == 2 * consumer.bytes_per_block
    assert torch.equal(block_of(consumer_caches, 2), block_of(producer_caches, 4))
    assert torch.equal(block_of(consumer_caches, 5), block_of(producer_caches, 1))
    for block_id in (0, 1, 3, 4):
        assert torch.equal(block_of(consumer_caches, block_id), untouched[block_id])
    released = steps_until(producer, lambda output: output.finished_sending)
    assert released[-1].finished_sending == ["p"]


def test_a_bf16_cache_round_trips_bit_for_bit():
    layout = dataclasses.replace(LAYOUT, dtype="bfloat16")
    transfer = KVTransferConfig(kv_connector="TcpConnector", kv_role="kv_both")
    workers = [
        TcpConnectorWorker(transfer, layout, torch.bfloat16, torch.device("cpu")) for _ in range(2)
    ]
    kv = [[c.to(torch.bfloat16) for c in caches(seed, layout)] for seed in (0, 1)]
    for worker, kv_caches in zip(workers, kv, strict=True):
        worker.register_kv_caches(kv_caches)
    hold(workers[0], block_ids=[3], hashes=[HASH_A])
    pull = pull_of(workers[0], [3], [0], [HASH_A])
    steps_until(workers[1], ended, TcpConnectorMetadata(pulls=[pull]))
    assert torch.equal(block_of(kv[1], 0).view(torch.int16), block_of(kv[0], 3).view(torch.int16))


def refused(consumer, consumer_caches, pull) -> None:
    """Runs a pull that must fail; checks that no block of the consumer changed."""
    before = [block_of(consumer_caches, b).clone() for b in range(NUM_BLOCKS)]
    outputs = steps_until(consumer, ended, TcpConnectorMetadata(pulls=[pull]))
    assert outputs[-1].failed_recving == ["d"] and outputs[-1].finished_recving == []
    for block_id in range(NUM_BLOCKS):
        assert torch.equal(block_of(consumer_caches, block_id), before[block_id])


def test_a_block_of_other_tokens_is_never_sent_and_the_hold_is_still_released():
    producer, _ = make_worker("kv_producer", seed=0)
    consumer, consumer_caches = make_worker("kv_consumer", seed=1)
    hold(producer)
    refused(consumer, consumer_caches, pull_of(producer, [1, 4], [2, 3], [HASH_A, HASH_A]))
    released = steps_until(producer, lambda output: output.finished_sending)
    assert released[-1].finished_sending == ["p"]


@pytest.mark.parametrize(
    "other",
    [
        dataclasses.replace(LAYOUT, block_size=8),
        dataclasses.replace(LAYOUT, model="/models/other.gguf (LlamaForCausalLM)"),
        dataclasses.replace(LAYOUT, num_kv_heads=1, head_dim=16),  # the same bytes per block
    ],
)
def test_blocks_of_another_layout_are_never_used(other):
    producer, _ = make_worker("kv_producer", seed=0)
    consumer, consumer_caches = make_worker("kv_consumer", seed=1, layout=other)
    hold(producer)
    pull = pull_of(producer, [1], [2], [HASH_A])
    refused(consumer, consumer_caches, pull)


def test_a_pull_meant_for_another_engine_instance_is_refused():
    producer, _ = make_worker("kv_producer", seed=0)
    consumer, consumer_caches = make_worker("kv_consumer", seed=1)
    hold(producer)
    pull = pull_of(producer, [1], [2], [HASH_A], engine_id="restarted-since")
    refused(consumer, consumer_caches, pull)


def test_a_producer_that_is_gone_fails_the_pull_at_once():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    producer, _ = make_worker("kv_producer", seed=0)
    consumer, consumer_caches = make_worker("kv_consumer", seed=1)
    start = time.monotonic()
    refused(consumer, consumer_caches, pull_of(producer, [1], [2], [HASH_A], port=port))
    assert time.monotonic() - start < 5.0


def test_a_producer_that_dies_mid_transfer_fails_the_pull():
    """A server that reads the pull, promises the bytes, sends half and closes."""
    consumer, consumer_caches = make_worker("kv_consumer", seed=1)
    listener = socket.create_server(("127.0.0.1", 0))

    def die_mid_transfer():
        connection, _ = listener.accept()
        with connection:
            connection.recv(1 << 16)
            num_bytes = consumer.bytes_per_block
            connection.sendall(encode_frame(KVPullReply(LAYOUT.to_json(), num_bytes)))
            connection.sendall(b"\0" * (num_bytes // 2))

    thread = threading.Thread(target=die_mid_transfer, daemon=True)
    thread.start()
    pull = RequestPull("d", "127.0.0.1", listener.getsockname()[1], "e", "p", [1], [2], [HASH_A])
    refused(consumer, consumer_caches, pull)
    listener.close()


def test_a_pull_of_a_request_aborted_meanwhile_is_dropped_before_any_block_is_written():
    producer, _ = make_worker("kv_producer", seed=0)
    consumer, consumer_caches = make_worker("kv_consumer", seed=1)
    before = block_of(consumer_caches, 2).clone()
    # The hold is not registered yet: the server waits for it, so the pull is still running.
    pull = pull_of(producer, [1], [2], [HASH_A])
    first = run_step(consumer, TcpConnectorMetadata(pulls=[pull]))
    aborted = run_step(consumer, finished_req_ids=["d"])
    hold(producer)  # now the server answers the (dropped) pull
    released = steps_until(producer, lambda output: output.finished_sending)
    assert released[-1].finished_sending == ["p"]
    later = [run_step(consumer) for _ in range(5)]
    for output in [first, aborted, *later]:
        assert output.finished_recving == [] and output.failed_recving == []
    assert torch.equal(block_of(consumer_caches, 2), before)


def test_blocks_no_consumer_pulls_are_freed_after_the_send_timeout():
    producer, _ = make_worker("kv_producer", seed=0, send_timeout_s=0.2)
    hold(producer)
    start = time.monotonic()
    released = steps_until(producer, lambda output: output.finished_sending)
    assert released[-1].finished_sending == ["p"]
    assert time.monotonic() - start >= 0.15
