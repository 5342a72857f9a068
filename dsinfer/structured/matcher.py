"""One request's grammar state: a matcher that has accepted exactly the request's output tokens so far.

The engine never feeds the matcher directly: ``sync(output_token_ids)`` advances it to the request's tokens, or
rolls it back when tokens were withdrawn (speculative drafts rejected), so preemption by recompute (output
tokens kept) and later rollbacks keep it right. ``check_drafts`` / ``fill_draft_bitmasks`` are the pieces a
speculative decoder needs: how many drafted tokens the grammar accepts, and one mask per draft position.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch
import xgrammar as xgr

from dsinfer.structured.spec import StructuredSpec


class GrammarRejected(Exception):
    """A token the grammar does not allow was generated (e.g. a forced token id); the request cannot go on."""


class RequestGrammar:
    def __init__(self, spec: StructuredSpec, compiled: Future):
        self.spec = spec
        self._compiled = compiled
        self._matcher: xgr.GrammarMatcher | None = None
        self.accepted: list[int] = []  # output tokens the matcher has accepted (a prefix of the request's)

    @property
    def ready(self) -> bool:
        """The grammar is compiled (or failed to compile: ``error`` says why)."""
        return self._compiled.done()

    @property
    def error(self) -> BaseException | None:
        return self._compiled.exception() if self._compiled.done() else None

    @property
    def matcher(self) -> xgr.GrammarMatcher:
        if self._matcher is None:
            self._matcher = xgr.GrammarMatcher(self._compiled.result())
        return self._matcher

    def sync(self, output_token_ids: list[int]) -> None:
        """Make the matcher's accepted tokens equal ``output_token_ids`` (roll back, then accept what is new)."""
        common = 0
        limit = min(len(self.accepted), len(output_token_ids))
        while common < limit and self.accepted[common] == output_token_ids[common]:
            common += 1
        if common < len(self.accepted):
            self.rollback(len(self.accepted) - common)
        for token in output_token_ids[common:]:
            self.accept(token)

    def accept(self, token: int) -> None:
        if self.matcher.is_terminated():
            raise GrammarRejected(f"token {token} after the grammar terminated")
        if not self.matcher.accept_token(token):
            raise GrammarRejected(f"token {token} is not allowed by the grammar here")
        self.accepted.append(token)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)
            del self.accepted[-num_tokens:]

    @property
    def is_terminated(self) -> bool:
        """The grammar accepted a stop token: nothing more may follow."""
        return self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.matcher.is_terminated():
            bitmask[row].zero_()  # nothing may follow a stop token (the engine finishes the request on it)
            return
        self.matcher.fill_next_token_bitmask(bitmask, row)

    # ---- speculative decoding ----------
    def check_drafts(self, draft_token_ids: list[int]) -> int:
        """How many leading drafted tokens the grammar accepts (the matcher is left unchanged)."""
        ok = 0
        for token in draft_token_ids:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                break
            ok += 1
        if ok:
            self.matcher.rollback(ok)
        return ok

    def fill_draft_bitmasks(self, bitmask: torch.Tensor, first_row: int, draft_token_ids: list[int]) -> int:
        """Masks for the draft positions: row ``first_row + i`` is the mask after drafts[:i] (i = 0..k).

        Stops at the first draft the grammar rejects (later rows are left unfilled); returns the rows filled.
        """
        accepted = 0
        rows = 0
        for i in range(len(draft_token_ids) + 1):
            self.fill_bitmask(bitmask, first_row + i)
            rows += 1
            if i == len(draft_token_ids) or not self.matcher.accept_token(draft_token_ids[i]):
                break
            accepted += 1
        if accepted:
            self.matcher.rollback(accepted)
        return rows
