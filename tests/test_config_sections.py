"""A config made of sections (pipeline.config): stage 2's options live in seven section
dataclasses, yet every spelling a user or a saved run has keeps working: flat flags, a flat
`[stage2]` table, the group tables `[stage2.optimizer]`, and a config.json saved when the config
was one flat dataclass, which loads to the same fingerprint (so its checkpoints resume)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from pipeline.config import (
    build_parser,
    declared,
    from_dict,
    parse_config,
    replaced,
    sections_of,
    to_dict,
    value_of,
)
from pipeline.io import fingerprint
from stage2_train.config import SECTION, TrainConfig, parse_train_config
from tests.test_config_validation import CONFIGS

REPO = Path(__file__).resolve().parents[1]
SAVED = json.loads((REPO / "tests" / "saved" / "stage2-flat-config.json").read_text())
# Options added since it was saved, at their defaults (which keep a run as it was): the config
# saved then is the one loaded now less these, by the same fingerprint.
ADDED_SINCE = {"eval_every": 0, "eval_data": None, "eval_docs": 200, "logger": "tensorboard",
               "wandb_project": "vocagno"}  # fmt: skip
# stage 2's sections as --help and the docs list them (issue 78: guidance first)
ORDER = ["guidance", "data", "model", "optimizer", "kernels", "checkpointing", "logging"]


def as_saved(config: TrainConfig) -> dict:
    """The config as it would have been saved before ADDED_SINCE, which must be at its defaults."""
    options = to_dict(config)
    assert {key: options.pop(key) for key in ADDED_SINCE} == ADDED_SINCE
    return options


def test_a_config_saved_flat_loads_to_the_same_options_and_fingerprint():
    config = from_dict(TrainConfig, SAVED["config"], "config.json")
    assert as_saved(config) == SAVED["config"]  # the same keys, values and so the same bytes
    assert fingerprint(as_saved(config)) == SAVED["fingerprint"]
    assert fingerprint(as_saved(parse_train_config(SAVED["argv"]))) == SAVED["fingerprint"]
    assert config.optimizer.lr == 0.001 and config.guidance.mode == "uld"
    assert config.checkpointing.out == Path("runs/out")
    assert [str(cache) for cache in config.data.more_caches] == ["runs/cache-b"]


def _toml(value) -> str:
    return json.dumps(value)  # TOML spells these values (strings, numbers, lists, booleans) alike


def test_flat_and_grouped_manifests_give_the_flat_configs_fingerprint(tmp_path):
    values = {k: v for k, v in SAVED["config"].items() if v is not None}
    flat = tmp_path / "flat.toml"
    flat.write_text(f"[{SECTION}]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in values.items()))
    groups: dict[str, dict] = {}
    for option in declared(TrainConfig):
        if option.key in values:
            groups.setdefault(option.group, {})[option.key] = values[option.key]
    grouped = tmp_path / "grouped.toml"
    grouped.write_text("".join(
        f"[{SECTION}.{group}]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in table.items())
        for group, table in groups.items()
    ))  # fmt: skip
    for manifest in (flat, grouped):
        config = parse_config(TrainConfig, ["--manifest", str(manifest)], "", SECTION)
        assert fingerprint(as_saved(config)) == SAVED["fingerprint"], manifest.name


def test_the_guidance_section_and_the_guidance_flag_do_not_clash():
    """`--guidance` (a flag, a manifest key, a saved key) is the section's `mode`."""
    config = parse_train_config([*SAVED["argv"], "--guidance", "kld"])
    assert config.guidance.mode == "kld" and value_of(config, "guidance") == "kld"
    assert to_dict(config)["guidance"] == "kld" and "mode" not in to_dict(config)
    assert replaced(config, guidance="uld").guidance.mode == "uld"


def test_help_lists_the_sections_in_their_declared_order_each_default_once():
    assert list(sections_of(TrainConfig)) == ORDER
    shown = build_parser(TrainConfig, "", SECTION).format_help()
    titles = re.findall(r"^(\w+) options:$", shown, re.MULTILINE)
    assert titles == ORDER
    for cls, (section, _) in CONFIGS.items():
        for action in build_parser(cls, "", section)._actions:
            assert (action.help or "").count("default:") <= 1, (cls.__name__, action.dest)


def test_the_docs_list_stage_2s_options_as_declared():
    """docs/stage2.md's table: each section in --help's order, each with its options in it."""
    page = (REPO / "docs" / "stage2.md").read_text(encoding="utf-8")
    table = page.split("### Options by section", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\w+) \| (`--.*) \|$", table, re.MULTILINE)
    assert [name for name, _ in rows] == ORDER
    for name, flags in rows:
        listed = re.findall(r"`(--[\w-]+)`", flags)
        assert listed == [o.flag for o in declared(TrainConfig) if o.section == name], name


def test_help_lists_every_student_preset_and_each_guidance_mode_with_its_summary():
    from pipeline.guidance_modes import MODES
    from pipeline.models.presets import PRESETS

    shown = " ".join(build_parser(TrainConfig, "", SECTION).format_help().split())
    assert all(preset in shown for preset in PRESETS)
    at = [shown.index(f"{name}: {' '.join(mode.summary.split()[:4])}") for name, mode in MODES.items()]
    assert at == sorted(at)  # one line a mode, in MODES' order, above the guidance options
    group = shown.index("guidance options:")
    assert group < at[0] and at[-1] < shown.index("--guidance {", group)
