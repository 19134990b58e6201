"""Loading tokenizers from every kind of spec, their framing, fingerprints and honest offsets."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipeline.errors import TokenizerError
from pipeline.io import read_bytes
from pipeline.shipped import shipped_tokenizer_file
from pipeline.tokenizer import load_tokenizer, shipped_tokenizers

SHIPPED = ("tinyllama", "mistral", "qwen2.5", "deepseek", "smollm2")
TEXT = "Natalia sold 48 clips in April, and half as many in May. 😀 √x ≤ 3"


def shipped_json(name: str) -> bytes:
    """The raw (compressed) bytes of a shipped tokenizer.json."""
    return shipped_tokenizer_file(shipped_tokenizers()[name]["file"]).read_bytes()


def read_bytes_of(name: str) -> bytes:
    """A shipped tokenizer.json, decompressed."""
    return read_bytes(shipped_tokenizer_file(shipped_tokenizers()[name]["file"]))


def same_encoding(a, b) -> bool:
    return all(
        np.array_equal(x, y) for x, y in ((a.ids, b.ids), (a.start, b.start), (a.end, b.end))
    )


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_name_loads_with_its_recorded_vocabulary_and_framing(name):
    record = shipped_tokenizers()[name]
    tok = load_tokenizer(name)
    assert tok.vocab_size == record["vocab"]
    assert tok.policy.add_bos == record["add_bos"]
    enc = tok.encode(TEXT, add_eos=True)
    assert enc.ids.dtype == enc.start.dtype == enc.end.dtype == np.int32
    assert (enc.ids[0] == tok.bos_id) == record["add_bos"]
    assert enc.ids[-1] == tok.eos_id and (enc.start[-1], enc.end[-1]) == (len(TEXT), len(TEXT))
    assert tok.backend.decode(enc.ids.tolist(), skip_special_tokens=True).strip() == TEXT


def test_tokenizer_json_plain_and_zst_load_the_same_tokenizer(tmp_path):
    compressed = tmp_path / "tokenizer.json.zst"
    compressed.write_bytes(shipped_json("qwen2.5"))
    plain = tmp_path / "tokenizer.json"
    plain.write_bytes(read_bytes(compressed))
    from_plain, from_zst = load_tokenizer(plain), load_tokenizer(str(compressed))
    shipped = load_tokenizer("qwen2.5")
    assert from_plain.fingerprint == from_zst.fingerprint
    # Qwen2.5's policy (no BOS, EOS <|endoftext|>) is in tokenizers.toml; a bare file has no EOS.
    assert not from_plain.policy.add_bos and from_plain.policy.eos_token is None
    assert same_encoding(from_plain.encode(TEXT), shipped.encode(TEXT))


def test_hf_folder_reads_bos_policy_from_tokenizer_config(tmp_path):
    with_bos = tmp_path / "with_bos"
    with_bos.mkdir()
    (with_bos / "tokenizer.json").write_bytes(read_bytes_of("tinyllama"))
    (with_bos / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "add_bos_token": True,
                "bos_token": {"content": "<s>", "lstrip": False},
                "eos_token": "</s>",
            }
        )
    )
    tok = load_tokenizer(with_bos)
    assert tok.policy.add_bos and tok.bos_id == 1 and tok.eos_id == 2
    assert tok.encode("hi").ids[0] == 1
    # Same file and same framing as the shipped name: same identity for caches.
    assert tok.fingerprint == load_tokenizer("tinyllama").fingerprint

    no_bos = tmp_path / "no_bos"
    no_bos.mkdir()
    (no_bos / "tokenizer.json").write_bytes(read_bytes_of("tinyllama"))
    (no_bos / "tokenizer_config.json").write_text(
        json.dumps({"add_bos_token": False, "bos_token": "<s>", "eos_token": "</s>"})
    )
    plain = load_tokenizer(no_bos)
    assert not plain.policy.add_bos and plain.encode("hi").ids[0] != 1
    assert plain.fingerprint != tok.fingerprint


def test_bos_policy_is_read_from_a_template_post_processor(tmp_path):
    config = json.loads(read_bytes_of("tinyllama"))
    config["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<s>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}},
    }
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(config))
    tok = load_tokenizer(path)
    assert tok.policy.add_bos and tok.policy.bos_token == "<s>"
    enc = tok.encode("hi")
    assert enc.ids[0] == 1 and (enc.start[0], enc.end[0]) == (0, 0)
    assert (enc.ids == 1).sum() == 1  # our framing, not the post-processor's, adds the BOS


def write_tiny_gguf(path, add_bos: bool) -> None:
    """A Llama-style SentencePiece vocabulary in a GGUF file: specials, 256 bytes, six pieces."""
    import gguf

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += ["▁", "a", "b", "▁a", "ab", "▁ab"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(1)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_scores([0.0] * 259 + [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * 6)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(add_bos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_file_loads_with_offsets_and_the_files_bos_flag(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, add_bos=True)
    tok = load_tokenizer(path)
    assert tok.spec == str(path) and tok.policy.add_bos and tok.eos_id == 2
    enc = tok.encode("ab a😀", add_eos=True)
    pieces = [tok.backend.id_to_token(int(i)) for i in enc.ids]
    assert pieces == ["<s>", "▁ab", "▁a", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>", "</s>"]
    assert enc.start.tolist() == [0, 0, 2, 4, 4, 4, 4, 5]
    assert enc.end.tolist() == [0, 2, 4, 5, 5, 5, 5, 5]


def test_gguf_without_bos_flag_frames_without_bos(tmp_path):
    path = tmp_path / "nobos.gguf"
    write_tiny_gguf(path, add_bos=False)
    tok = load_tokenizer(path)
    assert not tok.policy.add_bos and tok.encode("ab").ids.tolist() == [264]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("/nonexistent/tokenizer.json", "does not exist"),
        ("/nonexistent/model.gguf", "does not exist"),
        ("no-such-name", "not a shipped name (deepseek, mistral, qwen2.5, smollm2, tinyllama)"),
    ],
)
def test_missing_specs_raise_a_clear_tokenizer_error(spec, message):
    with pytest.raises(TokenizerError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_tokenizer(spec)


def test_damaged_files_raise_a_clear_tokenizer_error(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot read tokenizer file"):
        load_tokenizer(bad)
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(read_bytes_of("smollm2"))
    (folder / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(TokenizerError, match="tokenizer_config.json is not valid JSON"):
        load_tokenizer(folder)
    other = tmp_path / "notes.txt"
    other.write_text("hello")
    with pytest.raises(
        TokenizerError, match="is not a tokenizer.json, a GGUF file or a model folder"
    ):
        load_tokenizer(other)


def test_slow_tokenizer_without_offsets_is_refused(tmp_path):
    # ByT5 has only a Python ("slow") tokenizer in transformers: no Rust backend, no offsets.
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "ByT5Tokenizer"})
    )
    with pytest.raises(
        TokenizerError, match="slow .Python. tokenizer; it gives no character offsets"
    ):
        load_tokenizer(tmp_path)


def test_fingerprint_is_stable_across_loads_and_differs_between_tokenizers():
    first = {name: load_tokenizer(name).fingerprint for name in SHIPPED}
    assert len(set(first.values())) == len(SHIPPED)
    assert all(len(fp) == 16 and int(fp, 16) >= 0 for fp in first.values())
    load_tokenizer.cache_clear()  # a fresh parse of the same files, not the cached objects
    for name in ("tinyllama", "smollm2"):
        assert load_tokenizer(name).fingerprint == first[name]


# Documents whose repairs sit at their edges: a lone dummy prefix ("1" is "▁" "1" in SentencePiece),
# characters a normalizer drops at the start or end, empty documents between others.
EDGES = [TEXT, "", "1", "1", "  x", "\u0301a", "a\u0301", "", "日本語", "e\u0301", "1 ", " "]


@pytest.mark.parametrize("name", SHIPPED)
@pytest.mark.parametrize("framing", [{}, {"add_bos": False}, {"add_eos": True}])
def test_a_batch_is_its_documents_encoded_one_by_one(name, framing):
    """The batch call repairs and frames every document at once: nothing may cross from one
    document into the next."""
    tok = load_tokenizer(name)
    batched = tok.encode_concatenated(EDGES, **framing)
    alone = [tok.encode(text, **framing) for text in EDGES]
    assert batched.lengths.tolist() == [len(e) for e in alone]
    for name_, values in (("ids", batched.ids), ("start", batched.start), ("end", batched.end)):
        expected = np.concatenate([getattr(e, name_) for e in alone])
        np.testing.assert_array_equal(values, expected, err_msg=name_)
        assert values.dtype == np.int32
    for one, split in zip(alone, tok.encode_batch(EDGES, **framing), strict=True):
        assert same_encoding(one, split)
    assert tok.encode_batch([]) == [] and tok.encode_concatenated([]).ids.size == 0


@pytest.mark.parametrize("name", SHIPPED)
def test_special_token_strings_in_text_are_plain_text(name):
    tok = load_tokenizer(name)
    text = "<s> strike </s> <|endoftext|> <unk> <｜end▁of▁sentence｜>"
    enc = tok.encode(text, add_bos=False)
    specials = {tok.backend.token_to_id(t) for t in ("<s>", "</s>", "<unk>", "<|endoftext|>")}
    specials |= {tok.bos_id, tok.eos_id} - {None}
    assert not specials & set(enc.ids.tolist())


def test_truncation_and_padding_in_a_tokenizer_json_are_ignored(tmp_path):
    config = json.loads(read_bytes_of("smollm2"))
    config["truncation"] = {
        "direction": "Right",
        "max_length": 4,
        "strategy": "LongestFirst",
        "stride": 0,
    }
    config["padding"] = {
        "strategy": {"Fixed": 64},
        "direction": "Right",
        "pad_to_multiple_of": None,
        "pad_id": 0,
        "pad_type_id": 0,
        "pad_token": "<|endoftext|>",
    }
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(config))
    enc = load_tokenizer(path).encode(TEXT)
    assert same_encoding(enc, load_tokenizer("smollm2").encode(TEXT))


@pytest.mark.parametrize("name", SHIPPED)
def test_every_character_is_covered_by_a_token_in_text_order(name):
    tok = load_tokenizer(name)
    text = "cafe\u0301 n\u0303\u0323 x\u00a8  \t\r\n😀👨\u200d👩\u200d👧 \\frac{1}{2} ∑ 日本語 1"
    enc = tok.encode(text, add_eos=True)
    wide = enc.end > enc.start
    covered = np.zeros(len(text), dtype=bool)
    for start, end in zip(enc.start[wide], enc.end[wide], strict=True):
        covered[start:end] = True
    assert covered.all()
    assert (np.diff(enc.start[wide]) >= 0).all() and (np.diff(enc.end[wide]) >= 0).all()
