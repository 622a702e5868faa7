"""A tokenizer built in code whose token i stands for the bytes pieces[i] (a byte-level
`tokenizers` tokenizer, as GPT-2's or Qwen's are), for output-processing tests that need
characters split over tokens, invalid bytes and special tokens."""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models

from pipeserve.tokenizer import _BYTE_OF_CHAR, TextStream

CHAR_OF_BYTE = {b: c for c, b in _BYTE_OF_CHAR.items()}


class PieceTokenizer:
    """decode / decode_stream as pipeserve's Tokenizer has them; `specials`: pieces that are
    special tokens (skipped when decoding)."""

    def __init__(self, pieces: list[bytes], specials: tuple[int, ...] = ()) -> None:
        vocab = {"".join(CHAR_OF_BYTE[b] for b in p): i for i, p in enumerate(pieces)}
        self.tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=next(iter(vocab))))
        self.tok.decoder = decoders.ByteLevel()
        names = list(vocab)
        self.tok.add_special_tokens([AddedToken(names[i], special=True) for i in specials])
        self.decodes = 0  # decode calls (the output processor's are rare: held tokens only)
        self.steps = 0  # incremental decoder steps

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decodes += 1
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_stream(self) -> CountingStream:
        return CountingStream(self, TextStream(self.tok))


class CountingStream:
    def __init__(self, owner: PieceTokenizer, stream: TextStream) -> None:
        self.owner, self.stream = owner, stream

    def step(self, token_id: int) -> str | None:
        self.owner.steps += 1
        return self.stream.step(token_id)


def letters(n: int = 26) -> PieceTokenizer:
    """Token 0 is '?', token i is the i-th letter ('a' for 1)."""
    return PieceTokenizer([b"?"] + [bytes([ord("a") + i]) for i in range(n)])
