"""The Python side's defaults agree with the Rust side's (``RunnerConfig::default()``, read
through ``_core.default_config()``), and the settings table (`llamarunner.settings`) agrees
with what is built from it: `ServerConfig`'s fields, the ``LLAMARUNNER_*`` variables and the
flags of ``llamarunner serve``.

A setting missing on either side fails; where Python deliberately differs from Rust, the
difference is listed in `PYTHON_DIFFERS` with the reason.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

import pytest

from llamarunner import _core
from llamarunner.arguments import SERVE_ACTIONS, SOURCE_FLAGS, serve_settings
from llamarunner.cli import build_parser
from llamarunner.config import ServerConfig
from llamarunner.settings import ROUTER_SETTINGS, SERVER_SETTINGS

PYTHON_DIFFERS: dict[str, tuple[Any, Any, str]] = {
    # name: (Python's default, Rust's default, why)
    "model": (
        None,
        "",
        "Python's None means 'not given': Server resolves it to the default model's file "
        "(with_model_resolved) before the JSON goes to Rust, whose empty path is refused",
    ),
}


def rust_defaults() -> dict[str, Any]:
    defaults = json.loads(_core.default_config())
    assert isinstance(defaults, dict)
    return defaults


def serve_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve = sub.choices["serve"]
    assert isinstance(serve, argparse.ArgumentParser)
    return serve


def cli_default_config() -> ServerConfig:
    """What ``llamarunner serve`` runs with no flags and no variables."""
    args = build_parser().parse_args(["serve"])
    _, _, overrides = serve_settings(args)
    return ServerConfig.resolve(overrides, env={})


def python_defaults() -> dict[str, dict[str, Any]]:
    """Each setting's default as the table, the dataclass, ``resolve`` with an empty
    environment and the CLI without flags have it."""
    dataclass_default = ServerConfig()
    resolved = ServerConfig.resolve(env={})
    cli = cli_default_config()
    return {
        name: {
            "table": setting.default,
            "dataclass": getattr(dataclass_default, name),
            "resolve(env={})": getattr(resolved, name),
            "serve without flags": getattr(cli, name),
        }
        for name, setting in SERVER_SETTINGS.items()
    }


def test_every_setting_is_on_both_sides() -> None:
    rust = set(rust_defaults())
    python = set(SERVER_SETTINGS)
    fields = {f.name for f in dataclasses.fields(ServerConfig)}
    assert python - rust == set(), "settings Rust's RunnerConfig lacks"
    assert rust - python == set(), "RunnerConfig fields the settings table lacks"
    assert fields == python, "ServerConfig's fields and the settings table differ"


@pytest.mark.parametrize("name", list(SERVER_SETTINGS))
def test_the_defaults_agree_with_rust(name: str) -> None:
    rust = rust_defaults()[name]
    seen = python_defaults()[name]
    if name in PYTHON_DIFFERS:
        python, rust_expected, _why = PYTHON_DIFFERS[name]
        # The exception is still true (else it should go from the list).
        assert rust == rust_expected
        assert python != rust
    else:
        python = rust
    for where, value in seen.items():
        assert value == python, f"{name}: {where} says {value!r}, expected {python!r}"
        # 0 == False and 10 == 10.0: the types must agree too.
        assert type(value) is type(python), f"{name}: {where} is a {type(value).__name__}"


def test_the_differences_are_settings() -> None:
    assert set(PYTHON_DIFFERS) <= set(SERVER_SETTINGS)


def test_the_dataclass_fields_are_the_table() -> None:
    for f in dataclasses.fields(ServerConfig):
        setting = SERVER_SETTINGS[f.name]
        assert f.type == setting.annotation, f.name
        assert f.repr is not setting.secret, f.name


def test_the_variables_are_named_after_the_settings() -> None:
    for name, setting in SERVER_SETTINGS.items():
        assert setting.env_var == "LLAMARUNNER_" + name.upper()
    for setting in ROUTER_SETTINGS.values():
        assert setting.env_var is None


def test_every_flag_of_serve_is_a_setting_with_its_help() -> None:
    # --help and the flags that likewise do something else than serve (--list-devices), and
    # those of where the model comes from (read by the resolver, not settings).
    skipped = ("help", *SERVE_ACTIONS, *SOURCE_FLAGS)
    actions = [a for a in serve_parser()._actions if a.dest not in skipped]
    table = {**SERVER_SETTINGS, **ROUTER_SETTINGS}
    assert {a.dest for a in actions} == set(table)
    for action in actions:
        setting = table[action.dest]
        # Every flag is "not given" by default, so that the variables and defaults apply.
        assert action.default is None, action.dest
        if setting.positional:
            assert action.option_strings == []
            assert action.help is not None
            assert action.help.startswith(setting.help_text())
        elif action.const is False:
            assert action.option_strings == ["--no-" + setting.flag[2:]]
            assert action.help == setting.off_help
        else:
            assert action.option_strings == [setting.flag]
            assert action.help == setting.help_text()
            assert action.metavar == setting.metavar
            assert action.choices == (list(setting.choices) if setting.choices else None)


def test_a_help_that_states_the_default_states_the_tables() -> None:
    """No help text writes a default out by hand (it would go stale): a number after
    "default" is the ``{default}`` of the table."""
    for setting in [*SERVER_SETTINGS.values(), *ROUTER_SETTINGS.values()]:
        if "(default " in setting.help and setting.default not in (None, []):
            assert "(default {default}" in setting.help, setting.name
