"""An offline replica of ATC's ONNX pre-check (`atc --mode=3`): which nodes CANN's ONNX parser would refuse.

Read from hicann/ge `parser/parser/onnx/onnx_parser.cc` (`ModelParseToGraph`, `ConstructOriType`, `Prechecker`,
`AdaptAndFindAllOnnxGraph`), `parser/parser/common/pre_checker.cc` (`CheckName`, `CheckTypeSupported`) and
`parser/parser/onnx/subgraph_adapter/if_subgraph_adapter.cc`, at two points:

- "released": tags v8.5.0 (49e1770c29af) .. v9.2.0-beta.1 (391b34b23e2d). `domain_verseion_` holds each
  opset_import domain verbatim ("" stays ""). A node with a domain looks that exact string up; a node with an empty
  domain is accepted only when the model has exactly one opset_import (its domain, "" written "ai.onnx"), else
  E16005.
- "head": commit ffdcbc9f7496 (after 74f8167a49e0 "support empty onnx domain", in no tag yet): "" is read as
  "ai.onnx" on both sides, so `{"": 17, "npu": 1}` works.

Then the key `<domain>::<version>::<op_type>` must be registered (`keys.py`), else E13010. Constant, FileConstant
and Input are mapped by the parser itself (`kOnnxOpMap`) and never looked up. Where ATC and this check differ:
ATC stops at the first E16005 or unimported domain (`Prechecker` returns at once) and `--mode=3` checks only the
main graph (`ModelParseToGraph` returns after it); a real conversion parses each `If` branch the same way. Here
every node of every `If` branch is reported, so one run lists everything to fix.

Linear in the number of nodes; reads names, domains and attributes only, never a tensor's data, so a model loaded
with `onnx.load(path, load_external_data=False)` is enough.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import asdict, dataclass

import onnx

from npufuse.emit.atc import keys

GE_VERSIONS = ("released", "head")
GE_LABELS = {"released": "released GE v8.5.0..v9.2.0-beta.1", "head": "GE head (not yet released)"}
MAIN_GRAPH = "main graph"
# Mapped by the parser itself, at any opset and in any domain (onnx_parser.cc kOnnxOpMap).
_EXEMPT_OPS = frozenset({"Constant", "FileConstant", "Input"})
_IF_BRANCHES = ("then_branch", "else_branch")  # if_subgraph_adapter.cc kAttrNameToIndex
_EMIT_ATC = "`npufuse optimize MODEL --emit atc`"
_EMPTY = '""'  # how the messages write the empty (default) domain
# Ops no plugin registers in any domain, and the way around each (the fix line of their E13010).
_NO_KEY_FIXES = {
    "Gelu": "no key at any version: decompose into Erf/Tanh or use NPUFastGelu",
    "GroupNormalization": "no key at any version: decompose into Reshape + InstanceNormalization + Mul/Add, or use "
                          "NPUGroupNormSilu when SiLU follows",
    "RMSNormalization": "no key at any version: decompose into Pow/ReduceMean/Add/Sqrt/Div/Mul, or use "
                        "npu::1::NPURmsNorm (its epsilon is fixed at 1e-6)",
    "RotaryEmbedding": "no key at any version: decompose into Mul/Add/Slice/Concat, or use "
                       "npu::1::NPURotaryPositionEmbedding",
    "Attention": "no key at any version: decompose into MatMul/Softmax, or use NPUPromptFlashAttention",
}


@dataclass(frozen=True)
class AtcProblem:
    """One thing ATC's ONNX parser would refuse (severity "error") or accept but mis-wire ("warning").

    code: ATC's error code (E13010, E16005, E13009, E16004) or a stable npufuse code where ATC has none
    (functions-dropped, unsupported-subgraph-op, if-attributes, nested-if-capture, no-opset-import).
    key: the `<domain>::<version>::<op_type>` the parser builds for the node, "" where it builds none."""

    code: str
    node: str
    op_type: str
    graph: str
    key: str
    message: str
    fix: str
    severity: str = "error"


def atc_problems(model: onnx.ModelProto, ge: str = "released", extra_keys: frozenset[str] = frozenset()
                 ) -> list[AtcProblem]:
    """Every node of `model` that CANN's ONNX parser would refuse, in graph order (main graph, then `If` branches
    breadth-first, as the parser walks them). `ge` is "released" or "head" (see the module docstring).
    `extra_keys`: keys the user's own plugins register (`--kernels`), taken as registered."""
    if ge not in GE_VERSIONS:
        raise ValueError(f"ge must be one of {GE_VERSIONS}, got {ge!r}")
    if not model.HasField("graph"):
        return [AtcProblem("E16004", "", "", "model", "", "the model has no graph (ATC: E16004)",
                           "export the model again: an ONNX model needs a graph")]
    problems: list[AtcProblem] = []
    # A call names its function by (domain, op_type, overload) (ONNX IR 10 overloads share a name).
    functions = {(f.domain, f.name, f.overload) for f in model.functions}
    if functions:
        names = ", ".join(sorted({f"{d}::{n}" if d else n for d, n, _ in functions}))
        problems.append(AtcProblem(
            "functions-dropped", "", "", "model", "",
            f"{len(model.functions)} model-local function(s) ({names}): ATC's ONNX proto (ge_onnx.proto) has no "
            "`functions` field, so they are dropped, never inlined, and each call is looked up as an op",
            "inline them (onnx.inliner.inline_local_functions) before ATC"))
    _Walk(_opset_versions(model, ge), ge, functions, problems, extra_keys).run(model.graph)
    return problems


def refused(problems: list[AtcProblem]) -> bool:
    """True if ATC would refuse the model: any problem of severity "error" (a warning alone converts)."""
    return any(p.severity == "error" for p in problems)


def summarize(problems: list[AtcProblem]) -> dict[str, int]:
    """Problem counts by code, most frequent first (ties by code)."""
    counts = Counter(p.code for p in problems)
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def format_text(problems: list[AtcProblem], model_path: str, ge: str | None = None) -> str:
    """One line per problem (where, code, key, what, fix), then a total line; names are made printable."""
    from npufuse.console.textsafe import safe_line

    lines = []
    for p in problems:
        where = p.graph if not p.node else f"{p.graph}: node '{p.node}' ({p.op_type})"
        tag = f"{p.code} (warning)" if p.severity == "warning" else p.code
        key = f" {p.key}" if p.key else ""
        lines.append(safe_line(f"{model_path}: {where}: {tag}{key}: {p.message}; fix: {p.fix}"))
    on = f" on {GE_LABELS[ge]}" if ge else ""
    if not problems:
        lines.append(safe_line(f"{model_path}: no problems: ATC's ONNX parser would accept every node{on}"))
    else:
        counts = ", ".join(f"{n} {code}" for code, n in summarize(problems).items())
        verdict = "ATC would refuse this model" if refused(problems) else "ATC would convert it, with warnings"
        lines.append(safe_line(f"{model_path}: {len(problems)} problem(s) ({counts}): {verdict}{on}"))
    return "\n".join(lines) + "\n"


def to_json(problems: list[AtcProblem]) -> dict:
    """The problems as a JSON-ready dict: `refused`, `counts` by code and `problems` (one dict per problem)."""
    return {"refused": refused(problems), "counts": summarize(problems), "problems": [asdict(p) for p in problems]}


def _opset_versions(model: onnx.ModelProto, ge: str) -> dict[str, int]:
    """The parser's `domain_verseion_`: a std::map filled in opset_import order, so a repeated domain keeps the
    last version. Released GE keys it by the domain verbatim; head writes "" as "ai.onnx"."""
    versions: dict[str, int] = {}
    for imp in model.opset_import:
        domain = (imp.domain or keys.DEFAULT_DOMAIN) if ge == "head" else imp.domain
        versions[domain] = imp.version
    return versions


class _Walk:
    """One pass over the main graph and every `If` branch, breadth-first as AdaptAndFindAllOnnxGraph goes."""

    def __init__(self, versions: dict[str, int], ge: str, functions: set[tuple[str, str, str]],
                 problems: list[AtcProblem], extra_keys: frozenset[str] = frozenset()) -> None:
        self.versions, self.ge, self.functions, self.problems = versions, ge, functions, problems
        self.extra_keys = extra_keys
        self.unnamed = 0  # the parser names an unnamed node `<op_type>_<n>`, n counted over all graphs

    def run(self, root: onnx.GraphProto) -> None:
        # (graph, its path, the tensors the If adapter adds as its inputs, whether it is a branch)
        todo: deque[tuple[onnx.GraphProto, str, frozenset[str], bool]] = deque([(root, MAIN_GRAPH, frozenset(), False)])
        while todo:
            graph, path, captured, is_branch = todo.popleft()
            available: set[str] | None = None  # what a nested If can read here; built on the first nested If
            seen: dict[str, int] = {}
            for node in graph.node:
                name = node.name
                if not name:
                    name = f"{node.op_type}_{self.unnamed}"
                    self.unnamed += 1
                self._check_name(name, node, path, seen)
                if node.op_type == "If":  # the adapter factory goes by op_type alone, in any domain
                    self._check_key(node, name, path)
                    branches = self._check_if(node, name, path)
                    union = frozenset().union(*(_captures(b) for _, b in branches))
                    if is_branch and union:
                        if available is None:
                            available = _defined(graph) | captured
                        self._check_nested(node, name, path, union - available)
                    prefix = "" if path == MAIN_GRAPH else f"{path}/"
                    for attr, branch in branches:
                        todo.append((branch, f"{prefix}If '{name}'/{attr}", union, True))
                elif any(_has_graph(a) for a in node.attribute):
                    self._unsupported(node, name, path)
                else:
                    self._check_key(node, name, path)

    def _add(self, code: str, node: onnx.NodeProto, name: str, path: str, key: str, message: str, fix: str,
             severity: str = "error") -> None:
        self.problems.append(AtcProblem(code, name, node.op_type, path, key, message, fix, severity))

    def _key(self, node: onnx.NodeProto, name: str, path: str) -> str | None:
        """The key ConstructOriType builds, or None after reporting why it builds none (E16005, no import)."""
        domain = node.domain
        if self.ge == "head":
            domain = domain or keys.DEFAULT_DOMAIN
        elif not domain:
            if len(self.versions) != 1:
                imports = ", ".join(f"{d or _EMPTY} {v}" for d, v in self.versions.items()) or "none"
                self._add("E16005", node, name, path, "",
                          f"the node has an empty domain and the model imports {len(self.versions)} domains "
                          f"({imports}): released GE needs exactly one",
                          "set every node's domain to the literal `ai.onnx` and import `ai.onnx` in place of "
                          "\"\", or keep a single opset_import")
                return None
            domain, version = next(iter(self.versions.items()))
            return keys.make_key(domain, version, node.op_type)
        if domain not in self.versions:
            literal = self.ge == "released" and domain == keys.DEFAULT_DOMAIN and "" in self.versions
            self._add("no-opset-import", node, name, path, "",
                      f"domain '{domain}' has no opset_import (ATC: E19999 \"The opset of domain[{domain}] has no "
                      "responding version\")",
                      "released GE matches the domain string verbatim: import `ai.onnx` itself, or clear the "
                      "node's domain" if literal else
                      f"add an opset_import for '{domain}', or move the node to an imported domain")
            return None
        return keys.make_key(domain, self.versions[domain], node.op_type)

    def _check_key(self, node: onnx.NodeProto, name: str, path: str) -> None:
        if node.op_type in _EXEMPT_OPS:
            return
        key = self._key(node, name, path)
        if key is None or keys.lookup(key) is not None or key in self.extra_keys:
            return
        self._add("E13010", node, name, path, key,
                  "no CANN plugin registers this key (ATC: \"No operator plugin is registered for Op\")",
                  self._fix(node, key))

    def _fix(self, node: onnx.NodeProto, key: str) -> str:
        """What the user can do about a missing key: the most specific advice first."""
        domain, version_text, op = key.split("::", 2)
        version = int(version_text)
        if node.domain.startswith("npufuse"):
            return "write the model with `npufuse optimize --emit atc`"
        if (node.domain, node.op_type, node.overload) in self.functions:
            return "the node calls a model-local function ATC drops: inline them (onnx.inliner.inline_local_functions)"
        anywhere = keys.registered_domains(op)
        if not anywhere:
            return _NO_KEY_FIXES.get(op, f"no key at any version in any domain: decompose {op} into registered ops, "
                                         f"or register a custom plugin for `{key}`")
        here = anywhere.pop(domain, ())
        elsewhere = "; ".join(f"{d} {keys.format_versions(v)}" for d, v in sorted(anywhere.items()))
        also = f" (also registered in {elsewhere}: set the node's domain and import it)" if elsewhere else ""
        if not here:
            return f"{op} is not registered in {domain}, only in {elsewhere}: set the node's domain and import it"
        if domain == keys.DEFAULT_DOMAIN and version > here[-1]:
            return f"nothing is registered above ai.onnx {here[-1]}: {_EMIT_ATC} converts the model down{also}"
        return (f"{op} is registered at {domain} {keys.format_versions(here)} only: use one of those opsets, or "
                f"decompose it{also}")

    def _check_name(self, name: str, node: onnx.NodeProto, path: str, seen: dict[str, int]) -> None:
        # PreChecker::CheckName (E13009) compares names within one graph; a dict keeps it linear.
        seen[name] = seen.get(name, 0) + 1
        if seen[name] == 2:  # report a repeated name once, at its second use
            self._add("E13009", node, name, path, "", f"node name '{name}' is used by more than one node in this "
                      "graph", "give every node of a graph a unique name")

    def _check_if(self, node: onnx.NodeProto, name: str, path: str) -> list[tuple[str, onnx.GraphProto]]:
        """IfSubgraphAdapter: exactly 2 attributes, each then_branch or else_branch. Returns the branches."""
        attr_names = [a.name for a in node.attribute]
        if len(attr_names) != 2 or any(n not in _IF_BRANCHES for n in attr_names):
            extra = sorted(set(attr_names) - set(_IF_BRANCHES))
            self._add("if-attributes", node, name, path, "",
                      f"ATC's If adapter needs exactly 2 attributes, then_branch and else_branch; this node has "
                      f"{attr_names}: the whole parse fails before the pre-check (ATC: E19999)",
                      f"keep only then_branch and else_branch{' (drop ' + ', '.join(extra) + ')' if extra else ''}")
        return [(a.name, a.g) for a in node.attribute if a.name in _IF_BRANCHES and a.HasField("g")]

    def _check_nested(self, node: onnx.NodeProto, name: str, path: str, missing: frozenset[str]) -> None:
        """A nested If whose branch reads a tensor the enclosing branch neither defines nor was given: the adapter
        of the outer If ran first and saw only its branch's direct nodes, so that input stays unwired."""
        missing = missing - {""}  # "" is an omitted optional input, not a tensor
        if missing:
            shown = ", ".join(f"'{t}'" for t in sorted(missing)[:3]) + (" ..." if len(missing) > 3 else "")
            self._add("nested-if-capture", node, name, path, "",
                      f"a branch of this nested If reads {shown} from two or more levels up; ATC passes a branch "
                      "only what its direct nodes read, so the input is left unconnected (\"Unknown input\")",
                      "keep If branches flat: fold constant conditions, or hoist the inner If out of the branch",
                      severity="warning")

    def _unsupported(self, node: onnx.NodeProto, name: str, path: str) -> None:
        key = self._key(node, name, path)
        graphs = ", ".join(a.name for a in node.attribute if _has_graph(a))
        plugin = "" if key and keys.lookup(key) else f" and no plugin key (ATC: E13010 for {key})" if key else ""
        self._add("unsupported-subgraph-op", node, name, path, key or "",
                  f"{node.op_type} has graph attribute(s) {graphs}; ATC has a subgraph adapter only for If{plugin}, "
                  "so the body is never parsed",
                  "unroll it (a static trip count) or move it out of the model" if node.op_type in ("Loop", "Scan")
                  else f"rewrite {node.op_type} without a graph attribute")


def _has_graph(attr: onnx.AttributeProto) -> bool:
    return attr.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) or attr.HasField("g") \
        or len(attr.graphs) > 0


def _captures(branch: onnx.GraphProto) -> set[str]:
    """IfSubgraphAdapter::GetSubgraphsAllInputs: tensors the branch's direct nodes read but neither produce nor hold
    as initializers (the branch's declared inputs are not subtracted)."""
    read = {t for n in branch.node for t in n.input}
    made = {t for n in branch.node for t in n.output}
    return read - made - {t.name for t in branch.initializer}


def _defined(graph: onnx.GraphProto) -> set[str]:
    """Tensors a graph holds itself: its inputs, initializers and node outputs."""
    return ({v.name for v in graph.input} | {t.name for t in graph.initializer}
            | {t for n in graph.node for t in n.output})
