"""Write the shipped instruction example (pipeline/assets/corpus/gsm_symbolic-chat-*.jsonl.zst):
the shipped math problems as chat records, the question a user turn and the worked answer the
assistant's, so that `--targets chat` trains on the answers alone (docs/instruction-data.md).

    python scripts/make_chat_corpus.py   # deterministic: the same bytes on every run
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.corpus import Corpus  # noqa: E402
from pipeline.shipped import ASSETS, shipped_corpus  # noqa: E402

QUESTION, ANSWER = "Question: ", "\nAnswer: "
COUNTS = {"train": 2000, "eval": 200}  # the first documents of each split


def chat_record(doc_id: str, text: str) -> dict:
    question, answer = text.removeprefix(QUESTION).split(ANSWER, 1)
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return {"id": doc_id, "messages": messages}


def main() -> None:
    for split, count in COUNTS.items():
        lines = []
        for document in Corpus(shipped_corpus(split)):
            if len(lines) == count:
                break
            lines.append(json.dumps(chat_record(document.doc_id, document.text)) + "\n")
        data = zstandard.ZstdCompressor(level=19).compress("".join(lines).encode("utf-8"))
        out = ASSETS / "corpus" / f"gsm_symbolic-chat-{split}.jsonl.zst"
        out.write_bytes(data)
        print(f"{out}: {len(lines)} records, {len(data):,} bytes")


if __name__ == "__main__":
    main()
