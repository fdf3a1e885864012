"""Precise keys: our template rendering + tokenization reproduces vLLM's token ids, and the
request side and KV-event side agree on every block key."""

from __future__ import annotations

import json
from pathlib import Path

import msgpack
import orjson
import pytest
from tokenizers import Tokenizer

from extproc.core import InferenceRequest, MediaItem, Message, Modality, Part, Prompt
from extproc.errors import BadRequest
from extproc.hashing.precise import block_extra_keys, chain_seed, token_block_keys
from extproc.hashing.tokenizer import PreciseKeys, PreciseSettings, PromptTokenizer
from extproc.requests import ParseSettings, parse_request

CAPTURE = Path(__file__).parent.parent / "fixtures" / "vllm-0.32-cpu"
TOKENIZER = CAPTURE / "tokenizer"
RUNS = ("A-sha256-int-bs32", "B-sha256cbor-bytes-bs32-evict-reset-full")


def captured(run: str) -> list[dict]:
    return [
        json.loads(line) for line in (CAPTURE / run / "requests.jsonl").read_text().splitlines()
    ]


def parsed(record: dict) -> InferenceRequest:
    return parse_request(record["path"], {}, orjson.dumps(record["request"]), ParseSettings())


@pytest.fixture(scope="module")
def tokenizer() -> PromptTokenizer:
    return PromptTokenizer.from_dir(TOKENIZER)


@pytest.fixture(scope="module")
def keys() -> PreciseKeys:
    return PreciseKeys.from_settings(
        PreciseSettings(tokenizer_dir=str(TOKENIZER), model="tiny", block_size=32)
    )


@pytest.mark.parametrize("record", captured(RUNS[0]) + captured(RUNS[1]), ids=lambda r: r["name"])
def test_token_ids_match_what_vllm_produced(tokenizer: PromptTokenizer, record: dict) -> None:
    req = parsed(record)
    assert req.prompt is not None
    assert tokenizer.token_ids(req.prompt) == record["prompt_token_ids"]


def test_completions_start_with_bos_and_chat_with_im_start(tokenizer: PromptTokenizer) -> None:
    assert tokenizer.token_ids(Prompt(completion="hello"))[0] == 0
    chat = Prompt(messages=(Message("user", (Part("hello"),)),))
    assert tokenizer.token_ids(chat)[0] == 3
    assert tokenizer.render(chat) == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"


def _stored_events(run: str) -> list[dict]:
    events = []
    for line in (CAPTURE / run / "frames.jsonl").read_text().splitlines():
        payload = bytes.fromhex(json.loads(line)["frames_hex"][2])
        _ts, batch, _rank = msgpack.unpackb(payload)
        events += [e for e in batch if e["type"] == "BlockStored"]
    return events


def test_request_keys_equal_keys_recomputed_from_kv_events(keys: PreciseKeys) -> None:
    """What KV-event ingestion does with BlockStored (engine parent -> our key map, our
    own chain over token_ids with the published extra_keys) lands on the request's keys."""
    ours: dict[object, int] = {}
    stored: set[int] = set()
    run = RUNS[1]  # has the cache_salt request, whose block 0 carries the salt extra key
    for e in _stored_events(run):
        parent_engine = e.get("parent_block_hash")
        parent = (
            ours[_h(parent_engine)]
            if parent_engine is not None
            else chain_seed("tiny", e.get("lora_name"))
        )
        computed = token_block_keys(e["token_ids"], e["block_size"], parent, e.get("extra_keys"))
        for engine_hash, key in zip(e["block_hashes"], computed, strict=True):
            ours[_h(engine_hash)] = key
            stored.add(key)
    for record in captured(run):
        req = parsed(record)
        request_keys = keys.block_keys(req)
        assert request_keys, record["name"]
        assert set(request_keys) <= stored, record["name"]
    salted = next(parsed(r) for r in captured(run) if r["name"] == "salt1")
    plain = next(parsed(r) for r in captured(run) if r["name"] == "c1")
    assert keys.block_keys(salted)[0] != keys.block_keys(plain)[0]


def _h(value: object) -> object:
    return bytes(value) if isinstance(value, bytes | bytearray) else value


def test_token_block_keys_contract_is_pinned() -> None:
    """KV-event ingestion and stored indexes depend on these exact values."""
    assert token_block_keys([1, 2, 3, 4], 2, 7) == [9951117256991931262, 7276463116908850084]
    assert token_block_keys([1, 2, 3], 2, 7) == token_block_keys([1, 2], 2, 7)
    assert token_block_keys([1, 2], 2, 7, [["s"]]) != token_block_keys([1, 2], 2, 7)
    assert chain_seed("m", "a") != chain_seed("m")
    with pytest.raises(ValueError):
        token_block_keys([1], 0, 7)


def test_extra_keys_put_media_offsets_in_overlapping_blocks_and_salt_in_block_0() -> None:
    extras = block_extra_keys(4, 16, [("img", 10, 30)], cache_salt="t")
    assert extras == [["img", 10, "t"], ["img", -6], ["img", -22], []]
    assert block_extra_keys(4, 16) is None


def test_media_placeholders_expand_to_the_items_token_cost() -> None:
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
        "{% if p.type == 'text' %}{{ p.text }}{% else %}<|pad|>{% endif %}{% endfor %}{% endif %}"
        "<|im_end|>\n{% endfor %}"
    )
    tok = PromptTokenizer(Tokenizer.from_file(str(TOKENIZER / "tokenizer.json")), template, {})
    settings = PreciseSettings(
        tokenizer_dir=str(TOKENIZER), model="tiny", block_size=4, image_token="<|pad|>"
    )
    precise = PreciseKeys(tok, settings)
    item = MediaItem(Modality.IMAGE, "ab" * 32, tokens=10)
    prompt = Prompt(messages=(Message("user", (Part("hi"), Part(media=item))),))
    ids, placements = precise.token_ids(prompt)
    ((digest, start, length),) = placements
    assert (digest, length) == (item.content_hash, 10)
    assert ids[start : start + 10] == [2] * 10
    other = MediaItem(Modality.IMAGE, "cd" * 32, tokens=10)
    req = InferenceRequest("r", "/v1/chat/completions", prompt=prompt)
    req2 = InferenceRequest(
        "r",
        "/v1/chat/completions",
        prompt=Prompt(messages=(Message("user", (Part("hi"), Part(media=other))),)),
    )
    a, b = precise.block_keys(req), precise.block_keys(req2)
    first_media_block = start // 4
    assert (
        a[:first_media_block] == b[:first_media_block]
        and a[first_media_block] != b[first_media_block]
    )


def test_unknown_api_has_no_precise_keys(keys: PreciseKeys) -> None:
    assert keys.block_keys(InferenceRequest("r", "/x")) == ()


def test_a_template_that_cannot_render_the_request_is_a_400_not_an_internal_error() -> None:
    # A field the template needs is missing (an Anthropic tool_use has no `function`), and a
    # template's own `raise_exception`: vLLM answers both 400, and so does the picker.
    needs_function = (
        "{% for m in messages %}{% for c in m.tool_calls or [] %}"
        "{{ c['function'] | tojson }}{% endfor %}{% endfor %}"
    )
    refuses = "{{ raise_exception('roles must alternate') }}"
    call = Message("assistant", tool_calls=(b'{"type": "tool_use", "id": "", "name": ""}',))
    prompt = Prompt(messages=(call,))
    for template in (needs_function, refuses):
        tok = PromptTokenizer(Tokenizer.from_file(str(TOKENIZER / "tokenizer.json")), template, {})
        with pytest.raises(BadRequest) as err:
            tok.render(prompt)
        assert err.value.status == 400 and "chat template" in err.value.message
