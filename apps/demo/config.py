"""Options of the demo itself (`[demo]` in manifests/demo.toml); stages read their own tables."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.config import option
from pipeline.guidance import GUIDANCE_MODES

SECTION = "demo"


@dataclass
class DemoConfig:
    out: Path = option(Path("runs/demo"), help="folder for every output of the demo")
    train_docs: int = option(300, help="training documents taken from the shipped corpus")
    student: str = option("llama-tiny", help="stage-2 student preset or model")
    student_tokenizer: str = option("tinyllama", help="the student's tokenizer")
    arms: list[str] = option(
        ["none", "token"],
        help=f"--guidance of each training arm: any of {', '.join(GUIDANCE_MODES)}",
    )
    nproc_per_node: int = option(2, help="torchrun ranks per arm")
    ray_cpus: int = option(2, help="CPUs of the local Ray cluster")
    teacher: str | None = option(
        None, help="teacher model folder; unset: SmolLM2-135M-Instruct, prepared offline"
    )

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        unknown = sorted(set(self.arms) - set(GUIDANCE_MODES))
        if unknown or not self.arms:
            raise ValueError(f"arms must be guidance modes {GUIDANCE_MODES}, not {self.arms}")
        for name in ("train_docs", "nproc_per_node", "ray_cpus"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
