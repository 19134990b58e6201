"""A manifest value gets exactly the checks of the same value on the command line (issue 17).

Every option of every configuration dataclass is walked: a wrong-typed manifest value and, where
one applies, an out-of-choice or out-of-range value are each refused in one line naming the file,
section and key, with exit code 2 and nothing written; a right value gives the same config and
fingerprint as the same flag.
"""

from __future__ import annotations

import dataclasses
import json
import re
import types
import typing
from pathlib import Path

import pytest

from apps.analysis.configs import (
    ChunkOverlapConfig,
    SelectionConfig,
    TrainingCurvesConfig,
    VocabularyOverlapConfig,
)
from apps.demo.config import DemoConfig, PreRegistration
from apps.evaluation.config import EvalConfig
from pipeline.config import (
    build_parser,
    config_from_options,
    declared,
    from_dict,
    parse_config,
    sections_of,
    to_dict,
    value_of,
)
from pipeline.errors import ConfigError, exit_code
from pipeline.io import fingerprint
from pipeline.option_values import scalar_type
from stage1_score.config import ScoreConfig
from stage2_train.config import TrainConfig

REPO = Path(__file__).resolve().parents[1]
# Each configuration dataclass, its manifest section, and values for its required options.
CONFIGS = {
    ScoreConfig: ("stage1", {"teacher": "t", "corpus": "c.jsonl", "out": "cache"}),
    TrainConfig: ("stage2", {"cache": "cache", "student": "s", "out": "run", "max_steps": 200}),
    EvalConfig: ("eval", {"model": "m"}),
    DemoConfig: ("demo", {}),
    PreRegistration: ("preregistered", {}),
    VocabularyOverlapConfig: ("analyze", {"student_tokenizer": "s", "teacher_tokenizers": ["t"]}),
    ChunkOverlapConfig: (
        "analyze",
        {"student_tokenizer": "s", "teacher_tokenizer": "t", "input": "i"},
    ),
    TrainingCurvesConfig: ("analyze", {"run_dirs": ["r"]}),
    SelectionConfig: ("analyze", {"cache": "c", "student": "s"}),
}
# Values each `__post_init__` must refuse, by option (ranges, and emptiness of lists).
OUT_OF_RANGE = {
    ScoreConfig: {
        "docs_per_shard": 0, "batch_tokens": 0, "vllm_max_num_batched_tokens": 0,
        "num_workers": -1, "cpus_per_worker": -1, "max_length": 1, "stride": 0,
        "vllm_gpu_memory_utilization": 1.5, "progress_seconds": 0, "text_column": "",
    },
    TrainConfig: {
        "max_steps": 0, "num_chunks": 0, "seq_len": 0, "save_every": 0,
        "global_batch_tokens": 0, "micro_batch_size": 0, "warmup_steps": -1, "num_workers": -1,
        "weight_decay": -0.1, "grad_clip": -1, "stop_at_step": 0, "min_lr": 0,
        "adam_beta1": 1, "adam_beta2": 1.5, "topk": 1.5, "eval_every": -1, "eval_docs": 0,
    },
    EvalConfig: {
        "num_docs": -1, "accuracy_problems": -1, "shots": -1, "max_new_tokens": 0,
        "generation_batch": 0, "batch_tokens": 0, "max_length": 1,
    },
    DemoConfig: {"train_docs": 0, "nproc_per_node": 0, "ray_cpus": 0, "arms": []},
    VocabularyOverlapConfig: {"teacher_tokenizers": []},
    ChunkOverlapConfig: {"num_docs": 0, "chunks": [0]},
    TrainingCurvesConfig: {"run_dirs": []},
    SelectionConfig: {"tokens": 0, "seq_len": 0, "micro_batch_size": 0, "min_count": 0,
                      "top": 0, "max_kept_rate": 1.0},
    PreRegistration: {
        "primary": "loss", "secondary": ["loss"], "comparisons": ["token-nothing"],
        "resamples": 10, "confidence": 1.5,
    },
}  # fmt: skip
# Right values that the generic choice in `_right_value` would make invalid with the defaults.
RIGHT = {
    (TrainConfig, "max_steps"): 400,  # must stay above warmup_steps
    (TrainConfig, "warmup_steps"): 50,
    (TrainConfig, "grad_clip"): 2,  # a TOML integer for a float option
    (ScoreConfig, "progress_seconds"): 30,
    (PreRegistration, "primary"): "answer_accuracy",
    (PreRegistration, "secondary"): ["answer_bits"],
    (PreRegistration, "comparisons"): ["random-chunk-none"],
    (PreRegistration, "resamples"): 2000,
    (PreRegistration, "confidence"): 0.9,
    (SelectionConfig, "topk"): 0.5,  # unset by default: stage 2's
    (TrainConfig, "teacher_weights"): [1.5, 2.5],
    (TrainConfig, "source_teachers"): ["a.jsonl=cache", "b.jsonl=b"],
    (SelectionConfig, "source_teachers"): ["a.jsonl=c"],
}
# options a right value needs beside it (the config refuses it alone)
COMPANIONS = {  # a value that needs another option beside it
    (ScoreConfig, "topk_mode"): {"topk_probs": 8},
    (ScoreConfig, "student_tokenizer"): {"chat_template": "student"},
    (TrainConfig, "teacher_weights"): {"guidance": "uld", "more_caches": ["b"]},
    (TrainConfig, "source_teachers"): {"more_caches": ["b"], "combine_teachers": "source"},
    (TrainConfig, "eval_every"): {"eval_data": "heldout.jsonl"},
    (TrainConfig, "eval_data"): {"eval_every": 100},
    (SelectionConfig, "source_teachers"): {"more_caches": ["b"], "combine_teachers": "source"},
    (EvalConfig, "targets"): {"accuracy_problems": 0, "answer_problems": 5},
}


def _fields(cls):
    """Each option of `cls` (a section's too) as (field, hint), named by its flat key."""
    return [
        (types.SimpleNamespace(**{a: getattr(o.field, a) for a in FIELD_PARTS}, name=o.key), o.hint)
        for o in declared(cls)
    ]


FIELD_PARTS = ("default", "default_factory", "metadata")


def _default(field):
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def _literal(hint):
    """The Literal inside `hint` (itself, or in `X | None`), or None."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    for arg in (hint, *(typing.get_args(hint) if union else ())):
        if typing.get_origin(arg) is typing.Literal:
            return arg
    return None


def _right_value(cls, field, hint):
    """A valid value other than the default, as a manifest would write it."""
    if (cls, field.name) in RIGHT:
        return RIGHT[cls, field.name]
    default, kind = _default(field), scalar_type(hint)
    if _literal(hint):
        return next(c for c in typing.get_args(_literal(hint)) if c != default)
    if typing.get_origin(kind) is list:
        item = typing.get_args(kind)[0]
        if _literal(item):
            return list(typing.get_args(item)[:1])
        return [3, 5] if item is int else ["a", "b"]
    if kind is bool:
        return not default
    if kind is int:
        return default * 2 if default else 3
    if kind is float:
        return default / 2
    return "elsewhere"


def _wrong_types(hint):
    """Manifest values of the wrong type for `hint`: each must be refused."""
    kind = scalar_type(hint)
    if _literal(hint):
        return [5, True]
    if typing.get_origin(kind) is list:
        item = typing.get_args(kind)[0]
        return ["a", [True] if scalar_type(item) is not bool else ["a"]]
    return {
        bool: ["false", "no", 0],
        int: ["1", 1.5, True],
        float: ["0.5", True],
        str: [5, False, ["a"]],
        Path: [5, True],
    }[kind]


def _out_of_choice(hint):
    if _literal(hint):
        return ["bogus"]
    kind = scalar_type(hint)
    if typing.get_origin(kind) is list and _literal(typing.get_args(kind)[0]):
        return [["bogus"]]
    return []


def _flags(name, value):
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return [flag if value else "--no-" + name.replace("_", "-")]
    if isinstance(value, list):
        return [flag, *map(str, value)]
    return [flag, str(value)]


def _write_manifest(path, section, values):
    lines = [f"[{section}]"] + [f"{key} = {json.dumps(value)}" for key, value in values.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def _cases(kind):
    for cls in CONFIGS:
        for field, hint in _fields(cls):
            if kind == "right":
                yield pytest.param(cls, field.name, _right_value(cls, field, hint), id=field.name)
                continue
            values = _wrong_types(hint) + _out_of_choice(hint)
            if field.name in OUT_OF_RANGE[cls]:
                values.append(OUT_OF_RANGE[cls][field.name])
            for value in values:
                yield pytest.param(
                    cls, field.name, value, id=f"{cls.__name__}-{field.name}-{value!r}"
                )


@pytest.mark.parametrize(("cls", "name", "value"), list(_cases("bad")))
def test_a_bad_manifest_value_is_one_line_naming_file_section_and_key(
    cls, name, value, tmp_path, monkeypatch, capsys
):
    section, required = CONFIGS[cls]
    monkeypatch.chdir(tmp_path)  # the configs' relative paths would land here
    manifest = _write_manifest(tmp_path / "m.toml", section, {**required, name: value})
    code = exit_code("prog", lambda: parse_config(cls, ["--manifest", str(manifest)], "", section))
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"prog: error: {manifest} [{section}]"), err
    assert re.search(rf"(?<![\w-])({name}|--{name.replace('_', '-')})(?![\w-])", err), err
    assert [p.name for p in tmp_path.iterdir()] == ["m.toml"]  # nothing written


@pytest.mark.parametrize(("cls", "name", "value"), list(_cases("right")))
def test_a_right_manifest_value_is_the_same_config_as_the_same_flag(cls, name, value, tmp_path):
    section, required = CONFIGS[cls]
    values = {**required, **COMPANIONS.get((cls, name), {}), name: value}
    manifest = _write_manifest(tmp_path / "m.toml", section, values)
    from_manifest = parse_config(cls, ["--manifest", str(manifest)], "", section)
    argv = [arg for key, v in values.items() for arg in _flags(key, v)]
    from_flags = parse_config(cls, argv, "", section)
    assert from_manifest == from_flags
    assert fingerprint(to_dict(from_manifest)) == fingerprint(to_dict(from_flags))
    assert value_of(from_manifest, name) != _default(
        next(f for f, _ in _fields(cls) if f.name == name)
    )  # the value was read, not left at its default


def test_the_issues_examples_are_refused_with_what_is_allowed(tmp_path):
    stage2 = {"cache": "c", "student": "s", "out": "o", "max_steps": 10, "warmup_steps": 1}
    expected = {
        "fsdp": ("false", 'fsdp: "false" is a string; expected true or false'),
        "dtype": ("float16", 'dtype: "float16" is not allowed; expected one of "auto", "float32"'),
        "seed": ("0", 'seed: "0" is a string; expected an integer'),
        "topk": ("0.4", 'topk: "0.4" is a string; expected a number'),
        "warmup_steps": (1.5, "warmup_steps: 1.5 is a float; expected an integer"),
    }
    for key, (value, message) in expected.items():
        manifest = _write_manifest(tmp_path / "x.toml", "stage2", {**stage2, key: value})
        with pytest.raises(ConfigError) as refused:
            parse_config(TrainConfig, ["--manifest", str(manifest)], "", "stage2")
        assert str(refused.value).startswith(f"{manifest} [stage2] {message}")
    stage1 = {"teacher": "t", "corpus": "c", "out": "o"}
    for key, value in {"overwrite": "no", "max_length": "512", "loss_dtype": "bfloat16x"}.items():
        with pytest.raises(ConfigError, match=rf"^s\.toml \[stage1\] {key}: \"{value}\""):
            from_dict(ScoreConfig, {**stage1, key: value}, "s.toml [stage1]")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--seed", "1.5"], "argument --seed: invalid int value: '1.5'"),
        (["--dtype", "float16"], "argument --dtype: invalid choice: 'float16'"),
        (["--max-steps", "0"], "command line: --max-steps must be at least 1"),
        (["--out", "s3://bucket/run"], "--out s3://bucket/run: stage 2 writes to a local or"),
    ],
)
def test_a_bad_flag_is_one_line_naming_the_flag(argv, message, capsys):
    required = ["--cache", "c", "--student", "s", "--out", "o", "--max-steps", "10",
                "--warmup-steps", "1"]  # fmt: skip
    code = exit_code("train", lambda: parse_config(TrainConfig, required + argv, "", "stage2"))
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err


def test_a_bad_flag_is_named_before_a_manifest_is_merged(tmp_path):
    manifest = _write_manifest(tmp_path / "m.toml", "eval", {"model": "m"})
    with pytest.raises(ConfigError, match=r"^command line --shots: \"2\" is a string"):
        config_from_options(EvalConfig, {"manifest": manifest, "shots": "2"}, "eval")


def test_every_choice_set_reaches_flags_and_help_from_its_literal():
    for cls, (section, _) in CONFIGS.items():
        actions = {a.dest: a for a in build_parser(cls, "", section)._actions}
        for field, hint in _fields(cls):
            kind = scalar_type(hint)
            item = typing.get_args(kind)[0] if typing.get_origin(kind) is list else hint
            choices = typing.get_args(_literal(item)) if _literal(item) else None
            assert actions[field.name].choices == choices, (cls.__name__, field.name)


def test_every_configuration_dataclass_is_walked():
    """A new config class (any dataclass built from `option(...)` fields, or a group's
    `options_of` factory's, spelled in capitals) joins CONFIGS, or is a section of one."""
    folders = ("pipeline", "apps", "stage1_score", "stage2_train", "scripts")
    sources = [path for folder in folders for path in REPO.glob(f"{folder}/**/*.py")]
    found = set()
    for path in sources:
        text = path.read_text()
        for match in re.finditer(
            r"@dataclass[^\n]*\nclass (\w+)[^\n]*:\n(.*?)(?=\n\S|\Z)", text, re.S
        ):
            if re.search(r"= (option|[A-Z]+)\(", match.group(2)):
                found.add(match.group(1))
    # a sectioned config's sections hold its options: they are found, and walked through it
    sections = {part for cls in CONFIGS for part in sections_of(cls).values()}
    flat = {cls for cls in CONFIGS if not sections_of(cls)}
    assert found == {cls.__name__ for cls in (*flat, *sections)}


def test_a_checkpoints_saved_config_is_read_through_the_same_checks(tmp_path):
    from stage2_train.checkpoint import check_resumable
    from stage2_train.resolve import BEFORE

    config = from_dict(TrainConfig, {"cache": "c", "student": "s", "out": "o", "max_steps": 10,
                                     "warmup_steps": 1})  # fmt: skip
    meta = {"cache_fingerprint": "f", "world_size": 1, "workers_per_rank": 0, "torch_threads": 1,
            **{f"resolved_{name}": value for name, value in BEFORE.items()}}  # fmt: skip
    folder = tmp_path / "step-3"
    folder.mkdir()
    (folder / "checkpoint.json").write_text(json.dumps({"step": 3, **meta}))
    saved = {**to_dict(config), "out": "elsewhere"}  # `out` may change on resume
    (folder / "config.json").write_text(json.dumps(saved))
    assert check_resumable(folder, config, meta) == 3
    (folder / "config.json").write_text(json.dumps({**saved, "fsdp": "false"}))
    with pytest.raises(
        ConfigError, match=rf"^{folder / 'config.json'} fsdp: \"false\" is a string"
    ):
        check_resumable(folder, config, meta)


def test_the_known_manifest_tables_are_the_commands_sections():
    """MANIFEST_TABLES lists every table a command reads, and nothing else."""
    import apps.commands.analyze
    import apps.demo.config
    import apps.evaluation.config
    import experiments.curve.config
    import experiments.dose.config
    import experiments.regime.config
    import stage1_score.config
    import stage2_train.config
    from pipeline.config import MANIFEST_TABLES

    modules = (apps.commands.analyze, apps.demo.config, apps.evaluation.config,
               experiments.curve.config, experiments.dose.config, experiments.regime.config,
               stage1_score.config, stage2_train.config)  # fmt: skip
    read = {module.SECTION for module in modules} | {apps.demo.config.PREREGISTERED}
    read |= {experiments.regime.config.ARMS}
    assert set(MANIFEST_TABLES) == read
    sections = re.findall(r'^SECTION = "(\w+)"', "\n".join(
        p.read_text() for p in Path(__file__).parents[1].glob("[a-z]*/**/*.py")
        if ".venv" not in p.parts
    ), re.MULTILINE)  # fmt: skip
    assert set(sections) <= read  # no command's section is missing from the imports above


def test_a_misspelled_manifest_table_is_refused_naming_it(tmp_path, capsys):
    from stage2_train.train import main as train

    manifest = tmp_path / "m.toml"
    manifest.write_text("[stage_2]\nmax_steps = 4\n")
    assert train(["--manifest", str(manifest), "--cache", str(tmp_path), "--student", "x",
                  "--out", str(tmp_path / "out")]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no command reads a [stage_2] table; did you mean [stage2]?" in err[0]
    assert not (tmp_path / "out").exists()


STAGES = (ScoreConfig, TrainConfig)


@pytest.mark.parametrize("cls", STAGES, ids=lambda cls: cls.__name__)
def test_each_stage_option_is_in_a_group_with_a_short_help(cls):
    """--help lists a stage's options by the component that reads them, each in a sentence or
    two (the detail is in docs/)."""
    from pipeline.config import HELP_CHARACTERS, option_groups

    ungrouped = [name for name, group in option_groups(cls).items() if group is None]
    assert not ungrouped
    long = {
        f.name: len(f.metadata["help"])
        for f, _ in _fields(cls)
        if len(f.metadata["help"]) > HELP_CHARACTERS
    }
    assert not long, long
    shown = build_parser(cls, "", "x").format_help()
    for group in set(option_groups(cls).values()):
        assert f"\n{group} options:\n" in shown


def test_a_manifest_may_group_a_stages_options_in_sub_tables(tmp_path):
    """[stage1.corpus] holds the corpus options; the flat spelling still works, the same config;
    an option in the wrong sub-table or an unknown sub-table is one line naming it."""
    flat = tmp_path / "flat.toml"
    flat.write_text('[stage1]\nteacher = "t"\ncorpus = "c"\nout = "o"\ntext_column = "body"\n'
                    "batch_tokens = 4096\n")  # fmt: skip
    grouped = tmp_path / "grouped.toml"
    grouped.write_text('[stage1]\nteacher = "t"\n[stage1.corpus]\ncorpus = "c"\n'
                       'text_column = "body"\n[stage1.output]\nout = "o"\n'
                       "[stage1.batching]\nbatch_tokens = 4096\n")  # fmt: skip
    configs = [parse_config(ScoreConfig, ["--manifest", str(p)], "", "stage1") for p in (flat, grouped)]
    assert configs[0] == configs[1] and configs[1].corpus.text_column == "body"
    cases = {
        '[stage1.corpus]\nbatch_tokens = 4096\n': "batch_tokens is a [batching] option, not a "
        "[corpus] one",
        '[stage1.corpora]\ncorpus = "c"\n': "no option group [corpora]; the groups are batching, "
        "corpus,",
        '[stage1]\ntext_column = "a"\n[stage1.corpus]\ntext_column = "b"\n': "text_column is "
        "set twice (flat and in [corpus])",
    }
    for text, message in cases.items():
        bad = tmp_path / "bad.toml"
        bad.write_text(text)
        with pytest.raises(ConfigError, match=re.escape(message)):
            parse_config(ScoreConfig, ["--manifest", str(bad)], "", "stage1")
    bad.write_text('[eval]\nmodel = "m"\n[eval.data]\nnum_docs = 2\n')
    with pytest.raises(ConfigError, match=r"no option group \[data\]; its options are not grouped"):
        parse_config(EvalConfig, ["--manifest", str(bad)], "", "eval")


def _float_options():
    from experiments.curve import config as curve
    from experiments.dose import config as dose

    sections = {cls: section for cls, (section, _) in CONFIGS.items()}
    sections |= {dose.DoseConfig: dose.SECTION, curve.CurveConfig: curve.SECTION}
    for cls, section in sections.items():
        for field, hint in _fields(cls):
            kind = scalar_type(hint)
            if float in (kind, *typing.get_args(kind)):
                yield pytest.param(cls, section, field.name, kind is not float,
                                   id=f"{cls.__name__}-{field.name}")  # fmt: skip


@pytest.mark.parametrize(("cls", "section", "name", "listed"), list(_float_options()))
def test_every_float_option_refuses_nan_and_infinities(
    cls, section, name, listed, tmp_path, capsys
):
    """One rule for every float option of every command, flag or manifest: NaN and infinities are
    refused (before: `--uld-lambda nan` and `--teacher-weights inf 1` passed the range checks,
    which NaN passes, and trained a NaN model that exited 0)."""
    required = CONFIGS.get(cls, (section, {}))[1]
    for spelled in ("nan", "inf", "-inf"):
        value = f"[{spelled}]" if listed else spelled
        manifest = tmp_path / "m.toml"
        extra = "".join(f"{key} = {json.dumps(v)}\n" for key, v in required.items())
        manifest.write_text(f"[{section}]\n{extra}{name} = {value}\n")
        flags = ["--manifest", str(manifest)]
        for argv in (flags, [*flags, f"--{name.replace('_', '-')}={spelled}"]):
            code = exit_code("prog", lambda argv=argv: parse_config(cls, argv, "", section))
            err = capsys.readouterr().err
            assert code == 2 and err.count("\n") == 1, err
            assert f"{spelled} is not allowed; expected a finite number" in err, err


def test_every_seed_option_refuses_a_negative_seed(capsys):
    """Before: `--sample-seed -5` passed the checks and failed in the Ray workers (numpy refuses
    a negative seed) as a remote traceback. Every seed option is held to 0..2**63 - 1 by one rule
    where options are checked."""
    from experiments.curve import config as curve
    from experiments.dose import config as dose
    from pipeline.option_values import SEED_OPTION

    sections = {cls: section for cls, (section, _) in CONFIGS.items()}
    sections |= {dose.DoseConfig: dose.SECTION, curve.CurveConfig: curve.SECTION}
    seeds = [(cls, f.name, hint) for cls in sections for f, hint in _fields(cls)
             if SEED_OPTION.search(f.name)]  # fmt: skip
    assert {name for _, name, _ in seeds} == {"sample_seed", "seed", "seeds", "longest_seeds"}
    for cls, name, hint in seeds:
        listed = typing.get_origin(scalar_type(hint)) is list
        for seed in (-5, 2**63):
            flag = f"--{name.replace('_', '-')}={seed}"
            required = CONFIGS.get(cls, ("", {}))[1]
            argv = [arg for key, v in required.items() for arg in _flags(key, v)] + [flag]
            code = exit_code("prog", lambda a=argv, c=cls: parse_config(c, a, "", sections[c]))
            err = capsys.readouterr().err
            assert code == 2 and err.count("\n") == 1, (cls, name, err)
            assert f"{seed} is not allowed; expected a seed from 0 to 2**63 - 1" in err, err
        assert listed == (name in ("seeds", "longest_seeds"))
