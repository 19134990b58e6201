"""The machinery of --print-config and --dry-run (pipeline/config_preview.py) on stage 1's config
(stage 2's: tests/test_stage2_dry_run.py): each option's source is recorded (default, manifest,
flag), the listing is a manifest of the same config, and an assumption flag needs --dry-run."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from pipeline.config import grouped_table, parse_config, value_of
from pipeline.config_preview import options_listing, parse_command
from pipeline.errors import ConfigError
from stage1_score.config import SECTION, ScoreConfig

EXAMPLE = Path(__file__).resolve().parents[1] / "manifests" / "stage1-example.toml"
ARGV = ["--manifest", str(EXAMPLE), "--stride", "100", "--dry-run"]


def test_each_options_source_is_recorded_and_the_listing_is_the_same_config(tmp_path):
    command = parse_command(ScoreConfig, ARGV, "", SECTION)
    manifest = grouped_table(ScoreConfig, tomllib.loads(EXAMPLE.read_text())[SECTION], "")
    assert command.sources["stride"] == "flag"  # the manifest sets it too: the flag wins
    assert value_of(command.config, "stride") == 100
    for key, source in command.sources.items():
        if key != "stride":
            assert source == ("manifest" if key in manifest else "default"), key
    assert command.flags.dry_run and not command.flags.print_config and command.previewing

    listing = options_listing(command, SECTION)
    assert "stride = 100" in listing and listing.count("# flag") == 1
    tomllib.loads(listing)
    printed = tmp_path / "printed.toml"
    printed.write_text(listing)
    again = parse_config(ScoreConfig, ["--manifest", str(printed)], "", SECTION)
    assert again == command.config


def test_an_assumption_flag_needs_the_dry_run():
    def assume(group):
        group.add_argument("--assume-workers", type=int)

    argv = ["--manifest", str(EXAMPLE), "--assume-workers", "4"]
    with pytest.raises(ConfigError, match="--assume-workers is an assumption of --dry-run"):
        parse_command(ScoreConfig, argv, "", SECTION, assume)
    command = parse_command(ScoreConfig, [*argv, "--dry-run"], "", SECTION, assume)
    assert command.flags.assume_workers == 4
