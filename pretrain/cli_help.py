"""The one help style of every command line (launch/pretrain.py, tools/*)."""
import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description as written (its examples keep their lines), and each option's default after its help, unless
    it has none or the help already says what happens without it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or action.default in (None, False, argparse.SUPPRESS)
                or "default" in text or "%(default)" in text):
            return text
        return f"{text} (default: %(default)s)"
