"""What every config of the plan shares, written once: the check of a choice field, the reading
of a dict that a newer hf-actcomp may have written (unknown keys dropped with a warning), and
`ConfigMixin`, the JSON / YAML / file / Hub io of a saved config (`actcomp_config.json`, with its
`format_version`).

It knows no particular config, so every other module of the plan can import it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import asdict, fields
from typing import Any, TypeVar

import yaml

# The package's logger (`hf_actcomp.plan`), as before the split: levels and filters set on it hold.
logger = logging.getLogger(__package__)

CONFIG_NAME = "actcomp_config.json"
FORMAT_VERSION = 1


def check_choice(owner: str, name: str, value: Any, allowed: Sequence[Any]) -> None:
    if value not in allowed:
        raise ValueError(f"{owner}.{name}={value!r} is not valid. Allowed values: {', '.join(map(str, allowed))}.")


def known_fields(cls: type, data: dict[str, Any], owner: str) -> dict[str, Any]:
    """Drop (with a warning) keys a newer version may have added; keep the known ones."""
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        logger.warning("Ignoring unknown %s fields %s (written by a newer hf-actcomp?).", owner, unknown)
    return {k: v for k, v in data.items() if k in names}


_C = TypeVar("_C", bound="ConfigMixin")


class ConfigMixin:
    """`to_dict` / `from_dict`, JSON and YAML strings, `from_file`, `save_pretrained` and
    `from_pretrained` for a config dataclass. What is written carries `format_version`; what is
    read may come from a newer version: its unknown keys are dropped with a warning. A config
    with nested configs reads their dicts in `_read_fields`."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls: type[_C], data: dict[str, Any]) -> _C:
        data = dict(data)
        version = data.pop("format_version", FORMAT_VERSION)
        if isinstance(version, int) and version > FORMAT_VERSION:
            logger.warning(
                "actcomp config format_version %s is newer than this hf-actcomp (%s); "
                "unknown fields are ignored.", version, FORMAT_VERSION,
            )
        return cls(**cls._read_fields(known_fields(cls, data, cls.__name__)))

    @classmethod
    def _read_fields(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The known fields of `from_dict`, with nested configs' dicts read into their classes."""
        return kwargs

    def to_json_string(self) -> str:
        return json.dumps({"format_version": FORMAT_VERSION, **self.to_dict()}, indent=2) + "\n"

    @classmethod
    def from_json_string(cls: type[_C], text: str) -> _C:
        return cls.from_dict(json.loads(text))

    def to_yaml_string(self) -> str:
        return yaml.safe_dump({"format_version": FORMAT_VERSION, **self.to_dict()}, sort_keys=False)

    @classmethod
    def from_yaml_string(cls: type[_C], text: str) -> _C:
        return cls.from_dict(yaml.safe_load(text) or {})

    @classmethod
    def from_file(cls: type[_C], path: str | os.PathLike) -> _C:
        """Read a plan from a `.json`, `.yaml` or `.yml` file."""
        text = open(path, encoding="utf-8").read()
        if str(path).endswith((".yaml", ".yml")):
            return cls.from_yaml_string(text)
        return cls.from_json_string(text)

    def save_pretrained(self, save_directory: str | os.PathLike) -> str:
        """Write `actcomp_config.json` into `save_directory` (created if needed); return its path."""
        os.makedirs(save_directory, exist_ok=True)
        path = os.path.join(save_directory, CONFIG_NAME)
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json_string())
        return path

    @classmethod
    def from_pretrained(cls: type[_C], name_or_path: str | os.PathLike, **hub_kwargs: Any) -> _C:
        """Read `actcomp_config.json` from a local directory, or from a Hub model repo
        (`huggingface_hub.hf_hub_download`, which uses the local cache and `HF_HUB_OFFLINE`).
        `hub_kwargs` (revision, token, cache_dir, ...) go to `hf_hub_download`."""
        path = os.path.join(name_or_path, CONFIG_NAME)
        if os.path.isdir(name_or_path):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"No {CONFIG_NAME} in {name_or_path!s}.")
        else:
            from huggingface_hub import hf_hub_download
            from huggingface_hub.errors import (
                EntryNotFoundError,
                HFValidationError,
                LocalEntryNotFoundError,
                RepositoryNotFoundError,
            )

            try:
                path = hf_hub_download(os.fspath(name_or_path), CONFIG_NAME, **hub_kwargs)
            except (EntryNotFoundError, HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError) as err:
                raise FileNotFoundError(
                    f"No {CONFIG_NAME} for {name_or_path!s}: not a local directory, and the Hub (or its cache) "
                    f"has no such file ({type(err).__name__})."
                ) from err
        return cls.from_json_string(open(path, encoding="utf-8").read())

