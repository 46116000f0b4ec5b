"""The decode's read plan: which of a handle's blocks it asks its own kvstore for, the
tail only when it leaves the last token to compute, and no read of another kvstore."""
from __future__ import annotations

from pdserve.services.decode.read_plan import KV_WRITE_WAIT_MS, ReadPlan, ReadRefusal, plan_read
from pdserve.services.pb import common_pb2
from pdserve.services.worker.kv_integrity import KVSTORE_ADDRESS

OWN = "kvstore:50051"
BLOCK = 4
HASHES = [bytes([i]) * 32 for i in range(4)]  # the worker's hashes of 4 full blocks


def _handle(num_tokens: int, tail_key: str = "", lease_id: str = "lease-1", address: str = OWN,
            block_hashes=None) -> common_pb2.KVHandle:
    named = HASHES[:num_tokens // BLOCK] if block_hashes is None else block_hashes
    return common_pb2.KVHandle(block_hashes=named, tail_key=tail_key, lease_id=lease_id, num_tokens=num_tokens,
                               kvstore_address=address)


def test_a_handle_naming_no_kvstore_plans_nothing():
    assert plan_read(_handle(8, address=""), HASHES, 17, BLOCK, OWN) is None


def test_full_blocks_are_read_under_the_lease_with_a_wait():
    plan = plan_read(_handle(8), HASHES, 17, BLOCK, OWN)
    assert plan == ReadPlan(HASHES[:2], "", 0, "lease-1", KV_WRITE_WAIT_MS, False)
    assert (plan.num_asked, plan.tail_keys) == (2, [])


def test_without_a_lease_the_store_does_not_wait():
    plan = plan_read(_handle(8, lease_id=""), HASHES, 17, BLOCK, OWN)
    assert (plan.lease_id, plan.wait_ms) == ("", 0)


def test_a_partial_tail_is_read_when_the_last_token_is_left_to_compute():
    # |b0|b1|t t| . :  10 handle tokens, 12 tokens in all
    plan = plan_read(_handle(10, tail_key="r/tail/x"), HASHES, 12, BLOCK, OWN)
    assert (plan.block_hashes, plan.tail_key, plan.num_tail_tokens) == (HASHES[:2], "r/tail/x", 2)
    assert (plan.num_asked, plan.tail_keys) == (3, ["r/tail/x"])


def test_a_tail_that_covers_the_last_token_is_recomputed():
    plan = plan_read(_handle(10, tail_key="r/tail/x"), HASHES, 10, BLOCK, OWN)
    assert (plan.tail_key, plan.num_tail_tokens, plan.num_asked) == ("", 0, 2)


def test_a_tail_key_without_tail_tokens_is_not_read():
    plan = plan_read(_handle(8, tail_key="r/tail/x"), HASHES, 17, BLOCK, OWN)
    assert (plan.tail_key, plan.num_tail_tokens) == ("", 0)


def test_the_blocks_asked_are_the_workers_own_hashes_not_the_handles():
    forged = [b"\xff" * 32, b"\xee" * 32]
    plan = plan_read(_handle(8, block_hashes=forged), HASHES, 17, BLOCK, OWN)
    assert plan.block_hashes == HASHES[:2] and plan.names_other_blocks


def test_a_handle_longer_than_the_tokens_asks_only_their_blocks():
    plan = plan_read(_handle(16), HASHES[:2], 9, BLOCK, OWN)
    assert plan.block_hashes == HASHES[:2]


def test_a_handle_naming_another_kvstore_is_refused_counting_its_blocks():
    refusal = plan_read(_handle(10, tail_key="r/tail/x", address="127.0.0.1:1"), HASHES, 12, BLOCK, OWN)
    assert refusal == ReadRefusal(KVSTORE_ADDRESS, 3)


def test_blocks_the_worker_holds_are_not_read_again():
    plan = plan_read(_handle(14, tail_key="t"), HASHES, 17, BLOCK, OWN, num_local_blocks=2)
    assert (plan.block_hashes, plan.first_block, plan.tail_key, plan.num_tail_tokens) == (HASHES[2:3], 2, "t", 2)
    assert plan.num_asked == 2


def test_holding_every_full_block_leaves_only_the_tail_to_read():
    plan = plan_read(_handle(14, tail_key="t"), HASHES, 17, BLOCK, OWN, num_local_blocks=4)
    assert (plan.block_hashes, plan.first_block, plan.num_tail_tokens) == ([], 3, 2)
