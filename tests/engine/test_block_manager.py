"""KVCacheManager unit tests: allocation, prefix sharing, LRU eviction, swap mappings, sizing."""

from __future__ import annotations

import pytest

from ttsserve.engine.block_manager import KVCacheManager, kv_pool_report, size_kv_pool
from ttsserve.engine.request import Request


def make_req(rid: str, prompt: list, prefix_key: str | None = None, mode: str = "code") -> Request:
    return Request(rid, prompt, mode=mode, prefix_key=prefix_key)


def check_consistent(bm: KVCacheManager, live: list[Request]) -> None:
    refs = [0] * bm.num_gpu_blocks
    for r in live:
        for b in r.block_table:
            refs[b] += 1
    assert refs == bm.ref_cnt
    assert set(bm.free_queue) == {b for b in range(bm.num_gpu_blocks) if refs[b] == 0}
    for h, b in bm.cached_blocks.items():
        assert bm.block_hash[b] == h


def admit(bm: KVCacheManager, req: Request) -> int:
    """Admission as the scheduler does it: prefix hits, then the rest of the prompt."""
    req.num_computed_tokens = bm.get_computed_blocks(req)
    assert bm.allocate_slots(req, req.num_tokens - req.num_computed_tokens)
    return req.num_computed_tokens


def finish_prefill(req: Request) -> None:
    req.num_computed_tokens = req.num_tokens


def test_allocate_grows_block_table_and_free_returns_everything():
    bm = KVCacheManager(num_gpu_blocks=8, block_size=4)
    r = make_req("a", list(range(10)))
    assert bm.allocate_slots(r, 10)
    assert len(r.block_table) == 3 and bm.num_free_blocks == 5
    finish_prefill(r)
    assert bm.allocate_slots(r, 2)  # positions 10, 11 still fit in block 3
    assert len(r.block_table) == 3
    assert bm.allocate_slots(r, 3)
    assert len(r.block_table) == 4
    assert not bm.allocate_slots(r, 100)  # refused without side effects
    assert len(r.block_table) == 4 and bm.num_free_blocks == 4
    check_consistent(bm, [r])
    bm.free(r)
    assert r.block_table == [] and bm.num_free_blocks == 8 and bm.usage == 0.0
    check_consistent(bm, [])
    with pytest.raises(ValueError, match="num_new_tokens"):
        bm.allocate_slots(r, 0)


def test_prefix_sharing_same_key_shares_full_blocks_only():
    bm = KVCacheManager(num_gpu_blocks=16, block_size=4)
    prompt = [(i, i, i, i) for i in range(10)]  # 2 full blocks + 2 positions
    a = make_req("a", prompt, prefix_key="spk1")
    assert admit(bm, a) == 0
    finish_prefill(a)
    bm.allocate_slots(a, 1)  # next step: a's computed full blocks get published
    b = make_req("b", prompt, prefix_key="spk1")
    assert admit(bm, b) == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]  # the partial block is never shared
    assert [bm.ref_cnt[x] for x in a.block_table[:2]] == [2, 2]
    c = make_req("c", prompt, prefix_key="spk2")  # another speaker: no sharing
    assert admit(bm, c) == 0
    assert not set(c.block_table) & set(a.block_table)
    t = make_req("t", prompt, prefix_key="spk1", mode="text")  # another stage: no sharing
    assert admit(bm, t) == 0
    check_consistent(bm, [a, b, c, t])
    assert bm.prefix_cache_hits == 8 and bm.prefix_cache_queries == 40
    for r in (a, b, c, t):
        bm.free(r)
    check_consistent(bm, [])
    assert bm.num_free_blocks == 16


def test_uncomputed_blocks_are_not_shared():
    """A block is published only after its KV was written (num_computed_tokens covers it)."""
    bm = KVCacheManager(num_gpu_blocks=16, block_size=4)
    prompt = list(range(12))
    a = make_req("a", prompt)
    admit(bm, a)  # scheduled, but the step has not run: nothing computed yet
    b = make_req("b", prompt)
    assert admit(bm, b) == 0
    bm.free(a)  # e.g. preempted before its step ran: its blocks must not become cache hits
    c = make_req("c", prompt)
    assert admit(bm, c) == 0


def test_cache_hit_never_covers_the_whole_prompt():
    bm = KVCacheManager(num_gpu_blocks=16, block_size=4)
    a = make_req("a", list(range(8)))  # exactly 2 blocks
    admit(bm, a)
    finish_prefill(a)
    bm.free(a)  # finished: its computed blocks stay cached while free
    assert bm.num_free_blocks == 16 and len(bm.cached_blocks) == 2
    b = make_req("b", list(range(8)))
    assert admit(bm, b) == 4  # the last token must be computed so the step samples
    assert b.block_table[0] == a_first_block(bm, list(range(4)))


def a_first_block(bm: KVCacheManager, tokens: list) -> int:
    (bid,) = [b for h, b in bm.cached_blocks.items() if h[1] == tuple(tokens)]
    return bid


def test_lru_eviction_reuses_uncached_blocks_first_then_oldest_cached():
    bm = KVCacheManager(num_gpu_blocks=4, block_size=2)
    a = make_req("a", [1, 2, 3, 4, 5])  # 3 blocks, 2 full
    admit(bm, a)
    finish_prefill(a)
    bm.free(a)
    assert len(bm.cached_blocks) == 2  # the partial block is not cached
    x = make_req("x", [9, 9])  # needs 1 block: takes an uncached one, the cache survives
    admit(bm, x)
    assert len(bm.cached_blocks) == 2
    a2 = make_req("a2", [1, 2, 3, 4, 5])
    assert admit(bm, a2) == 4
    bm.free(a2)
    bm.free(x)
    y = make_req("y", [7, 7, 7, 7, 7, 7, 7, 7])  # needs all 4 blocks: every cached block is evicted
    admit(bm, y)
    assert bm.cached_blocks == {} and bm.num_free_blocks == 0
    bm.free(y)
    a3 = make_req("a3", [1, 2, 3, 4, 5])
    assert admit(bm, a3) == 0
    check_consistent(bm, [a3])


def test_output_blocks_are_cached_for_recompute():
    bm = KVCacheManager(num_gpu_blocks=8, block_size=2)
    r = make_req("r", [1, 2, 3])
    admit(bm, r)
    finish_prefill(r)
    for tok in [(5,), (6,), (7,)]:  # three decode steps
        r.output_token_ids.append(tok)
        assert bm.allocate_slots(r, 1)
        r.num_computed_tokens += 1
    r.output_token_ids.append((8,))  # sampled by the last step, not computed yet
    assert len(bm.cached_blocks) == 1  # while it runs, only the full prompt block [1, 2] is published
    bm.free(r, keep_outputs=True)  # preempted (recompute): 6 computed positions = 3 full blocks stay cached
    r.num_computed_tokens = 0
    assert bm.get_computed_blocks(r) == 6
    check_consistent(bm, [r])


def test_a_finished_request_publishes_its_prompt_blocks_only():
    """Output blocks hold sampled codes no other request repeats: a finished request leaves its prompt's full
    blocks cached (an identical prompt reuses them) and hashes none of its outputs."""
    bm = KVCacheManager(num_gpu_blocks=8, block_size=2)
    r = make_req("r", [1, 2, 3, 4, 5])
    admit(bm, r)
    finish_prefill(r)
    for tok in [(5,), (6,), (7,), (8,)]:
        r.output_token_ids.append(tok)
        assert bm.allocate_slots(r, 1)
        r.num_computed_tokens += 1
    bm.free(r)
    assert sorted(h[1] for h in bm.cached_blocks) == [(1, 2), (3, 4)]
    again = make_req("again", [1, 2, 3, 4, 5])
    assert bm.get_computed_blocks(again) == 4
    check_consistent(bm, [again])


def test_swap_out_and_in_round_trip():
    bm = KVCacheManager(num_gpu_blocks=8, block_size=4, num_cpu_blocks=4)
    r = make_req("r", list(range(9)))
    admit(bm, r)
    r.num_computed_tokens = 6  # chunked: 6 of 9 computed, 3 blocks allocated
    old = list(r.block_table)
    assert bm.can_swap_out(r)
    out = bm.swap_out(r)
    assert [g for g, _ in out] == old[:2]  # only blocks holding computed KV are copied
    assert len({c for _, c in out}) == 2 and bm.num_free_cpu_blocks == 2
    assert r.block_table == [] and bm.num_free_blocks == 8
    assert bm.num_swapped_blocks(r) == 2
    assert bm.can_swap_in(r, num_new_tokens=3)
    back = bm.swap_in(r)
    assert [c for c, _ in back] == [c for _, c in out]  # same host blocks, in block order
    assert [g for _, g in back] == r.block_table
    assert bm.num_free_cpu_blocks == 4
    assert bm.allocate_slots(r, 3)
    check_consistent(bm, [r])
    bm.free(r)
    check_consistent(bm, [])


def test_swap_out_refuses_without_host_room_and_free_releases_host_blocks():
    bm = KVCacheManager(num_gpu_blocks=8, block_size=2, num_cpu_blocks=2)
    r = make_req("r", list(range(6)))
    admit(bm, r)
    finish_prefill(r)
    assert not bm.can_swap_out(r)
    with pytest.raises(ValueError, match="host blocks"):
        bm.swap_out(r)
    r2 = make_req("r2", [1, 2, 3])
    admit(bm, r2)
    finish_prefill(r2)
    bm.swap_out(r2)
    assert bm.num_free_cpu_blocks == 0
    bm.free(r2)  # aborted while swapped
    assert bm.num_free_cpu_blocks == 2


def test_sizing_and_report():
    # ChatTTS: 20 layers x K,V x 768 x 2 bytes = 61440 bytes per frame (MODEL.md §9).
    assert size_kv_pool(10 * 2**30, 61440, 16) == 10922  # floor(10 GiB / 960 KiB)
    assert size_kv_pool(61440 * 16 - 1, 61440, 16) == 0
    rep = kv_pool_report(10922, 16, utterance_seconds=30.0, prompt_len=64)
    assert rep.num_tokens == 174752
    assert rep.tokens_per_utterance == 64 + 1407  # ceil(30 s x 46.875 frames/s)
    assert rep.blocks_per_utterance == 92  # ceil(1471 / 16)
    assert rep.max_concurrent_utterances == 118  # floor(10922 / 92)
    assert "118 concurrent" in str(rep)
    assert kv_pool_report(100, 16, utterance_seconds=1.0, prompt_len=0).tokens_per_utterance == 47
    with pytest.raises(ValueError):
        size_kv_pool(1, 0, 16)
    with pytest.raises(ValueError):
        kv_pool_report(10, utterance_seconds=0)


def test_freed_uncached_blocks_are_handed_out_before_cached_ones():
    bm = KVCacheManager(num_gpu_blocks=3, block_size=2)
    a = make_req("a", [1, 2, 3, 4])
    admit(bm, a)
    finish_prefill(a)
    x = make_req("x", [9])
    admit(bm, x)
    bm.free(a)  # 2 cached blocks
    bm.free(x)  # uncached: goes to the head of the queue although freed last
    y = make_req("y", [8])
    admit(bm, y)
    assert len(bm.cached_blocks) == 2
    check_consistent(bm, [y])


def test_prefix_stats_count_admissions_not_failed_attempts():
    bm = KVCacheManager(num_gpu_blocks=4, block_size=2)
    a = make_req("a", [1, 2, 3, 4, 5])
    admit(bm, a)
    finish_prefill(a)
    bm.allocate_slots(a, 1)  # publishes a's 2 full blocks
    big = make_req("big", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    big.num_computed_tokens = bm.get_computed_blocks(big)
    assert big.num_computed_tokens == 4
    assert not bm.allocate_slots(big, 5)  # pool too full: the scheduler frees and retries later
    bm.free(big)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (5, 0)  # only a's admission
    check_consistent(bm, [a])


def test_request_rejects_unhashable_prompt_items():
    with pytest.raises(ValueError, match="hashable"):
        Request("x", [[1, 2, 3, 4]])


def test_cached_block_keys_leave_the_garbage_collector():
    """The prefix cache keeps a key per full block it publishes (hundreds of thousands in a GPU's pool).
    Each must become untracked by the GC (an exact tuple of untracked items): tracked keys made every full
    collection of the served engine core walk them, a 20-55-ms stall of the step loop on the H200."""
    import gc

    bm = KVCacheManager(num_gpu_blocks=64, block_size=4)
    for n in range(8):
        r = make_req(f"r{n}", [(n, i, i, i) for i in range(17)], prefix_key="spk")
        admit(bm, r)
        finish_prefill(r)
        bm.free(r)  # the computed full blocks are published and stay cached
    assert len(bm.cached_blocks) == 8 * 4
    for _ in range(3):  # a pass untracks a tuple once its items are: inner tuples first, one level a pass
        gc.collect()
    assert not [h for h in bm.cached_blocks if gc.is_tracked(h)]
