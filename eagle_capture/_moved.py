"""The names of eagle-capture 0.1, before the package had folders:
``import eagle_capture.symm`` (or ``python -m eagle_capture.doctor``) and
``eagle_capture.add_rmsnorm_reference`` still work, warn, and yield the module
or object at its new place -- the same object, so state and ``isinstance``
checks are shared."""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "eagle_capture.sglang": "eagle_capture.integrations.sglang.dropin",
    "eagle_capture.sglang_plugin": "eagle_capture.integrations.sglang.plugin",
    "eagle_capture.sglang_sizing": "eagle_capture.integrations.sglang.sizing",
    "eagle_capture.sglang_lines": "eagle_capture.layer_ids.lines",
    "eagle_capture.plan": "eagle_capture.layer_ids.plan",
    "eagle_capture.doctor": "eagle_capture.layer_ids.doctor",
    "eagle_capture.deployment": "eagle_capture.layer_ids.deployment",
    "eagle_capture.tp": "eagle_capture.parallel.tp",
    "eagle_capture.symm": "eagle_capture.parallel.symm",
    "eagle_capture.allreduce_paths": "eagle_capture.parallel.paths",
    "eagle_capture.reference": "eagle_capture.testing.reference",
    "eagle_capture.reference_loop": "eagle_capture.testing.reference_loop",
    "eagle_capture.bench": "eagle_capture.testing.bench",
}


# Attributes of the package that moved (the references: into testing/).
MOVED_ATTRIBUTES = {
    "add_rmsnorm_reference": "eagle_capture.testing.reference",
    "sglang_eager_capture": "eagle_capture.testing.reference",
}


def _warn(old: str, new: str, category=DeprecationWarning) -> None:
    warnings.warn(f"{old} has moved to {new}; the old name will be removed in a later "
                  f"release", category, stacklevel=3)


def moved_attribute(name: str):
    """The package's ``__getattr__``: a moved name, with a warning."""
    if name not in MOVED_ATTRIBUTES:
        raise AttributeError(f"module 'eagle_capture' has no attribute {name!r}")
    _warn(f"eagle_capture.{name}", f"{MOVED_ATTRIBUTES[name]}.{name}")
    return getattr(importlib.import_module(MOVED_ATTRIBUTES[name]), name)


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec):
        _warn(spec.name, MOVED[spec.name])
        module = importlib.import_module(MOVED[spec.name])
        self._own_spec = module.__spec__   # the import system overwrites it next
        return module

    def exec_module(self, module):
        module.__spec__ = self._own_spec

    def get_code(self, fullname):  # runpy: python -m <old name>; shown to a CLI user
        _warn(fullname, MOVED[fullname], FutureWarning)
        return importlib.util.find_spec(MOVED[fullname]).loader.get_code(MOVED[fullname])


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())
