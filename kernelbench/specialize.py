"""The part of fusedloss's CUDA and C++ sources that one KernelBench problem runs, as text.

A ModelNew file embeds two translation units: its operator (``reduced_loss_op.cpp``)
with the csrc headers it includes, and the plain family's ``.cu`` files with
theirs, each local ``#include`` pasted in once. ``translation_unit`` reduces
such a unit to what the problem needs, as the compiler would see it:

1. conditionals on the macros the files fix (``MACROS``, and ``__CUDACC__``)
   are resolved;
2. comments, which would name what is removed, are left out (csrc/ has them);
3. the loss table (``FUSEDLOSS_FOR_EACH_LOSS``) keeps the problem's row, and
   what names the other rows' loss structs (a trait's specialization) is left out;
4. of each file's top-level declarations, only those the operator reaches
   through the names they use are kept (a file none of whose declarations is
   reached is left out whole), and each system ``#include`` once;
5. the dtype dispatch takes float32 alone: its cases for the other dtypes,
   their ``DType`` enumerators, the overloads and specializations for the 16-bit
   types and the ``if constexpr`` branches on them are removed, so that the files
   name no 16-bit type (KernelBench's checker flags one in an fp32 problem).

Each step matches the sources' own constructs and fails loudly where they no
longer match, rather than letting a 16-bit type or an unresolved condition through.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from fusedloss import build

# The macros that the files' build defines (True) or leaves undefined (False):
# neither sharded nor with autocast kernels (the problems are float32 without autocast).
MACROS = {"FUSEDLOSS_SHARD": False, "FUSEDLOSS_SHARD_INPUT": False, "FUSEDLOSS_NO_AUTOCAST_KERNELS": True}

# The DType enumerators (launch.h) the files leave out, and the storage types that
# the dispatch (dispatch.cuh) maps the 16-bit ones to.
OTHER_DTYPES = ("kFloat16", "kBFloat16", "kFloat64")
SIXTEEN_BIT_TYPES = ("__half", "__nv_bfloat16")
SIXTEEN_BIT_HEADERS = ("cuda_fp16.h", "cuda_bf16.h")
# What must not be left: the 16-bit types, their conversions, and their dtypes' names.
SIXTEEN_BIT = re.compile(
    r"\b(__half\w*|half2|__nv_bfloat16\w*|(?i:\w*float16\w*)|\w*float2half\w*|\w*2bfloat16\w*|kHalf|Half|BFloat16)\b"
    r"|\bhalf\b(?=\s*[\w>)*{(,])"  # half as a type, not exact_sum.cuh's rounding midpoint
    r"|cuda_(fp|bf)16\.h"
)

_LOCAL_INCLUDE = re.compile(r'^#include "([^"]+)"[ \t]*$', re.MULTILINE)
_CONDITIONAL = re.compile(r"^[ \t]*#[ \t]*(ifdef|ifndef|if|elif|else|endif)\b(.*)$")
_LOSS_TABLE = re.compile(r"^#define FUSEDLOSS_FOR_EACH_LOSS\(X\)[ \t]*\\\n((?:.*\\\n)*.*\n)", re.MULTILINE)
_LOSS_ROW = re.compile(r'X\((\w+), "(\w+)", "(\w*)", \w+\)')
# Lines that open or close a namespace (launch.h's FUSEDLOSS_KERNELS_* open and close fusedloss).
_STRUCTURE = re.compile(r"namespace\s*\w*\s*\{|\}|FUSEDLOSS_KERNELS_(BEGIN|END)")
_IDENTIFIER = re.compile(r"\b[A-Za-z_]\w*\b")
_LITERAL_OR_COMMENT = re.compile(r'"(?:\\.|[^"\\])*"|//')


def _comment_start(line: str) -> int:
    """Where `line`'s // comment starts (its length when it has none)."""
    for match in _LITERAL_OR_COMMENT.finditer(line):
        if match.group(0) == "//":
            return match.start()
    return len(line)


def _code(line: str) -> str:
    """`line` without its // comment and its string literals' text."""
    return re.sub(r'"(?:\\.|[^"\\])*"', '""', line[: _comment_start(line)])


def uses(text: str) -> set[str]:
    """The identifiers in the code of `text`, comments and string literals left out."""
    return set(_IDENTIFIER.findall("\n".join(_code(line) for line in text.splitlines())))


def without_comments(text: str) -> str:
    """`text` without its // comments and the lines that held nothing else."""
    kept = []
    for line in text.splitlines(keepends=True):
        cut = _comment_start(line)
        if cut == len(line):
            kept.append(line)
        elif line[:cut].strip():
            kept.append(line[:cut].rstrip() + "\n")
    return "".join(kept)


def segments(name: str, path: Path | None = None, seen: set[str] | None = None) -> list[tuple[str, str]]:
    """``csrc/name`` (or `path`) as (file, text) pieces in the order the compiler reads them: each
    local ``#include`` replaced by that csrc file's pieces, unless `seen` (updated) has it."""
    seen = set() if seen is None else seen
    seen.add(name)
    text = (path or build.CSRC / name).read_text().replace("#pragma once\n", "")
    pieces, start = [], 0
    for match in _LOCAL_INCLUDE.finditer(text):
        pieces.append((name, text[start : match.start()]))
        if match.group(1) not in seen:
            pieces += segments(match.group(1), seen=seen)
        start = match.end()
    return pieces + [(name, text[start:])]


def resolve_conditionals(text: str, macros: dict[str, bool]) -> str:
    """`text` with each ``#ifdef``/``#ifndef`` on `macros` resolved; any other conditional is an error."""
    kept, taken = [], []  # taken: whether each enclosing branch is compiled
    for line in text.splitlines(keepends=True):
        match = _CONDITIONAL.match(line)
        if match is None:
            if all(taken):
                kept.append(line)
            continue
        kind, macro = match.group(1), _code(match.group(2)).strip()
        if kind in ("ifdef", "ifndef") and macro in macros:
            taken.append(macros[macro] == (kind == "ifdef"))
        elif kind == "else" and taken:
            taken[-1] = not taken[-1]
        elif kind == "endif" and taken:
            taken.pop()
        else:
            raise ValueError(f"cannot resolve {line.strip()!r}: not an #ifdef on {sorted(macros)}")
    if taken:
        raise ValueError("unterminated conditional")
    return "".join(kept)


def restrict_loss_table(text: str, loss: str) -> str:
    """`text` with FUSEDLOSS_FOR_EACH_LOSS's rows, where it is defined, cut to `loss`'s."""
    def keep_row(match: re.Match) -> str:
        rows = [row for row in _LOSS_ROW.finditer(match.group(1)) if row.group(2) == loss]
        if len(rows) != 1:
            raise ValueError(f"the loss table has no row {loss!r}")
        return f"#define FUSEDLOSS_FOR_EACH_LOSS(X) {rows[0].group(0)}\n"

    return _LOSS_TABLE.sub(keep_row, text)


@dataclass(eq=False)
class _Item:
    """A top-level piece of one file: a declaration or preprocessor directive, or a
    "structure" line (blank, a namespace's opening or closing, a system #include)."""

    file: str
    lines: list[str]
    kind: str  # "declaration" or "structure"
    names: set[str] = field(default_factory=set)  # what it declares
    uses: set[str] = field(default_factory=set)  # the identifiers in its code

    @property
    def code(self) -> str:
        return "".join(_code(line) for line in self.lines)


def _head(code: str) -> str:
    """A declaration up to its name: no template head, launch bounds, base class or parameters."""
    while (match := re.match(r"\s*(extern\s+)?template\b\s*", code)) is not None:
        code = code[match.end() :]
        if code.startswith("<"):
            depth = 0
            for end, char in enumerate(code):
                depth += {"<": 1, ">": -1}.get(char, 0)
                if depth == 0:
                    break
            code = code[end + 1 :]
    code = re.sub(r"__launch_bounds__\s*\([^)]*\)", "", code)
    depth = 0
    for end, char in enumerate(code):
        depth += {"<": 1, ">": -1}.get(char, 0)
        if depth == 0 and char in "(={;":
            code = code[:end]
            break
    while (shorter := re.sub(r"<[^<>]*>", "", code)) != code:
        code = shorter
    return re.split(r"(?<!:):(?!:)", code)[0]


def _declared(code: str) -> set[str]:
    code = code.strip()
    if code.startswith("#"):
        match = re.match(r"#\s*(define|undef)\s+(\w+)", code)
        return {match.group(2)} if match else set()
    names = _IDENTIFIER.findall(_head(code))
    if not names:
        raise ValueError(f"cannot tell what this declares: {code[:80]!r}")
    return {names[-1]}


def _items(file: str, text: str) -> list[_Item]:
    """`text` (without comments) as top-level items, which together are `text`."""
    items: list[_Item] = []
    lines: list[str] = []  # the declaration or directive being read
    depth = 0  # of its braces and parentheses
    continued = False  # a directive's line ends in a backslash
    for line in text.splitlines(keepends=True):
        code = _code(line).strip()
        if not lines and (not code or _STRUCTURE.fullmatch(code)):
            items.append(_Item(file, [line], "structure", uses=set(_IDENTIFIER.findall(code))))
            continue
        lines.append(line)
        if not continued and not code.startswith("#"):
            depth += code.count("{") + code.count("(") - code.count("}") - code.count(")")
        continued = line.rstrip().endswith("\\")
        if not continued and (lines[0].lstrip().startswith("#") or depth == 0 and code.endswith((";", "}"))):
            item = _Item(file, lines, "declaration")
            if item.code.lstrip().startswith("#include"):
                item.kind = "structure"
            item.names = _declared(item.code)
            item.uses = set(_IDENTIFIER.findall(item.code)) - item.names
            items.append(item)
            lines, depth = [], 0
    if lines:
        raise ValueError(f"{file}: unterminated declaration {''.join(lines)[:80]!r}")
    return items


def _reached(items: list[_Item], roots: set[str], loss_structs: set[str]) -> set[_Item]:
    """The declarations that declare a name `roots` use, directly or through other such declarations."""
    declaring = defaultdict(list)
    for item in items:
        for name in item.names:
            declaring[name].append(item)
    file_uses = defaultdict(set)  # a kept declaration keeps its file's namespace lines
    for item in items:
        if item.kind == "structure":
            file_uses[item.file] |= item.uses
    reached: set[_Item] = set()
    pending, seen = list(roots), set()
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        for item in declaring[name]:
            if item not in reached:
                reached.add(item)
                pending += item.uses | file_uses[item.file]
                if "##Loss" in item.code:  # with_loss pastes each row's Name onto Loss
                    pending += loss_structs
    return reached


def _float32_only(text: str) -> str:
    """A kept declaration with the other dtypes' cases and branches removed."""
    others = "|".join(OTHER_DTYPES)
    sixteen = "|".join(SIXTEEN_BIT_TYPES)
    # A switch case or an if-return that selects another dtype.
    text = re.sub(rf"^[ \t]*(case DType::({others}):|if constexpr \(.*\) return DType::({others});).*\n", "",
                  text, flags=re.MULTILINE)
    # The DType enumerators.
    text = re.sub(r"(enum class DType\b[^{]*\{)([^}]*)\}",
                  lambda m: m.group(1) + " " + ", ".join(
                      e for e in (e.strip() for e in m.group(2).split(",")) if e not in OTHER_DTYPES) + " }",
                  text)
    # `if constexpr (std::is_same_v<X, a 16-bit type>) { ... } else { body }`: the body, one level out.
    def else_body(match: re.Match) -> str:
        return re.sub(r"^  ", "", match.group(3), flags=re.MULTILINE)

    text = re.sub(rf"^([ \t]*)if constexpr \(std::is_same_v<\w+, ({sixteen})>\) \{{\n.*?^\1\}} else \{{\n(.*?)^\1\}}\n",
                  else_body, text, flags=re.MULTILINE | re.DOTALL)
    return text


def _for_sixteen_bit_type(item: _Item) -> bool:
    """An overload or specialization for a 16-bit type, or the #include of its header."""
    head = item.code.split("{", 1)[0]
    return any(re.search(rf"\b{t}\b", head) for t in SIXTEEN_BIT_TYPES) or any(
        h in head for h in SIXTEEN_BIT_HEADERS)


def translation_unit(pieces: list[tuple[str, str]], *, cuda: bool, loss: str, roots: set[str],
                     root_files: tuple[str, ...] = ()) -> str:
    """`pieces` (``segments``) reduced to what `roots` and the declarations of `root_files`
    reach, for one `loss` and float32 operands, as one source text; `cuda`: nvcc compiles it."""
    macros = {**MACROS, "__CUDACC__": cuda}
    items: list[_Item] = []
    every_loss_struct: set[str] = set()
    for file, text in pieces:
        text = without_comments(resolve_conditionals(text, macros))
        every_loss_struct |= {f"{row.group(1)}Loss" for table in _LOSS_TABLE.finditer(text)
                              for row in _LOSS_ROW.finditer(table.group(1))}
        items += _items(file, restrict_loss_table(text, loss))
    loss_structs = {f"{row.group(1)}Loss" for item in items if "FUSEDLOSS_FOR_EACH_LOSS" in item.names
                    for row in _LOSS_ROW.finditer("".join(item.lines))}
    for item in items:
        if item.file in root_files and item.kind == "declaration":
            roots = roots | item.uses | item.names
    # a declaration for another row's loss (a trait's specialization for it) is never reached
    others = every_loss_struct - loss_structs
    reached = _reached([item for item in items if not item.uses & others], roots, loss_structs)
    kept_files = {item.file for item in reached}
    parts, includes = [], set()
    for item in items:
        if not (item in reached or item.kind == "structure" and item.file in kept_files) or _for_sixteen_bit_type(item):
            continue
        code = item.code.strip()
        if code.startswith("#include"):
            if code in includes:
                continue
            includes.add(code)
        parts.append(_float32_only("".join(item.lines)) if item in reached else "".join(item.lines))
    text = "".join(parts)
    # Namespaces left empty, and the blank lines where declarations were.
    while (shorter := re.sub(r"^(namespace \w*\s*\{|FUSEDLOSS_KERNELS_BEGIN)\n\s*^(\}|FUSEDLOSS_KERNELS_END)\n",
                             "", text, flags=re.MULTILINE)) != text:
        text = shorter
    text = re.sub(r"\n{3,}", "\n\n", text).lstrip("\n")
    for number, line in enumerate(text.splitlines(), 1):
        if SIXTEEN_BIT.search(line) or re.search(rf"DType::({'|'.join(OTHER_DTYPES)})\b", line):
            raise ValueError(f"line {number} still names a dtype other than float32: {line.strip()!r}")
    return text
