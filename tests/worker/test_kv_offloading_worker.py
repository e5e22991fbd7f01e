"""The OffloadingConnector's worker side on small CPU tensors: bytes stored to host slots and
files come back exactly; a file of another model, dtype, block size or layout, a truncated one
and a half-written one are never loaded."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from core_engine.proto.kv_transfer import (
    BlockLoad,
    BlockStore,
    OffloadingConnectorMetadata,
    RequestLoad,
)
from core_engine.worker.kv_connector.disk_kv_tier import DiskKVTier
from core_engine.worker.kv_connector.kv_block_file import KVBlockFileError, read_block_file
from core_engine.worker.kv_connector.kv_block_layout import KVBlockLayout
from core_engine.worker.kv_connector.offloading_connector_worker import OffloadingConnectorWorker

LAYOUT = KVBlockLayout(
    model="/models/tiny.gguf (LlamaForCausalLM)",
    dtype="float32",
    block_size=4,
    num_layers=2,
    num_kv_heads=2,
    head_dim=8,
)
NUM_DEVICE_BLOCKS = 6
HASH_A, HASH_B = b"A" * 16, b"B" * 16


def device_caches(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (2, NUM_DEVICE_BLOCKS, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return [torch.randn(shape, generator=generator) for _ in range(LAYOUT.num_layers)]


def block_of(caches: list[torch.Tensor], block_id: int) -> torch.Tensor:
    return torch.stack([cache[:, block_id] for cache in caches])


def make_connector(disk: DiskKVTier | None = None, seed: int = 0):
    connector = OffloadingConnectorWorker(
        LAYOUT,
        torch.float32,
        torch.device("cpu"),
        host_bytes=4 * 2 * 4 * 2 * 2 * 8 * 4,  # 4 blocks
        disk=disk,
        disk_bytes=1 << 20,
    )
    caches = device_caches(seed)
    connector.register_kv_caches(caches)
    return connector, caches


def run_step(connector, metadata: OffloadingConnectorMetadata):
    connector.bind_connector_metadata(metadata)
    connector.start_load_kv()
    connector.wait_for_save()
    _, finished_recving = connector.get_finished([])
    output = connector.take_connector_output()
    connector.clear_connector_metadata()
    assert set(output.finished_recving) == finished_recving
    return output


def test_blocks_stored_to_host_slots_load_back_exactly_into_other_blocks():
    connector, caches = make_connector()
    assert connector.num_host_blocks == 4
    stored = [block_of(caches, 1).clone(), block_of(caches, 4).clone()]
    output = run_step(
        connector, OffloadingConnectorMetadata(stores=[BlockStore(1, 3), BlockStore(4, 0)])
    )
    assert output.num_bytes_stored == 2 * connector.bytes_per_block
    load = RequestLoad("r", [BlockLoad(5, 3), BlockLoad(2, 0)])
    output = run_step(connector, OffloadingConnectorMetadata(loads=[load]))
    assert output.finished_recving == ["r"]
    assert output.num_bytes_loaded == 2 * connector.bytes_per_block
    assert torch.equal(block_of(caches, 5), stored[0])
    assert torch.equal(block_of(caches, 2), stored[1])


def test_a_block_written_to_disk_survives_a_restart_of_the_tier(tmp_path):
    connector, caches = make_connector(DiskKVTier(tmp_path, LAYOUT))
    expected = block_of(caches, 3).clone()
    run_step(connector, OffloadingConnectorMetadata(stores=[BlockStore(3, None, HASH_A)]))
    connector.shutdown()  # drains the writer
    (path,) = (tmp_path / LAYOUT.fingerprint).iterdir()
    assert path.name == HASH_A.hex() + ".kv"

    restarted, fresh_caches = make_connector(DiskKVTier(tmp_path, LAYOUT), seed=1)
    handshake = restarted.handshake()
    assert handshake.disk_block_hashes == [HASH_A]
    assert handshake.num_host_blocks == 4
    load = RequestLoad("r", [BlockLoad(0, 2, HASH_A)])
    assert run_step(restarted, OffloadingConnectorMetadata(loads=[load])).finished_recving == ["r"]
    assert torch.equal(block_of(fresh_caches, 0), expected)
    assert torch.equal(restarted.host.read_slots([2])[0], expected)  # promoted to its slot
    restarted.shutdown()


@pytest.mark.parametrize(
    "change",
    [
        {"model": "/models/other.gguf (LlamaForCausalLM)"},
        {"dtype": "bfloat16"},
        {"block_size": 8},
        {"num_kv_heads": 1},
        {"tp_rank": 1, "tp_size": 2},
    ],
)
def test_a_file_of_another_model_dtype_block_size_or_layout_is_never_loaded(tmp_path, change):
    other = dataclasses.replace(LAYOUT, **change)
    writer, _ = make_connector(DiskKVTier(tmp_path, LAYOUT))
    run_step(writer, OffloadingConnectorMetadata(stores=[BlockStore(1, None, HASH_A)]))
    writer.shutdown()
    written = tmp_path / LAYOUT.fingerprint / (HASH_A.hex() + ".kv")
    # Even placed where `other` looks, the header gives it away.
    foreign_folder = tmp_path / other.fingerprint
    foreign_folder.mkdir()
    os.replace(written, foreign_folder / written.name)
    with pytest.raises(KVBlockFileError, match="another layout"):
        read_block_file(foreign_folder / written.name, other, HASH_A)
    tier = DiskKVTier(tmp_path, other)
    assert tier.scan() == []
    tier.close()


def test_a_truncated_file_is_never_loaded_and_fails_its_request(tmp_path):
    connector, caches = make_connector(DiskKVTier(tmp_path, LAYOUT))
    run_step(
        connector,
        OffloadingConnectorMetadata(
            stores=[BlockStore(1, None, HASH_A), BlockStore(2, None, HASH_B)]
        ),
    )
    connector.disk.flush()
    path = connector.disk.path_of(HASH_B)
    path.write_bytes(path.read_bytes()[:-10])
    assert connector.disk.scan() == [HASH_A]  # and the damaged file is removed
    path.write_bytes(b"CEKVBLK1")  # put a damaged one back for the load
    before = block_of(caches, 4).clone()
    load = RequestLoad("r", [BlockLoad(3, None, HASH_A), BlockLoad(4, 1, HASH_B)])
    output = run_step(connector, OffloadingConnectorMetadata(loads=[load]))
    assert output.failed_recving == ["r"]
    assert output.finished_recving == []
    assert output.invalid_block_hashes == [HASH_B]
    assert torch.equal(block_of(caches, 4), before)
    assert not path.exists()
    connector.shutdown()


def test_a_half_written_file_is_never_loaded(tmp_path):
    tier = DiskKVTier(tmp_path, LAYOUT)
    half_written = tier.folder / (HASH_A.hex() + ".kv.1234.tmp")
    half_written.write_bytes(b"CEKVBLK1\x00\x00")
    assert tier.scan() == []
    assert half_written.exists()  # young: it may belong to a writer still running
    with pytest.raises(KVBlockFileError):
        tier.read(HASH_A)
    tier.close()


def test_a_corrupt_payload_fails_its_checksum(tmp_path):
    connector, _ = make_connector(DiskKVTier(tmp_path, LAYOUT))
    run_step(connector, OffloadingConnectorMetadata(stores=[BlockStore(1, None, HASH_A)]))
    connector.disk.flush()
    path = connector.disk.path_of(HASH_A)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(KVBlockFileError, match="checksum"):
        read_block_file(path, LAYOUT, HASH_A)
    connector.shutdown()


def test_a_block_read_while_its_write_is_queued_comes_from_the_queue(tmp_path):
    tier = DiskKVTier(tmp_path, LAYOUT)
    tier._pending[HASH_A] = b"queued"  # as `write` leaves it until the writer gets to it
    assert tier.read(HASH_A) == b"queued"
    tier.close()
