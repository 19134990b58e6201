"""Log lines keep the plain `[tag] message` look job logs and users already read."""

import re

from pipeline.log import configure, get_logger


def test_lines_read_tag_then_message_on_stderr(capsys):
    configure()
    get_logger("worker 3").info("unit 1: 5/10 tokens")
    assert capsys.readouterr().err == "[worker 3] unit 1: 5/10 tokens\n"


def test_separated_lines_open_with_a_blank_line_and_the_time(capsys):
    configure(separated=True)
    try:
        get_logger("demo").info("stage 1")
        assert re.fullmatch(r"\n\[demo \d\d:\d\d:\d\d\] stage 1\n", capsys.readouterr().err)
    finally:
        configure()
