"""Stage 1's `--dry-run`: the options with their sources, every device-dependent switch as this
machine resolves it, and the plan (documents, units, workers, an estimate of the cache's bytes),
printed without starting or joining Ray, loading the teacher's weights or touching --out.

The driver resolves `auto` for the device the Ray cluster gives its workers
(stage1_score.job.teacher_dtype); a dry run asks no cluster and assumes this machine's device and
CPUs, as a local Ray started here would have them, and says so. It reads the whole corpus to count
its records (what the run's units are made of), and tokenizes a sample of it with the teacher's
tokenizer for the cache's size.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import pyarrow as pa
import torch

from pipeline.cache.schema import TARGET_SPANS, cache_schema
from pipeline.config import replaced
from pipeline.config_preview import Command, options_listing
from pipeline.corpus import Document
from pipeline.log import counted
from pipeline.scoring.head import HeadExtras
from pipeline.scoring.resolve import Asked, Resolved, resolve
from pipeline.scoring.switches import HeadSwitches
from pipeline.scoring.teacher import load_teacher_tokenizer
from stage1_score.config import SECTION
from stage1_score.job import plan
from stage1_score.pool import pool_shape

# Documents whose tokens per character estimate the corpus's: enough for a stable ratio, few
# enough that a big corpus's dry run tokenizes in seconds.
SAMPLE_DOCUMENTS = 200
SHA256_HEX = 64  # bytes of a text_sha256 value


def dry_run(command: Command) -> list[str]:
    """The dry run's blocks of text, in the order printed: options, switches, plan."""
    config = command.config
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    output, batching, workers_asked = config.output, config.batching, config.workers
    sampled = bool(output.topk_probs) and output.topk_mode == "sampled"
    extras = HeadExtras(topk=output.topk_probs, sampled=sampled)
    resolved = resolve(Asked.of(config), device, extras=extras)
    job = plan(replaced(config, dtype=resolved.dtype))  # the dtype as this device resolves it
    read = _read(job.corpus)
    documents, characters, sample = read.documents, read.characters, read.sample
    tokenizer = load_teacher_tokenizer(job.teacher, config.teacher.tokenizer)
    sample_tokens = sum(len(e) for e in tokenizer.encode_batch([d.text for d in sample]))
    sample_characters = sum(len(d.text) for d in sample)
    per_character = sample_tokens / max(1, sample_characters)
    tokens = round(characters * per_character)
    row_bytes = token_bytes(job.settings, output.loss_dtype)
    cache_bytes = tokens * row_bytes + read.document_bytes
    cpus, gpus = os.cpu_count() or 1, torch.cuda.device_count()
    workers, worker_cpus, worker_gpus = pool_shape(workers_asked, cpus, gpus)
    units = math.ceil(documents / batching.docs_per_shard)
    max_docs, ray_address = config.corpus.max_docs, workers_asked.ray_address
    sliced = f", its first {max_docs:,} records" if max_docs else ""
    asked_cluster = f" (--ray-address {ray_address} not asked)" if ray_address else ""
    plan_lines = [
        f"device: this machine's ({device.type}), assumed to be the workers' (a dry run asks no "
        "Ray cluster)",
        "auto switches: " + ", ".join(_switches(config, resolved)),
        f"corpus: {config.corpus.location} ({counted(len(job.corpus.sources), 'source')}, "
        f"{job.corpus.total_bytes:,} bytes){sliced}",
        f"documents: {documents:,} ({characters:,} characters)",
        f"units: {units:,} of up to {batching.docs_per_shard:,} documents (one shard each)",
        f"windows: {job.max_length:,} tokens every {job.stride:,}",
        f"workers: {workers} x ({counted(worker_cpus, 'CPU')}, {counted(worker_gpus, 'GPU')}), "
        f"assuming a local Ray of this machine's {counted(cpus, 'CPU')} and "
        f"{counted(gpus, 'GPU')}{asked_cluster}",
        f"teacher tokens: about {tokens:,} (an estimate: {characters:,} characters x "
        f"{per_character:.4f} tokens a character, the teacher's tokenizer on the first "
        f"{counted(len(sample), 'document')})",
        f"cache bytes: about {_size(cache_bytes)} before compression (an estimate: {tokens:,} "
        f"tokens x {row_bytes} bytes of per-token columns, + {_size(read.document_bytes)} of "
        "texts, ids and hashes); zstd makes the shards smaller",
    ]
    return [
        "# stage 1 --dry-run: nothing is written, no weights loaded, no Ray started\n"
        "# each option's value and where it came from (default, manifest or flag)\n"
        + options_listing(command, SECTION),
        "\n".join(["", "# the plan", *plan_lines]),
    ]


def _switches(config, resolved: Resolved) -> list[str]:
    """Each device-dependent switch, `asked -> resolved` where they differ; the hf backend's
    head switches only under it (vllm reads none of them)."""
    asked = {"dtype": config.teacher.dtype, "unit_overlap": config.batching.unit_overlap}
    got = {"dtype": resolved.dtype, "unit_overlap": resolved.unit_overlap}
    if config.teacher.backend == "hf":
        asked |= HeadSwitches.asked_by(config.head, config.batching).saved()
        got |= resolved.switches.saved()
    said = [
        f"{name} {value}" if got[name] == value else f"{name} {value} -> {got[name] or 'unused'}"
        for name, value in asked.items()
    ]
    if config.teacher.backend == "hf":  # what HFScorer.load decides with the teacher on its device
        said[-1] += "; at load, a teacher may take back packing, onepass or compile"
    return said


def _size(count: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:,.1f} {unit}"
    return f"{count} bytes"


class Read(NamedTuple):
    """What the dry run learns from reading the corpus as the run would."""

    documents: int
    characters: int
    document_bytes: int  # of the per-document columns: text, doc_id, text_sha256, target spans
    sample: list[Document]  # the first SAMPLE_DOCUMENTS


def _read(corpus) -> Read:
    """The corpus as the run reads it (--max-docs honoured; a bad record refused or skipped as
    the run would)."""
    documents = characters = stored = 0
    sample: list[Document] = []
    for item in corpus:
        if isinstance(item, Document):
            documents += 1
            characters += len(item.text)
            spans = 2 * len(item.target_spans or ())
            stored += len(item.text.encode("utf-8")) + len(item.doc_id.encode("utf-8")) + 4 * spans
            if len(sample) < SAMPLE_DOCUMENTS:
                sample.append(item)
    return Read(documents, characters, stored + documents * SHA256_HEX, sample)


def token_bytes(settings, loss_dtype: str) -> int:
    """Bytes a scored token takes in the cache's per-token columns, uncompressed: their Arrow
    widths in the schema the shards are written with (a document's own columns aside)."""
    total = 0
    for field in cache_schema(loss_dtype, settings):
        if not pa.types.is_list(field.type) or field.name == TARGET_SPANS:
            continue  # one value a document (doc_id, text, text_sha256), or its spans
        value = field.type.value_type
        if pa.types.is_fixed_size_list(value):
            total += value.list_size * value.value_type.bit_width // 8
        elif pa.types.is_fixed_size_binary(value):
            total += value.byte_width
        else:
            total += value.bit_width // 8
    return total
