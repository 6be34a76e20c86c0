"""`pipeline("sparsekv-text-generation")` registered with transformers without importing its pipelines.

transformers' pipelines take seconds to import, more than the rest of sparsekv, and most users never use them.
So `import sparsekv` does not import them: the task is registered (by importing `sparsekv.pipeline`) at once if
they are imported already, or else the moment anyone imports them, by a finder that watches for that one module,
runs its own loader, registers, and leaves `sys.meta_path`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import logging
import sys

PIPELINES = "transformers.pipelines"


def register_when_pipelines_load() -> None:
    """Register the task now if transformers' pipelines are imported, else when they are."""
    if PIPELINES in sys.modules:
        _register()
    elif not any(isinstance(finder, _WatchPipelines) for finder in sys.meta_path):
        sys.meta_path.insert(0, _WatchPipelines())


def _register() -> None:
    try:
        importlib.import_module("sparsekv.pipeline")  # registers on import
    except Exception as err:  # noqa: BLE001 (a user's `import transformers.pipelines` must not fail for it)
        logging.getLogger("sparsekv").warning("sparsekv: could not register pipeline('sparsekv-text-generation'): %s",
                                              err)


class _WatchPipelines(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != PIPELINES:
            return None
        sys.meta_path.remove(self)  # once, and so that the module's own finder answers below
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenRegister(spec.loader)
        return spec


class _ThenRegister(importlib.abc.Loader):
    """The module's own loader, registering the task once the module has run."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        _register()

    def __getattr__(self, name):  # anything else the import system or a tool asks the loader
        return getattr(self.loader, name)
