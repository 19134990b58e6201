"""The launch environment is checked like a flag: torchrun's variables that are not integers, out
of range, or set without the others are one line naming the variable and the fix, before stage 2
writes anything."""

from __future__ import annotations

import pytest

from pipeline.errors import ConfigError
from stage2_train.distributed import LAUNCH_VARIABLES, launch_environment
from stage2_train.train import main
from tests.cache_fixtures import build_cache
from tests.stage2_runs import train_args

TORCHRUN = {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}  # fmt: skip


def test_what_torchrun_sets_and_a_plain_process_are_accepted():
    assert launch_environment(TORCHRUN) == (4, 3, 1)
    assert launch_environment({}) == (1, 0, 0)
    single = {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": "29500", "LOCAL_WORLD_SIZE": "1"}  # fmt: skip
    assert launch_environment(single) == (1, 0, 0)


@pytest.mark.parametrize(
    "change, said",
    [
        ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' is not an integer"),
        ({"RANK": "abc"}, "RANK='abc' is not an integer"),
        ({"LOCAL_RANK": "x"}, "LOCAL_RANK='x' is not an integer"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0' must be at least 1"),
        ({"RANK": "4"}, "RANK=4 must be in [0, WORLD_SIZE=4)"),
        ({"LOCAL_RANK": "2"}, "LOCAL_RANK=2 must be in [0, LOCAL_WORLD_SIZE=2)"),
        ({"LOCAL_WORLD_SIZE": "8"}, "LOCAL_WORLD_SIZE=8 must be in [1, WORLD_SIZE=4]"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a port"),
        ({"MASTER_ADDR": None}, "WORLD_SIZE=4 is set but MASTER_ADDR is not"),
        (
            {"MASTER_ADDR": None, "MASTER_PORT": None},
            "WORLD_SIZE=4 is set but MASTER_ADDR and MASTER_PORT are not",
        ),
        (
            {"WORLD_SIZE": None, "LOCAL_WORLD_SIZE": None, "RANK": "0", "LOCAL_RANK": None},
            "RANK is set but WORLD_SIZE is not",
        ),
    ],
)
def test_a_bad_launch_environment_is_one_line_naming_the_variable(
    tmp_path, monkeypatch, capsys, change, said
):
    cache = tmp_path / "cache"
    build_cache(cache, teacher_tokenizer="qwen2.5", num_documents=2, docs_per_shard=2)
    env = {k: v for k, v in {**TORCHRUN, **change}.items() if v is not None}
    with pytest.raises(ConfigError, match="run under torchrun"):
        launch_environment(env)
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "out"
    assert main(train_args(cache, out)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0], err
    assert all(name in err[0] for name in LAUNCH_VARIABLES)  # the fix names them all
    assert not out.exists()
