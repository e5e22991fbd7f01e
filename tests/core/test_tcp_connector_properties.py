"""Property test: random add / step / abort sequences on a `kv_both` TcpConnector scheduler, with
a fake worker whose pulls end after random delays (or fail) and whose producer holds are
released at random, keep the pool sound, and every block a running request computed (itself,
from the prefix cache, or pulled from a remote prompt) holds the KV of its own tokens.

A block's KV is modelled by a label: the transfer hash of the tokens up to its end. The remote
prompts are the request's own or one that differs in a token, so a pull of the wrong blocks
shows as a wrong label."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core_engine.common.block_hash import transfer_block_hashes
from core_engine.core.kv_connector.tcp_connector import TcpConnector
from core_engine.core.request import RequestStatus
from core_engine.proto.kv_transfer import KVConnectorHandshake, KVConnectorOutput, KVTransferConfig
from core_engine.proto.kv_transfer_params import KVTransferParams
from tests.helpers.core_factories import BLOCK_SIZE, fake_model_output, make_request, make_scheduler

HANDSHAKE = KVConnectorHandshake(1000, 0, transfer_host="h", transfer_port=1, engine_id="e")


def labels(token_ids: list[int]) -> list[bytes]:
    return transfer_block_hashes(token_ids, BLOCK_SIZE)


def remote_params(prompt: list[int], remote_id: str) -> KVTransferParams:
    hashes = labels(prompt)
    return KVTransferParams(
        do_remote_prefill=True,
        remote_engine_id="e",
        remote_host="h",
        remote_port=1,
        remote_request_id=remote_id,
        remote_block_ids=[1000 + i for i in range(len(hashes))],
        remote_block_hashes=[h.hex() for h in hashes],
    )


@dataclass
class FakeWorker:
    """Device blocks as labels; remote blocks by (remote request, block id); pulls in flight."""

    device: dict[int, bytes] = field(default_factory=dict)
    remote: dict[tuple[str, int], bytes] = field(default_factory=dict)
    pulls: dict[str, list] = field(default_factory=dict)  # req id -> [pull, steps left, fails]
    held: set[str] = field(default_factory=set)

    def compute(self, scheduler, scheduler_output) -> None:
        before = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        for cached in scheduler_output.scheduled_cached_reqs:
            before[cached.req_id] = cached.num_computed_tokens
        for request_id, num_before in before.items():
            request = scheduler.requests[request_id]
            block_ids = scheduler.kv_cache_manager.get_block_ids(request_id)[0]
            own = labels(request.all_token_ids)
            num_full = min(request.num_computed_tokens // BLOCK_SIZE, len(own))
            for index in range(num_before // BLOCK_SIZE, num_full):
                self.device[block_ids[index]] = own[index]

    def transfer(self, scheduler_output, data) -> KVConnectorOutput:
        output = KVConnectorOutput()
        metadata = scheduler_output.kv_connector_metadata
        self.held.update(send.req_id for send in metadata.sends)
        for pull in metadata.pulls:
            if pull.local_block_ids:
                delay = data.draw(st.integers(0, 3))
                self.pulls[pull.req_id] = [pull, delay, data.draw(st.booleans())]
        for request_id in scheduler_output.finished_req_ids:
            self.pulls.pop(request_id, None)
        for request_id, entry in list(self.pulls.items()):
            pull, steps_left, fails = entry
            if steps_left > 0:
                entry[1] -= 1
                continue
            del self.pulls[request_id]
            if fails:
                output.failed_recving.append(request_id)
                continue
            for remote_id, local_id in zip(
                pull.remote_block_ids, pull.local_block_ids, strict=True
            ):
                self.device[local_id] = self.remote[(pull.remote_request_id, remote_id)]
            output.finished_recving.append(request_id)
        released = [r for r in sorted(self.held) if data.draw(st.booleans())]
        self.held.difference_update(released)
        output.finished_sending = released
        return output

    def check_running_blocks(self, scheduler) -> None:
        for request in scheduler.running:
            block_ids = scheduler.kv_cache_manager.get_block_ids(request.request_id)[0]
            own = labels(request.all_token_ids)
            num_full = min(request.num_computed_tokens // BLOCK_SIZE, len(own))
            for index in range(num_full):
                assert self.device.get(block_ids[index]) == own[index], (
                    f"{request.request_id} block {index} holds the KV of other tokens"
                )


def step(scheduler, worker: FakeWorker, data) -> None:
    scheduler_output = scheduler.schedule()
    worker.compute(scheduler, scheduler_output)
    model_output = fake_model_output(scheduler, scheduler_output)
    model_output.kv_connector_output = worker.transfer(scheduler_output, data)
    scheduler.update_from_output(scheduler_output, model_output)
    scheduler.kv_cache_manager.check_integrity()
    scheduler.connector.check_integrity()
    worker.check_running_blocks(scheduler)


actions = st.lists(
    st.one_of(
        st.tuples(
            st.sampled_from(["local", "remote", "remote_other", "prefill"]),
            st.lists(st.integers(0, 2), min_size=1, max_size=28),  # few symbols: shared prefixes
            st.integers(1, 6),
        ),
        st.tuples(st.just("step")),
        st.tuples(st.just("abort"), st.integers(0, 100)),
    ),
    max_size=40,
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    actions=actions, num_gpu_blocks=st.integers(9, 14), budget=st.integers(4, 40), data=st.data()
)
def test_random_interleavings_keep_pulled_and_held_blocks_sound(
    actions, num_gpu_blocks, budget, data
):
    scheduler = make_scheduler(
        num_gpu_blocks=num_gpu_blocks,
        max_model_len=32,
        max_num_batched_tokens=budget,
        max_num_seqs=3,
    )
    transfer = KVTransferConfig(kv_connector="TcpConnector", kv_role="kv_both")
    scheduler.connector = TcpConnector(transfer, BLOCK_SIZE, HANDSHAKE)
    worker = FakeWorker()
    added = []
    for action in actions:
        kind = action[0]
        if kind == "step":
            step(scheduler, worker, data)
            continue
        if kind == "abort":
            if added:
                request_id = added[action[1] % len(added)]
                scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)
            continue
        request_id, prompt = f"r{len(added)}", action[1]
        params = None
        if kind == "prefill":
            params = KVTransferParams(do_remote_decode=True)
        elif kind.startswith("remote"):
            remote_prompt = list(prompt)
            if kind == "remote_other":
                remote_prompt[len(prompt) // 2] += 1
            params = remote_params(remote_prompt, f"p{request_id}")
            for index, label in enumerate(labels(remote_prompt)):
                worker.remote[(f"p{request_id}", 1000 + index)] = label
        request = make_request(request_id, prompt, max_tokens=action[2], kv_transfer_params=params)
        scheduler.add_request(request)
        added.append(request_id)
    for _ in range(500):
        if not (scheduler.has_unfinished_requests() or scheduler.has_kv_transfers_pending()):
            break
        step(scheduler, worker, data)
    assert not scheduler.has_unfinished_requests()
    assert not scheduler.has_kv_transfers_pending()
    assert scheduler.kv_cache_manager.usage == 0.0
