"""Incremental detokenization and stop strings for one sequence.

Text grows one token at a time through ``tokenizers``' DecodeStream (multi-byte characters split across tokens are
held back until complete). Stop strings are searched only in the newly added tail; the stop text itself is cut
from the output (unless ``include_stop_str_in_output``). While the sequence runs, the last ``max_stop_len - 1``
characters are withheld from streamed deltas, since they could still become the start of a stop string.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from dsinfer.tokenizer import Tokenizer

_PROMPT_CONTEXT = 8  # prompt tokens fed first, so the first output token decodes with its left context


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop: list[str],
                 skip_special_tokens: bool, include_stop_str_in_output: bool):
        self._tok = tokenizer.backend
        self._stream = DecodeStream(prompt_token_ids[-_PROMPT_CONTEXT:], skip_special_tokens=skip_special_tokens)
        self._stop = stop
        self._include_stop = include_stop_str_in_output
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self._sent = 0  # characters already returned as deltas

    def add_token(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append a token; return the stop string if the text now contains one (text is cut there)."""
        try:
            piece = self._stream.step(self._tok, token_id)
        except Exception:  # a token the decoder cannot place (e.g. out of vocab): contributes no text
            piece = None
        if not piece:
            return None
        search_from = max(0, len(self.text) - self._hold)
        self.text += piece
        if not check_stop:
            return None
        for stop in self._stop:
            idx = self.text.find(stop, search_from)
            if idx != -1:
                self.text = self.text[: idx + len(stop)] if self._include_stop else self.text[:idx]
                return stop
        return None

    def delta(self, finished: bool) -> str:
        """Text not yet returned; while running, withhold what could still be a stop string's prefix."""
        end = len(self.text) if finished or not self._stop else max(self._sent, len(self.text) - self._hold)
        out = self.text[self._sent:end]
        self._sent = end
        return out

    def visible_text(self, finished: bool) -> str:
        return self.text if finished or not self._stop else self.text[: max(0, len(self.text) - self._hold)]
