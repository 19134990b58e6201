"""Chat records rendered by a tokenizer's own chat template (`--chat-template teacher|student`).

The template is the tokenizer's Jinja `chat_template` (its folder's `tokenizer_config.json` or
`chat_template.jinja`, a GGUF's, a hub tokenizer's) and transformers' `apply_chat_template`
(tokenize=False) renders it, so the text is what the model saw in its chat training.

An assistant turn's span is found by rendering the prefixes of the conversation: the text up to
and including the assistant's header (the prefix rendered with the generation prompt), then the
content as the template writes it (stripped of surrounding whitespace, as most templates `trim`),
and everything the turn adds after it up to the next turn, less trailing whitespace: the
end-of-turn marker (`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`, `</s>`), so that a student
learns where a turn ends, as with the named templates. Every prefix must be a prefix of the whole
rendering and the content must appear as given; a template that rewrites earlier turns once later
ones follow, or changes a content, has no exact span and the record is refused in one line.

A leading BOS that the rendering tokenizer adds itself when it tokenizes is left out of the text
(templates such as Llama-3's write `{{ bos_token }}`), so the model sees one BOS, not two.
"""

from __future__ import annotations

import functools
import hashlib
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.corpus.targets import ASSISTANT, BadTargets, Spans, checked_messages
from pipeline.errors import TokenizerError
from pipeline.shipped import ASSETS, shipped_chat_template
from pipeline.tokenizer import TextTokenizer, shipped_tokenizers

NO_TEMPLATE = (
    "tokenizer {spec!r} has no chat_template (a model folder keeps it in tokenizer_config.json "
    "or chat_template.jinja); use --chat-template chatml or plain"
)


@dataclass(frozen=True)
class OwnTemplate:
    """A tokenizer's own chat template, as `name` ("teacher" or "student") names its owner."""

    name: str
    tokenizer: Any  # a transformers tokenizer whose chat_template renders
    leading_bos: str | None  # the BOS its tokenization adds, left out of the text where written

    @property
    def template(self) -> str:
        return self.tokenizer.chat_template

    def describe(self) -> dict:
        """The cache's record of the rendering: whose template, and which one (by its hash)."""
        return {
            "name": self.name,
            "chat_template_sha256": hashlib.sha256(self.template.encode("utf-8")).hexdigest(),
            "leading_bos": self.leading_bos,
        }

    def render(self, messages: Any) -> tuple[str, Spans]:
        """The text of `messages` and its assistant spans, or BadTargets."""
        messages = checked_messages(messages)
        full = self._apply(messages)
        spans: list[tuple[int, int]] = []
        for index, message in enumerate(messages):
            content = message["content"].strip()
            if message["role"] == ASSISTANT and content:
                spans.append(self._span(messages, index, content, full))
        if not spans:
            raise BadTargets("no assistant message with content: the record has no targets")
        cut = len(self.leading_bos) if self.leading_bos and full.startswith(self.leading_bos) else 0
        return full[cut:], tuple((start - cut, end - cut) for start, end in spans)

    def _span(self, messages: list[dict], index: int, content: str, full: str) -> tuple[int, int]:
        """Where assistant message `index` (its stripped `content`) and its closing lie in
        `full`, checked against the conversation rendered up to and including it."""
        header = self._prefix(messages[:index], full, index)
        turn = self._apply(messages[: index + 1])
        if not turn.startswith(full[:header]):
            raise BadTargets(
                f"the {self.name}'s chat template renders the messages before message {index} "
                "differently once it follows them: its span cannot be placed exactly"
            )
        start = turn.find(content, header)
        if start < 0:
            raise BadTargets(
                f"the {self.name}'s chat template does not write message {index}'s content "
                "as given: its span cannot be placed exactly"
            )
        closing = turn[start + len(content) :].rstrip()
        if full.startswith(turn):
            return start, start + len(content) + len(closing)
        # a template may write a block before the content of the last turn only (Qwen3's empty
        # reasoning): where the whole rendering leaves it out, the content follows the header
        # and the whitespace the message gave it
        given = messages[index]["content"]
        start = header + len(given) - len(given.lstrip())
        if full.startswith(content + closing, start):
            return start, start + len(content) + len(closing)
        raise BadTargets(
            f"the {self.name}'s chat template renders message {index} differently once later "
            "messages follow it: its span cannot be placed exactly"
        )

    def _prefix(self, before: list[dict], full: str, index: int) -> int:
        """Where the assistant's content may start: after the messages before it and the
        assistant's header (the generation prompt) where the template writes it so."""
        if not before:
            return 0
        for prompt in (True, False):
            text = self._apply(before, add_generation_prompt=prompt)
            if full.startswith(text):
                return len(text)
        raise BadTargets(
            f"the {self.name}'s chat template renders the messages before message {index} "
            "differently once it follows them: its span cannot be placed exactly"
        )

    def _apply(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        # a template is code of the tokenizer's authors: it refuses records its own way
        # (raise_exception for roles out of turn, a TypeError on a field it expects)
        except Exception as exc:
            raise BadTargets(
                f"the {self.name}'s chat template refused the messages: {first_line(exc)}"
            ) from None


@functools.cache
def shipped_chat_templates() -> dict[str, dict]:
    """Name -> provenance record of the chat templates that ship inside the package."""
    return tomllib.loads((ASSETS / "chat_templates.toml").read_text(encoding="utf-8"))


def own_template(name: str, tokenizer: TextTokenizer) -> OwnTemplate:
    """The chat template of `tokenizer` (as loaded from its spec: a folder, a GGUF file, a hub
    id, or a shipped name whose template ships too), or one line saying it has none."""
    from transformers import PreTrainedTokenizerFast

    spec, policy = tokenizer.spec, tokenizer.policy
    leading_bos = policy.bos_token if policy.add_bos else None
    if spec in shipped_tokenizers() or spec.endswith((".json", ".json.zst")):
        # a bare tokenizer.json holds no template; a shipped one's ships beside it
        shipped = [t for t in shipped_chat_templates().values() if t.get("tokenizer") == spec]
        if not shipped:
            raise TokenizerError(f"--chat-template {name}: {NO_TEMPLATE.format(spec=spec)}")
        hf = PreTrainedTokenizerFast(
            tokenizer_object=tokenizer.backend,
            chat_template=shipped_chat_template(shipped[0]["file"]).read_text(encoding="utf-8"),
            bos_token=policy.bos_token,
            eos_token=policy.eos_token,
        )
        return OwnTemplate(name, hf, leading_bos)
    try:
        hf = _read_tokenizer(spec)
    except Exception as exc:  # transformers raises OSError, ValueError or its own kinds
        raise TokenizerError(
            f"--chat-template {name}: cannot read the chat template of tokenizer {spec!r}: "
            f"{first_line(exc)}"
        ) from None
    if not isinstance(getattr(hf, "chat_template", None), str) or not hf.chat_template:
        raise TokenizerError(f"--chat-template {name}: {NO_TEMPLATE.format(spec=spec)}")
    return OwnTemplate(name, hf, leading_bos)


def _read_tokenizer(spec: str):
    """The transformers tokenizer at `spec`, with its chat template. A tokenizer.json is read
    as such: AutoTokenizer, needed only for a GGUF file or a folder without one, imports torch
    and every model's code (about 20 s here)."""
    from transformers import PreTrainedTokenizerFast

    path = Path(spec).expanduser()
    if path.suffix == ".gguf" or (path.is_dir() and not (path / "tokenizer.json").exists()):
        from transformers import AutoTokenizer

        if path.suffix == ".gguf":
            return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        return AutoTokenizer.from_pretrained(spec)
    return PreTrainedTokenizerFast.from_pretrained(spec)


def first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
