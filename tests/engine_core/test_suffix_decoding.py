"""Suffix decoding's trees (engine_core/suffix_decoding.py) against a brute-force count of every
window's prefixes, over sequences growing side by side with repeats in them; and the cache of
requests' answers."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from engine_core.suffix_decoding import SuffixCache, SuffixTree


class BruteForce:
    """Every window of up to ``depth`` tokens of every sequence, its prefixes counted."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.seqs: dict[int, list[int]] = {}

    def append(self, seq: int, token: int) -> None:
        self.seqs.setdefault(seq, []).append(token)

    def counts(self) -> Counter:
        counts: Counter = Counter()
        for tokens in self.seqs.values():
            for start in range(len(tokens)):
                window = tokens[start:start + self.depth]
                for end in range(1, len(window) + 1):
                    counts[tuple(window[:end])] += 1
        return counts

    def best_score(self, pattern: list[int], max_tokens: int, factor: float, min_prob: float) -> float:
        counts = self.counts()
        pattern = pattern[-self.depth:]
        best = 0.0
        for length in range(1, len(pattern)):
            path = tuple(pattern[len(pattern) - length:])
            if not counts[path]:
                break
            limit = min(max_tokens, int(length * factor + 1e-6))
            prob = score = 0.0
            prob, emitted = 1.0, 0
            while emitted < limit:
                children = [(counts[(*path, t)], t) for t in range(10) if counts[(*path, t)]]
                if not children:
                    break
                count, token = max((count, -token) for count, token in children)
                token = -token
                prob *= count / counts[path]
                if prob < min_prob:
                    break
                path = (*path, token)
                emitted += 1
                score += prob
            best = max(best, score)
        return best


def is_most_counted_path(brute: BruteForce, pattern: list[int], draft: list[int]) -> bool:
    """Whether each draft token is a most counted next token after some matched suffix and the
    draft before it."""
    counts = brute.counts()
    for length in range(1, len(pattern[-brute.depth:])):
        path = tuple(pattern[len(pattern) - length:])
        ok = True
        for token in draft:
            children = {t: counts[(*path, t)] for t in range(10) if counts[(*path, t)]}
            if not children or token != min(t for t, c in children.items() if c == max(children.values())):
                ok = False
                break
            path = (*path, token)
        if ok:
            return True
    return False


@pytest.mark.parametrize("seed", range(6))
def test_every_draft_scores_as_the_brute_force_count_of_windows(seed):
    rng = random.Random(seed)
    depth = rng.choice([3, 5, 8])
    tree, brute = SuffixTree(depth), BruteForce(depth)
    motifs = [[rng.randrange(10) for _ in range(rng.randrange(2, 7))] for _ in range(3)]
    checked = 0
    for _ in range(400):
        seq = rng.randrange(4)
        tokens = rng.choice(motifs) if rng.random() < 0.6 else [rng.randrange(10)]
        for token in tokens:
            tree.append(seq, token)
            brute.append(seq, token)
        if rng.random() < 0.3:
            pattern = (brute.seqs[seq] + [rng.randrange(10)] * rng.randrange(2))[-depth - 2:]
            max_tokens, factor, min_prob = rng.randrange(1, 8), rng.choice([0.5, 1.0, 2.0]), rng.choice([0.0, 0.1, 0.5])
            draft, score = tree.speculate(pattern, max_tokens, factor, min_prob)
            assert score == pytest.approx(brute.best_score(pattern, max_tokens, factor, min_prob))
            assert not draft or is_most_counted_path(brute, pattern, draft)
            checked += bool(draft)
    assert checked > 20
    # (Every sequence's windows, counted as the brute force counts them, through the explicit nodes.)
    counts = brute.counts()
    for path, count in list(counts.items())[:300]:
        assert tree.speculate([*path, 0], 0, 1.0, 0.0)[1] == 0.0  # (no tokens asked for: nothing proposed)
        found = tree._match(list(path))
        assert found is not None
        node = found[0]
        if node.children is not None and found[1] == len(path):
            assert node.count == count, path


def test_a_long_match_drafts_what_followed_it():
    tree = SuffixTree(24)
    tree.extend(0, [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3])
    draft, score = tree.speculate([9, 1, 2, 3], 8, 1.0, 0.1)
    # ("9 1 2 3" was never followed; "1 2 3" was, once of twice (the sequence ends with it): 3
    # tokens for 3 matched, each half likely.)
    assert draft == [4, 5, 6] and score == pytest.approx(1.5)
    assert tree.speculate([9, 1, 2, 3], 8, 2.0, 0.1)[0] == [4, 5, 6, 7, 8, 9]
    assert tree.speculate([5, 5, 0], 8, 1.0, 0.1) == ([], 0.0)  # (0 never came)


def test_the_cache_drafts_from_an_earlier_answer_and_forgets_the_older_generation():
    cache = SuffixCache(depth=16, max_cached_requests=2)
    answer = [50, 51, 52, 53, 54, 55]
    cache.start("a", [1, 2, 3], [])
    cache.add("a", answer)
    cache.stop("a")
    cache.start("b", [7, 8, 9], [])
    # (b's own tree has never seen 50: the answer a gave has.)
    assert cache.speculate("b", [9, 50, 51], 4, 1.0, 0.1) == [52, 53]
    cache.stop("b")
    for name in ("c", "d"):  # (a's generation is dropped when a third request starts after it fills)
        cache.start(name, [4], [])
        cache.stop(name)
    cache.start("e", [5], [])
    assert cache.speculate("e", [5, 50, 51], 4, 1.0, 0.1) == []
    off = SuffixCache(depth=16, max_cached_requests=0)
    off.start("a", [1], [])
    off.add("a", answer)
    off.stop("a")
    off.start("b", [2], [])
    assert off.speculate("b", [2, 50, 51], 4, 1.0, 0.1) == []


def test_the_cache_keeps_no_more_answers_than_asked_nor_more_nodes_than_its_budget(monkeypatch):
    from engine_core import suffix_decoding

    def answers_kept(cache: SuffixCache) -> int:
        return sum(len(tree.seqs) for tree in cache.generations)

    for limit, most in ((1, 1), (2, 2), (3, 2), (4, 4)):
        cache = SuffixCache(depth=8, max_cached_requests=limit)
        peak = 0
        for i in range(9):
            cache.start(str(i), [1, 2], [3, 4, 5])
            cache.stop(str(i))
            peak = max(peak, answers_kept(cache))
            assert answers_kept(cache) >= min(limit, i + 1, max(1, limit // 2))  # (the latest are kept)
        assert peak == most, limit
    monkeypatch.setattr(suffix_decoding, "GENERATION_MAX_NODES", 50)
    cache = SuffixCache(depth=8, max_cached_requests=-1)
    rng = random.Random(0)
    for i in range(20):
        cache.start(str(i), [1], [rng.randrange(1000) for _ in range(30)])
        cache.stop(str(i))
    assert len(cache.generations) == 2 and answers_kept(cache) < 20
