"""The command line: --help shows every default and keeps the test hooks apart."""

from capstone.cli import build_parser


def test_help_shows_defaults_and_keeps_test_hooks_apart():
    text = build_parser().format_help()
    assert "(default: 0.01)" in text and "(default: 'reference')" in text
    options = text[text.index("\noptions:"):]   # after the usage lines
    users, hooks = options.split("\ntest hooks", 1)
    assert "--inject-lr-spike" in hooks and "--stop-after" in hooks and "--inject-nan" in hooks
    assert "--inject" not in users and "--lr LR" in users and "--resume" in users
    assert "--init-from" in users and "--keep-best" in users and "--inject-grad-sign" in hooks
