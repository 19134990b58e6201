"""Every closed set of option values, each declared once as a `Literal`.

A config field typed with one of these gets its flag's `choices`, its `--help` and its manifest
check from that declaration (pipeline.config); code that checks a value at run time uses the
tuple derived from it. It imports nothing of the package, so any module may use it cheaply. The
guidance modes are declared with what each needs in pipeline/guidance_modes.py, their Literal
beside them.
"""

from typing import Literal, get_args

UnmappedStrategy = Literal["include", "exclude", "mean"]
SelectionScope = Literal["microbatch", "global"]
LossNormalization = Literal["all", "kept"]  # eq. 3: over all target tokens, or the kept ones
ChunkStudentAggregate = Literal["mean", "max", "sum"]
Aggregation = Literal["max", "mean", "sum"]
# how the teacher losses of several caches combine per student token (pipeline.teacher_loss);
# source: each document's loss is its corpus source's named teacher's (--source-teachers)
TeacherCombination = Literal["min", "mean", "source"]
TextSplit = Literal["file", "line"]
# which characters of a record are training targets (pipeline.corpus.targets): all of them, the
# record's own spans, or the assistant turns of its chat messages rendered by a named template
Targets = Literal["all", "spans", "chat"]
# how chat messages become text: a named template (pipeline.corpus.targets), or the teacher's or
# the student's tokenizer's own chat_template (pipeline.corpus.own_template; stage 1 only)
NamedChatTemplate = Literal["chatml", "plain"]
ChatTemplate = Literal["chatml", "plain", "teacher", "student"]
OnBadRecord = Literal["error", "skip"]
# a teacher's weights as loaded; checkpoint: the dtype its checkpoint was saved in
TorchDtype = Literal["float32", "bfloat16", "float16", "checkpoint"]
# stage 1's --dtype: those, or auto: bfloat16 where the workers get GPUs, float32 on CPUs (as
# stage 2's --dtype auto computes)
TeacherDtype = Literal["auto", "float32", "bfloat16", "float16", "checkpoint"]
ComputeDtype = Literal["auto", "float32", "bfloat16"]  # stage 2 autocast
FsdpParamDtype = Literal["auto", "bfloat16", "float32"]  # stage 2 --fsdp: FSDP2's param_dtype
ScoringBackend = Literal["hf", "vllm"]
LossDtype = Literal["float16", "float32"]
Packing = Literal["documents", "stream"]  # stage 2: how documents fill training sequences
Attention = Literal["auto", "flex", "dense"]  # how a document mask reaches attention (both stages)
AdamwKernel = Literal["auto", "fused", "plain"]  # stage 2: torch's AdamW implementation
CompileLayers = Literal["auto", "layers", "off"]  # both stages: torch.compile of each layer
LossKernel = Literal["auto", "chunked", "plain"]  # stage 2: how the per-token loss is computed
HeadKernel = Literal["auto", "fused", "plain", "onepass"]  # stage 1: the head's columns
LoggerName = Literal["tensorboard", "wandb", "none"]  # stage 2: where each step's metrics also go
# stage 1: how the top-k columns are stored (pipeline.cache.topk_codec); a cache whose settings
# name none is float16
TopkEncoding = Literal["compact", "float16"]
# stage 1: the teacher's K largest probabilities, or K ids drawn from its distribution
# (pipeline.scoring.draws); only the plain head holds a row's whole softmax to draw from,
# which stage 1's config and the scorer both refuse otherwise, in these words
TopkMode = Literal["top", "sampled"]
SAMPLED_NEEDS_PLAIN_HEAD = (
    "--topk-mode sampled draws from the plain head's softmax: use --head-kernel plain, not {kernel}"
)
HeadChunks = Literal["auto", "sized", "fixed"]  # stage 1: how many rows a head chunk holds
UnitOverlap = Literal["auto", "on", "off"]  # stage 1: a unit's CPU work beside another's scoring
BatchOverlap = Literal["auto", "on", "off"]  # stage 1: a batch built while the last one runs
RowPacking = Literal["auto", "packed", "padded"]  # stage 1: how windows fill a batch's rows
# stage 2 --guidance alm: tokenkit's alm_mode values (merge chunks by the teacher's space
# probability, append each side's space log-probability), naive = neither
AlmMode = Literal[
    "merge_by_space_prob+append_space", "merge_by_space_prob", "append_space", "naive"
]

UNMAPPED_STRATEGIES: tuple[str, ...] = get_args(UnmappedStrategy)
SELECTION_SCOPES: tuple[str, ...] = get_args(SelectionScope)
LOSS_NORMALIZATIONS: tuple[str, ...] = get_args(LossNormalization)
CHUNK_STUDENT_AGGREGATES: tuple[str, ...] = get_args(ChunkStudentAggregate)
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)
TEACHER_COMBINATIONS: tuple[str, ...] = get_args(TeacherCombination)
TEXT_SPLITS: tuple[str, ...] = get_args(TextSplit)
ON_BAD_RECORD: tuple[str, ...] = get_args(OnBadRecord)
TARGETS: tuple[str, ...] = get_args(Targets)
CHAT_TEMPLATES: tuple[str, ...] = get_args(ChatTemplate)
NAMED_CHAT_TEMPLATES: tuple[str, ...] = get_args(NamedChatTemplate)
OWN_CHAT_TEMPLATES = tuple(t for t in CHAT_TEMPLATES if t not in NAMED_CHAT_TEMPLATES)
TORCH_DTYPES: tuple[str, ...] = get_args(TorchDtype)
LOSS_DTYPE_NAMES: tuple[str, ...] = get_args(LossDtype)
PACKINGS: tuple[str, ...] = get_args(Packing)
ALM_MODES: tuple[str, ...] = get_args(AlmMode)


def on_device(choice: str, device, gpu: str, cpu: str) -> str:
    """What a switch's `auto` means on `device` (a torch.device): `gpu` on CUDA, `cpu` elsewhere;
    any other choice stands as given."""
    if choice != "auto":
        return choice
    return gpu if device.type == "cuda" else cpu


def compiles_on(device) -> bool:
    """Whether the fast paths' own kernels (stage 1's fused head, flex attention's block mask)
    run under torch.compile on `device` (a torch.device): on CUDA; elsewhere eagerly, where a
    compile costs a run more than it saves."""
    return device.type == "cuda"
