"""How the router reads prompts (length, chained block hashes) and remembers which engine was sent which blocks."""

from __future__ import annotations

import pytest

from rendezvous.clients._prefix import PrefixIndex
from rendezvous.connector.prompts import CHARS_PER_TOKEN, PromptReader


class WordTokenizer:
    """A real (if simple) tokenizer: one token per whitespace-separated word, ids by first sight."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        return [self.vocab.setdefault(word, len(self.vocab)) for word in text.split()]


def test_token_ids_are_counted_exactly_and_text_is_estimated() -> None:
    reader = PromptReader(block_tokens=4)
    assert reader.tokens({"prompt": list(range(10))}) == 10
    assert reader.tokens({"prompt": "x" * (3 * CHARS_PER_TOKEN + 1)}) == 4
    assert reader.tokens({"prompt": [[1, 2, 3], [4]]}) == 3  # a batch: its first prompt
    assert reader.tokens({"messages": [{"role": "user", "content": "hi"}]}) == 2  # "user: hi"
    assert reader.tokens({}) == 0


def test_token_ids_are_known_only_where_the_engine_would_see_the_same() -> None:
    assert PromptReader().token_ids({"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert PromptReader(tokenizer=WordTokenizer()).token_ids({"prompt": "a b a"}) == [0, 1, 0]
    assert PromptReader().token_ids({"prompt": "a b a"}) is None  # no tokenizer: an estimate is no chain
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert PromptReader(tokenizer=WordTokenizer()).token_ids(chat) is None  # the chat template is the engine's


def test_only_full_blocks_are_hashed_and_the_hashes_chain() -> None:
    reader = PromptReader(block_tokens=4)
    a = reader.block_hashes({"prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9]})
    b = reader.block_hashes({"prompt": [1, 2, 3, 4, 5, 6, 7, 0]})
    c = reader.block_hashes({"prompt": [0, 2, 3, 4, 5, 6, 7, 8]})
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]
    assert c[1] != a[1]  # the same second block after another first block is another block


def test_a_tokenizer_counts_text_exactly() -> None:
    reader = PromptReader(block_tokens=2, tokenizer=WordTokenizer())
    assert reader.tokens({"prompt": "a long word list"}) == 4
    first = reader.block_hashes({"prompt": "one two three four"})
    assert reader.block_hashes({"prompt": "one two three five"})[0] == first[0]
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "one two"}]}]}
    assert reader.tokens(chat) == 3  # "user: one two"


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        PromptReader(0)


def test_the_index_matches_leading_blocks_until_the_first_miss() -> None:
    index = PrefixIndex()
    index.record("e0", [1, 2, 3])
    assert index.matched("e0", [1, 2, 3, 4]) == 3
    assert index.matched("e0", [1, 9, 3]) == 1
    assert index.matched("e1", [1, 2]) == 0


def test_the_index_forgets_the_least_recently_sent_blocks_first() -> None:
    index = PrefixIndex(capacity=3)
    index.record("e0", [1, 2])
    index.record("e1", [7])
    index.record("e0", [1])  # 1 is fresh again; 2 is now the oldest
    index.record("e1", [8])
    assert len(index) == 3
    assert index.matched("e0", [1, 2]) == 1 and index.matched("e1", [7, 8]) == 2
    with pytest.raises(ValueError, match="positive"):
        PrefixIndex(0)
