"""The TcpConnector's scheduler side, block by block: a producer holds a finished prompt's blocks
and answers where to pull them; a consumer parks a request in WAITING_FOR_REMOTE_KVS, pulls the
matching blocks into its own, admits it as a prefix hit, and computes the prompt itself when the
pull fails or the tokens differ."""

from __future__ import annotations

from core_engine.common.block_hash import transfer_block_hashes
from core_engine.core.kv_connector.tcp_connector import TcpConnector
from core_engine.core.request import RequestStatus
from core_engine.proto.kv_transfer import (
    KV_ROLES,
    KVConnectorHandshake,
    KVConnectorOutput,
    KVTransferConfig,
    RequestPull,
    RequestSend,
    TcpConnectorMetadata,
)
from core_engine.proto.kv_transfer_params import KVTransferParams
from tests.helpers.core_factories import BLOCK_SIZE, fake_model_output, make_request, make_scheduler

HANDSHAKE = KVConnectorHandshake(
    bytes_per_block=1000,
    num_host_blocks=0,
    transfer_host="127.0.0.1",
    transfer_port=5555,
    engine_id="prefill-engine",
)
PROMPT = list(range(100, 113))  # 13 tokens: 3 full blocks of 4 and one token
HASHES = transfer_block_hashes(PROMPT, BLOCK_SIZE)
REMOTE = KVTransferParams(
    do_remote_prefill=True,
    remote_engine_id="prefill-engine",
    remote_host="10.0.0.1",
    remote_port=5555,
    remote_request_id="p",
    remote_block_ids=[7, 8, 9],
    remote_block_hashes=[h.hex() for h in HASHES],
)


def tcp_scheduler(role: str):
    scheduler = make_scheduler(num_gpu_blocks=16, max_model_len=32)
    transfer = KVTransferConfig(kv_connector="TcpConnector", kv_role=role)
    scheduler.connector = TcpConnector(transfer, BLOCK_SIZE, HANDSHAKE)
    return scheduler


def step(scheduler, connector_output: KVConnectorOutput | None = None):
    scheduler_output = scheduler.schedule()
    model_output = fake_model_output(scheduler, scheduler_output)
    model_output.kv_connector_output = connector_output or KVConnectorOutput()
    outputs = scheduler.update_from_output(scheduler_output, model_output)
    scheduler.kv_cache_manager.check_integrity()
    scheduler.connector.check_integrity()
    return scheduler_output, outputs.outputs


def num_free_blocks(scheduler) -> int:
    return scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


# ---- producer ----------------------------------------------------------------------------


def test_a_producer_holds_the_full_prompt_blocks_until_the_consumer_releases_them():
    scheduler = tcp_scheduler("kv_producer")
    free_before = num_free_blocks(scheduler)
    asked = KVTransferParams(do_remote_decode=True)
    scheduler.add_request(make_request("p", PROMPT, max_tokens=1, kv_transfer_params=asked))
    first, (output,) = step(scheduler)
    block_ids = first.scheduled_new_reqs[0].block_ids[0]
    assert output.finish_reason is not None
    assert output.kv_transfer_params == KVTransferParams(
        do_remote_prefill=True,
        remote_engine_id="prefill-engine",
        remote_host="127.0.0.1",
        remote_port=5555,
        remote_request_id="p",
        remote_block_ids=block_ids[:3],
        remote_block_hashes=[h.hex() for h in HASHES],
    )
    # Finished, but its 4 blocks are held: the engine keeps stepping to register and free them.
    assert not scheduler.has_unfinished_requests()
    assert scheduler.has_kv_transfers_pending()
    assert num_free_blocks(scheduler) == free_before - 4
    registering, _ = step(scheduler)
    assert registering.kv_connector_metadata == TcpConnectorMetadata(
        sends=[RequestSend("p", block_ids[:3], HASHES)], pulls=[], idle=True
    )
    step(scheduler, KVConnectorOutput(finished_sending=["p"]))
    assert num_free_blocks(scheduler) == free_before
    assert not scheduler.has_kv_transfers_pending()


def test_a_producer_holds_nothing_for_an_aborted_request_or_one_that_did_not_ask():
    scheduler = tcp_scheduler("kv_producer")
    free_before = num_free_blocks(scheduler)
    scheduler.add_request(make_request("plain", PROMPT, max_tokens=1))
    _, (output,) = step(scheduler)
    assert output.kv_transfer_params is None
    asked = KVTransferParams(do_remote_decode=True)
    scheduler.add_request(make_request("p", PROMPT, max_tokens=5, kv_transfer_params=asked))
    step(scheduler)
    assert num_free_blocks(scheduler) < free_before
    scheduler.finish_requests("p", RequestStatus.FINISHED_ABORTED)
    assert num_free_blocks(scheduler) == free_before
    assert not scheduler.has_kv_transfers_pending()


# ---- consumer ----------------------------------------------------------------------------


def park(scheduler, request_id: str = "d", prompt=PROMPT, params=REMOTE):
    request = make_request(request_id, prompt, max_tokens=3, kv_transfer_params=params)
    scheduler.add_request(request)
    parking, outputs = step(scheduler)
    assert outputs == [] and parking.total_num_scheduled_tokens == 0
    return request, parking


def test_a_consumer_pulls_the_remote_blocks_then_admits_the_request_as_a_prefix_hit():
    scheduler = tcp_scheduler("kv_consumer")
    request, parking = park(scheduler)
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    local_ids = scheduler.kv_cache_manager.get_block_ids("d")[0][:3]
    assert parking.kv_connector_metadata == TcpConnectorMetadata(
        sends=[],
        pulls=[
            RequestPull("d", "10.0.0.1", 5555, "prefill-engine", "p", [7, 8, 9], local_ids, HASHES)
        ],
        idle=True,
    )
    waiting, _ = step(scheduler, KVConnectorOutput(finished_recving=["d"], num_bytes_loaded=3000))
    assert waiting.total_num_scheduled_tokens == 0
    admitted, _ = step(scheduler)
    (new_req,) = admitted.scheduled_new_reqs
    assert new_req.num_computed_tokens == 12  # the last prompt token is computed here
    assert admitted.num_scheduled_tokens == {"d": 1}
    assert new_req.block_ids[0][:3] == local_ids
    assert admitted.kv_connector_metadata.pulls == []  # the params are used once
    stats = scheduler.get_stats()
    assert (stats.external_prefix_cache_queries, stats.external_prefix_cache_hits) == (13, 12)
    assert stats.kv_offload_loaded_bytes == 3000


def test_a_failed_pull_makes_the_consumer_compute_the_whole_prompt():
    scheduler = tcp_scheduler("kv_consumer")
    park(scheduler)
    step(scheduler, KVConnectorOutput(failed_recving=["d"]))
    computing, _ = step(scheduler)
    (new_req,) = computing.scheduled_new_reqs
    assert new_req.num_computed_tokens == 0
    assert computing.num_scheduled_tokens == {"d": 13}
    assert computing.kv_connector_metadata.pulls == []


def test_only_blocks_of_the_same_tokens_are_pulled_and_never_the_last_prompt_token():
    scheduler = tcp_scheduler("kv_consumer")
    other = PROMPT[:5] + [999] + PROMPT[6:]  # differs in the second block
    mismatched = make_request("x", other, kv_transfer_params=REMOTE)
    assert scheduler.connector.get_num_new_matched_tokens(mismatched, 0) == (4, True)
    without_params = make_request("w", PROMPT)
    assert scheduler.connector.get_num_new_matched_tokens(without_params, 0) == (0, False)
    exact = PROMPT[:12]  # 3 full blocks: the third holds the last token
    request = make_request("y", exact, kv_transfer_params=REMOTE)
    assert scheduler.connector.get_num_new_matched_tokens(request, 0) == (8, True)
    salted = make_request("z", PROMPT, kv_transfer_params=REMOTE, cache_salt="tenant")
    assert scheduler.connector.get_num_new_matched_tokens(salted, 0) == (0, False)
    assert scheduler.connector.get_num_new_matched_tokens(request, 8) == (0, False)


def test_a_request_that_ends_before_using_its_remote_blocks_releases_them():
    scheduler = tcp_scheduler("kv_consumer")
    # Prompt logprobs need every prompt token's logits: no external KV, but a release.
    scheduler.add_request(
        make_request("d", PROMPT, max_tokens=1, kv_transfer_params=REMOTE, prompt_logprobs=1)
    )
    computing, _ = step(scheduler)
    assert computing.num_scheduled_tokens == {"d": 13}
    assert scheduler.has_kv_transfers_pending()
    releasing, _ = step(scheduler)
    assert releasing.kv_connector_metadata.pulls == [
        RequestPull("d", "10.0.0.1", 5555, "prefill-engine", "p", [], [], [])
    ]
    assert not scheduler.has_kv_transfers_pending()


def test_a_request_aborted_while_pulling_frees_its_blocks_and_is_named_to_the_workers():
    scheduler = tcp_scheduler("kv_consumer")
    free_before = num_free_blocks(scheduler)
    park(scheduler)
    scheduler.finish_requests("d", RequestStatus.FINISHED_ABORTED)
    assert num_free_blocks(scheduler) == free_before
    after, _ = step(scheduler, KVConnectorOutput(finished_recving=["d"]))  # a late report
    assert "d" in after.finished_req_ids  # the worker drops its pull before copying
    assert after.kv_connector_metadata.pulls == []  # the pull in flight releases the producer
    assert not scheduler.has_unfinished_requests()


def test_the_start_up_line_names_the_roles_and_the_block_server():
    lines = {role: tcp_scheduler(role).connector.describe() for role in KV_ROLES}
    assert lines["kv_producer"] == (
        f"KV transfer (TcpConnector): serves KV on 127.0.0.1:5555, blocks of {BLOCK_SIZE} tokens"
    )
    assert lines["kv_consumer"] == (
        f"KV transfer (TcpConnector): pulls prefills' KV from producers, blocks of {BLOCK_SIZE} "
        "tokens"
    )
    assert "serves KV on 127.0.0.1:5555 and pulls prefills' KV" in lines["kv_both"]
