"""The flags of the settings (`settings.SERVER_SETTINGS`, `settings.ROUTER_SETTINGS`) on an
``argparse`` parser, and the split of the parsed flags into a `ServerConfig`'s overrides and
the router's flags: shared by ``llamarunner serve``, ``run`` and ``cluster``
(`cli`, `terminal_chat`, `ray.cluster`).

Every flag's default is None ("not given"), so that ``ServerConfig.resolve`` can put the
``LLAMARUNNER_*`` variables and then the settings' defaults in its place.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence
from typing import Any

from .settings import GROUP_DESCRIPTIONS, ROUTER_SETTINGS, SERVER_SETTINGS, Setting

ROUTER_FLAGS = tuple(ROUTER_SETTINGS)
"""The router's settings among `serve`'s parsed flags."""

SOURCE_FLAGS = ("hf_repo", "offline", "no_mmproj")
"""The flags of where the model comes from (`add_source_arguments`): read by the resolver
(`sources.resolve`) before the settings are made, and left out of `serve_settings`' split."""

SERVE_ACTIONS = ("list_devices",)
"""`serve`'s flags that do something else instead of serving (as ``--help`` does): not
settings, and left out of `serve_settings`' split."""

# The settings of `llamarunner serve` that `run` takes for a model it runs itself (copied into
# its parser, help and all, by `cli`); in the order `run --host` names them when given.
SERVER_FLAGS = (
    "ctx_size",
    "parallel",
    "threads",
    "batch_size",
    "n_gpu_layers",
    "main_gpu",
    "split_mode",
    "fit",
    "fit_target",
    "flash_attn",
    "kv_cache_type",
    "no_mmap",
    "mlock",
    "lora",
    "chat_template",
    "cache_ram",
    "draft_model",
    "verbose",
)


def add_server_arguments(p: argparse.ArgumentParser, several_models: bool = False) -> None:
    """Every setting of a server, as flags: `serve` takes them (and several models), and
    `cluster` for each of its replicas."""
    _add_settings(p, SERVER_SETTINGS.values(), several_models)


def add_serve_actions(p: argparse.ArgumentParser) -> None:
    """`SERVE_ACTIONS` as flags."""
    p.add_argument(
        "--list-devices",
        action="store_true",
        default=False,
        help="print the compute devices llama.cpp's backends find here (GPUs with their free "
        "memory, numbered as --main-gpu takes them) and exit",
    )


def add_source_arguments(p: argparse.ArgumentParser, *, hf_repo: bool = True) -> None:
    """`SOURCE_FLAGS`: ``-hf`` (``hf_repo``: for the commands that take one model),
    ``--offline``, ``--no-mmproj``."""
    g = p.add_argument_group(
        "model sources",
        "MODEL is a GGUF file, a Hugging Face repository "
        "OWNER/REPO[:QUANT] (hf.co/OWNER/REPO:QUANT too; fetched into the Hugging Face "
        "cache, HF_HOME or HF_HUB_CACHE, with HF_TOKEN; the quantization tag picks the "
        "file, Q4_K_M then Q8_0 without one) or a model Ollama pulled, NAME[:TAG] (from "
        "OLLAMA_MODELS, else ~/.ollama/models, served in place)",
    )
    if hf_repo:
        g.add_argument(
            "-hf",
            "--hf-repo",
            metavar="OWNER/REPO[:QUANT]",
            help="the model from Hugging Face, as llama-server's -hf (instead of MODEL)",
        )
    g.add_argument(
        "--offline",
        action="store_true",
        default=False,
        help="download nothing: use the Hugging Face cache only (as HF_HUB_OFFLINE=1)",
    )
    g.add_argument(
        "--no-mmproj",
        action="store_true",
        default=False,
        help="leave out the projector (mmproj*.gguf) found with a Hugging Face or Ollama model",
    )


def add_models_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of many models behind one endpoint (`serve`, and `cluster` for each replica)."""
    _add_settings(p, ROUTER_SETTINGS.values(), several_models=False)


def _add_settings(
    p: argparse.ArgumentParser, settings: Iterable[Setting], several_models: bool
) -> None:
    groups: dict[str, argparse._ArgumentGroup] = {}
    for s in settings:
        if s.group is None:
            container: argparse._ActionsContainer = p
        else:
            if s.group not in groups:
                groups[s.group] = p.add_argument_group(s.group, GROUP_DESCRIPTIONS.get(s.group))
            container = groups[s.group]
        _add_setting(container, s, several_models)


def _add_setting(container: argparse._ActionsContainer, s: Setting, several_models: bool) -> None:
    help = s.help_text()
    if s.positional:
        if several_models:
            help += "; several: one endpoint serves them all, by file name"
        container.add_argument(s.name, nargs="*" if several_models else "?", help=help)
        return
    kwargs: dict[str, Any] = {"help": help}
    if s.metavar is not None:
        kwargs["metavar"] = s.metavar
    if s.choices is not None:
        kwargs["choices"] = list(s.choices)
    if s.type is bool:
        container.add_argument(s.flag, action="store_const", const=True, **kwargs)
        if s.off_help is not None:
            container.add_argument(
                "--no-" + s.flag[2:],
                dest=s.name,
                action="store_const",
                const=False,
                help=s.off_help,
            )
    elif s.type is list:
        container.add_argument(s.flag, action="append", **kwargs)
    else:
        if s.type is not str:
            kwargs["type"] = s.type
        container.add_argument(s.flag, **kwargs)


def serve_settings(
    args: argparse.Namespace, exclude: Sequence[str] = ()
) -> tuple[list[str], dict[str, Any], dict[str, Any]]:
    """Split `serve`'s (or `cluster`'s, less its own flags ``exclude``) parsed flags into the
    MODELs, the router's flags (``ROUTER_FLAGS``) and the ``ServerConfig`` overrides, whose
    ``model`` is the first MODEL (or None)."""
    skipped = {"command", *SERVE_ACTIONS, *SOURCE_FLAGS, *exclude}
    overrides = {k: v for k, v in vars(args).items() if k not in skipped}
    models: list[str] = overrides.pop("model") or []
    router = {k: overrides.pop(k) for k in ROUTER_FLAGS}
    overrides["model"] = models[0] if models else None
    return models, router, overrides


def router_setting(router: dict[str, Any], name: str) -> Any:
    """A router flag of `serve_settings`' split, or its default when it was not given."""
    value = router[name]
    return ROUTER_SETTINGS[name].default if value is None else value


def many_models(models: list[str], router: dict[str, Any], overrides: dict[str, Any]) -> bool:
    """Whether `serve_settings`' split asks for many models (--models-dir, --library,
    --allow-pull, --models-preset or several MODELs); raises ValueError for a flag that does
    not go with the answer."""
    many = router["models_dir"] is not None or router["models_preset"] is not None
    many = many or bool(router["library"]) or bool(router["allow_pull"])
    many = many or len(models) > 1
    if many and overrides.get("alias"):
        raise ValueError("--alias names one model; with many, each is served by its name")
    if not many and any(
        router[k] is not None for k in ("models_max", "models_memory", "keep_alive")
    ):
        raise ValueError(
            "--models-max, --models-memory and --keep-alive are for many models "
            "(--models-dir, --models-preset, several MODELs)"
        )
    return many
