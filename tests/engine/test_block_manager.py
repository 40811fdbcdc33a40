"""BlockManager on fake requests: exact block ids, ref counts, eviction order, copy-on-write, prefix
hits."""
from __future__ import annotations

from engine.block_manager import BlockManager
from engine.request import Request
from engine.sequence import Sequence
from shared.sampling import SamplingParams

BS = 4
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def make_request(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(Request(rid, tokens, PARAMS))


def compute(bm: BlockManager, req: Sequence, n: int) -> None:
    """Allocate and 'compute' req's next n tokens as the scheduler and runner would."""
    before = req.num_computed_tokens
    bm.allocate(req, before + n)
    req.num_computed_tokens += n
    if bm.enable_prefix_caching:
        bm.cache_blocks(req, before)


def start(bm: BlockManager, req: Sequence) -> int:
    """Admit req on its cached prefix and compute the rest, as the scheduler would. -> cached
    tokens."""
    hit = bm.lookup(req)
    assert bm.can_allocate_hit(hit, req.num_tokens)
    cached = bm.allocate_hit(req, hit, req.num_tokens)
    assert cached == hit.num_tokens(BS)
    req.num_computed_tokens = req.num_tokens
    bm.cache_blocks(req, cached)
    return cached


def test_hash_chain_shares_full_blocks_only_and_never_the_last_token():
    bm = BlockManager(10, BS, enable_prefix_caching=True)
    a = make_request("a", list(range(100, 110)))  # 2 full blocks + 2 tokens
    assert start(bm, a) == 0
    assert a.block_table == [0, 1, 2] and bm.device.cached == {a.block_hashes[0]: 0,
                                                               a.block_hashes[1]: 1}
    b = make_request("b", list(range(100, 108)) + [7, 7, 7])  # same 2 full blocks, other tail
    assert start(bm, b) == 8
    assert b.block_table == [0, 1, 3]
    assert bm.ref_counts[:4] == [2, 2, 1, 1]
    # exactly 2 blocks: the last token must be computed
    c = make_request("c", list(range(100, 108)))
    assert start(bm, c) == 4 and c.block_table == [0, 4]
    # differs in block 0: block 1's hash differs too
    d = make_request("d", [1] + list(range(101, 108)))
    assert start(bm, d) == 0


def test_freed_blocks_stay_cached_and_are_evicted_least_recently_freed_first():
    bm = BlockManager(6, BS, enable_prefix_caching=True)
    a, b = make_request("a", list(range(9))), make_request("b", list(range(50, 59)))
    start(bm, a)
    start(bm, b)
    assert a.block_table == [0, 1, 2] and b.block_table == [3, 4, 5]
    bm.free(a)
    bm.free(b)  # tails first: each request's last block is evicted before its head
    # Unhashed blocks (the partial tails 2 and 5) hold nothing reusable: they go first of all.
    assert list(bm.device.free_blocks) == [5, 2, 1, 0, 4, 3]
    assert len(bm.device.cached) == 4
    again = make_request("a2", list(range(9)))
    assert start(bm, again) == 8 and again.block_table == [0, 1, 5]  # hits 0, 1; takes unhashed 5
    assert list(bm.device.free_blocks) == [2, 4, 3]
    other = make_request("x", list(range(200, 205)))
    start(bm, other)  # takes 2 (unhashed) then 4, evicting b's second block; b's head (3) survives
    assert other.block_table == [2, 4] and sorted(bm.device.cached.values()) == [0, 1, 2, 3]
    assert bm.lookup(make_request("b2", list(range(50, 59)))).device == [3]


def test_copy_on_write_exactly_when_a_shared_partial_block_is_written():
    bm = BlockManager(8, BS)
    root = make_request("r", list(range(10)))  # 10 tokens: blocks 0, 1 full, block 2 holds 1 token
    compute(bm, root, 9)
    child = root.fork(1)
    bm.fork(root, child)
    assert bm.ref_counts[:3] == [2, 2, 2]
    assert bm.num_new_blocks(child, 10) == 1  # writing position 9 lands in shared block 2
    compute(bm, child, 1)
    assert bm.take_moves().copies == [(2, 3)] and child.block_table == [0, 1, 3]
    assert bm.ref_counts[:4] == [2, 2, 1, 1]
    assert bm.num_new_blocks(root, 10) == 0  # block 2 is root's alone now: written in place
    compute(bm, root, 1)
    assert bm.take_moves().copies == [] and root.block_table == [0, 1, 2]  # no second copy
    # At a block boundary nothing is copied: the next token gets a fresh block.
    r2 = make_request("r2", list(range(9)))
    compute(bm, r2, 8)
    c2 = r2.fork(1)
    bm.fork(r2, c2)
    bm.begin_step()
    compute(bm, c2, 1)
    assert bm.take_moves().copies == [] and c2.block_table == r2.block_table + [6]
    for r in (root, child, r2, c2):
        bm.free(r)
    assert set(bm.ref_counts) == {0} and bm.num_free_blocks == 8


def test_evicted_hashed_block_moves_to_cpu_tier_and_a_hit_there_is_swapped_back_in():
    bm = BlockManager(3, BS, num_cpu_blocks=4, enable_prefix_caching=True)
    a = make_request("a", list(range(9)))  # blocks 0, 1 hashed, 2 partial
    start(bm, a)
    bm.free(a)
    bm.begin_step()
    # evicts all three: only the two hashed ones are saved
    x = make_request("x", list(range(300, 309)))
    start(bm, x)
    # Free order was [2, 1, 0]: 2 held no hash; 1 and 0 did and go to CPU blocks 0 and 1.
    assert bm.take_moves().swap_out == [(1, 0), (0, 1)]
    assert bm.cpu.cached == {a.block_hashes[1]: 0, a.block_hashes[0]: 1}
    assert bm.cpu.ref_counts[:2] == [1, 1]  # held until the runner has copied them
    bm.free(x)
    bm.begin_step()
    assert bm.cpu.ref_counts[:2] == [0, 0]
    again = make_request("a2", list(range(9)))
    hit = bm.lookup(again)
    assert hit.device == [] and hit.cpu == [1, 0]
    assert start(bm, again) == 8
    # x freed [2, 1, 0] tail first: 0 (x's unhashed tail) is taken first, then 1 and 2, x's full
    # blocks, which go to the CPU tier in turn (CPU blocks 2 and 3).
    moves = bm.take_moves()
    assert moves.swap_in == [(1, 0), (0, 1)] and again.block_table == [0, 1, 2]
    assert moves.swap_out == [(1, 2), (2, 3)]
    assert bm.stats["prefix_cpu_hits"] == 8


def test_reset_prefix_cache_forgets_everything_but_blocks_in_use_keep_running():
    bm = BlockManager(6, BS, enable_prefix_caching=True)
    a = make_request("a", list(range(9)))
    start(bm, a)
    bm.reset_prefix_cache()
    assert bm.device.cached == {} and a.block_table == [0, 1, 2] and bm.ref_counts[:3] == [1, 1, 1]
    assert start(bm, make_request("b", list(range(9)))) == 0


def test_caching_off_never_hits():
    bm = BlockManager(6, BS)
    start(bm, make_request("a", list(range(9))))
    assert start(bm, make_request("b", list(range(9)))) == 0 and bm.device.cached == {}
