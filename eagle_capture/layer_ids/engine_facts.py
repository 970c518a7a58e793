"""The engines' EAGLE-3 facts per release, generated from their own code.

``data/engine_facts.json`` holds, for each SGLang and vLLM wheel read
(:mod:`.engine_read`, the source read without importing it):

* ``targets``: every architecture the release registers -> whether its class can
  feed an EAGLE-3 draft (``capture``: true, false, or null where the code cannot
  be read mechanically, with ``why``), the class whose code decides it
  (``owner``), for SGLang the id rule its ``set_eagle3_layers_to_capture``
  applies (a :data:`~eagle_capture.layer_ids.id_rules.RULE_WORDS` key) and the
  delegation it goes through (``via``);
* ``eagle3_drafts``: the EAGLE-3 draft architectures it registers -> their class
  (vLLM also lists ``speculative``: every architecture of its speculative-decoding
  table);
* SGLang's ``capture_only``: whether the release has the capture-only mode
  (``--enable-return-aux-hidden-states``, a server-argument field);
* SGLang's ``eagle3_draft_attribute``: what its EAGLE-3 worker reads of the draft
  model with no fallback (``hot_token_id``, with file:line): a draft architecture
  that resolves to a target model class, not one of ``eagle3_drafts``, fails there;
* vLLM's ``eagle3_draft_fc``: per EAGLE-3 draft class, the config keys its fc's width
  (how many hidden states it takes) is read from, in order, and the default; and
  ``speculators_eagle3``: the class it builds for a speculators-format draft, per model
  type (``transformer_layer_config``, the draft's config as vLLM sees it); and
  ``layer_count``: the config field a model type's layer count is read from where it is
  not ``num_hidden_layers`` (LongCat-Flash: ``num_layers``).

Regenerate after a new engine release (and review the diff)::

    python -m eagle_capture.layer_ids.engine_facts --wheel-dir DIR [--check]

``DIR`` holds the wheels (``pip download --no-deps sglang==V vllm==V -d DIR``);
``--check`` compares with the committed file instead of writing it (exit 1 on
drift). The tests run the same comparison.
"""

import argparse
import functools
import glob
import json
import os
import sys
from typing import Optional

DATA = os.path.join(os.path.dirname(__file__), "data", "engine_facts.json")

# The releases read: the wheels the doctor's lines rest on. SGLang: every release from
# 0.5.9 to 0.5.23 (its post releases 0.5.10.post1, 0.5.12.post1, 0.5.13.post1 and
# 0.5.15.post1 are not read: they generate the facts of their base release, but for the
# line of eagle_worker_v2.py that reads hot_token_id, and the doctor reads X.Y.Z.postN as X.Y.Z).
SGLANG_RELEASES = tuple(f"0.5.{n}" for n in range(9, 24))
VLLM_RELEASES = ("0.32.0", "0.33.0", "0.34.0")


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


@functools.lru_cache(maxsize=None)
def load(path: str = DATA) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def releases(engine: str) -> list[str]:
    return sorted(load()[engine], key=_key)


def read_release(engine: str, version: tuple[int, ...]) -> Optional[str]:
    """The newest release read that is not newer than ``version``."""
    read = [v for v in releases(engine) if _key(v) <= tuple(version)]
    return read[-1] if read else None


def target(engine: str, release: str, architecture: str) -> Optional[dict]:
    """The fact for ``architecture`` in ``release`` (a version read), None: not
    registered there."""
    return load()[engine][release]["targets"].get(architecture)


def registers_draft(engine: str, release: str, architecture: str) -> bool:
    return architecture in load()[engine][release]["eagle3_drafts"]


def draft_class(engine: str, architecture: str) -> Optional[tuple[str, str]]:
    """(the first release read that registers ``architecture`` as an EAGLE-3 draft,
    its class), or None."""
    for release in releases(engine):
        cls = load()[engine][release]["eagle3_drafts"].get(architecture)
        if cls:
            return release, cls
    return None


def registered_anywhere(architecture: str) -> bool:
    """Whether any release read of either engine registers ``architecture`` at all
    (a target, an EAGLE-3 draft, vLLM's other speculative models)."""
    return any(
        architecture in r["targets"]
        or architecture in r["eagle3_drafts"]
        or architecture in r.get("speculative", ())
        for engine in ("sglang", "vllm")
        for r in load()[engine].values()
    )


def eagle3_drafts() -> frozenset:
    """Every EAGLE-3 draft architecture any release read registers."""
    return frozenset(
        a
        for engine in ("sglang", "vllm")
        for r in load()[engine].values()
        for a in r["eagle3_drafts"]
    )


def capture_only_releases() -> list[str]:
    """The SGLang releases read that have the capture-only mode
    (``--enable-return-aux-hidden-states``)."""
    return [v for v in releases("sglang") if load()["sglang"][v].get("capture_only")]


def eagle3_draft_attribute(release: str) -> Optional[dict]:
    """What SGLang ``release``'s EAGLE-3 worker reads of the draft model with no
    fallback (``{"attribute", "where"}``), as read; None where nothing was found."""
    return load()["sglang"][release].get("eagle3_draft_attribute")


def vllm_fc_width(release: str, cls: str) -> Optional[dict]:
    """How vLLM ``release``'s EAGLE-3 draft class ``cls`` ("module.Class") sizes its fc
    (``{"reads", "default", "where"}``), as read; None where not."""
    return (load()["vllm"][release].get("eagle3_draft_fc") or {}).get(cls)


def vllm_draft_fc(release: str, architecture: str, read) -> Optional[tuple[int, str, dict]]:
    """How many hidden states vLLM ``release``'s EAGLE-3 class for the draft architecture
    ``architecture`` (as vLLM names it: ``Eagle3LlamaForCausalLM``) sizes its fc for, given
    ``read(key)`` -> the draft config's value for a key of the class's rule
    ("eagle_config.K" for the nested dict; None where absent): ``(width, class, rule)``,
    or None where the class or its rule was not read."""
    cls = load()["vllm"][release]["eagle3_drafts"].get(architecture)
    rule = vllm_fc_width(release, cls) if cls else None
    if rule is None:
        return None
    for key in rule["reads"]:
        value = read(key)
        if key.endswith("_ids"):  # ``len(ids) if ids else N``
            if not value:
                continue
            if not isinstance(value, list):
                return None  # not a list of ids: vLLM's own len() would stop first
            return len(value), cls, rule
        if value is not None:  # a count, where given
            if isinstance(value, bool) or not isinstance(value, int):
                return None  # not a count vLLM could size a layer with
            return value, cls, rule
    return rule["default"], cls, rule


def layer_count_field(model_type: Optional[str], architecture: str = "") -> Optional[str]:
    """The config field the newest vLLM read takes a model's layer count from where it is
    not ``num_hidden_layers`` (LongCat-Flash: ``num_layers``), by ``model_type``, else
    by the architecture of a config that names no model type; None: num_hidden_layers."""
    read = (load()["vllm"][releases("vllm")[-1]].get("layer_count")) or {}
    if not isinstance(model_type, str):  # absent, or not a name a config could hold
        model_type = read.get("model_types", {}).get(architecture)
    return read.get("fields", {}).get(model_type) if isinstance(model_type, str) else None


def vllm_speculators_eagle3(release: str) -> Optional[dict]:
    """vLLM ``release``'s classes for speculators-format EAGLE-3 drafts, per model type
    (``{"archs", "model_type_default"}``), as read."""
    return load()["vllm"][release].get("speculators_eagle3")


def transformers_backend(release: str) -> Optional[dict]:
    """vLLM ``release``'s Transformers modeling backend (what serves an architecture it
    registers no class of its own for), as read; None where it was not."""
    return load()["vllm"][release].get("transformers_backend")


def vllm_fallback_releases(architecture: str) -> list[str]:
    """The vLLM releases read that register no class of their own as ``architecture``
    and whose Transformers modeling backend can capture (would serve it, if at all)."""
    return [
        v
        for v in releases("vllm")
        if target("vllm", v, architecture) is None
        and (transformers_backend(v) or {}).get("capture")
    ]


def capturing_releases(architecture: str) -> dict[str, list[str]]:
    """Per engine, the releases read whose class for ``architecture`` can capture."""
    return {
        engine: [
            v for v in releases(engine) if (target(engine, v, architecture) or {}).get("capture")
        ]
        for engine in ("sglang", "vllm")
    }


# ----------------------------------------------------------------------------
# Generating
# ----------------------------------------------------------------------------


def find_wheels(wheel_dir: str) -> dict[str, dict[str, str]]:
    """{"sglang": {version: wheel}, "vllm": {...}} for the releases read."""
    found: dict[str, dict[str, str]] = {"sglang": {}, "vllm": {}}
    for engine, wanted in (("sglang", SGLANG_RELEASES), ("vllm", VLLM_RELEASES)):
        for version in wanted:
            hits = sorted(glob.glob(os.path.join(wheel_dir, f"{engine}-{version}-*.whl")))
            if hits:
                found[engine][version] = hits[0]
    return found


def generate(wheels: dict[str, dict[str, str]]) -> dict:
    from eagle_capture.layer_ids.engine_read import read_sglang, read_vllm

    out: dict = {"sglang": {}, "vllm": {}}
    for version, wheel in sorted(wheels["sglang"].items(), key=lambda kv: _key(kv[0])):
        out["sglang"][version] = read_sglang(wheel)
    for version, wheel in sorted(wheels["vllm"].items(), key=lambda kv: _key(kv[0])):
        out["vllm"][version] = read_vllm(wheel)
    return out


def dumps(facts: dict) -> str:
    """JSON with one architecture per line (a new release reads as a short diff)."""
    lines = ["{"]
    engines = list(facts.items())
    for ei, (engine, per) in enumerate(engines):
        lines.append(f"  {json.dumps(engine)}: {{")
        items = list(per.items())
        for ri, (version, rel) in enumerate(items):
            lines.append(f"    {json.dumps(version)}: {{")
            lines.append(f'      "wheel": {json.dumps(rel["wheel"])},')
            lines.append(f'      "registered": {rel["registered"]},')
            lines.append(f'      "eagle3_drafts": {json.dumps(rel["eagle3_drafts"])},')
            if "speculative" in rel:
                lines.append(f'      "speculative": {json.dumps(rel["speculative"])},')
            if "capture_only" in rel:
                lines.append(f'      "capture_only": {json.dumps(rel["capture_only"])},')
            if "eagle3_draft_attribute" in rel:
                needs = json.dumps(rel["eagle3_draft_attribute"])
                lines.append(f'      "eagle3_draft_attribute": {needs},')
            for key in ("eagle3_draft_fc", "speculators_eagle3", "layer_count"):
                if key in rel:
                    lines.append(f"      {json.dumps(key)}: {json.dumps(rel[key])},")
            if "transformers_backend" in rel:
                backend = json.dumps(rel["transformers_backend"])
                lines.append(f'      "transformers_backend": {backend},')
            lines.append('      "targets": {')
            targets = list(rel["targets"].items())
            for ti, (arch, fact) in enumerate(targets):
                comma = "," if ti < len(targets) - 1 else ""
                lines.append(f"        {json.dumps(arch)}: {json.dumps(fact)}{comma}")
            lines.append("      }")
            lines.append("    }" + ("," if ri < len(items) - 1 else ""))
        lines.append("  }" + ("," if ei < len(engines) - 1 else ""))
    lines.append("}")
    return "\n".join(lines) + "\n"


def drift(generated: dict, committed: dict) -> list[str]:
    """What differs, one line per architecture (empty: none)."""
    out = []
    for engine in ("sglang", "vllm"):
        for version in sorted(
            set(generated.get(engine, {})) | set(committed.get(engine, {})), key=_key
        ):
            g, c = generated.get(engine, {}).get(version), committed.get(engine, {}).get(version)
            if g is None or c is None:
                missing = "not generated" if g is None else "not committed"
                out.append(f"{engine} {version}: {missing}")
                continue
            if g.get("capture_only") != c.get("capture_only"):
                out.append(
                    f"{engine} {version} capture_only: {c.get('capture_only')} -> "
                    f"{g.get('capture_only')}"
                )
            for key in (
                "eagle3_draft_attribute",
                "eagle3_draft_fc",
                "speculators_eagle3",
                "layer_count",
            ):
                if g.get(key) != c.get(key):
                    out.append(f"{engine} {version} {key}: {c.get(key)} -> {g.get(key)}")
            if g.get("transformers_backend") != c.get("transformers_backend"):
                out.append(
                    f"{engine} {version} transformers_backend: "
                    f"{c.get('transformers_backend')} -> {g.get('transformers_backend')}"
                )
            if g["eagle3_drafts"] != c["eagle3_drafts"] or g.get("speculative") != c.get(
                "speculative"
            ):
                out.append(
                    f"{engine} {version} eagle3_drafts: {c['eagle3_drafts']} -> "
                    f"{g['eagle3_drafts']}"
                )
            for arch in sorted(set(g["targets"]) | set(c["targets"])):
                if g["targets"].get(arch) != c["targets"].get(arch):
                    out.append(
                        f"{engine} {version} {arch}: {c['targets'].get(arch)} -> "
                        f"{g['targets'].get(arch)}"
                    )
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m eagle_capture.layer_ids.engine_facts",
        description="Read the SGLang and vLLM wheels' model code and write (or check) the "
        "doctor's engine facts.",
    )
    p.add_argument(
        "--wheel-dir",
        required=True,
        help="a folder holding the wheels: sglang-{%s}, vllm-{%s}"
        % (",".join(SGLANG_RELEASES), ",".join(VLLM_RELEASES)),
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="compare with the committed data instead of writing it (exit 1 on drift)",
    )
    p.add_argument("--out", default=DATA, help="where to write (default: the package's data)")
    args = p.parse_args(argv)
    if not os.path.isdir(args.wheel_dir):
        print(f"error: --wheel-dir {args.wheel_dir} is not a folder", file=sys.stderr)
        return 2
    wheels = find_wheels(args.wheel_dir)
    missing = [
        f"{e}=={v}"
        for e, want in (("sglang", SGLANG_RELEASES), ("vllm", VLLM_RELEASES))
        for v in want
        if v not in wheels[e]
    ]
    if missing:
        print(
            f"error: {args.wheel_dir} lacks the wheels of {', '.join(missing)} (pip download "
            f"--no-deps {' '.join(missing)} -d {args.wheel_dir})",
            file=sys.stderr,
        )
        return 2
    facts = generate(wheels)
    if args.check:
        with open(args.out, encoding="utf-8") as f:
            diff = drift(facts, json.load(f))
        for line in diff:
            print(line)
        print(
            f"{len(diff)} difference(s) from {args.out}"
            if diff
            else f"{args.out} matches the wheels"
        )
        return 1 if diff else 0
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(dumps(facts))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
