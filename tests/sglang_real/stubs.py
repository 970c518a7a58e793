"""Import hook that lets the real SGLang wheels import on a CPU-only machine.

SGLang imports GPU-only packages (sgl_kernel, flashinfer, vllm, ...) at module
level, mostly behind ``if _is_cuda:`` guards but not always. ``install()``
puts a ``MetaPathFinder`` first on ``sys.meta_path`` that answers, for the
listed top-level names and any submodule of them, with a permissive stub
module:

* any attribute of a stub module is a ``Stub`` (created on first access and
  cached), and any attribute of a ``Stub`` is again a ``Stub``, so
  ``from flashinfer.comm import X`` and ``sgl_kernel.foo.bar`` import fine;
* a ``Stub`` is a real class (so it can be a base class, a type hint,
  ``Stub | None``, ``Stub[int]``, used in ``isinstance``), but CALLING it,
  instantiating it or a subclass of it raises ``StubCalled``: a code path
  that really uses a GPU-only package fails loudly, it can never run silently
  through a stub.

What the stubs do NOT fake: ``importlib.util.find_spec(name)`` for a stubbed
top-level name returns a spec (that is how the import system works), so
``find_spec("flashinfer") is not None`` is true; in SGLang that check is
always and-ed with ``is_cuda()`` (false here), see the harness docstring.
``importlib.metadata.version(name)`` is not faked (raises
``PackageNotFoundError`` as for any missing package). transformers'
``is_torchvision_available()`` (find_spec based) therefore answers True once
the hook is installed, and that is needed: sglang's multimodal modules, imported
by the model registry, touch transformers' image-processor classes, which
raise "requires the Torchvision library" otherwise. Install the hook before
anything imports transformers (the harness does).

Only names that are really absent are stubbed: a package that is installed
(found by the other finders) is imported for real.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

# Top-level packages that are GPU-only (or heavy and irrelevant) for the code
# path under test and whose absence breaks sglang's module-level imports.
# Version-specific extras are passed to install() by the harness (e.g.
# xgrammar for 0.5.18, tvm_ffi for 0.5.23); names whose absence sglang
# handles itself (try/except ImportError) are NOT stubbed.
DEFAULT_NAMES = (
    "sgl_kernel",
    "flashinfer",
    "vllm",
    "torchvision",
    "IPython",
    "compressed_tensors",
    "gguf",
)


class StubCalled(RuntimeError):
    """A stubbed GPU-only object was called: the CPU harness took a GPU path."""


class _StubMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        sub = _make_stub(f"{cls.__qualname__}.{name}", cls.__module__)
        setattr(cls, name, sub)
        return sub

    def __call__(cls, *args, **kwargs):
        raise StubCalled(f"stub {cls.__module__}.{cls.__qualname__} was called")

    def __getitem__(cls, item):
        return cls

    def __or__(cls, other):
        return cls

    def __ror__(cls, other):
        return cls

    def __repr__(cls):
        return f"<stub {cls.__module__}.{cls.__qualname__}>"

    def __get_pydantic_core_schema__(cls, source, handler):
        # A stub used as a field type in a pydantic model (e.g.
        # xgrammar.StructuralTag in sglang's OpenAI protocol): accept anything.
        from pydantic_core import core_schema

        return core_schema.any_schema()

    def __bool__(cls):
        # A stub is truthy like any class; never used as a feature flag here.
        return True


def _make_stub(qualname: str, module: str):
    name = qualname.rsplit(".", 1)[-1]
    return _StubMeta(name, (), {"__module__": module, "__qualname__": qualname})


class StubModule(types.ModuleType):
    """A module whose every missing attribute is a ``Stub``."""

    __stub__ = True

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            if name == "__version__":
                return "0.0.0+stub"
            raise AttributeError(name)
        stub = _make_stub(name, self.__name__)
        setattr(self, name, stub)
        return stub


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec):
        mod = StubModule(spec.name)
        mod.__path__ = []  # a package: submodules import through the finder
        return mod

    def exec_module(self, module):
        pass


class StubFinder(importlib.abc.MetaPathFinder):
    def __init__(self, names):
        self.names = set(names)
        self.stubbed = set()

    def find_spec(self, fullname, path=None, target=None):
        top = fullname.partition(".")[0]
        if top not in self.names:
            return None
        if fullname == top:
            # Stub only what is really absent.
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                try:
                    spec = finder.find_spec(fullname, path, target)
                except Exception:
                    spec = None
                if spec is not None:
                    self.names.discard(top)
                    return None
        elif top in sys.modules and not getattr(sys.modules[top], "__stub__", False):
            return None
        self.stubbed.add(fullname)
        return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)


_FINDER: StubFinder | None = None


def install(extra_names=()) -> StubFinder:
    """Install the hook (idempotent). Returns the finder; ``finder.stubbed``
    lists the module names that were actually stubbed."""
    global _FINDER
    if _FINDER is None:
        _FINDER = StubFinder(DEFAULT_NAMES)
        sys.meta_path.insert(0, _FINDER)
    _FINDER.names.update(extra_names)
    return _FINDER


def install_deep_ep() -> None:
    """A fork server's pre-loader for runs with ``moe_a2a_backend="deepep"``: DeepEP's
    package stubbed before SGLang's DeepEP dispatcher is imported (it records at import
    whether ``deep_ep`` imports), as harness.setup() does in a fresh interpreter."""
    install(("deep_ep",))
