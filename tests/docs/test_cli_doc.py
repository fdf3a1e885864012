"""The command-line flags the docs give exist, on the command they give them to, and every flag
of `extproc serve` and `extproc envoy-config` is documented.

Commands are read from the docs' code blocks (a line, `\\` continuations joined) and code
spans: flags after `extproc <subcommand>` (or `python -m extproc.sim`) must be that
subcommand's, flags after a `bench/` or `scripts/` file must be spelled in that file. A flag
in code with no command before it (`--worker-ports P`) must be some extproc command's or a
known foreign one's (FOREIGN).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from functools import cache

import pytest

from extproc.cli import build_parser
from extproc.sim.cli import build_arg_parser as sim_parser
from tests.docs.doc_texts import ROOT, code_spans, doc_texts

FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")

# Flags the docs give to other programs, by program.
FOREIGN = {
    "vllm serve": {
        "--kv-events-config", "--max-num-batched-tokens", "--enable-chunked-prefill",
        "--no-enable-chunked-prefill", "--long-prefill-token-threshold", "--max-model-len",
        "--num-gpu-blocks", "--num-cpu-blocks", "--enable-prompt-tokens-details",
        "--encoder-cache-items", "--scheduling-policy",
    },
}  # fmt: skip
# Where the serve flags must be documented (the README's "Use it", operations.md).
SERVE_DOCS = ("README.md", "operations.md")
HIDDEN = {"--worker-index"}  # serve's own flag for the workers it starts (help suppressed)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings if o.startswith("--")}


@cache
def command_flags() -> dict[str, set[str]]:
    """extproc's subcommand -> its flags (the global ones included)."""
    top = build_parser()
    common = _flags(top)
    found = {name: _flags(p) | common for name, p in _subparsers(top).items()}
    found["sim"] = _flags(sim_parser()) | common  # `extproc sim` hands its argv to this parser
    return found


def _commands(text: str) -> Iterator[str]:
    """Each command line of a doc: code-block lines (fenced or indented, continuations
    joined) and code spans."""
    for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, re.MULTILINE | re.DOTALL):
        yield from block.replace("\\\n", " ").splitlines()
    prose = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    yield from re.findall(r"^ {4,}(\S.*)$", prose, re.MULTILINE)
    yield from code_spans(prose.replace("\n", " "))


COMMAND = re.compile(
    r"\bextproc\s+(?:--log-\S+\s+\S+\s+)*(?P<sub>[a-z][a-z-]*)"
    r"|python -m extproc\.(?P<mod>sim)\b"
    r"|(?P<file>\b(?:bench|scripts)/[\w/.-]+\.(?:py|sh))"
    r"|\b(?P<envoy>envoy-config)\b"
)


def _wrong_flags(line: str) -> list[str]:
    """Flags of `line` its command does not have ([] for other programs' commands)."""
    wrong = []
    # a command runs up to a pipe, `;`, `&&` or the next command of the line
    starts = list(COMMAND.finditer(line))
    for i, m in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(line)
        tail = re.split(r"\||;|&&|#", line[m.end() : end])[0]
        flags = FLAG.findall(tail)
        sub = m["sub"] or m["mod"] or m["envoy"]
        if m["file"]:
            path = ROOT / m["file"]
            source = path.read_text() if path.exists() else ""
            passed = re.search(r'extproc ([a-z-]+) "\$@"', source)  # a wrapper: its flags
            if passed is None:
                wrong += [f"{m['file']} {f}" for f in flags if f'"{f}"' not in source]
                continue
            sub = passed[1]
        if sub not in command_flags():
            continue  # `extproc` as a word, not a command (`extproc envoy` in prose, ...)
        wrong += [f"extproc {sub} {f}" for f in flags if f not in command_flags()[sub]]
    return wrong


@pytest.mark.parametrize("doc", sorted(doc_texts()))
def test_flags_given_to_a_command_are_its_own(doc: str):
    wrong = [w for line in _commands(doc_texts()[doc]) for w in _wrong_flags(line)]
    assert wrong == []


@pytest.mark.parametrize("doc", sorted(doc_texts()))
def test_every_flag_named_is_some_commands(doc: str):
    known = set().union(*command_flags().values(), *FOREIGN.values())
    scripts = "".join(
        p.read_text() for d in ("bench", "scripts") for p in (ROOT / d).rglob("*.[ps][yh]")
    )
    wrong = []
    for span in code_spans(re.sub(r"^```.*?^```", "", doc_texts()[doc], flags=re.M | re.S)):
        wrong += [f for f in FLAG.findall(span) if f not in known and f'"{f}"' not in scripts]
    assert wrong == []


@pytest.mark.parametrize(
    ("command", "docs"), [("serve", SERVE_DOCS), ("envoy-config", tuple(doc_texts()))]
)
def test_every_flag_is_documented(command: str, docs: tuple[str, ...]):
    text = "\n".join(doc_texts()[d] for d in docs)
    named = set(FLAG.findall(text))
    own = command_flags()[command] - command_flags()["check-config"] - HIDDEN  # not --help
    assert sorted(own - named) == []


def test_the_checks_see_a_wrong_flag():
    assert _wrong_flags("extproc serve --port 1 --no-such-flag") == ["extproc serve --no-such-flag"]
    assert _wrong_flags("extproc envoy-config --workers 2") == ["extproc envoy-config --workers"]
    assert _wrong_flags("extproc sim --servers 3 --base-port 8100") == []
    assert _wrong_flags("vllm serve m --kv-events-config x") == []
    assert _wrong_flags("bash scripts/demo.sh --rate 5 --fast 2") == []  # extproc demo "$@"
    assert _wrong_flags("python bench/soak.py --minutes 5 --nope") == ["bench/soak.py --nope"]
