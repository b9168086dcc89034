"""docs/architecture.md names only what exists: every backticked path is a file, every `module.name` and
`Class.member` is defined there (a class's bases included), and every other backticked name is defined somewhere in
the package (or is one of the few outside names it cites). A span with a `<placeholder>` is a template, not a
name."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "kvm_maglev"
# names the document cites from transformers, torch, vLLM and the shell, not from this package
OUTSIDE = {"use_kernels", "True", "False", "None", "nn", "Linear", "torch", "compile", "fullgraph", "python", "m",
           "self", "loss_function", "cache_utils", "CacheLayerMixin", "Cache", "GenerationMixin", "MambaBase",
           "past_key_values", "save_pretrained", "push_to_hub", "trust_remote_code", "auto_map", "generate",
           "from_pretrained", "OUT_DIR", "kvm", "maglev", "enforce_eager", "support_torch_compile", "torch_library",
           "library", "KVM_MAGLEV_SPEEDUPS", "cache", "update", "crop", "layers", "model", "cu_seq_lens_q",
           "seq_idx", "position_ids", "attention_mask", "DataCollatorWithFlattening", "logger", "warning"}


def definitions() -> tuple[dict[str, set[str]], dict[str, set[str]], dict[str, list[str]], set[str]]:
    """Per module basename its top-level names; per class its members and bases; every name defined anywhere."""
    modules: dict[str, set[str]] = {}
    members: dict[str, set[str]] = {}
    bases: dict[str, list[str]] = {}
    everywhere: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        top = modules.setdefault(path.stem, set())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                names = members.setdefault(node.name, set())
                bases[node.name] = [getattr(base, "id", getattr(base, "attr", "")) for base in node.bases]
                for item in node.body:
                    names.update(bound_names(item))
            everywhere.update(bound_names(node))
            if isinstance(node, ast.arg):
                everywhere.add(node.arg)
        for item in tree.body:
            top.update(bound_names(item))
        everywhere.add(path.stem)
    everywhere.update(path.name for path in PACKAGE.rglob("*") if path.is_dir())
    return modules, members, bases, everywhere


def bound_names(node: ast.AST) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)} | {
            n.attr for t in targets for n in ast.walk(t) if isinstance(n, ast.Attribute)}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    return set()


def class_has(name: str, member: str, members: dict, bases: dict) -> bool:
    """Whether class `name` or a base defines `member`; a base from outside the package (transformers') may."""
    pending, seen = [name], set()
    while pending:
        current = pending.pop()
        if current in seen:
            continue
        seen.add(current)
        if current not in members or member in members[current]:
            return True
        pending += bases.get(current, [])
    return False


def problems(text: str) -> list[str]:
    modules, members, bases, everywhere = definitions()
    found = []
    for span in re.findall(r"`([^`]+)`", text):
        if re.search(r"<\w+>", span):  # a template (`modeling_<name>.py`), not a name
            continue
        for token in re.findall(r"[\w./]+", span):
            token = token.rstrip("./")
            if not token.strip("./") or token.isdigit():
                continue
            if re.search(r"\.(py|md|json)$", token):
                if not any((base / token).exists() for base in (ROOT, ROOT / "docs", PACKAGE, PACKAGE / "models")) \
                        and not list(PACKAGE.rglob(Path(token).name)):
                    found.append(f"{span!r}: no file {token}")
                continue
            if "/" in token:  # a module's path, then maybe its names: common/seams.package_speedups
                folder, _, token = token.rpartition("/")
                module = token.split(".")[0]
                if not any((base / folder / f"{module}{suffix}").exists() for base in (ROOT, PACKAGE, PACKAGE / "models")
                           for suffix in (".py", "")):
                    found.append(f"{span!r}: no module {folder}/{module}")
                    continue
            parts = [part for part in token.split(".") if part]
            for owner, member in zip(parts, parts[1:]):
                if owner in members and not class_has(owner, member, members, bases):
                    found.append(f"{span!r}: {owner} has no {member}")
                elif owner in modules and owner not in members and member not in modules[owner] \
                        and member not in modules:
                    found.append(f"{span!r}: module {owner} defines no {member}")
            for part in parts:
                if part not in everywhere and part not in OUTSIDE and not part.startswith("kvm_maglev"):
                    found.append(f"{span!r}: {part} is defined nowhere in the package")
    return found


def test_every_name_in_the_architecture_doc_exists():
    assert problems((ROOT / "docs" / "architecture.md").read_text()) == []


def test_the_check_finds_a_missing_name():
    text = "`KVMCache.over_pages`, `RowStorage.read`, `vllm/page_caches.bind_pages`, `no_such_helper`, `common/nothing`"
    assert problems(text) == ["'KVMCache.over_pages': over_pages is defined nowhere in the package",
                              "'no_such_helper': no_such_helper is defined nowhere in the package",
                              "'common/nothing': no module common/nothing"]
