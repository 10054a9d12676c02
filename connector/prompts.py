"""What the router reads from an OpenAI request's prompt: its length in tokens and the hashes of its leading blocks.

The router has no model, so by default it estimates: a prompt given as token ids (`/v1/completions` accepts a
list of ints) is counted exactly; text counts one token per `CHARS_PER_TOKEN` characters, and its blocks are
runs of `block_tokens * CHARS_PER_TOKEN` characters. Given a tokenizer (`--tokenizer`, any object with
`encode(str) -> list[int]`, e.g. Hugging Face's), text is counted and cut into blocks exactly as the engines
cut it, up to the chat template, which the router does not apply (a chat's messages are joined as
`role: content` lines, so equal conversations still hash equally).

Block hashes chain (each covers every block before it), as vLLM's prefix cache does, so two prompts share
their first n hashes exactly when they share their first n full blocks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

CHARS_PER_TOKEN = 4
"""Characters per token when the router has no tokenizer (about right for English with BPE vocabularies)."""


class Tokenizer(Protocol):
    """What the router needs of a tokenizer."""

    def encode(self, text: str) -> list[int]: ...


def _prompt(body: Mapping[str, Any]) -> str | list[int]:
    """The request's first prompt, as text or token ids."""
    prompt = body.get("prompt")
    if prompt is None and isinstance(body.get("messages"), list):
        lines = [f"{m.get('role', '')}: {_content(m.get('content'))}" for m in body["messages"] if isinstance(m, dict)]
        return "\n".join(lines)
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        prompt = prompt[0]  # a batch of prompts: the first decides
    if isinstance(prompt, list):
        return [t for t in prompt if isinstance(t, int)]
    return prompt if isinstance(prompt, str) else ""


def _content(content: Any) -> str:
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        return " ".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return str(content or "")


class PromptReader:
    """Reads prompts with a tokenizer, or estimates without one; `block_tokens` is the engines' KV block size."""

    def __init__(self, block_tokens: int = 16, tokenizer: Tokenizer | None = None) -> None:
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be positive, not {block_tokens}")
        self.block_tokens = block_tokens
        self.tokenizer = tokenizer

    def _units(self, body: Mapping[str, Any]) -> tuple[Sequence[int] | str, int]:
        """The prompt as token ids (and tokens per unit 1) or as text (and characters per token)."""
        prompt = _prompt(body)
        if isinstance(prompt, str) and self.tokenizer is not None:
            return self.tokenizer.encode(prompt), 1
        return prompt, 1 if isinstance(prompt, list) else CHARS_PER_TOKEN

    def token_ids(self, body: Mapping[str, Any]) -> list[int] | None:
        """The prompt's token ids as the engine sees them: a prompt of token ids, or a text prompt with a
        tokenizer; None for a chat (its template is the engine's) or a text prompt without a tokenizer."""
        if body.get("prompt") is None:
            return None
        units, per_token = self._units(body)
        return list(units) if per_token == 1 and not isinstance(units, str) else None

    def tokens(self, body: Mapping[str, Any]) -> int:
        """The prompt's length in tokens (estimated for text without a tokenizer)."""
        units, per_token = self._units(body)
        return -(-len(units) // per_token)

    def block_hashes(self, body: Mapping[str, Any]) -> list[int]:
        """Chained hashes of the prompt's full blocks, first block first."""
        units, per_token = self._units(body)
        step = self.block_tokens * per_token
        hashes: list[int] = []
        previous = b""
        for start in range(0, len(units) - step + 1, step):
            chunk = units[start : start + step]
            data = chunk.encode() if isinstance(chunk, str) else b",".join(str(t).encode() for t in chunk)
            previous = hashlib.blake2b(previous + data, digest_size=8).digest()
            hashes.append(int.from_bytes(previous, "big"))
        return hashes
