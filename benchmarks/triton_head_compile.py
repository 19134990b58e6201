"""What `--head-kernel onepass`'s row kernel compiles to for a GPU, on any machine (no GPU
needed): with the space column, and with the top k's block maxima, its exponentials in base 2 and
natural as runs 7-15 measured them, its registers, spills, the width of its loads of the logits
and the instructions a thread issues per logit in its loop (SASS), which bound its speed where
memory does not.

    python benchmarks/triton_head_compile.py [--arch 90 80]

Triton compiles the kernel (pipeline/scoring/triton_head.py) down to a cubin here, with the ptxas
its wheel ships, specialized as a launch on a real shape is (pointers and the vocabulary and
stride divisible by 16, but what the kernel leaves unspecialized: the pointers into per-position
arrays), and the cuobjdump it ships reads the cubin's resource use. A spill (STACK or LOCAL above
0) is slow on any GPU. These are the compiler's facts, not speeds: a GPU run measures those
(bench_stage1_head.py). The triton here is this project's lock's; a GPU machine's may compile
differently.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from pipeline.scoring import triton_head  # noqa: E402
from pipeline.scoring.head_kernels import TOPK_BLOCK  # noqa: E402

ARCHES = {90: "H100/H200 (sm_90a)", 80: "A100 (sm_80)"}
# the row kernel's runtime arguments as a launch on bf16 logits passes them (rows of a
# vocabulary divisible by 16); constexprs follow
ROW_SIGNATURE = {
    "logits_ptr": "*bf16", "target_ptr": "*i64", "space_ptr": "*i8", "max_ptr": "*fp32",
    "total_ptr": "*fp32", "space_total_ptr": "*fp32", "picked_ptr": "*fp32",
    "block_max_ptr": "*fp32", "vocab": "i32", "row_stride": "i32",
}  # fmt: skip


def launch_attrs(kernel, signature: dict[str, str]) -> dict:
    """Divisibility by 16 where a launch on a real shape has it: each pointer and integer in
    `signature` but those `kernel` leaves unspecialized (the ones that vary with a batch's
    positions)."""
    params = {param.name: param for param in kernel.params}
    return {
        (index,): [["tt.divisibility", 16]]
        for index, name in enumerate(signature)
        if not (params[name].do_not_specialize or params[name].do_not_specialize_on_alignment)
    }


@dataclass
class CompiledRows:
    registers: int
    spill_bytes: int
    load_bytes: int  # the widest global load of the logits: 16 is a full vector load
    loop: Counter  # the row loop's SASS instructions by opcode, one pass over ROW_BLOCK logits

    def per_logit(self, opcode: str | None = None) -> float:
        """Instructions a thread issues per logit it reads (of `opcode` alone, if given)."""
        count = self.loop[opcode] if opcode else sum(self.loop.values())
        return count * 32 * triton_head.ROW_WARPS / triton_head.ROW_BLOCK


def compile_rows(
    arch: int, space: bool, maxima: bool = False, natural_exp: bool = False
) -> CompiledRows:
    """`--head-kernel onepass`'s row kernel compiled for sm_`arch` with its fixed block, with or
    without the space column and the top k's block maxima, its exponentials in base 2 or (as
    runs 7-15 measured it) natural."""
    names = triton_head._row_sums.arg_names
    signature = ROW_SIGNATURE | {name: "constexpr" for name in names if name not in ROW_SIGNATURE}
    if list(signature) != names:
        raise RuntimeError(f"the row kernel's arguments changed: {names}")
    constants = dict(
        HAS_SPACE=space, BLOCK=triton_head.ROW_BLOCK, MAX_BLOCK=TOPK_BLOCK if maxima else 0,
        NATURAL_EXP=natural_exp,
    )  # fmt: skip
    source = ASTSource(fn=triton_head._row_sums, signature=signature, constexprs=constants,
                       attrs=launch_attrs(triton_head._row_sums, ROW_SIGNATURE))  # fmt: skip
    kernel = triton.compile(
        source, target=GPUTarget("cuda", arch, 32), options=triton_head.ROW_OPTIONS
    )
    usage = resource_usage(kernel.asm["cubin"])
    widths = [int(n) for n in re.findall(r"ld\.global(?:\.\w+)*\.v(\d)\.b32", kernel.asm["ptx"])]
    return CompiledRows(
        registers=usage["REG"], spill_bytes=usage["STACK"] + usage["LOCAL"],
        load_bytes=4 * max(widths, default=0), loop=loop_opcodes(kernel.asm["cubin"]),
    )  # fmt: skip


def cuobjdump(cubin: bytes, *flags: str) -> str:
    """What the cuobjdump Triton ships says of `cubin` with `flags`."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        return subprocess.run(
            [str(tool), *flags, file.name], capture_output=True, text=True, check=True
        ).stdout


def resource_usage(cubin: bytes) -> dict[str, int]:
    """cuobjdump's resource use of the cubin's kernel: REG, STACK, SHARED, LOCAL, ..."""
    said = cuobjdump(cubin, "-res-usage")
    return {key: int(value) for key, value in re.findall(r"(\w+)(?:\[\d+\])?:(\d+)", said)}


def loop_opcodes(cubin: bytes) -> Counter:
    """The opcodes (predicates dropped) of the kernel's one loop in SASS: the instructions from a
    backward branch's target to the branch."""
    code = re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)([^;]*);",
                      cuobjdump(cubin, "-sass"))  # fmt: skip
    loops = [
        (int(target, 16), int(address, 16))
        for address, opcode, rest in code
        if opcode == "BRA"
        for target in re.findall(r"0x([0-9a-f]+)", rest)
        if int(target, 16) < int(address, 16)
    ]
    if len(loops) != 1:
        raise RuntimeError(f"expected one loop in the kernel, found {len(loops)}")
    ((begin, end),) = loops
    return Counter(op for address, op, _ in code if begin <= int(address, 16) <= end)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", nargs="+", type=int, choices=tuple(ARCHES), default=[90, 80])
    args = parser.parse_args(argv)
    header = f"{'kernel':<28} {'target':<20} {'column':<7} {'registers':>9} {'spill B':>8}"
    print(header)
    print("-" * len(header))
    for arch in args.arch:
        for column, space, maxima in (("loss", False, False), ("+space", True, False),
                                      ("+topk", False, True)):  # fmt: skip
            for natural_exp in (False, True):
                r = compile_rows(arch, space, maxima, natural_exp)
                print(
                    f"{'onepass rows' + (', natural exp' if natural_exp else ''):<28} "
                    f"{ARCHES[arch]:<20} {column:<7} {r.registers:>9} {r.spill_bytes:>8}  loads "
                    f"of {r.load_bytes} B, {r.per_logit():.1f} instructions a logit"
                )
    print(f"triton {triton.__version__}; spill B: stack and local bytes (0: none)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
