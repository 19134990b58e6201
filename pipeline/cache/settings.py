"""A cache's result settings (its manifest's `settings`): the options that decide what its shards
hold, besides the teacher, tokenizer and corpus. Stage 1 writes them and every reader reads them
as one `CacheSettings`, the only place that knows their JSON spellings and what a key's absence
means for a cache made before the key existed.

On disk they stay what stage 1 has always written, as they are part of the cache's producer
fingerprint: a key is written only where its value says more than its absence, so a cache
without an optional column keeps the identity it always had. Read back, an absent key takes the
meaning its field's comment gives, and the settings must write back exactly what was read: a key
this vocagno does not know (a newer one's cache) or a value of the wrong kind is refused in one
line, not dropped from the fingerprint.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, get_args

from pipeline.choices import LOSS_DTYPE_NAMES, LossDtype, TopkEncoding, TopkMode
from pipeline.errors import CacheError
from pipeline.io import canonical_json

ID_DTYPES = ("uint16", "int32")  # a top-k or drawn id's Arrow type, by the teacher's head size


@dataclass(frozen=True)
class CacheSettings:
    # the teacher's windows and the units' size; absent only from a manifest made by hand
    max_length: int | None = None
    stride: int | None = None
    docs_per_shard: int | None = None
    loss_dtype: LossDtype = "float32"  # the stored loss column's (always written)
    # --topk-probs K: entries a scored position holds, 0 for none (absent: none); with
    # topk_ids their ids too (absent: kept), in the narrowest type of the teacher's head
    topk_probs: int = 0
    topk_ids: bool = True
    topk_id_dtype: str | None = None
    # how the top K is stored (absent: float16, the only encoding before compact; a float16
    # cache written today leaves it out too, keeping that identity)
    topk_encoding: TopkEncoding = "float16"
    # the K largest, or K draws from the teacher's distribution (absent: top, the only mode
    # before draws); a sampled cache records its seed, temperature and the teacher's head
    # size V_t (absent: scored before it was recorded)
    topk_mode: TopkMode = "top"
    sample_seed: int = 0
    sample_temperature: float = 1.0
    sample_head_size: int | None = None
    target_spans: bool = False  # the shards hold each document's target spans (absent: no)
    space_logprob: dict | None = None  # the space mask's identity (absent: no such column)

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            allowed, kind = _KINDS[field.name]
            if not allowed(value):
                raise ValueError(f"setting {field.name} is {value!r}, not {kind}")
        if self.topk_probs and self.topk_ids and self.topk_id_dtype is None:
            raise ValueError(f"topk_probs {self.topk_probs} with ids needs their topk_id_dtype")
        if self.sampled and not self.topk_probs:
            raise ValueError("topk_mode sampled needs topk_probs: the draws a position holds")

    @property
    def sampled(self) -> bool:
        """Whether the cache holds teacher draws rather than its top K."""
        return self.topk_mode == "sampled"

    @property
    def compact(self) -> bool:
        """Whether the top K is stored in the compact encoding (pipeline.cache.topk_codec)."""
        return self.topk_encoding == "compact"

    def to_json(self) -> dict[str, Any]:
        """The manifest's `settings`, as stage 1 has always written them."""
        data: dict[str, Any] = {"loss_dtype": self.loss_dtype}
        for name in ("max_length", "stride", "docs_per_shard"):
            if getattr(self, name) is not None:
                data[name] = getattr(self, name)
        if self.topk_probs:
            data |= {"topk_probs": self.topk_probs, "topk_ids": self.topk_ids}
            if self.sampled:
                data |= {"topk_mode": "sampled", "sample_seed": self.sample_seed,
                         "sample_temperature": self.sample_temperature}  # fmt: skip
                if self.sample_head_size is not None:
                    data["sample_head_size"] = self.sample_head_size
            elif self.topk_encoding != "float16":
                data["topk_encoding"] = self.topk_encoding
            if self.topk_ids:
                data["topk_id_dtype"] = self.topk_id_dtype
        if self.target_spans:
            data["target_spans"] = True
        if self.space_logprob is not None:
            data["space_logprob"] = self.space_logprob
        return data

    @classmethod
    def from_json(cls, data: Any, where: str = "the cache's settings") -> CacheSettings:
        """The settings a manifest's (or producer record's) `settings` hold; CacheError in one
        line, naming `where`, for anything stage 1 would not have written."""
        if not isinstance(data, dict):
            raise CacheError(f"{where} are {type(data).__name__}, not a JSON object")
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise CacheError(
                f"{where} hold {', '.join(unknown)}, which this vocagno does not know (a cache "
                "of a newer vocagno?)"
            )
        try:
            settings = cls(**data)
        except ValueError as exc:
            raise CacheError(f"{where}: {exc}") from None
        written = settings.to_json()  # as spelled in the fingerprint: 1 is not 1.0 there
        differ = sorted(
            key
            for key in data.keys() | written.keys()
            if canonical_json(data.get(key)) != canonical_json(written.get(key))
        )
        if differ:
            raise CacheError(f"{where} are not as stage 1 writes them ({', '.join(differ)})")
        return settings


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0  # True: no count


def _one_of(*choices):
    return lambda value: value in choices


# each setting's kind: what it may hold, and those words for a refusal
_KINDS = {
    "max_length": (lambda v: v is None or _count(v), "a count or absent"),
    "stride": (lambda v: v is None or _count(v), "a count or absent"),
    "docs_per_shard": (lambda v: v is None or _count(v), "a count or absent"),
    "loss_dtype": (_one_of(*LOSS_DTYPE_NAMES), f"one of {', '.join(LOSS_DTYPE_NAMES)}"),
    "topk_probs": (_count, "a count"),
    "topk_ids": (lambda v: isinstance(v, bool), "true or false"),
    "topk_id_dtype": (_one_of(None, *ID_DTYPES), f"one of {', '.join(ID_DTYPES)} or absent"),
    "topk_encoding": (_one_of(*get_args(TopkEncoding)), "compact or float16"),
    "topk_mode": (_one_of(*get_args(TopkMode)), "top or sampled"),
    "sample_seed": (_count, "a count"),
    "sample_temperature": (lambda v: isinstance(v, float) and v > 0, "a positive number"),
    "sample_head_size": (lambda v: v is None or _count(v), "a count or absent"),
    "target_spans": (lambda v: isinstance(v, bool), "true or false"),
    "space_logprob": (lambda v: v is None or isinstance(v, dict), "an object or absent"),
}
