"""Chat records in a tokenizer's own chat template (`--chat-template teacher|student`,
pipeline.corpus.own_template): the text is transformers' `apply_chat_template` of the real
templates that ship (SmolLM2-Instruct's and Qwen2.5-Instruct's, with their shipped tokenizers;
Llama-3.1's, Gemma-2's and Qwen3's), and each assistant span is exactly its content and its
end-of-turn marker; a tokenizer without a template, or a record its template refuses, is one line."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import zstandard
from transformers import PreTrainedTokenizerFast

from pipeline.corpus import Corpus, CorpusOptions
from pipeline.corpus.own_template import OwnTemplate, own_template, shipped_chat_templates
from pipeline.corpus.targets import BadTargets
from pipeline.errors import CorpusError, TokenizerError
from pipeline.io import read_bytes
from pipeline.shipped import shipped_chat_template, shipped_corpus, shipped_tokenizer_file
from pipeline.tokenizer import load_tokenizer

# each template's end-of-turn marker: the oracle the spans are held to, written out by hand
CLOSING = {
    "smollm2-instruct": "<|im_end|>",
    "qwen2.5-instruct": "<|im_end|>",
    "llama-3.1-instruct": "<|eot_id|>",
    "gemma-2-it": "<end_of_turn>",
    "qwen3": "<|im_end|>",
}
TRIMMING = {"llama-3.1-instruct", "gemma-2-it"}  # those that `trim` a message's content
# the BOS a template writes and the tokenizer of its family adds itself (left out of the text)
BOS = {"llama-3.1-instruct": "<|begin_of_text|>", "gemma-2-it": "<bos>"}


def chat_records(count: int) -> list[list[dict]]:
    """Real shipped question/answer pairs, and conversations of two turns with a system prompt
    and answers given with surrounding whitespace (which most templates trim)."""
    lines = zstandard.decompress(shipped_corpus("chat-train").read_bytes()).decode().splitlines()
    pairs = [json.loads(line)["messages"] for line in lines[: 2 * count]]
    multi = [
        [{"role": "system", "content": "Answer step by step."}, *a]
        + [b[0], {"role": "assistant", "content": "\n " + b[1]["content"] + " \n"}]
        for a, b in zip(pairs[::2], pairs[1::2], strict=True)
    ]
    return pairs[:count] + multi


def template_tokenizer(name: str) -> OwnTemplate:
    """The template `name` as a teacher's: with its shipped tokenizer where one ships, else on
    SmolLM2's vocabulary with the family's BOS (the rendering reads only the special tokens)."""
    record = shipped_chat_templates()[name]
    if "tokenizer" in record:
        return own_template("teacher", load_tokenizer(record["tokenizer"]))
    hf = PreTrainedTokenizerFast(
        tokenizer_object=load_tokenizer("smollm2").backend,
        chat_template=shipped_chat_template(record["file"]).read_text(),
        bos_token=BOS.get(name),
        eos_token="<|endoftext|>",
    )
    return OwnTemplate("teacher", hf, BOS.get(name))


@pytest.mark.parametrize("name", sorted(CLOSING))
def test_the_text_is_apply_chat_template_and_the_spans_its_assistant_contents(name):
    template = template_tokenizer(name)
    for messages in chat_records(4):
        if name == "gemma-2-it":  # Gemma has no system role: its template refuses one
            messages = [m for m in messages if m["role"] != "system"]
        text, spans = template.render(messages)
        rendered = template.tokenizer.apply_chat_template(messages, tokenize=False)
        assert BOS.get(name, "") + text == rendered
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        # a span starts at the content's first character that is not whitespace and ends with
        # the marker, after the content's trailing whitespace where the template keeps it
        kept = [a.strip() if name in TRIMMING else a.lstrip() for a in answers]
        assert [text[a:b] for a, b in spans] == [a + CLOSING[name] for a in kept]
        answers = [a.strip() for a in answers]
        # everything outside the spans is the template's and the other roles' text: no answer
        bounds = [0, *(edge for span in spans for edge in span), len(text)]
        outside = "".join(text[a:b] for a, b in zip(bounds[::2], bounds[1::2], strict=True))
        assert not any(answer in outside for answer in answers)


def test_the_shipped_tokenizers_that_carry_a_template_are_smollm2_and_qwen():
    carried = {r["tokenizer"] for r in shipped_chat_templates().values() if "tokenizer" in r}
    assert carried == {"smollm2", "qwen2.5"}
    for name in ("tinyllama", "mistral", "deepseek"):
        with pytest.raises(TokenizerError, match=f"tokenizer '{name}' has no chat_template"):
            own_template("teacher", load_tokenizer(name))


def tokenizer_folder(folder: Path, template: str | None) -> Path:
    """A teacher's tokenizer folder: SmolLM2's tokenizer.json and a tokenizer_config.json naming
    `template` as its chat_template (or none), as transformers saves them."""
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(read_bytes(shipped_tokenizer_file("smollm2.json.zst")))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_a_folder_s_template_is_read_and_a_folder_without_one_is_one_line(tmp_path):
    text = shipped_chat_template("smollm2-instruct.jinja").read_text()
    loaded = own_template("teacher", load_tokenizer(str(tokenizer_folder(tmp_path / "a", text))))
    assert loaded.template == text
    assert loaded.render(chat_records(1)[0]) == template_tokenizer("smollm2-instruct").render(
        chat_records(1)[0]
    )
    bare = load_tokenizer(str(tokenizer_folder(tmp_path / "b", None)))
    with pytest.raises(TokenizerError) as error:
        own_template("student", bare)
    assert str(error.value).startswith("--chat-template student: tokenizer ")
    assert "has no chat_template" in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(TokenizerError, match="has no chat_template"):  # a bare tokenizer.json
        own_template("teacher", load_tokenizer(str(tmp_path / "b" / "tokenizer.json")))


def test_a_record_the_template_refuses_is_named_in_one_line_or_skipped(tmp_path):
    """Gemma's template raises on a system turn: the corpus names the record, or skips it."""
    corpus = tmp_path / "chat.jsonl"
    records = chat_records(2)
    corpus.write_text("".join(json.dumps({"messages": m}) + "\n" for m in records))
    template = template_tokenizer("gemma-2-it")
    options = CorpusOptions(targets="chat", chat_template="teacher")
    with pytest.raises(
        CorpusError,
        match="record 2: the teacher's chat template refused the "
        "messages: System role not supported",
    ):
        list(Corpus(corpus, options, template))
    skipping = CorpusOptions(targets="chat", chat_template="teacher", on_bad_record="skip")
    read = list(Corpus(corpus, skipping, template))
    assert [type(d).__name__ for d in read] == [
        "Document",
        "Document",
        "SkippedDocument",
        "SkippedDocument",
    ]


def test_the_cache_records_whose_template_rendered_it():
    """The manifest's corpus.targets.template: a named template's strings as before, or the
    owner and the hash of a tokenizer's own (another template is another corpus)."""
    spec = shipped_corpus("chat-eval")
    named = Corpus(spec, CorpusOptions(targets="chat")).describe()["targets"]["template"]
    assert named == {"name": "chatml", "before": "<|im_start|>{role}\n", "after": "<|im_end|>\n",
                     "closing": len("<|im_end|>")}  # fmt: skip
    options = CorpusOptions(targets="chat", chat_template="teacher")
    described = {
        name: Corpus(spec, options, template_tokenizer(name)).describe()["targets"]["template"]
        for name in ("smollm2-instruct", "llama-3.1-instruct")
    }
    text = shipped_chat_template("smollm2-instruct.jinja").read_bytes()
    assert described["smollm2-instruct"] == {
        "name": "teacher", "chat_template_sha256": hashlib.sha256(text).hexdigest(),
        "leading_bos": None,
    }  # fmt: skip
    assert described["llama-3.1-instruct"]["leading_bos"] == "<|begin_of_text|>"
    with pytest.raises(ValueError, match="needs own_template"):
        Corpus(spec, options)


def test_stage_2_says_when_the_cache_was_rendered_for_another_student():
    """A cache rendered by --chat-template student trains any student (the alignment is by
    characters into its one text); stage 2 says in one line when its student's tokenizer is not
    the one whose template rendered it, and says nothing otherwise."""
    from pipeline.cache.manifest import CacheManifest
    from pipeline.cache.settings import CacheSettings
    from stage2_train.preflight import chat_template_note

    def cache(template: dict) -> CacheManifest:
        corpus = {"targets": {"mode": "chat", "column": "messages", "template": template}}
        return CacheManifest(teacher={}, tokenizer={}, settings=CacheSettings(), corpus=corpus)

    qwen = own_template("student", load_tokenizer("qwen2.5")).describe()
    assert chat_template_note(cache(qwen), load_tokenizer("qwen2.5")) is None
    other = chat_template_note(cache(qwen), load_tokenizer("smollm2"))
    assert "this student's tokenizer has another chat template" in other
    assert "has no chat template" in chat_template_note(cache(qwen), load_tokenizer("tinyllama"))
    as_teacher = own_template("teacher", load_tokenizer("qwen2.5")).describe()
    assert chat_template_note(cache(as_teacher), load_tokenizer("tinyllama")) is None


def test_a_template_that_rewrites_a_content_gives_no_guessed_span():
    """Qwen3's template drops the reasoning of an answer before the last question: the text has
    no place for that content as given, so the record is refused, not given a nearby span."""
    template = template_tokenizer("qwen3")
    question, answer = chat_records(1)[0]
    thinking = {
        "role": "assistant",
        "content": "<think>\nadd them\n</think>\n\n" + answer["content"],
    }
    with pytest.raises(BadTargets, match="renders message 1 differently once later messages follow it"):
        template.render([question, thinking, question, answer])
    text, spans = template.render([question, thinking])  # the last answer keeps its reasoning
    assert text[slice(*spans[0])] == thinking["content"] + "<|im_end|>"
