"""Suffix decoding (vLLM's ``suffix`` speculative method, after SuffixDecoding, Oliaro et al. 2024):
drafts from the continuations seen after the context's last tokens, in the request's own prompt
and output, and in the answers earlier requests gave, without a model.

A ``SuffixTree`` counts every window of up to ``depth`` tokens of the sequences it holds (a window
starts at each token): the count of a path is how many windows begin with it. Speculating, each
suffix of the context's last tokens that some window begins with is a match; from the longest on
down to one token, the continuation follows the most counted next token while its estimated
probability (the product of count ratios along the way; on a tie the lowest token id) stays at
least ``min_token_prob``, for at
most ``max_spec_factor`` tokens per matched token; the draft whose probabilities sum highest wins.

Storage: the paths at least two windows share are explicit nodes; below them a path only one
window takes is one node (a "tail") that reads its tokens from the window's sequence. Unique text
costs about one node per token; text repeated costs up to ``depth`` nodes per token.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class _Node:
    """An explicit path (``children``: next token -> node; ``count``: windows through or ending
    here), or a tail: the one window (``seq``, ``start``) below its parent (``children`` None)."""

    __slots__ = ("children", "count", "seq", "start")

    def __init__(self, count: int, children: dict[int, _Node] | None, seq: int = -1, start: int = -1) -> None:
        self.count = count
        self.children = children
        self.seq = seq
        self.start = start


class SuffixTree:
    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = _Node(0, {})
        self.num_nodes = 1
        self.seqs: dict[int, list[int]] = {}
        # Per sequence, its windows still growing (fewer than depth tokens): start -> the explicit
        # node where the window ends, or the tail that holds it.
        self._growing: dict[int, dict[int, _Node]] = {}

    def extend(self, seq: int, tokens: Iterable[int]) -> None:
        for token in tokens:
            self.append(seq, token)

    def append(self, seq: int, token: int) -> None:
        """``token`` after sequence ``seq``'s (a new sequence when unknown)."""
        tokens = self.seqs.setdefault(seq, [])
        growing = self._growing.setdefault(seq, {})
        n = len(tokens)  # (the new token's index)
        tokens.append(token)
        growing.pop(n - self.depth, None)  # (a window of depth tokens grows no more)
        # Windows inside a tail take the token without a change (the tail reads the sequence);
        # those ending at an explicit node step down, and so does the one this token starts.
        explicit = [start for start, node in growing.items() if node.children is not None]
        self.root.count += 1
        growing[n] = self.root
        explicit.append(n)
        for start in explicit:
            node = growing[start]
            assert node.children is not None
            child = node.children.get(token)
            if child is None:
                growing[start] = node.children[token] = _Node(1, None, seq, start)
                self.num_nodes += 1
            elif child.children is not None:
                child.count += 1
                growing[start] = child
            else:
                self._split(child, n - start + 1)
                growing[start] = child

    def _split(self, tail: _Node, depth: int) -> None:
        """A second window takes the tail's first token (the tail is at ``depth``): the tail becomes
        an explicit node of two, and its window goes on below in a tail of its own, or ends there."""
        seq, start = tail.seq, tail.start
        tokens = self.seqs[seq]
        tail.children, tail.count = {}, 2
        after = start + depth  # (the index of the window's token below this node)
        holder = tail
        if after < min(start + self.depth, len(tokens)):
            holder = tail.children[tokens[after]] = _Node(1, None, seq, start)
            self.num_nodes += 1
        growing = self._growing.get(seq)
        if growing is not None and start in growing:
            growing[start] = holder

    def finish(self, seq: int) -> None:
        """The sequence takes no more tokens (its windows stay)."""
        self._growing.pop(seq, None)

    def _match(self, pattern: Sequence[int]) -> tuple[_Node, int] | None:
        """Where the path ``pattern`` ends (node, depth), None when no window begins with it."""
        node, depth = self.root, 0
        for token in pattern:
            if node.children is None:
                tokens = self.seqs[node.seq]
                index = node.start + depth
                if index >= min(node.start + self.depth, len(tokens)) or tokens[index] != token:
                    return None
            else:
                child = node.children.get(token)
                if child is None:
                    return None
                node = child
            depth += 1
        return node, depth

    def _continue(self, node: _Node, depth: int, limit: int, min_prob: float) -> tuple[list[int], float]:
        """The most counted continuation from (node, depth): at most ``limit`` tokens, while the
        estimated probability stays at least ``min_prob``; and its probabilities' sum."""
        draft: list[int] = []
        prob, score = 1.0, 0.0
        while len(draft) < limit:
            if node.children is None:
                tokens = self.seqs[node.seq]
                index = node.start + depth
                if index >= min(node.start + self.depth, len(tokens)):
                    break
                token = tokens[index]
            else:
                best = None  # (the most counted; on a tie the lowest token id, so that drafts are reproducible)
                for candidate, child in node.children.items():
                    if best is None or child.count > best[1].count or (
                            child.count == best[1].count and candidate < best[0]):
                        best = (candidate, child)
                if best is None:
                    break
                prob *= best[1].count / node.count
                if prob < min_prob:
                    break
                token, node = best
            depth += 1
            draft.append(token)
            score += prob
        return draft, score

    def speculate(self, pattern: Sequence[int], max_tokens: int, max_spec_factor: float, min_token_prob: float
                  ) -> tuple[list[int], float]:
        """The best draft after ``pattern`` (its last tokens matched, up to ``depth`` - 1 of them)
        and its score: over every suffix of it some window begins with, the continuation whose
        estimated probabilities sum highest (the longer match on a tie)."""
        pattern = list(pattern[-self.depth:])
        best: tuple[list[int], float] = ([], 0.0)
        for length in range(1, len(pattern)):
            found = self._match(pattern[len(pattern) - length:])
            if found is None:
                break  # (no window begins with a longer suffix either)
            limit = min(max_tokens, int(length * max_spec_factor + 1e-6))
            draft, score = self._continue(found[0], found[1], limit, min_token_prob)
            if score >= best[1]:
                best = (draft, score)
        return best


# Nodes a generation of answers holds at most (about 150-250 MB of Python objects): repeated text
# makes up to ``depth`` nodes per token, so a count of requests alone does not bound the memory.
GENERATION_MAX_NODES = 1_000_000


class SuffixCache:
    """The request's own tree (its prompt and output) for each request drafting, and a global tree
    of the answers requests gave (each as it is written), kept for the latest
    ``max_cached_requests`` requests (-1: all; 0: none) in two generations of half as many (one of
    one for a single request): when the newer is full (or holds GENERATION_MAX_NODES nodes), the
    older is dropped whole (vLLM drops one answer at a time, oldest first)."""

    def __init__(self, depth: int, max_cached_requests: int) -> None:
        self.depth = depth
        self.max_cached_requests = max_cached_requests
        self.local: dict[str, SuffixTree] = {}
        self.generations: list[SuffixTree] = [SuffixTree(depth)]
        self._in_newest = 0
        # Each request's answer in the global tree: (its generation's tree, its sequence number).
        self._answers: dict[str, tuple[SuffixTree, int]] = {}
        self._next_seq = 0

    def start(self, req_id: str, prompt: Sequence[int], output: Sequence[int]) -> None:
        """A request begins drafting: its tree from its prompt and what it has answered so far."""
        local = self.local[req_id] = SuffixTree(self.depth)
        local.extend(0, prompt)
        local.extend(0, output)
        if self.max_cached_requests == 0:
            return
        limit = self.max_cached_requests
        newest = self.generations[-1]
        if (limit > 0 and self._in_newest >= max(1, limit // 2)) or newest.num_nodes >= GENERATION_MAX_NODES:
            self.generations.append(SuffixTree(self.depth))
            if len(self.generations) > (2 if limit != 1 else 1):
                self.generations.pop(0)
            self._in_newest = 0
        self._in_newest += 1
        tree = self.generations[-1]
        self._answers[req_id] = (tree, self._next_seq)
        self._next_seq += 1
        tree.extend(self._answers[req_id][1], output)

    def add(self, req_id: str, tokens: Sequence[int]) -> None:
        """New tokens of a drafting request's answer."""
        self.local[req_id].extend(0, tokens)
        answer = self._answers.get(req_id)
        if answer is not None:
            tree, seq = answer
            if any(tree is kept for kept in self.generations):
                tree.extend(seq, tokens)
            else:  # (its generation was dropped)
                del self._answers[req_id]

    def stop(self, req_id: str) -> None:
        """The request drafts no more (finished, aborted, or started anew): its own tree goes, its
        answer stays in the global tree (until its generation goes)."""
        del self.local[req_id]
        answer = self._answers.pop(req_id, None)
        if answer is not None:
            answer[0].finish(answer[1])

    def speculate(self, req_id: str, pattern: Sequence[int], max_tokens: int, max_spec_factor: float,
                  min_token_prob: float) -> list[int]:
        """The request's draft: its own tree's, or a global one's that scores higher."""
        draft, score = self.local[req_id].speculate(pattern, max_tokens, max_spec_factor, min_token_prob)
        for tree in self.generations:
            other, other_score = tree.speculate(pattern, max_tokens, max_spec_factor, min_token_prob)
            if other_score > score:
                draft, score = other, other_score
        return draft
