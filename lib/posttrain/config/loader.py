"""Build frozen dataclasses from plain dicts (parsed YAML), strictly.

Each part of the library owns a small frozen dataclass for its own slice of the config
(`PackingConfig`, `SourceConfig`, ...). `build(cls, data, where)` turns a dict into that
dataclass recursively and rejects unknown keys and wrong types with a message that names the
file and the dotted key path, e.g. ``configs/x.yaml: data.sources[0].pathh: unknown key (did you
mean 'path'?)``. YAML is read with `yaml.safe_load` only.

Configs compose: a recipe's config holds the parts' configs as fields. A field declared with
`inline()` is a part whose keys sit in the enclosing mapping rather than under its own name
(e.g. the engine's ``max_steps``, ``optimizer``, ... directly under a recipe's ``train:``), so
a part can be handed on whole (the Engine receives only its `EngineConfig`) while the YAML keeps
one flat section.

A config class may list keys of earlier releases in a `MOVED_KEYS` class attribute (key -> where
it went); such a key fails saying where to put it instead of only "unknown key".

User code named in a config (a reward function, an RL environment) is written
``package.module:attribute`` and imported by `import_attribute` when the config is built, so a
typo or a missing package fails at launch, naming the key, not at the first step.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import types
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from posttrain.errors import ConfigError

T = TypeVar("T")


def load_yaml(path: str | Path) -> dict:
    """Read a YAML mapping with `yaml.safe_load`; a missing or malformed file is a ConfigError."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return data


def import_attribute(spec: str, key: str) -> Any:
    """The object `spec` = ``"package.module:attribute"`` names (the attribute may be dotted:
    ``module:Class.method``); a ConfigError naming `key` when it is malformed or the import or
    the look-up fails."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ConfigError(f"{key}: {spec!r} is not of the form 'package.module:attribute'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any failure of user code at import is reported
        raise ConfigError(f"{key}: cannot import module {module_name!r} for {spec!r} "
                          f"({type(e).__name__}: {e}); is it installed or on PYTHONPATH?"
                          ) from None
    for part in attribute.split("."):
        if not hasattr(obj, part):
            owner = getattr(obj, "__name__", type(obj).__name__)
            raise ConfigError(f"{key}: {spec!r}: {owner} has no attribute {part!r}")
        obj = getattr(obj, part)
    return obj


def inline(**kwargs: Any) -> Any:
    """A dataclass field whose dataclass's keys are read from (and written to) the enclosing
    mapping; see the module docstring."""
    metadata = {**kwargs.pop("metadata", {}), "inline": True}
    return dataclasses.field(metadata=metadata, **kwargs)


def _is_inline(f: dataclasses.Field) -> bool:
    return bool(f.metadata.get("inline"))


def _keys(cls: Any) -> set[str]:
    """The mapping keys of dataclass `cls`, inline parts' keys included."""
    hints = get_type_hints(cls)
    out: set[str] = set()
    for f in dataclasses.fields(cls):
        if f.init:
            out |= _keys(hints[f.name]) if _is_inline(f) else {f.name}
    return out


def build(cls: type[T], data: Any, where: str = "") -> T:
    """Construct dataclass `cls` from `data`, checking keys and types; `where` prefixes errors."""
    return _convert(cls, data, where or cls.__name__)


def to_dict(obj: Any) -> Any:
    """The inverse of `build`: plain dicts/lists for YAML/JSON (e.g. a resolved-config artifact)."""
    if dataclasses.is_dataclass(obj):
        out: dict = {}
        for f in dataclasses.fields(obj):
            value = to_dict(getattr(obj, f.name))
            if _is_inline(f):
                out.update(value)
            else:
                out[f.name] = value
        return out
    if isinstance(obj, (list, tuple)):
        return [to_dict(x) for x in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(tp: Any, value: Any, where: str) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else
                          f"{where}: {value!r} matches none of {_type_name(tp)}")
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{where}: {value!r} is not one of {list(allowed)}")
        return value
    if dataclasses.is_dataclass(tp):
        return _build_dataclass(tp, value, where)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__} ({value!r})")
        (item_tp, *_) = get_args(tp) or (Any,)
        items = [_convert(item_tp, v, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
        _, val_tp = get_args(tp) or (Any, Any)
        return {k: _convert(val_tp, v, f"{where}.{k}") for k, v in value.items()}
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{where}: expected {_type_name(tp)}, got {value!r}")
    return value


def _build_dataclass(cls: Any, value: Any, where: str) -> Any:
    if isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping for {cls.__name__}, "
                          f"got {type(value).__name__} ({value!r})")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = get_type_hints(cls)
    known = _keys(cls)
    moved = getattr(cls, "MOVED_KEYS", {})
    for key in value:
        if key in moved and key not in known:
            raise ConfigError(f"{where}.{key}: this key has moved: {moved[key]}")
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else \
                f" (known keys: {', '.join(sorted(known))})"
            raise ConfigError(f"{where}.{key}: unknown key{hint}")
    kwargs = {}
    for name, f in fields.items():
        if _is_inline(f):
            part = _keys(hints[name])
            kwargs[name] = _build_dataclass(hints[name],
                                            {k: v for k, v in value.items() if k in part}, where)
        elif name in value:
            kwargs[name] = _convert(hints[name], value[name], f"{where}.{name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{where}.{name}: required key is missing")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{where}: {e}") from None
