"""Turn generated token ids into text deltas for streaming.

vLLM-style detokenizers re-decode a window of recent tokens (prefix_offset/read_offset) and hold text
back while it ends in U+FFFD. For a byte-level BPE vocabulary there is a simpler exact method:
decode() is nothing but the lossy UTF-8 decoding of the tokens' bytes concatenated, so we feed each
token's bytes to an incremental UTF-8 decoder. That is O(token length) per token, holds back at most
the 1-3 bytes of an unfinished character, never invents or drops spaces, and its deltas concatenate
to exactly decode(ids) -- including a U+FFFD wherever decode() would put one (invalid bytes are
replaced as soon as they are known to be invalid; an unfinished character at the end, at flush()).
"""

from __future__ import annotations

import codecs

from fairway.models.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Streams the text of one generated sequence, one token at a time. Byte-level tokens need no
    left context (no prompt, unlike window-based detokenizers): the text is decode(generated ids)."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        """Text newly completed by this token; '' while a multi-byte character is still partial."""
        if token_id in self._skip:
            return ""
        return self._utf8.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """Whatever is held back at the end: an unfinished character becomes U+FFFD, as in decode()."""
        return self._utf8.decode(b"", final=True)
