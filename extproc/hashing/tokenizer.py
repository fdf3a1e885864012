"""Precise block keys for requests: render the model's chat template with jinja2, tokenize
with the model's `tokenizer.json` (HF `tokenizers`), all in-process and offline, then chain
token blocks with `precise.token_block_keys` exactly as KV-event ingestion does for
`BlockStored.token_ids`.

Built once at startup (loading a tokenizer takes milliseconds to seconds); thread-safe
afterwards: the tokenizer and the compiled template are read-only, and the memory of recent
prompts (`token_prefixes.py`: a session's next turn is encoded only past the previous one)
takes a lock.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import msgspec
import orjson
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from extproc.core import InferenceRequest, MediaItem, Message, Modality, Prompt
from extproc.errors import BadRequest
from extproc.hashing.precise import block_extra_keys, chain_seed, token_block_keys
from extproc.hashing.token_prefixes import TokenPrefixes


class PreciseSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Precise (tokenizer) block keys for one served model.

    - `tokenizer_dir`: a folder with `tokenizer.json` and the chat template, either
      `chat_template.jinja` or `tokenizer_config.json`'s `chat_template` (the file wins).
    - `model`: the served model name the endpoints publish KV events under (seeds the chain).
    - `block_size`: the engine's KV block size in tokens (vLLM's default is 16).
    - `image_token` / `audio_token` / `video_token`: the placeholder token text the engine
      expands to an item's tokens (e.g. `<|image_pad|>`); when unset, that modality adds
      no tokens and no extra keys.
    """

    tokenizer_dir: str
    model: str
    block_size: Annotated[int, msgspec.Meta(gt=0)] = 16
    add_generation_prompt: bool = True
    image_token: str | None = None
    audio_token: str | None = None
    video_token: str | None = None


class PromptTokenizer:
    """A model's tokenizer and chat template: `Prompt` -> the token ids the engine sees.

    Completions are tokenized with special tokens (the BOS the post-processor adds); chat
    prompts are rendered with the template and tokenized without, as vLLM does (the
    template writes its own special tokens).
    """

    def __init__(self, tokenizer: Tokenizer, chat_template: str | None, config: dict[str, Any]):
        self._tokenizer = tokenizer
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = env.from_string(chat_template) if chat_template else None
        self._specials = {
            k: _token_text(v) for k, v in config.items() if k.endswith("_token") and v is not None
        }
        # A session's next turn holds its previous turn whole: only the new part is encoded.
        self.prefixes = TokenPrefixes(self._encode_plain)

    def _encode_plain(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        enc = self._tokenizer.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    @classmethod
    def from_dir(cls, path: str | Path) -> PromptTokenizer:
        """Loads `tokenizer.json` and the chat template from a local folder (no network)."""
        folder = Path(path)
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
        template_file = folder / "chat_template.jinja"
        template = (
            template_file.read_text() if template_file.exists() else config.get("chat_template")
        )
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return cls(tokenizer, template, config)

    def token_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def render(self, prompt: Prompt, add_generation_prompt: bool = True) -> str:
        """The chat template applied to `prompt` (tools, then messages). With
        `continue_final_message` the text after the last message's content is cut off, so
        the model continues that turn (and no generation prompt is added)."""
        if self._template is None:
            raise ValueError("this tokenizer has no chat template")
        tools = [orjson.loads(t) for t in prompt.tools] or None
        if prompt.add_generation_prompt is not None:
            add_generation_prompt = prompt.add_generation_prompt
        cont = prompt.continue_final_message and bool(prompt.messages)
        try:
            text = self._template.render(
                messages=[_template_message(m) for m in prompt.messages],
                tools=tools,
                add_generation_prompt=add_generation_prompt and not cont,
                **self._specials,
            )
        except (TemplateError, TypeError, ValueError) as exc:
            # The template refused the request (its `raise_exception`, or a field it needs
            # missing, e.g. a tool call without `function`): the engine answers such a
            # request 400 too, so the client hears it here, not as the picker's failure.
            # The reason is the template's or Python's words, never the body's text.
            raise BadRequest(
                f"the model's chat template cannot render this request: "
                f"{type(exc).__name__}: {str(exc)[:120]}"
            ) from None
        if cont:
            text = _cut_after_final(text, prompt.messages[-1])
        return text

    def token_ids(self, prompt: Prompt, add_generation_prompt: bool = True) -> list[int]:
        """Completions get special tokens (BOS) unless `add_special_tokens` is false; chat
        prompts get none unless it is true (the template writes its own)."""
        if prompt.completion is not None:
            if isinstance(prompt.completion, str):
                special = prompt.add_special_tokens is not False
                return self._tokenizer.encode(prompt.completion, add_special_tokens=special).ids
            return list(prompt.completion)
        text = self.render(prompt, add_generation_prompt)
        if prompt.add_special_tokens is True:
            return self._tokenizer.encode(text, add_special_tokens=True).ids
        return self.prefixes.ids(text)


def _cut_after_final(text: str, final: Message) -> str:
    """`text` up to the end of the final message's last text (what the engine continues);
    unchanged when that text is not found (a template that rewrites content)."""
    tail = next((p.text for p in reversed(final.parts) if p.media is None and p.text), "")
    if not tail:
        return text
    for needle in (tail, tail.strip()):
        at = text.rfind(needle) if needle else -1
        if at >= 0:
            return text[: at + len(needle)]
    return text


class PreciseKeys:
    """Request -> precise block keys, identical to those KV-event ingestion computes from
    `BlockStored.token_ids` with `token_block_keys(ids, block_size, chain_seed(model,
    lora_name), extra_keys)`."""

    def __init__(self, tokenizer: PromptTokenizer, settings: PreciseSettings) -> None:
        self._tokenizer = tokenizer
        self._settings = settings
        self._placeholders = {
            mod: tid
            for mod, text in (
                (Modality.IMAGE, settings.image_token),
                (Modality.AUDIO, settings.audio_token),
                (Modality.VIDEO, settings.video_token),
            )
            if text is not None and (tid := tokenizer.token_id(text)) is not None
        }

    @property
    def block_size(self) -> int:
        """Tokens per block key: the engine's KV block size."""
        return self._settings.block_size

    @property
    def model(self) -> str:
        return self._settings.model

    @classmethod
    def from_settings(cls, settings: PreciseSettings) -> PreciseKeys:
        return cls(PromptTokenizer.from_dir(settings.tokenizer_dir), settings)

    def token_ids(self, prompt: Prompt) -> tuple[list[int], list[tuple[str, int, int]]]:
        """The engine's token ids for `prompt`, each media placeholder expanded to the item's
        estimated tokens, and the placements `(content_hash, start, length)` of the items."""
        ids = self._tokenizer.token_ids(prompt, self._settings.add_generation_prompt)
        items = [p.media for m in prompt.messages for p in m.parts if p.media is not None]
        if not items or not self._placeholders:
            return ids, []
        return _expand(ids, items, self._placeholders)

    def block_keys(self, req: InferenceRequest) -> tuple[int, ...]:
        """Precise keys of the blocks of `req` the engine can serve from its cache (empty
        when it has no parsed prompt).

        The engine always computes a prompt's last token itself (it needs its logits), so a
        cache hit covers at most `(n - 1) // block_size` blocks of an n-token prompt: a
        block-aligned prompt's last block is never a hit, and is not looked up."""
        return self.prompt_keys(req)[0]

    def prompt_keys(self, req: InferenceRequest) -> tuple[tuple[int, ...], int]:
        """`block_keys(req)` and the prompt's length in the engine's tokens (media counted
        at their estimated tokens), from one tokenization; `((), 0)` without a parsed
        prompt. The router puts the length in `prompt_tokens`: matched blocks are counted
        in engine tokens here, and an estimate in another unit next to them made the
        uncached part of a prompt (in-flight tokens, prefill speed samples) come out 0."""
        if req.prompt is None:
            return (), 0
        ids, placements = self.token_ids(req.prompt)
        n = len(ids)
        ids = ids[:-1]
        size = self._settings.block_size
        extras = block_extra_keys(len(ids) // size, size, placements, req.cache_salt)
        seed = chain_seed(self._settings.model, req.lora_adapter)
        return tuple(token_block_keys(ids, size, seed, extras)), n


def _expand(
    ids: list[int], items: Sequence[MediaItem], placeholders: dict[Modality, int]
) -> tuple[list[int], list[tuple[str, int, int]]]:
    """Replaces the k-th placeholder token of a modality by the k-th item's run of tokens."""
    by_token = {tid: mod for mod, tid in placeholders.items()}
    queues: dict[Modality, list[MediaItem]] = {mod: [] for mod in placeholders}
    for item in items:
        if item.modality in queues:
            queues[item.modality].append(item)
    out: list[int] = []
    placements: list[tuple[str, int, int]] = []
    for tid in ids:
        mod = by_token.get(tid)
        if mod is None or not queues[mod]:
            out.append(tid)
            continue
        item = queues[mod].pop(0)
        placements.append((item.content_hash, len(out), item.tokens))
        out.extend([tid] * item.tokens)
    return out, placements


def _template_message(m: Message) -> dict[str, Any]:
    """A message as chat templates expect it: string content when all text (parts joined
    by newlines, vLLM's "string" content format), else a list of typed parts."""
    msg: dict[str, Any] = {"role": m.role}
    if all(p.media is None for p in m.parts):
        msg["content"] = "\n".join(p.text for p in m.parts)
    else:
        msg["content"] = [
            {"type": "text", "text": p.text}
            if p.media is None
            else {"type": p.media.modality.value}
            for p in m.parts
        ]
    if m.name is not None:
        msg["name"] = m.name
    if m.tool_calls:
        msg["tool_calls"] = [orjson.loads(c) for c in m.tool_calls]
    if m.tool_call_id is not None:
        msg["tool_call_id"] = m.tool_call_id
    return msg


def _token_text(value: Any) -> Any:
    # tokenizer_config.json may spell a special token as {"content": "<s>", ...}
    return value.get("content") if isinstance(value, dict) else value


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)
