"""Prompt lookup (n-gram) drafting: continue the latest earlier occurrence of the last n tokens.

For n from ``prompt_lookup_max`` down to ``prompt_lookup_min``, the last n
tokens of the request (prompt and output) are looked up among its earlier
n-grams; the first size that matches proposes the (up to k) tokens that
followed its latest earlier occurrence. Input-grounded generation (rewrite,
fix, continue a given text) copies long runs of its prompt, which this
finds at no model cost.

Cost: each request keeps, per n, a dict from n-gram to the end of its
latest occurrence, extended incrementally with the tokens appended since the
previous lookup: O(number of sizes) per generated token, and one pass over
the prompt on the request's first lookup. No scan of the history per step.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.request import Request
from engine.sampling.rejection import RowMaskFactory
from engine.scheduler import ScheduledRequest
from engine.spec_decode.proposer import Proposal, Proposer


class NgramIndex:
    """The latest end of every n-gram (``nmin <= n <= nmax``) of one growing token list.

    An n-gram ending at ``e`` (exclusive) is ``tokens[e - n : e]``; ``indexed``
    is the largest end inserted so far. Tokens are only ever appended.
    """

    def __init__(self, nmin: int, nmax: int) -> None:
        self.nmin = nmin
        self.nmax = nmax
        self.latest: list[dict[tuple[int, ...], int]] = [{} for _ in range(nmax - nmin + 1)]
        self.indexed = 0

    def _index_upto(self, tokens: Sequence[int], end: int) -> None:
        for e in range(self.indexed + 1, end + 1):
            for n in range(self.nmin, min(self.nmax, e) + 1):
                self.latest[n - self.nmin][tuple(tokens[e - n : e])] = e
        self.indexed = max(self.indexed, end)

    def lookup(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the
        longest matching suffix n-gram ([] when none matches)."""
        length = len(tokens)
        # Every n-gram ending before the last token: the suffix itself is not an
        # "earlier occurrence".
        self._index_upto(tokens, length - 1)
        for n in range(min(self.nmax, length), self.nmin - 1, -1):
            end = self.latest[n - self.nmin].get(tuple(tokens[length - n :]))
            if end is not None:
                return list(tokens[end : min(end + k, length)])
        return []


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.nmin = prompt_lookup_min
        self.nmax = prompt_lookup_max
        self._index: dict[str, NgramIndex] = {}
        # The last lookup per request (its token count, k and drafts): the planner's
        # ``available`` and the step's ``propose`` ask about the same tokens.
        self._last: dict[str, tuple[int, int, list[int]]] = {}

    def _lookup(self, req: Request, k: int) -> list[int]:
        key = req.request_id
        last = self._last.get(key)
        if last is not None and last[0] == req.num_tokens and last[1] >= k:
            return last[2][:k]
        index = self._index.get(key)
        if index is None:
            index = self._index[key] = NgramIndex(self.nmin, self.nmax)
        drafts = index.lookup(req.all_token_ids, k)
        self._last[key] = (req.num_tokens, k, drafts)
        return drafts

    def available(self, req: Request, k: int) -> int:
        return len(self._lookup(req, k)) if k > 0 else 0

    def propose(
        self, batch: Sequence[ScheduledRequest], mask_for: RowMaskFactory | None
    ) -> dict[str, Proposal]:
        out: dict[str, Proposal] = {}
        for s in batch:
            if s.num_lookahead_slots:
                out[s.req.request_id] = Proposal(self._lookup(s.req, s.num_lookahead_slots))
        return out

    def forget(self, request_id: str) -> None:
        self._index.pop(request_id, None)
        self._last.pop(request_id, None)
