"""Token ids as the simulated engine sees them: prompts through the model's real tokenizer
and chat template (`PromptTokenizer`, as vLLM does), media expanded to runs of placeholder
tokens, and seeded pseudo-random output tokens turned back into text.

The shipped tokenizer (`data/tokenizer/`) is the 465-token model captured from a real vLLM
0.32 (tests/fixtures/vllm-0.32-cpu); its chat template gained one branch for list content
that renders each media part as `<|pad|>`, which the engine expands to the item's tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from extproc.core import MediaItem, Prompt
from extproc.hashing.precise import ExtraKey, block_extra_keys
from extproc.hashing.tokenizer import PromptTokenizer

TOKENIZER_DIR = Path(__file__).parent / "data" / "tokenizer"
MEDIA_PLACEHOLDER = "<|pad|>"


@dataclass(frozen=True, slots=True)
class PromptTokens:
    """A prompt's token ids and where each media item sits: `(item, start)`, the item
    occupying `item.tokens` ids from `start`."""

    ids: tuple[int, ...]
    media: tuple[tuple[MediaItem, int], ...] = ()

    def extra_keys(self, block_size: int, cache_salt: str | None) -> list[list[ExtraKey]] | None:
        """Per full block: the media items overlapping it (identifier, offset to the block
        start), then the salt on block 0; None when no block has any (the text case)."""
        placements = [(item.content_hash, start, media_len(item)) for item, start in self.media]
        return block_extra_keys(len(self.ids) // block_size, block_size, placements, cache_salt)


def media_len(item: MediaItem) -> int:
    """Tokens an item occupies in the prompt (at least one, so it always has a place)."""
    return max(item.tokens, 1)


class SimTokenizer:
    """Prompt -> engine token ids, and output ids -> text. Read-only after construction."""

    def __init__(self, folder: Path = TOKENIZER_DIR) -> None:
        self._prompts = PromptTokenizer.from_dir(folder)
        self._tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        placeholder = self._tokenizer.token_to_id(MEDIA_PLACEHOLDER)
        if placeholder is None:
            raise ValueError(f"{folder}: tokenizer has no {MEDIA_PLACEHOLDER} token")
        self._placeholder = placeholder
        specials = {t.content for t in self._tokenizer.get_added_tokens_decoder().values()}
        # Output is sampled from ordinary tokens only: no EOS, so generation always runs to
        # max_tokens (finish_reason "length", as in the captured vLLM responses).
        self._output_vocab = [
            i
            for i in range(self._tokenizer.get_vocab_size())
            if self._tokenizer.id_to_token(i) not in specials
        ]

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size()

    def prompt_tokens(self, prompt: Prompt) -> PromptTokens:
        """Completions get BOS; chat is rendered with the template, tokenized without special
        tokens; the k-th placeholder becomes the k-th media item's run of tokens."""
        ids = self._prompts.token_ids(prompt)
        items = [p.media for m in prompt.messages for p in m.parts if p.media is not None]
        if not items:
            return PromptTokens(tuple(ids))
        out: list[int] = []
        media: list[tuple[MediaItem, int]] = []
        pending = iter(items)
        for tid in ids:
            item = next(pending, None) if tid == self._placeholder else None
            if item is None:
                out.append(tid)
                continue
            media.append((item, len(out)))
            out.extend([tid] * media_len(item))
        return PromptTokens(tuple(out), tuple(media))

    def sample(self, rng: random.Random, n: int) -> list[int]:
        return rng.choices(self._output_vocab, k=n)

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)
