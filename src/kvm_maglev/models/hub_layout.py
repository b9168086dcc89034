"""The generated modeling file told top-down: the causal-LM class and the model first, then the decoder layer,
attention, cache, and the state math last, the order a reader needs (`hub_code` uses it).

The package's modules are written bottom-up, as Python runs them; reversed, a class would come before its base and
a default argument before its constant. What a statement needs at the moment it runs (bases, decorators, default
arguments, class-body values, module-level expressions; annotations are lazy under `from __future__ import
annotations`; what a function called then reads) and is defined further down is placed just before the first
statement that needs it, under a line naming the module it comes from (`PULLED_UP`).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

SUBSECTION = re.compile(r"^# ---- ")  # the package modules' own section rules inside a module
PULLED_UP = "# (from {module}: defined here, before its first use)"


@dataclass
class Statement:
    """One top-level statement of a module body, with the comments above it."""

    text: str
    defines: set[str]
    needs: set[str]  # names it reads when it runs (at import), not when it is later called
    reads: set[str]  # a function's: the names its body reads when it is called


def names_in(node: ast.AST) -> set[str]:
    return {child.id for child in ast.walk(node) if isinstance(child, ast.Name)}


def needed_at_definition(node: ast.stmt) -> set[str]:
    """The names `node` reads when the module runs it: a function's decorators and defaults, a class's bases,
    keywords, decorators and body values; all of any other statement."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        defaults = node.args.defaults + [value for value in node.args.kw_defaults if value is not None]
        return set().union(*map(names_in, node.decorator_list + defaults))
    if isinstance(node, ast.ClassDef):
        heads = node.decorator_list + node.bases + [keyword.value for keyword in node.keywords]
        return set().union(*map(names_in, heads), *map(needed_at_definition, node.body))
    if isinstance(node, ast.AnnAssign):
        return names_in(node.value) if node.value is not None else set()
    return names_in(node)


def defined_by(node: ast.stmt) -> set[str]:
    """The module-level names `node` binds (a `try` or `if` block's imports and assignments included)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    names = set()
    for child in ast.walk(node):
        if isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store):
            names.add(child.id)
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(child.name)
        elif isinstance(child, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in child.names)
    return names


def statements(text: str) -> list[Statement]:
    """`text`'s top-level statements, each with the comment lines and blank lines above it."""
    lines = text.splitlines()
    found, start = [], 0
    for node in ast.parse(text).body:
        end = node.end_lineno
        reads = set().union(*map(names_in, node.body)) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
            else set()
        found.append(Statement("\n".join(lines[start:end]).strip("\n"), defined_by(node),
                               needed_at_definition(node) - defined_by(node), reads))
        start = end
    if found and start < len(lines):
        found[-1].text = (found[-1].text + "\n" + "\n".join(lines[start:])).rstrip("\n")
    return found


def with_calls_followed(every: list[Statement]) -> None:
    """Widen each statement's needs by what the functions it needs read, transitively: a function called at import
    (a module-level `x = f()`) runs its body then, so what that body reads must be defined first too."""
    owner = {name: statement for statement in every for name in statement.defines}
    for statement in every:
        needs, pending = set(statement.needs), list(statement.needs)
        while pending:
            callee = owner.get(pending.pop())
            fresh = callee.reads - needs if callee is not None else set()
            needs |= fresh
            pending += fresh
        statement.needs = needs - statement.defines


def subsections(body: str) -> list[tuple[str, list[Statement]]]:
    """A module body cut at its `# ---- ` rules: (rule, statements) in order; the part before the first rule has
    the rule ""."""
    cuts: list[tuple[str, list[str]]] = [("", [])]
    for line in body.splitlines():
        if SUBSECTION.match(line):
            cuts.append((line, []))
        else:
            cuts[-1][1].append(line)
    return [(rule, statements("\n".join(lines))) for rule, lines in cuts if rule or any(line.strip() for line in lines)]


def reversed_module(parts: list[tuple[str, list[Statement]]]) -> list[tuple[str, Statement]]:
    """A module's statements top-down, each with its part's rule: the part without a rule first, then the parts
    in reverse; inside a part its constants as written, then its functions and classes in reverse. A statement
    that needs another of the module's at definition time follows it (that one is pulled up)."""
    parts = parts[:1] + parts[1:][::-1] if parts and not parts[0][0] else parts[::-1]
    wanted = []
    for rule, block in parts:
        definitions = [s for s in block if DEFINITION.match(first_code(s))]
        wanted += [(rule, s) for s in block if s not in definitions] + [(rule, s) for s in definitions[::-1]]
    owner = {name: (rule, s) for rule, s in wanted for name in s.defines}
    placed: list[tuple[str, Statement]] = []
    seen: set[int] = set()

    def place(rule: str, statement: Statement) -> None:
        if id(statement) in seen:
            return
        seen.add(id(statement))
        for name in sorted(statement.needs & owner.keys()):
            place(rule, owner[name][1])  # pulled up into the part that needs it
        placed.append((rule, statement))

    for rule, statement in wanted:
        place(rule, statement)
    return placed


DEFINITION = re.compile(r"(@|def |async def |class )")


def first_code(statement: Statement) -> str:
    """The statement's first line that is not a comment or blank."""
    return next(line for line in statement.text.splitlines() if line.strip() and not line.startswith("#"))


def top_down(sections: list[tuple[str, str]]) -> list[tuple[str, list[tuple[str, Statement]]]]:
    """`sections` (title, body) in the package's order, dependencies first, the model module last, laid out
    top-down: the model's module first, the dependencies after it in reverse, each module by `reversed_module`.
    A statement that needs, at definition time, one defined further down gets it placed just before itself (with
    what that one needs, first), marked with its module. Returns the sections as (title, [(rule, statement)])."""
    package_order = [(title, subsections(body)) for title, body in sections]
    every = [statement for _, parts in package_order for _, block in parts for statement in block]
    with_calls_followed(every)
    home = {id(statement): title for title, parts in package_order for _, block in parts for statement in block}
    owner: dict[str, Statement] = {}
    for statement in every:
        for name in statement.defines:
            owner.setdefault(name, statement)
    layout = [(title, reversed_module(parts)) for title, parts in package_order[::-1]]
    order = [statement for _, placed in layout for _, statement in placed]
    position = {id(statement): index for index, statement in enumerate(order)}
    moved: dict[int, list[Statement]] = {}  # a statement -> the ones placed just before it
    placed: set[int] = set()

    def pull_up(statement: Statement, before: Statement) -> None:
        """Place before `before` what `statement` needs and the layout has further down, each after its needs."""
        for name in sorted(statement.needs & owner.keys()):
            need = owner[name]
            if id(need) not in placed and position[id(need)] > position[id(before)]:
                placed.add(id(need))
                pull_up(need, before)
                moved.setdefault(id(before), []).append(need)

    for statement in order:
        if id(statement) not in placed:
            placed.add(id(statement))
            pull_up(statement, statement)
    pulled = {id(need) for needs in moved.values() for need in needs}
    laid_out = []
    for title, statements in layout:
        kept = []
        for rule, statement in statements:
            marked = None  # the module the last marker named: one marker for a run of one module's statements
            for need in moved.get(id(statement), []):
                module = module_name(home[id(need)])
                marker = PULLED_UP.format(module=module) + "\n" if module != marked else ""
                kept.append(("", Statement(marker + need.text.strip("\n"), need.defines, need.needs, need.reads)))
                marked = module
            if id(statement) not in pulled:
                kept.append((rule, statement))
        laid_out.append((title, kept))
    return laid_out


def module_name(title: str) -> str:
    """The module file a section's title rule names (`# ---- cache_kvm.py ----`)."""
    return title.split("\n")[0].split()[2]


def render(laid_out: list) -> list[str]:
    """The file's parts after its imports: each section, a part's rule written before its first statement."""
    parts = []
    for title, placed in laid_out:
        texts, ruled = [title.strip("\n")], set()
        for rule, statement in placed:
            text = statement.text.strip("\n")
            if rule and rule not in ruled:
                ruled.add(rule)
                text = rule + "\n" + text
            texts.append(text)
        parts.append("\n\n\n".join(texts))
    return parts
