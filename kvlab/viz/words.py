"""Token ids shown as words, as the PagedAttention paper draws its blocks ("Four score and seven ...").

kvlab's scenarios write made-up token ids (0, 1, 2, ...): only which ids repeat matters to a
pool or a hash. A picture reads better with words, so token id ``i`` is drawn as word ``i`` of
the Gettysburg Address (public domain; the paper's Fig. 6 and 7 use its opening), wrapping
around after the last word. ``token_label(i, "ids")`` gives the id itself.
"""

from __future__ import annotations

from kvlab._validate import one_of

_TEXT = """
Four score and seven years ago our fathers brought forth on this continent a new nation conceived in
Liberty and dedicated to the proposition that all men are created equal Now we are engaged in a great
civil war testing whether that nation or any nation so conceived and so dedicated can long endure We
are met on a great battle field of that war We have come to dedicate a portion of that field as a final
resting place for those who here gave their lives that that nation might live It is altogether fitting
and proper that we should do this But in a larger sense we can not dedicate we can not consecrate we
can not hallow this ground The brave men living and dead who struggled here have consecrated it far
above our poor power to add or detract The world will little note nor long remember what we say here
but it can never forget what they did here It is for us the living rather to be dedicated here to the
unfinished work which they who fought here have thus far so nobly advanced It is rather for us to be
here dedicated to the great task remaining before us that from these honored dead we take increased
devotion to that cause for which they gave the last full measure of devotion that we here highly
resolve that these dead shall not have died in vain that this nation under God shall have a new birth
of freedom and that government of the people by the people for the people shall not perish from the
earth
"""

#: The words, in order: token id ``i`` is ``WORDS[i % len(WORDS)]``.
WORDS: tuple[str, ...] = tuple(_TEXT.split())
TOKEN_MODES = ("words", "ids")


def token_label(token_id: int, tokens: str = "words", max_chars: int | None = None) -> str:
    """How a picture writes one token: its word (``tokens="words"``) or its id (``"ids"``), cut to ``max_chars``."""
    one_of("tokens", tokens, TOKEN_MODES)
    text = WORDS[token_id % len(WORDS)] if tokens == "words" else str(token_id)
    if max_chars is not None and len(text) > max_chars:
        text = text[: max(max_chars - 1, 1)] + "…"
    return text


def token_text(token_ids: tuple[int, ...] | list[int], tokens: str = "words") -> str:
    """Several tokens as one line: words joined by spaces, or ids by commas."""
    return (" " if tokens == "words" else ", ").join(token_label(t, tokens) for t in token_ids)
