"""Stage 1: score every token of a corpus with a teacher into a reusable Parquet cache.

On a laptop:   python stage1_score/run.py --teacher T --corpus C --out DIR
On a cluster:  ray job submit --address ADDR -- python stage1_score/run.py --teacher T ...
From a file:   python stage1_score/run.py --manifest manifests/stage1-example.toml
Before it:     add --dry-run (options, switches as resolved here, the plan) or --print-config

Rerunning the same command resumes: finished shards are verified and kept. The cache folder's
manifest.json is written last; `vocagno cache verify DIR` audits the result.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.config_preview import options_listing, parse_command  # noqa: E402
from pipeline.errors import exit_code  # noqa: E402
from pipeline.log import configure  # noqa: E402
from stage1_score.config import SECTION, ScoreConfig  # noqa: E402

DESCRIPTION = (
    "Score every token of a corpus with a teacher into a reusable Parquet cache. Run it directly "
    "(it joins or starts a local Ray), or on a cluster with `ray job submit --address ADDR -- "
    "python stage1_score/run.py ...`. Rerunning the same command resumes; `vocagno cache verify "
    "DIR` audits the result. Options marked [identity] make the cache's identity: a rerun with "
    "another value refuses to mix into the same cache; [run only] ones change how fast, where or "
    "how visibly it is built, never its bytes."
)


def main(argv: list[str] | None = None) -> int:
    return exit_code("stage1", lambda: _score(argv))


def _score(argv: list[str] | None) -> None:
    command = parse_command(ScoreConfig, argv, DESCRIPTION, SECTION)
    if command.flags.print_config:
        print(options_listing(command, SECTION))
        return
    configure()
    if command.flags.dry_run:
        from stage1_score.dry_run import dry_run

        for block in dry_run(command):
            print(block, flush=True)
        return
    from stage1_score.job import run

    run(command.config)


if __name__ == "__main__":
    sys.exit(main())
