"""docs/configuration.md is what `python -m backends.config_doc` generates from the role dataclasses and
`triton-pd serve`'s parser: an option added, removed or changed without regenerating the page fails here."""

from __future__ import annotations

import argparse
import dataclasses

from backends import config_doc
from backends.common.core import role_config


def test_the_configuration_page_is_the_one_the_code_generates():
    assert config_doc.PAGE.read_text() == config_doc.render(), "run: .venv/bin/python -m backends.config_doc"


def test_every_role_field_and_every_serve_option_is_on_the_page():
    from backends.cli import build_parser

    text = config_doc.render()
    for cls in role_config.ROLES:
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in text, f.name
    serve = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    for action in serve._actions:
        for option in action.option_strings:
            if option not in ("-h", "--help"):
                assert f"`{option}" in text, option
