"""User code named by an import path, `package.module:Name`, resolved when asked, never by import side effects.

A user's remedy or merge method is found the way mergekit and entry points find code: the module is
imported with `importlib.import_module` and the attribute after the colon is read from it (dots after
the colon walk attributes, `module:Outer.Inner`). Nothing registers itself when it is imported. The
module is looked up where Python looks (installed packages, `PYTHONPATH`) and then in the current
folder, as `uvicorn main:app` finds `main.py`: the current folder is appended to `sys.path`, last, so
that an installed package of the same name wins.

`source_hash` gives the SHA-256 of the module's source file, which enters a config's fingerprint
beside the path, so that a cached result computed with an older version of the user's code is not
reused silently.

Every error is a ValueError that names the argument, the value and what is allowed.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import re
import sys
from pathlib import Path

# `package.module:Name`: a dotted module path, a colon, a dotted attribute path.
_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


def is_import_path(value: object) -> bool:
    """Whether `value` is written as an import path, `package.module:Name` (a built-in name has no colon)."""
    return isinstance(value, str) and ":" in value


def resolve_import_path(value: object, argument: str) -> object:
    """The object that `value` (`package.module:Name`) names.

    Raises:
        ValueError: `value` is not of the form `package.module:Name`; the module cannot be imported (its
            error is quoted); the module has no such attribute.
    """
    if not isinstance(value, str) or not _IMPORT_PATH.match(value):
        raise ValueError(
            f"`{argument}` must be an import path `package.module:Name` (a module importable from the current "
            f"environment, a colon, an attribute of it), got {value!r}"
        )
    module_name, _, attribute_path = value.partition(":")
    _look_in_current_folder()
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # any failure of the user's module is reported in one line
        raise ValueError(
            f"`{argument}` {value!r}: module {module_name!r} does not import ({type(error).__name__}: {error})"
        ) from None
    target: object = module
    for part in attribute_path.split("."):
        if not hasattr(target, part):
            raise ValueError(f"`{argument}` {value!r}: {module_name!r} has no attribute {attribute_path!r}")
        target = getattr(target, part)
    return target


def source_hash(value: str) -> str | None:
    """SHA-256 of the source file of the module that import path `value` names (None for a module without
    a file, e.g. a built-in). The module is imported if it is not already."""
    module_name = value.partition(":")[0]
    _look_in_current_folder()
    module = sys.modules.get(module_name) or importlib.import_module(module_name)
    file = getattr(module, "__file__", None)
    if not file or not Path(file).is_file():
        return None
    return hashlib.sha256(Path(file).read_bytes()).hexdigest()


def _look_in_current_folder() -> None:
    """Append the current folder to `sys.path` (last) if it is not there, as a command run from a project expects."""
    folder = os.getcwd()
    if folder not in sys.path and "" not in sys.path:
        sys.path.append(folder)
