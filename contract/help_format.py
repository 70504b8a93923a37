"""--help that states each option's default once: in the option's own words where its help text
names it ("default: ..."), else appended; an on/off switch says on or off. Shared by `kvpilot
serve`, `kvpilot router` and `kvpilot operator`."""

from __future__ import annotations

import argparse

BOOLEAN_OPTIONAL_SUFFIX = " (default: %(default)s)"


def names_its_default(help_text: str) -> bool:
    return "default" in help_text.lower()


class DefaultsOnceFormatter(argparse.HelpFormatter):
    """argparse.ArgumentDefaultsHelpFormatter without its second "(default: ...)" after a help
    text that already says it, nor "(default: None)" where None means nothing to the reader."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if isinstance(action, argparse.BooleanOptionalAction):
            # Python 3.11's appends "(default: True)" itself; on/off reads better.
            help_text = help_text.removesuffix(BOOLEAN_OPTIONAL_SUFFIX)
        default = action.default
        if (
            names_its_default(help_text)
            or not action.option_strings
            or default is None
            or default is argparse.SUPPRESS
            or default == []
        ):
            return help_text
        # "%(default)s": argparse's own substitution, as its formatter writes it.
        shown = ("on" if default else "off") if isinstance(default, bool) else "%(default)s"
        return f"{help_text} (default: {shown})" if help_text else f"default: {shown}"
