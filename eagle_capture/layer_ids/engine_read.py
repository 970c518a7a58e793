"""Read SGLang's and vLLM's model code from their wheels, as source: nothing is
imported, so every release reads the same on any machine (no GPU, no engine
installed). What is read:

* the registry: SGLang registers each ``EntryClass`` of a top-level
  ``sglang/srt/models/*.py`` by the class's ``__name__``; vLLM maps an
  architecture to ``(module, class)`` in ``model_executor/models/registry.py``'s
  tables;
* each class's bases, resolved through the files' imports (the method
  resolution order of the engine's classes, across files);
* SGLang: ``set_eagle3_layers_to_capture`` -- found on the class through its
  MRO, then *run* (only that function's body, compiled from the source) on a
  recording shell for a few probe id lists: what it assigns to a
  ``layers_to_capture``, and where it hands the ids on (``self.language_model``
  / ``self.model``: that attribute's class, from the ``__init__`` that builds
  it, and its own method, run the same way);
* vLLM: ``SupportsEagle3`` among the class's ancestors (the server refuses an
  EAGLE-3 draft at start-up otherwise: "Model does not support EAGLE3
  interface").
"""

import ast
import builtins
import re
import threading
import zipfile
from dataclasses import dataclass, field
from typing import Optional

# CPython 3.11 (3.11.2 and 3.11.7 seen) keeps the AST converter's recursion depth in state
# shared by all threads: two threads converting ASTs at once (the wheels read in a
# background thread while Triton parses a kernel in another) raise "SystemError: AST
# constructor recursion depth mismatch". Ours go one at a time, and a clash with another
# thread's is tried again (the state is set afresh at each call); the other thread's parse
# is not ours to retry, so the test suite reads the wheels in a child process.
_AST_LOCK = threading.Lock()
AST_TRIES = 5


def _ast_call(fn, *args):
    for attempt in range(AST_TRIES):
        try:
            with _AST_LOCK:
                return fn(*args)
        except SystemError:
            if attempt == AST_TRIES - 1:
                raise


def parse_source(source: str) -> ast.Module:
    return _ast_call(ast.parse, source)


METHOD = "set_eagle3_layers_to_capture"
# The per-layer flag the flag-based loops read instead of ``layers_to_capture``.
LAYER_FLAG = "_is_layer_to_capture"
# Probe ids on a 40-layer shell: they tell every rule in id_rules.RULE_WORDS apart
# (None: the defaults; ids[0] == 1 or not; the largest == num_layers or not).
PROBE_LAYERS = 40
PROBES = (None, [1, 19, 36], [2, 19, 36], [3, 20, 40], [0, 5, 9])


class Unresolved(Exception):
    """The source names something this reader cannot follow (a class built at
    run time, a name from outside the engine)."""


# ----------------------------------------------------------------------------
# Modules, classes and imports
# ----------------------------------------------------------------------------


@dataclass
class Module:
    name: str  # dotted: sglang.srt.models.llama
    path: str  # in the wheel
    tree: ast.Module
    is_package: bool = False
    classes: dict = field(default_factory=dict)  # name -> ast.ClassDef
    imports: dict = field(default_factory=dict)  # local name -> (module, name or None)
    aliases: dict = field(default_factory=dict)  # NAME = OtherName at module level


@dataclass(frozen=True)
class ClassRef:
    module: str
    name: str

    def short(self, prefix: str) -> str:
        """``llama.LlamaForCausalLM`` for a class of ``prefix`` (the models package)."""
        mod = (
            self.module[len(prefix) + 1 :] if self.module.startswith(prefix + ".") else self.module
        )
        return f"{mod}.{self.name}"


class Source:
    """The Python files of one wheel under some packages, parsed on demand."""

    def __init__(self, wheel: str, packages: tuple[str, ...]):
        self.wheel = wheel
        self._files: dict[str, str] = {}
        with zipfile.ZipFile(wheel) as z:
            for info in z.infolist():
                name = info.filename
                if name.endswith(".py") and name.startswith(packages):
                    self._files[name] = z.read(info).decode("utf-8-sig", errors="replace")
        self._modules: dict[str, Optional[Module]] = {}

    def files(self) -> dict[str, str]:
        return self._files

    def module(self, name: str) -> Optional[Module]:
        if name in self._modules:
            return self._modules[name]
        base = name.replace(".", "/")
        mod = None
        for path, package in ((base + ".py", False), (base + "/__init__.py", True)):
            if path in self._files:
                try:
                    mod = self._parse(name, path, package)
                except SyntaxError:  # the engine's import fails too: not registered
                    mod = None
                break
        self._modules[name] = mod
        return mod

    def _parse(self, name: str, path: str, package: bool) -> Module:
        tree = parse_source(self._files[path])
        mod = Module(name, path, tree, package)
        pkg = name if package else name.rsplit(".", 1)[0]
        for node in tree.body:
            self._index(mod, node, pkg)
        return mod

    def _index(self, mod: Module, node: ast.stmt, pkg: str) -> None:
        if isinstance(node, ast.ClassDef):
            mod.classes[node.name] = node
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for a in node.names:
                mod.imports[a.asname or a.name] = (base, a.name)
        elif isinstance(node, ast.Import):
            for a in node.names:
                mod.imports[a.asname or a.name.split(".")[0]] = (a.name, None)
        elif (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Name)
        ):
            mod.aliases[node.targets[0].id] = node.value.id
        elif isinstance(node, (ast.If, ast.Try)):
            # Definitions under a guard (try: import X except ImportError): every branch.
            for sub in ast.iter_child_nodes(node):
                if isinstance(sub, ast.stmt):
                    self._index(mod, sub, pkg)
                elif isinstance(sub, ast.ExceptHandler):
                    for s in sub.body:
                        self._index(mod, s, pkg)

    def resolve(self, module: str, name: str, depth: int = 0) -> Optional[ClassRef]:
        """The class ``name`` means in ``module`` (following imports and aliases);
        None: not a class defined in this wheel."""
        mod = self.module(module)
        if mod is None or depth > 20:
            return None
        if name in mod.classes:
            return ClassRef(module, name)
        if name in mod.aliases and mod.aliases[name] != name:
            return self.resolve(module, mod.aliases[name], depth + 1)
        if name in mod.imports:
            src, orig = mod.imports[name]
            if orig is None:
                return None
            found = self.resolve(src, orig, depth + 1)
            if found is None and self.module(f"{src}.{orig}") is not None:
                return None  # a submodule, not a class
            return found
        return None

    def resolve_expr(self, module: str, expr: ast.expr) -> Optional[ClassRef]:
        """The class an expression names: ``Name`` or ``module_alias.Name``."""
        if isinstance(expr, ast.Name):
            return self.resolve(module, expr.id)
        if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
            mod = self.module(module)
            imported = mod.imports.get(expr.value.id) if mod else None
            if imported is not None:
                target = imported[0] if imported[1] is None else f"{imported[0]}.{imported[1]}"
                return self.resolve(target, expr.attr)
        return None

    def classdef(self, ref: ClassRef) -> ast.ClassDef:
        return self.module(ref.module).classes[ref.name]

    def bases(self, ref: ClassRef) -> list:
        """Each base: a ClassRef, or the base's source text when it is not a class of
        this wheel (``nn.Module``)."""
        out = []
        for b in self.classdef(ref).bases:
            if isinstance(b, ast.Name):
                out.append(self.resolve(ref.module, b.id) or b.id)
            elif isinstance(b, ast.Subscript) and isinstance(b.value, ast.Name):
                out.append(self.resolve(ref.module, b.value.id) or ast.unparse(b))
            else:
                out.append(ast.unparse(b))
        return out

    def mro(self, ref: ClassRef) -> list:
        """C3 linearisation over the wheel's classes (foreign bases kept as names)."""
        return _c3(ref, self.bases, {})

    def method(self, ref: ClassRef, name: str) -> Optional[tuple[ClassRef, ast.FunctionDef]]:
        """(owner, def) of ``name`` found on ``ref`` through its MRO."""
        for c in self.mro(ref):
            if not isinstance(c, ClassRef):
                continue
            for node in self.classdef(c).body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                    return c, node
        return None


def _c3(ref, bases_of, memo):
    if not isinstance(ref, ClassRef):
        return [ref]
    if ref in memo:
        return memo[ref]
    memo[ref] = [ref]  # a cycle (never in real code) ends here
    bases = bases_of(ref)
    seqs = [_c3(b, bases_of, memo) for b in bases] + [list(bases)]
    out = [ref]
    seqs = [list(s) for s in seqs if s]
    while seqs:
        for s in seqs:
            head = s[0]
            if not any(head in t[1:] for t in seqs):
                break
        else:  # inconsistent: fall back to depth-first order
            rest = [x for s in seqs for x in s]
            out += [x for i, x in enumerate(rest) if x not in rest[:i] and x not in out]
            break
        out.append(head)
        seqs = [[x for x in s if x != head] for s in seqs]
        seqs = [s for s in seqs if s]
    memo[ref] = out
    return out


# ----------------------------------------------------------------------------
# SGLang
# ----------------------------------------------------------------------------

SGLANG_MODELS = "sglang.srt.models"


def sglang_registry(src: Source) -> dict[str, ClassRef]:
    """Architecture -> class, as SGLang's ``import_model_classes`` builds it: each
    top-level module of ``sglang.srt.models`` with an ``EntryClass``."""
    out = {}
    prefix = SGLANG_MODELS.replace(".", "/") + "/"
    for path in sorted(src.files()):
        rest = path[len(prefix) :] if path.startswith(prefix) else None
        if not rest or "/" in rest or rest == "__init__.py":
            continue
        name = f"{SGLANG_MODELS}.{rest[:-3]}"
        mod = src.module(name)
        if mod is None:
            continue
        for node in mod.tree.body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "EntryClass" for t in node.targets
            ):
                items = (
                    node.value.elts
                    if isinstance(node.value, (ast.List, ast.Tuple))
                    else [node.value]
                )
                for item in items:
                    if not isinstance(item, ast.Name):
                        continue
                    ref = src.resolve(name, item.id)
                    if ref is not None:
                        out[ref.name] = ref  # registered by __name__
    return out


class _Shell:
    """A model object as the method sees it: attributes made on demand, the
    layers_to_capture assignments recorded, the config a ``PROBE_LAYERS``-layer one."""

    def __init__(self, run: "_Run", cls: Optional[ClassRef], path: str):
        object.__setattr__(self, "_run", run)
        object.__setattr__(self, "_cls", cls)
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_attrs", {})

    def __getattr__(self, name):
        attrs = object.__getattribute__(self, "_attrs")
        if name in attrs:
            return attrs[name]
        run, path = self._run, f"{self._path}.{name}"
        if name == "is_last_rank":
            return True
        if name == "num_hidden_layers":
            return PROBE_LAYERS
        if name == "layers":
            value = _Layers(run, path)
        elif name == METHOD:
            return run.bound(self)
        else:
            value = _Shell(run, run.attribute_class(self, name), path)
        attrs[name] = value
        return value

    def __setattr__(self, name, value):
        self._attrs[name] = value
        if name == "layers_to_capture":
            self._run.captures.append((self._path, list(value)))
            self._run.holders[self._path] = self._cls
        elif name == LAYER_FLAG and value:
            # self.<model>.layers[i]._is_layer_to_capture = True: the model's loop reads
            # the flags, not the list (qwen2_moe, qwen3_next)
            self._run.flagged.add(self._path.rsplit(".layers[", 1)[0])

    def __call__(self, *args, **kwargs):
        return _Shell(self._run, None, f"{self._path}()")


class _Run:
    """One call of a class's method on a shell, following delegation."""

    def __init__(self, src: Source, top: ClassRef):
        self.src = src
        self.captures: list = []
        self.holders: dict = {}  # path -> class of the object given layers_to_capture
        self.flagged: set = set()  # paths of the models whose layers got LAYER_FLAG
        self.chain: list = []  # (owner ClassRef, whether it got the caller's ids)
        self.top = top

    def attribute_class(self, shell: _Shell, name: str) -> Optional[ClassRef]:
        """The class ``self.<name>`` is built from in the MRO's ``__init__``s."""
        cls = shell._cls
        if cls is None:
            return None
        mro = [c for c in self.src.mro(cls) if isinstance(c, ClassRef)]
        for c in mro:
            init = next(
                (
                    n
                    for n in self.src.classdef(c).body
                    if isinstance(n, ast.FunctionDef) and n.name == "__init__"
                ),
                None,
            )
            if init is None:
                continue
            for node in ast.walk(init):
                if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
                    continue
                if not any(
                    isinstance(t, ast.Attribute)
                    and t.attr == name
                    and isinstance(t.value, ast.Name)
                    and t.value.id == "self"
                    for t in node.targets
                ):
                    continue
                func = node.value.func
                if (
                    isinstance(func, ast.Attribute)
                    and isinstance(func.value, ast.Name)
                    and func.value.id == "self"
                ):
                    # self.body_cls(...): a class attribute, the most derived one
                    return self._class_attribute(mro, func.attr)
                if not isinstance(func, ast.Name):
                    return None
                params = [a.arg for a in init.args.args + init.args.kwonlyargs]
                if func.id in params:
                    # A class passed in: the default of the most derived __init__
                    # that declares the parameter (subclasses pass their own).
                    return self._param_default(mro, func.id)
                local = _local_import(init, func.id, c.module)
                if local is not None:
                    return self.src.resolve(*local)
                return self.src.resolve(c.module, func.id)
        return None

    def _class_attribute(self, mro, name: str) -> Optional[ClassRef]:
        for c in mro:
            for node in self.src.classdef(c).body:
                tgt = (
                    node.targets[0]
                    if isinstance(node, ast.Assign) and len(node.targets) == 1
                    else (node.target if isinstance(node, ast.AnnAssign) else None)
                )
                if isinstance(tgt, ast.Name) and tgt.id == name:
                    return self.src.resolve_expr(c.module, node.value)
        return None

    def _param_default(self, mro, param: str) -> Optional[ClassRef]:
        for c in mro:
            init = next(
                (
                    n
                    for n in self.src.classdef(c).body
                    if isinstance(n, ast.FunctionDef) and n.name == "__init__"
                ),
                None,
            )
            if init is None:
                continue
            args = init.args
            pos = args.args[len(args.args) - len(args.defaults) :]
            pairs = list(zip(pos, args.defaults)) + [
                (a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None
            ]
            for a, default in pairs:
                if a.arg == param and isinstance(default, ast.Name):
                    return self.src.resolve(c.module, default.id)
        return None

    def bound(self, shell: _Shell):
        def call(*args, **kwargs):
            return self.call(shell, args, kwargs)

        return call

    def call(self, shell: _Shell, args, kwargs, top: bool = False):
        cls = shell._cls
        if cls is None:
            raise Unresolved(f"{shell._path}: its class is built at run time")
        found = self.src.method(cls, METHOD)
        if found is None:
            raise AttributeError(f"{cls.name} has no {METHOD}")
        owner, fn = found
        given = args[0] if args else next(iter(kwargs.values()), None)
        self.chain.append((owner, cls, given))
        return _execute(self, owner, fn, shell, args, kwargs)


def _local_import(fn: ast.FunctionDef, name: str, module: str) -> Optional[tuple[str, str]]:
    """(module, name) of an ``from X import name`` inside ``fn`` (absolute or relative)."""
    for node in ast.walk(fn):
        if isinstance(node, ast.ImportFrom):
            for a in node.names:
                if (a.asname or a.name) == name:
                    base = node.module or ""
                    if node.level:
                        parts = module.split(".")[: -node.level]
                        base = ".".join(parts + ([node.module] if node.module else []))
                    return base, a.name
    return None


class _Layers(list):
    """A model's ``layers``: ``len`` is the probe's layer count, and an index past it
    is still an object (the probes name the final boundary, past the last layer)."""

    def __init__(self, run, path):
        super().__init__(_Shell(run, None, f"{path}[{i}]") for i in range(PROBE_LAYERS))
        self._extra = _Shell(run, None, f"{path}[n]")

    def __getitem__(self, i):
        return (
            super().__getitem__(i)
            if isinstance(i, slice) or -len(self) <= i < len(self)
            else self._extra
        )


# What a set_eagle3_layers_to_capture body may call; anything else is not followed.
_SAFE_BUILTINS = {
    n: getattr(builtins, n)
    for n in (
        "len",
        "list",
        "max",
        "min",
        "range",
        "sorted",
        "tuple",
        "set",
        "setattr",
        "getattr",
        "isinstance",
        "int",
        "enumerate",
        "any",
        "all",
        "zip",
        "print",
        "ValueError",
        "AttributeError",
        "RuntimeError",
        "NotImplementedError",
        "AssertionError",
        "TypeError",
    )
}


def _execute(run: _Run, owner: ClassRef, fn: ast.FunctionDef, shell: _Shell, args, kwargs):
    """Run the method's body, compiled from its source (annotations and decorators
    dropped: they are not executed for a call), on ``shell``."""
    fn = parse_source(ast.unparse(fn)).body[0]  # a fresh copy to strip
    fn.decorator_list = []
    fn.returns = None
    for a in fn.args.args + fn.args.kwonlyargs + fn.args.posonlyargs:
        a.annotation = None
    code = _ast_call(compile, ast.Module([fn], []), f"<{owner.module}.{owner.name}>", "exec")

    def hasattr_(obj, name):
        if isinstance(obj, _Shell):
            if name == METHOD:
                if obj._cls is None:
                    raise Unresolved(
                        f"hasattr({obj._path}, {name!r}): its class is built at run time"
                    )
                return run.src.method(obj._cls, METHOD) is not None
            raise Unresolved(f"hasattr({obj._path}, {name!r})")
        return hasattr(obj, name)

    # The parallel-state helpers answer as the pipeline's last rank (where SGLang
    # captures); any other global the body names is a NameError: not read.
    parallel = lambda *a, **k: _Shell(run, None, "<parallel>")  # noqa: E731
    shell_globals = {
        "__builtins__": dict(_SAFE_BUILTINS, hasattr=hasattr_),
        "get_pp_group": parallel,
        "get_parallel": parallel,
        "logger": _Shell(run, None, "<logger>"),
    }
    namespace: dict = {}
    exec(code, shell_globals, namespace)  # noqa: S102 - one engine method, on a shell
    return namespace[fn.name](shell, *args, **kwargs)


@dataclass
class SGLangFact:
    architecture: str
    cls: str  # "llama.LlamaForCausalLM"
    capture: Optional[bool]  # None: could not be read mechanically
    owner: Optional[str] = None  # the class whose method computes the capture layers
    rule: Optional[str] = None  # an id_rules.RULE_WORDS key; None: unclassified
    via: list = field(default_factory=list)  # delegation, outermost first
    why: str = ""
    # The owner's model loop also captures after its last layer (capture layer
    # num_layers, the final norm's input): see FINAL_BOUNDARY.
    final_boundary: bool = False

    def as_dict(self) -> dict:
        d = {"class": self.cls, "capture": self.capture}
        for k in ("owner", "rule"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        if self.via:
            d["via"] = self.via
        if self.final_boundary:
            d["final_boundary"] = True
        if self.why:
            d["why"] = self.why
        return d


# A model loop that captures after its last layer tests the layer count itself against
# the capture set (gemma3_causal.py: ``if num_layers in self.layers_to_capture``; 0.5.22+
# gpt_oss.py: ``if self.end_layer in self.layers_to_capture``), or captures each layer's
# output (0.5.18 - 0.5.20 gpt_oss.py: ``if i + 1 in self.layers_to_capture`` after layer i,
# the last one's included); every other capture tests the loop index ``i`` before the
# layer. ``self.end_layer - 1 in ...`` (the last layer's input) does not match.
FINAL_BOUNDARY = re.compile(
    r"(?<![\w.])(?:num_layers|self\.end_layer|len\(self\.layers\)|"
    r"self\.config\.num_hidden_layers|\w+\s*\+\s*1)\s+in\s+self\.layers_to_capture\b"
)


def captures_final_boundary(src: Source, classes) -> bool:
    """Whether the model loop behind ``classes`` (the registered class, the classes it
    delegates to and the method's owner: the loop lives in one of their modules)
    captures at the final boundary."""
    for ref in classes:
        mod = src.module(ref.module)
        if mod is not None and FINAL_BOUNDARY.search(src.files()[mod.path]):
            return True
    return False


# Methods that only set the capture up (they read the list they were just given):
# a read there is not the model loop's.
_SETUP = re.compile(r"^(__init__|set_\w*layers_to_capture)$")


def _reads(src: Source, cls: ClassRef) -> set:
    """What the code around ``cls`` reads to capture, outside set-up methods: "list"
    (``self.layers_to_capture``) and / or "flags" (``LAYER_FLAG``). Every module of
    the class's MRO is read whole (a loop may live in a module-level helper)."""
    found = set()
    modules = {c.module for c in src.mro(cls) if isinstance(c, ClassRef)}
    for name in modules:
        mod = src.module(name)
        if mod is None:
            continue
        skipped = {
            id(n)
            for fn in ast.walk(mod.tree)
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and _SETUP.match(fn.name)
            for n in ast.walk(fn)
        }
        for node in ast.walk(mod.tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                if node.attr == "layers_to_capture":
                    found.add("list")
                elif node.attr == LAYER_FLAG:
                    found.add("flags")
            elif isinstance(node, ast.Constant) and node.value == LAYER_FLAG:
                found.add("flags")  # getattr(layer, "_is_layer_to_capture", False)
    return found


def _dead_store(src: Source, run: "_Run", path: str, holder: ClassRef) -> Optional[str]:
    """Why the ids the method stored never reach a model loop, or None when they
    do. The store is dead when the object given
    ``layers_to_capture`` belongs to code that reads neither that list nor, where the
    method flagged its layers, the flags (SGLang 0.5.13 - 0.5.20's Qwen3.5 wrappers:
    Qwen3VL's method sets the language model's list, whose loop reads only the flags
    that set_dflash_layers_to_capture sets). ``path``: the object given the list,
    ``holder`` its class."""
    reads = _reads(src, holder)
    if "list" in reads or ("flags" in reads and path in run.flagged):
        return None
    loop = (
        f"its loop captures only the layers flagged {LAYER_FLAG}, which this method does not set"
        if "flags" in reads
        else "it reads neither the list nor per-layer flags outside its set-up methods"
    )
    return (
        f"hands the ids to {holder.short(SGLANG_MODELS)}.layers_to_capture, which that "
        f"model never reads: nothing is captured ({loop})"
    )


def _branch_appends(fn: ast.FunctionDef) -> list:
    """Lines where ``fn`` (a model loop) captures a layer's branch output instead of the
    residual stream: its layers return ``hidden_states, residual`` (the add deferred to
    the next fused add + norm, which the final ``self.norm(hidden_states, residual)``
    shows) and a capture under ``... in self.layers_to_capture`` appends the bare
    ``hidden_states`` -- not ``hidden_states + residual``, and not in a branch where
    ``residual is None`` (no add pending there)."""
    deferred = any(
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "norm"
        and len(n.args) >= 2
        and isinstance(n.args[1], ast.Name)
        and n.args[1].id == "residual"
        for n in ast.walk(fn)
    )
    outputs = set()
    for n in ast.walk(fn):
        if (
            isinstance(n, ast.Assign)
            and isinstance(n.targets[0], ast.Tuple)
            and isinstance(n.value, ast.Call)
        ):
            names = [e.id for e in n.targets[0].elts if isinstance(e, ast.Name)]
            if "residual" in names[1:]:
                outputs.add(names[0])
    if not (deferred and outputs):
        return []
    no_add_pending = {
        id(node)
        for n in ast.walk(fn)
        if isinstance(n, ast.If) and ast.unparse(n.test).strip() == "residual is None"
        for stmt in n.body
        for node in ast.walk(stmt)
    }
    lines = []
    for n in ast.walk(fn):
        if not (isinstance(n, ast.If) and "layers_to_capture" in ast.unparse(n.test)):
            continue
        for c in ast.walk(n):
            if (
                isinstance(c, ast.Call)
                and isinstance(c.func, ast.Attribute)
                and c.func.attr == "append"
                and c.args
                and isinstance(c.args[0], ast.Name)
                and c.args[0].id in outputs
                and id(c) not in no_add_pending
            ):
                lines.append(c.lineno)
    return sorted(set(lines))


def _branch_capture(src: Source, holder: ClassRef) -> Optional[str]:
    """Why the model loop that reads the ids captures the wrong tensor (each layer's
    branch output, its residual add deferred: SGLang 0.5.18+'s Gemma 3), or None. Read
    in the methods of ``holder``, the class that holds the ids (and its bases), set-up
    left out."""
    for c in src.mro(holder):
        if not isinstance(c, ClassRef):
            continue
        for fn in src.classdef(c).body:
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or _SETUP.match(fn.name):
                continue
            lines = _branch_appends(fn)
            if lines:
                where = src.module(c.module).path.rsplit("/", 1)[-1]
                return (
                    f"captures a layer's branch output, not the residual stream: "
                    f"{where} {c.name}.{fn.name} (line {', '.join(map(str, lines))}) appends "
                    f"hidden_states while its layers return (hidden_states, residual) with the "
                    f"add deferred to the next norm, so the draft gets the branch, not the "
                    f"stream it was trained on"
                )
    return None


def sglang_fact(src: Source, arch: str, ref: ClassRef) -> SGLangFact:
    """Whether ``ref`` captures for an EAGLE-3 draft, and by which rule."""
    from eagle_capture.layer_ids.id_rules import RULE_WORDS, apply_rule

    short = ref.short(SGLANG_MODELS)
    if src.method(ref, METHOD) is None:
        # (no set_eagle3_layers_to_capture: the model runner's call raises AttributeError)
        return SGLangFact(arch, short, False)
    results, chains = {}, []
    for ids in PROBES:
        run = _Run(src, ref)
        probe = None if ids is None else list(ids)
        try:
            run.call(_Shell(run, ref, "self"), (probe,), {})
        except Unresolved as e:
            return SGLangFact(arch, short, None, why=f"not read mechanically: {e}")
        except AttributeError as e:
            return SGLangFact(arch, short, False, why=f"delegates, and {e}: start-up fails")
        except Exception as e:  # noqa: BLE001 - the shell could not run it: say what
            return SGLangFact(
                arch, short, None, why=f"not read mechanically: {type(e).__name__}: {e}"
            )
        results[str(ids)] = run.captures[-1][1] if run.captures else None
        if probe is not None:
            # The method that computes the layers: the last one handed the caller's ids.
            chains.append([(o, c) for o, c, given in run.chain if given is probe])
    if any(v is None for v in results.values()):
        last = [c.short(SGLANG_MODELS) for _, c, _ in run.chain]
        return SGLangFact(
            arch,
            short,
            False,
            via=last,
            why="the ids are handed to a model without the method "
            "(checked with hasattr): nothing is captured",
        )
    chain = chains[0]
    owner = chain[-1][0].short(SGLANG_MODELS)
    via = [c.short(SGLANG_MODELS) for _, c in chain] if len(chain) > 1 else []
    rule = next(
        (
            r
            for r in RULE_WORDS
            if all(results[str(ids)] == apply_rule(r, ids, PROBE_LAYERS) for ids in PROBES)
        ),
        None,
    )
    # The method's rule is kept where the loop fails the draft: the ids it sets, which
    # nothing reads or which pick the wrong tensor (that loop's final boundary, too).
    # (Where the holder's class is not known, neither is asked.)
    path = run.captures[-1][0]
    holder = run.holders.get(path)
    dead = _dead_store(src, run, path, holder) if holder is not None else None
    if dead is not None:
        return SGLangFact(arch, short, False, owner, rule, via, why=dead)
    # The loop is the holder's (the object given the ids: Gemma 4's multimodal class
    # hands them to its text model, in another module, without a delegation chain).
    final_boundary = captures_final_boundary(
        src, [ref] + [c for _, c in chain] + [chain[-1][0]] + ([holder] if holder else [])
    )
    branch = _branch_capture(src, holder) if holder is not None else None
    if branch is not None:
        return SGLangFact(arch, short, False, owner, rule, via, branch, final_boundary)
    fact = SGLangFact(arch, short, True, owner, rule, via, final_boundary=final_boundary)
    if rule is None:
        fact.why = "unclassified: " + "; ".join(f"ids {k} -> {v}" for k, v in results.items())
    return fact


def is_sglang_eagle3_draft(ref: ClassRef) -> bool:
    """SGLang's EAGLE-3 draft classes: the ``*eagle3`` model files' entries."""
    return ref.module.rsplit(".", 1)[-1].endswith("eagle3") or "Eagle3" in ref.name


# SGLang's capture-only mode: a server-argument field (0.5.23: arg_groups/fields/exec_.py
# ``enable_return_aux_hidden_states: A[bool, ...] = False``; earlier lines' server_args.py
# dataclass would declare it the same way).
CAPTURE_ONLY_FIELD = re.compile(r"^\s+enable_return_aux_hidden_states\s*:", re.M)


def sglang_capture_only(wheel: str) -> bool:
    """Whether the release has the capture-only mode (--enable-return-aux-hidden-states)."""
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if name.endswith(".py") and (
                name.startswith("sglang/srt/arg_groups/") or name == "sglang/srt/server_args.py"
            ):
                text = z.read(name).decode("utf-8", errors="replace")
                if CAPTURE_ONLY_FIELD.search(text):
                    return True
    return False


def _draft_model_reads(node: ast.AST) -> Optional[str]:
    """``X`` when ``node`` is a plain load of ``<...>.draft_runner.model.X``."""
    if not (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)):
        return None
    model = node.value
    if (
        isinstance(model, ast.Attribute)
        and model.attr == "model"
        and isinstance(model.value, ast.Attribute)
        and model.value.attr in ("draft_runner", "draft_model_runner")
    ):
        return node.attr
    return None


def sglang_eagle3_draft_attribute(wheel: str) -> Optional[dict]:
    """What SGLang's EAGLE-3 worker reads of the draft model without a fallback: the
    first ``self.draft_(model_)runner.model.hot_token_id`` attribute load (not a ``getattr``
    with a default) in ``sglang/srt/speculative/``. A draft class without it -- a target
    model class named as the draft's architecture -- fails the worker's start-up with
    AttributeError. ``{"attribute", "where"}``, or None where no such read is found."""
    with zipfile.ZipFile(wheel) as z:
        names = sorted(
            n for n in z.namelist() if n.startswith("sglang/srt/speculative/") and n.endswith(".py")
        )
        for name in names:
            try:
                tree = parse_source(z.read(name).decode("utf-8-sig", errors="replace"))
            except SyntaxError:
                continue
            for node in ast.walk(tree):
                if _draft_model_reads(node) == "hot_token_id":
                    where = f"{name.removeprefix('sglang/srt/')}:{node.lineno}"
                    return {"attribute": "hot_token_id", "where": where}
    return None


def read_sglang(wheel: str) -> dict:
    src = Source(wheel, ("sglang/srt/models/",))
    registry = sglang_registry(src)
    targets, drafts = {}, {}
    for arch, ref in sorted(registry.items()):
        if is_sglang_eagle3_draft(ref):
            drafts[arch] = ref.short(SGLANG_MODELS)
            continue
        targets[arch] = sglang_fact(src, arch, ref).as_dict()
    return {
        "wheel": wheel.rsplit("/", 1)[-1],
        "eagle3_drafts": drafts,
        "registered": len(registry),
        "capture_only": sglang_capture_only(wheel),
        "eagle3_draft_attribute": sglang_eagle3_draft_attribute(wheel),
        "targets": targets,
    }


# ----------------------------------------------------------------------------
# vLLM
# ----------------------------------------------------------------------------

VLLM_MODELS = "vllm.model_executor.models"
# Not listed as targets: the Transformers backend's tables (one generic class each),
# removed or out-of-tree names, and the union of the others.
_VLLM_TABLES_SKIPPED = (
    "_TRANSFORMERS_SUPPORTED_MODELS",
    "_TRANSFORMERS_BACKEND_MODELS",
    "_PREVIOUSLY_SUPPORTED_MODELS",
    "_OOT_SUPPORTED_MODELS",
    "_VLLM_MODELS",
)


def _vllm_tables(src: Source) -> dict[str, dict]:
    """registry.py's literal tables in file order: ``{table: {arch: ClassRef, or
    (module, class) where the class is not found}}`` from ``"Arch": ("module",
    "Class")`` entries; modules without a dot are under ``vllm.model_executor.models``."""
    mod = src.module(f"{VLLM_MODELS}.registry")
    tables = {}
    for node in mod.tree.body:
        target = (
            node.targets[0]
            if isinstance(node, ast.Assign)
            else (node.target if isinstance(node, ast.AnnAssign) else None)
        )
        if not (
            isinstance(target, ast.Name)
            and isinstance(node.value, ast.Dict)
            and target.id.endswith("_MODELS")
        ):
            continue
        table = tables.setdefault(target.id, {})
        for k, v in zip(node.value.keys, node.value.values):
            if not (
                isinstance(k, ast.Constant)
                and isinstance(v, ast.Tuple)
                and len(v.elts) >= 2
                and all(isinstance(e, ast.Constant) for e in v.elts[:2])
            ):
                continue
            module, cls = v.elts[0].value, v.elts[1].value
            module = module if "." in module else f"{VLLM_MODELS}.{module}"
            table[k.value] = src.resolve(module, cls) or (module, cls)
    return tables


def vllm_registry(src: Source) -> tuple[dict, dict]:
    """(targets, speculative) architecture -> ClassRef-or-(module, class) from
    registry.py's tables, those of _VLLM_TABLES_SKIPPED left out."""
    targets, spec = {}, {}
    for name, table in _vllm_tables(src).items():
        if name not in _VLLM_TABLES_SKIPPED:
            (spec if name == "_SPECULATIVE_DECODING_MODELS" else targets).update(table)
    return targets, spec


def vllm_fact(src: Source, ref) -> dict:
    if not isinstance(ref, ClassRef):
        return {
            "class": f"{ref[0]}.{ref[1]}",
            "capture": None,
            "why": "not read mechanically: the class is not defined in that module's source",
        }
    short = ref.short(VLLM_MODELS)
    mro = src.mro(ref)
    flag = None
    for c in mro:
        if not isinstance(c, ClassRef):
            continue
        for node in src.classdef(c).body:
            tgt = (
                node.targets[0]
                if isinstance(node, ast.Assign) and len(node.targets) == 1
                else (node.target if isinstance(node, ast.AnnAssign) else None)
            )
            if (
                isinstance(tgt, ast.Name)
                and tgt.id == "supports_eagle3"
                and isinstance(node.value, ast.Constant)
            ):
                flag = (c, bool(node.value.value))
                break
        if flag:
            break
    owner = next(
        (
            c
            for c in mro
            if isinstance(c, ClassRef)
            and c.name == "SupportsEagle3"
            and c.module.endswith("interfaces")
        ),
        None,
    )
    if flag is not None and flag[0] != owner:
        capture, by = flag[1], flag[0]
    else:
        capture, by = owner is not None, None
    out = {"class": short, "capture": capture}
    if capture:
        # The class that brings SupportsEagle3 in: the first in the MRO listing it as a base.
        holder = by or next(c for c in mro if isinstance(c, ClassRef) and owner in src.bases(c))
        out["owner"] = holder.short(VLLM_MODELS)
    # (else not SupportsEagle3: the server raises "Model does not support EAGLE3 interface")
    return out


def vllm_transformers_backend(src: Source) -> Optional[dict]:
    """The fact of vLLM's Transformers modeling backend for text models
    (``_TRANSFORMERS_BACKEND_MODELS["TransformersForCausalLM"]``): what serves an
    architecture vLLM registers no class of its own for. None where the table or the
    entry is absent."""
    ref = _vllm_tables(src).get("_TRANSFORMERS_BACKEND_MODELS", {}).get("TransformersForCausalLM")
    return vllm_fact(src, ref) if ref is not None else None


def _config_key(node: ast.AST, nested: set) -> Optional[str]:
    """The draft-config key a node reads: ``getattr(self.config, "K", ...)`` -> "K";
    ``<eagle_config>.get("K")`` (a name bound to the nested dict) -> "eagle_config.K"."""
    if not isinstance(node, ast.Call) or not node.args:
        return None
    f = node.func
    if (
        isinstance(f, ast.Name)
        and f.id == "getattr"
        and len(node.args) >= 2
        and isinstance(node.args[0], ast.Attribute)
        and node.args[0].attr == "config"
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    ):
        return node.args[1].value
    if (
        isinstance(f, ast.Attribute)
        and f.attr == "get"
        and isinstance(f.value, ast.Name)
        and f.value.id in nested
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return f"eagle_config.{node.args[0].value}"
    return None


def _target_name(node: ast.AST) -> Optional[str]:
    """``x`` of ``x = ...`` or ``self.x = ...``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def vllm_fc_width(src: Source, ref: ClassRef) -> Optional[dict]:
    """How vLLM's EAGLE-3 draft class ``ref`` sizes its fc (the hidden states it takes,
    concatenated), read in its module: the function that ends in ``len(ids) if ids else
    N``; the draft-config keys it reads before that, in order (a count, or a list of ids
    whose length counts), and N. ``{"reads": [...], "default": N, "where": "file:line"}``,
    or None where no such rule is found. A checkpoint whose fc was trained on another
    count does not load (the weight's shape)."""
    mod = src.module(ref.module)
    if mod is None:
        return None
    for fn in ast.walk(mod.tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        default = next(
            (
                n
                for n in ast.walk(fn)
                if isinstance(n, ast.IfExp)
                and isinstance(n.body, ast.Call)
                and isinstance(n.body.func, ast.Name)
                and n.body.func.id == "len"
                and isinstance(n.orelse, ast.Constant)
                and isinstance(n.orelse.value, int)
            ),
            None,
        )
        if default is None:
            continue
        nested = {"eagle_config"}
        for n in ast.walk(fn):  # eagle_config = getattr(self.config, "eagle_config", ...) or {}
            if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name):
                if any(_config_key(c, set()) == "eagle_config" for c in ast.walk(n.value)):
                    nested.add(n.targets[0].id)
        # The count's variable, and the ids it is the length of: what feeds them.
        feeds = {
            _target_name(n.targets[0])
            for n in ast.walk(fn)
            if isinstance(n, ast.Assign) and n.value is default
        }
        feeds |= {n.id for n in ast.walk(default) if isinstance(n, ast.Name)} - {"len"}
        reads = []
        assigns = sorted(
            (
                n
                for n in ast.walk(fn)
                if isinstance(n, ast.Assign)
                and _target_name(n.targets[0]) in feeds
                and n.lineno <= default.lineno
            ),
            key=lambda n: n.lineno,
        )
        for assign in assigns:
            calls = sorted(
                (c for c in ast.walk(assign.value) if isinstance(c, ast.Call)),
                key=lambda c: (c.lineno, c.col_offset),
            )
            for call in calls:
                key = _config_key(call, nested)
                if key and key != "eagle_config" and key not in reads:
                    reads.append(key)
        if not reads:
            continue
        path = mod.path.split("/models/", 1)[-1]
        return {
            "reads": reads,
            "default": default.orelse.value,
            "where": f"{path}:{default.lineno}",
        }
    return None


SPECULATORS_ALGOS = "vllm/transformers_utils/configs/speculators/algos.py"


def vllm_speculators_eagle3(wheel: str) -> Optional[dict]:
    """The class vLLM builds for a speculators-format EAGLE-3 draft, per its
    transformer_layer_config's model_type: ``update_eagle3``'s literal
    ``eagle3_arch_map`` (and the model_type assumed when there is none). The draft's
    config as vLLM sees it is that transformer_layer_config, plus the top-level ids
    ``update_eagle3`` copies in. None where not found."""
    with zipfile.ZipFile(wheel) as z:
        if SPECULATORS_ALGOS not in z.namelist():
            return None
        tree = parse_source(z.read(SPECULATORS_ALGOS).decode("utf-8-sig", errors="replace"))
    for fn in ast.walk(tree):
        if not (isinstance(fn, ast.FunctionDef) and fn.name == "update_eagle3"):
            continue
        archs, assumed = None, None
        for n in ast.walk(fn):
            if (
                isinstance(n, ast.Assign)
                and isinstance(n.targets[0], ast.Name)
                and n.targets[0].id == "eagle3_arch_map"
                and isinstance(n.value, ast.Dict)
            ):
                archs = {k.value: v.value for k, v in zip(n.value.keys, n.value.values)}
            if (
                isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute)
                and n.func.attr == "get"
                and len(n.args) == 2
                and isinstance(n.args[0], ast.Constant)
                and n.args[0].value == "model_type"
                and isinstance(n.args[1], ast.Constant)
            ):
                assumed = n.args[1].value
        if archs:
            return {"archs": archs, "model_type_default": assumed}
    return None


CONVERTORS = "vllm/transformers_utils/model_arch_config_convertor.py"
VLLM_CONFIG = "vllm/transformers_utils/config.py"


def _text_config_field(fn: ast.FunctionDef) -> Optional[str]:
    """``X`` where ``fn`` returns ``self.hf_text_config.X`` or
    ``getattr(self.hf_text_config, "X", ...)``."""
    for node in ast.walk(fn):
        if not isinstance(node, ast.Return) or node.value is None:
            continue
        v = node.value
        if (
            isinstance(v, ast.Attribute)
            and isinstance(v.value, ast.Attribute)
            and v.value.attr == "hf_text_config"
        ):
            return v.attr
        if (
            isinstance(v, ast.Call)
            and isinstance(v.func, ast.Name)
            and v.func.id == "getattr"
            and len(v.args) >= 2
            and isinstance(v.args[0], ast.Attribute)
            and v.args[0].attr == "hf_text_config"
            and isinstance(v.args[1], ast.Constant)
        ):
            return v.args[1].value
    return None


def _module_dict(tree: ast.Module, name: str) -> list:
    """The (key, value) nodes of the dict literal a module assigns to ``name``."""
    for node in tree.body:
        target = (
            node.targets[0]
            if isinstance(node, ast.Assign)
            else (node.target if isinstance(node, ast.AnnAssign) else None)
        )
        if isinstance(target, ast.Name) and target.id == name and isinstance(node.value, ast.Dict):
            return list(zip(node.value.keys, node.value.values))
    return []


def vllm_layer_count(wheel: str) -> Optional[dict]:
    """Where vLLM reads a model's layer count from when it is not ``num_hidden_layers``:
    ``{"fields": {model_type: field}}`` from model_arch_config_convertor.py's
    MODEL_ARCH_CONFIG_CONVERTORS (the classes whose ``get_num_hidden_layers`` returns
    another field of the text config: LongCat-Flash's ``num_layers``, whose
    ``num_hidden_layers`` counts two sublayers a layer), and ``{"model_types":
    {architecture: model_type}}`` for configs that carry none (config.py's
    _ARCHITECTURE_TO_MODEL_TYPE). None where the file is not there."""
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        if CONVERTORS not in names:
            return None
        tree = parse_source(z.read(CONVERTORS).decode("utf-8-sig", errors="replace"))
        config = (
            parse_source(z.read(VLLM_CONFIG).decode("utf-8-sig", errors="replace"))
            if VLLM_CONFIG in names
            else None
        )
    field_of = {}
    for cls in tree.body:
        if isinstance(cls, ast.ClassDef):
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "get_num_hidden_layers":
                    field = _text_config_field(fn)
                    if field and field != "num_hidden_layers":
                        field_of[cls.name] = field
    fields = {
        k.value: field_of[v.id]
        for k, v in _module_dict(tree, "MODEL_ARCH_CONFIG_CONVERTORS")
        if isinstance(k, ast.Constant) and isinstance(v, ast.Name) and v.id in field_of
    }
    model_types = {
        k.value: v.value
        for k, v in (_module_dict(config, "_ARCHITECTURE_TO_MODEL_TYPE") if config else [])
        if isinstance(k, ast.Constant) and isinstance(v, ast.Constant)
    }
    return {"fields": dict(sorted(fields.items())), "model_types": model_types}


def read_vllm(wheel: str) -> dict:
    src = Source(wheel, ("vllm/model_executor/models/", "vllm/models/"))
    targets, spec = vllm_registry(src)
    drafts = {
        a: ref.short(VLLM_MODELS)
        for a, ref in sorted(spec.items())
        if isinstance(ref, ClassRef) and ref.name.startswith("Eagle3")
    }
    fc = {}
    for ref in spec.values():
        if isinstance(ref, ClassRef) and ref.name.startswith("Eagle3"):
            width = vllm_fc_width(src, ref)
            if width is not None:
                fc[ref.short(VLLM_MODELS)] = width
    return {
        "wheel": wheel.rsplit("/", 1)[-1],
        "eagle3_drafts": drafts,
        "eagle3_draft_fc": dict(sorted(fc.items())),
        "speculators_eagle3": vllm_speculators_eagle3(wheel),
        "layer_count": vllm_layer_count(wheel),
        "registered": len(targets) + len(spec),
        "speculative": sorted(spec),
        "transformers_backend": vllm_transformers_backend(src),
        "targets": {a: vllm_fact(src, ref) for a, ref in sorted(targets.items())},
    }
