"""What an optimizer's update becomes on a GPU, read from its lowering on a machine without one.

    python benchmarks/gpu_lowering.py [--preset 60M] [--optimizers racs,alice,galore]
                                      [--layout stacked] [--json FILE]

JAX lowers a jitted function for a platform it does not have
(``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))``): the StableHLO that the
GPU compiler would receive, ``platform_dependent`` resolved for the GPU and every
decomposition a call into cuSOLVER. Three things in that program decide how an update
runs on a GPU beyond its FLOPs and bytes (``benchmarks/cost_model.py``), and all three can
be read here:

- **Decompositions** (``custom_call`` into jaxlib's GPU solver). jaxlib runs some as one
  batched kernel call and others one matrix after another, by operand shape
  (:func:`gpu_execution`, from jaxlib's ``solver_kernels_ffi.cc``, 2026 sources):
  ``syevd`` (eigh) is batched only up to ``32 x 32`` (``syevjBatched``); ``potrf``
  (Cholesky) is batched; ``geqrf`` (QR) uses cuBLAS's batched QR when
  ``rows // batch <= 128`` and ``cols // batch <= 128``; ``orgqr``/``ormqr`` are batched
  up to ``128 x 128`` (jaxlib 0.10 and later); ``gesvd`` always loops, ``gesvdj`` is
  batched up to ``32 x 32``. Triangular solves are XLA's own batched cuBLAS ``trsm``.
- **Conditionals** (``stablehlo.case`` on a run-time value). XLA's GPU runtime copies each
  executed conditional's predicate to the host and waits for the stream before it
  launches a branch (``ConditionalThunk``; conditionals are not in XLA's default CUDA
  graph command types), so each one is a host synchronisation. Those outside every other
  conditional run on every step; those inside run only where their branch is taken
  (a refresh). Conditionals on constants (``platform_dependent``) fold away and are not
  counted.
- **Loops** (``stablehlo.while``). A loop whose bound is a constant has a trip count XLA
  computes, and its runtime then launches the body that many times without reading the
  condition (``WhileThunk`` with a known trip count); a loop with a run-time bound reads
  its condition on the host every iteration.

Per optimizer it prints the program as it trains (step counters are run-time values: its
host synchronisations on every step and its loops), then each kind of step alone -- the
first step, an ordinary step and a later refresh -- lowered with the state's step counters
fixed (as ``benchmarks/cost_model.py`` does), its refresh conditionals folded here to the
branch that step takes as XLA folds them, and the solver calls that step issues. No GPU is
needed, so this runs in CI and on any laptop; the device check
(``benchmarks/device_check.py``) measures what these counts predict.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax

DEFAULT_OPTIMIZERS = ("adam", "racs", "alice", "alice0", "galore", "fira", "apollo_mini",
                      "soap", "muon")

# a symbol is printed bare (``@main``) or quoted where it holds other characters
# (``@"<lambda>"``: a jitted lambda)
_SYM = r'(?:"(?P<{0}_q>[^"]+)"|(?P<{0}>[\w.$-]+))'
_FUNC = re.compile(r"^  func\.func (?:public |private )?@" + _SYM.format("name") + r"\(")
_LOC_DEF = re.compile(r"^#loc(?P<id>\d+) = (?P<body>.*)$")
_LOC_REF = re.compile(r"#loc(\d+)")
_TRAILING_LOC = re.compile(r"loc\((?P<ref>#loc\d+|\".*)\)\s*$")
_CASE = re.compile(r"\"stablehlo\.case\"\((?P<arg>%[\w#]+)\)")
_CALL = re.compile(r"(?<![\w.])(?:func\.)?call @" + _SYM.format("callee") + r"\(")


def _sym(match: re.Match, group: str) -> str:
  """The symbol of ``_SYM``'s ``group``, bare or quoted."""
  return match.group(group) or match.group(group + "_q")


_CUSTOM = re.compile(r"custom_call @(?P<target>\w+)\(.*?:\s*\((?P<operands>[^)]*)\)\s*->")
_TENSOR = re.compile(r"tensor<(?P<dims>(?:\d+x)*)(?P<dtype>\w+)>")


@dataclasses.dataclass(frozen=True)
class Decomposition:
  """One solver call of the update as the GPU runs it."""
  target: str          # jaxlib's FFI target, e.g. ``cusolver_syevd_ffi``
  shape: tuple         # the operand jaxlib dispatches on: ``(batch..., rows, cols)``
  execution: str       # ``batched``, ``per matrix`` (a loop over the batch) or ``single``
  calls: int           # solver calls issued per execution (the batch where it loops)
  when: str            # ``every step``, ``refresh``, ``first refresh only``


@dataclasses.dataclass(frozen=True)
class Loop:
  static_trip_count: bool
  when: str


@dataclasses.dataclass
class Audit:
  optimizer: str
  decompositions: list
  syncs_every_step: int       # run-time conditionals outside every other conditional
  syncs_at_refresh: int       # every run-time conditional (an upper bound at a refresh)
  loops: list
  # matrix products (``dot_general``) of the program as XLA compiles it (a function's
  # body once per call; a loop body once): ``(float32-pinned, when, signature)`` each,
  # the signature being the product's dimension numbers and operand and result types
  products: list = dataclasses.field(default_factory=list)

  def solver_calls(self, when: str) -> int:
    """Solver calls a step of kind ``when`` issues, one after another: a batched call
    counts once, a call jaxlib loops over its batch once per matrix."""
    return sum(d.calls for d in self.decompositions if d.when == when)

  def row(self) -> dict:
    return dict(optimizer=self.optimizer, syncs_every_step=self.syncs_every_step,
                syncs_at_refresh=self.syncs_at_refresh,
                loops_static=sum(lp.static_trip_count for lp in self.loops),
                loops_dynamic=sum(not lp.static_trip_count for lp in self.loops),
                solver_calls_every_step=self.solver_calls("every step"),
                solver_calls_refresh=self.solver_calls("refresh"),
                solver_calls_first_refresh=self.solver_calls("first refresh only"),
                products_float32=sum(p for p, _, _ in self.products),
                products_default=sum(not p for p, _, _ in self.products),
                products_float32_distinct=len({g for p, _, g in self.products if p}),
                decompositions=[dataclasses.asdict(d) for d in self.decompositions])


def gpu_execution(target: str, shape: tuple) -> tuple[str, int]:
  """``(execution, solver calls)`` of one jaxlib GPU solver call on an operand of
  ``shape`` (batch dimensions first): how jaxlib's dispatch runs it."""
  *batch_dims, rows, cols = shape
  batch = 1
  for b in batch_dims:
    batch *= b
  op = target.split("solver_")[-1].removesuffix("_ffi")
  if batch <= 1:
    return "single", 1
  if op == "syevd":
    return ("batched", 1) if cols <= 32 else ("per matrix", batch)
  if op == "potrf":
    return "batched", 1
  if op == "geqrf":
    return (("batched", 1) if rows // batch <= 128 and cols // batch <= 128
            else ("per matrix", batch))
  if op == "getrf":
    return (("batched", 1) if rows == cols and rows // batch <= 128
            else ("per matrix", batch))
  if op in ("orgqr", "ormqr"):
    return ("batched", 1) if rows <= 128 and cols <= 128 else ("per matrix", batch)
  if op == "gesvdj":
    return ("batched", 1) if rows <= 32 and cols <= 32 else ("per matrix", batch)
  return "per matrix", batch  # gesvd, gesdd, gesvdp, sytrd, ...


def _shapes(operands: str) -> list:
  return [tuple(int(d) for d in m.group("dims").split("x") if d)
          for m in _TENSOR.finditer(operands)]


def dispatch_shape(target: str, shapes: list) -> tuple:
  """The operand whose shape jaxlib's dispatch reads: ``C`` (the third) for ``ormqr``,
  the first otherwise."""
  if not shapes:
    return ()
  return shapes[2] if target.endswith("ormqr_ffi") and len(shapes) > 2 else shapes[0]


class _Locations:
  """``#locN`` aliases of a module printed with debug info, expanded on demand."""

  def __init__(self, lines):
    self._raw = {}
    for line in lines:
      m = _LOC_DEF.match(line)
      if m:
        self._raw[m.group("id")] = m.group("body")
    self._memo = {}

  def text(self, ref: str, limit: int = 20000) -> str:
    """The location ``ref`` (``#locN`` or an inline ``"name"(...)``) with every alias
    inside it expanded (cut at ``limit`` characters)."""
    key = ref[4:] if ref.startswith("#loc") else None
    if key is None:
      return _LOC_REF.sub(lambda m: self.text("#loc" + m.group(1), limit), ref)[:limit]
    if key not in self._memo:
      self._memo[key] = ""  # cycles: none in MLIR, but never recurse forever
      body = self._raw.get(key, "")
      self._memo[key] = _LOC_REF.sub(lambda m: self.text("#loc" + m.group(1), limit),
                                     body)[:limit]
    return self._memo[key]


@dataclasses.dataclass
class _Op:
  kind: str                  # custom, call, case, while
  detail: dict
  regions: list = dataclasses.field(default_factory=list)  # case branches; while cond, body


_SCALAR_CONST = re.compile(r"stablehlo\.constant dense<(?P<v>-?\d+|true|false)> : tensor<(?:i|ui)\d+>")
_BINARY = re.compile(r"stablehlo\.(?P<op>add|subtract|multiply|remainder|and|or|maximum|minimum)"
                     r" (?P<a>%[\w#]+), (?P<b>%[\w#]+) : tensor<(?:i|ui)\d+>")
_COMPARE = re.compile(r"stablehlo\.compare\s+(?P<dir>EQ|NE|LT|LE|GT|GE), (?P<a>%[\w#]+), "
                      r"(?P<b>%[\w#]+)(?:, \w+)? : \(tensor<(?:i|ui)\d+>")
_UNARY = re.compile(r"stablehlo\.(?P<op>convert|not) (?P<a>%[\w#]+) : \(?tensor<(?:i|ui)\d+>")
_SELECT = re.compile(r"stablehlo\.select (?P<p>%[\w#]+), (?P<a>%[\w#]+), (?P<b>%[\w#]+) : "
                     r"tensor<i1>, tensor<(?:i|ui)\d+>")
_CLAMP = re.compile(r"stablehlo\.clamp (?P<lo>%[\w#]+), (?P<x>%[\w#]+), (?P<hi>%[\w#]+) : "
                    r"tensor<(?:i|ui)\d+>")
_CASE_RETURN = re.compile(r"^\s*stablehlo\.return (?P<name>%[\w]+) : tensor<(?:i|ui)\d+>\s")
_DEF = re.compile(r"^\s*(?P<name>%[\w]+)(?::\d+)? = (?P<rhs>.*)$")


_CALL_RHS = re.compile(r"(?:func\.)?call @" + _SYM.format("callee") + r"\((?P<args>[^)]*)\)")
_RETURN = re.compile(r"^\s*(?:func\.)?return (?P<name>%[\w]+) : tensor<(?:i|ui)\d+>")


def _fold(name: str, defs: dict, funcs: dict, env=None, depth: int = 0):
  """The value of the scalar integer ``name`` where it is computed from constants alone
  (the step counters fixed at lowering), else ``None``: what XLA folds before it runs.
  ``funcs``: ``{function: (defs, returned name)}`` for calls (``jnp.remainder`` and
  ``jnp.where`` lower to private functions); ``env`` binds a callee's arguments."""
  env = env or {}
  if name in env:
    return env[name]
  rhs = defs.get(name)
  if rhs is None or depth > 60:
    return None
  sub = lambda n: _fold(n, defs, funcs, env, depth + 1)  # noqa: E731
  m = _SCALAR_CONST.match(rhs)
  if m:
    v = m.group("v")
    return {"true": 1, "false": 0}[v] if v in ("true", "false") else int(v)
  m = _BINARY.match(rhs)
  if m:
    a, b = sub(m.group("a")), sub(m.group("b"))
    if a is None or b is None or (m.group("op") == "remainder" and b == 0):
      return None
    op = m.group("op")
    if op == "remainder":  # truncated, as stablehlo.remainder
      return int(math.fmod(a, b))
    return {"add": a + b, "subtract": a - b, "multiply": a * b, "and": a & b, "or": a | b,
            "maximum": max(a, b), "minimum": min(a, b)}[op]
  m = _COMPARE.match(rhs)
  if m:
    a, b = sub(m.group("a")), sub(m.group("b"))
    if a is None or b is None:
      return None
    return int({"EQ": a == b, "NE": a != b, "LT": a < b, "LE": a <= b, "GT": a > b,
                "GE": a >= b}[m.group("dir")])
  m = _UNARY.match(rhs)
  if m:
    a = sub(m.group("a"))
    if a is None:
      return None
    return a if m.group("op") == "convert" else int(not a)
  m = _SELECT.match(rhs)
  if m:
    p = sub(m.group("p"))
    return None if p is None else sub(m.group("a") if p else m.group("b"))
  m = _CASE.match(rhs)
  if m and ("@case", name) in defs:  # a case whose branches return constants
    op = defs[("@case", name)]
    idx = sub(m.group("arg"))
    returns = op.detail.get("returns", {})
    if idx is None or not returns:
      return None
    return returns.get(idx if 0 <= idx < len(op.regions) else len(op.regions) - 1)
  m = _CLAMP.match(rhs)
  if m:
    lo, x, hi = sub(m.group("lo")), sub(m.group("x")), sub(m.group("hi"))
    return None if None in (lo, x, hi) else min(max(x, lo), hi)
  m = _CALL_RHS.match(rhs)
  if m and _sym(m, "callee") in funcs:
    args = [a.strip() for a in m.group("args").split(",") if a.strip()]
    values = [sub(a) for a in args]
    if any(v is None for v in values):
      return None
    cdefs, ret = funcs[_sym(m, "callee")]
    if ret is None:
      return None
    return _fold(ret, cdefs, funcs, {f"%arg{i}": v for i, v in enumerate(values)},
                 depth + 1)
  return None


def _parse_functions(lines) -> tuple[dict, dict]:
  """``{function: [ops]}``: the ops that matter here, nested in their case branches and
  loop regions; a case whose index folds to a constant records the branch it takes. A
  case or a call keeps its operands and the definitions before it, so that a case whose
  index is a function argument folds at the call site (:func:`audit_text`). Also returns
  the scalar definitions per function, what :func:`_fold` reads through calls."""
  funcs, scalars, cases = {}, {}, []
  body = None
  stack = []   # open regions: (brace level inside, kind, op, container)
  brace = 0
  defs = {}
  for line in lines:
    m = _FUNC.match(line)
    if m:
      body, stack, brace, defs = [], [], 0, {}
      fname = _sym(m, "name")
      funcs[fname] = body
      scalars[fname] = (defs, None)
    if body is None:
      continue
    here = stack[-1][3] if stack else body
    d = _DEF.match(line)
    if d:
      defs[d.group("name")] = d.group("rhs")
    r = _RETURN.match(line)
    if r and brace == 1:
      scalars[fname] = (defs, r.group("name"))
    stripped = re.sub(r'"(?:[^"\\]|\\.)*"', '""', line)
    before = brace
    brace += stripped.count("{") - stripped.count("}")
    s = line.strip()
    ret = _CASE_RETURN.match(line)
    if ret and stack and stack[-1][1] == "case" and brace == stack[-1][0]:
      op = stack[-1][2]
      op.detail.setdefault("returns", {})[len(op.regions) - 1] = _fold(
          ret.group("name"), defs, scalars)
    if s.startswith("}, {") and stack and stack[-1][1] == "case":
      op = stack[-1][2]
      op.regions.append([])
      stack[-1] = (stack[-1][0], "case", op, op.regions[-1])
      continue
    if s.startswith("} do {") and stack and stack[-1][1] == "while":
      op = stack[-1][2]
      op.regions.append([])
      stack[-1] = (stack[-1][0], "while", op, op.regions[-1])
      continue
    while stack and brace < stack[-1][0]:
      stack.pop()
    if brace <= 0 and s.startswith("}"):
      body = None
      continue
    case = _CASE.search(line)
    if case:
      op = _Op("case", dict(index=None), [[]])
      if d:
        defs[("@case", d.group("name"))] = op
      cases.append((op, case.group("arg"), dict(defs)))
      op.detail.update(arg=case.group("arg"), defs=cases[-1][2])
      here.append(op)
      stack.append((before + 1, "case", op, op.regions[0]))
      continue
    c = _SCALAR_CONST.search(line)
    if c and stack and stack[-1][1] == "while" and len(stack[-1][2].regions) == 1:
      stack[-1][2].detail["static"] = True  # a constant in the condition: a fixed bound
    for callm in _CALL.finditer(line):
      loc = _TRAILING_LOC.search(line)
      rhs = _CALL_RHS.search(line)
      args = ([a.strip() for a in rhs.group("args").split(",") if a.strip()]
              if rhs and _sym(rhs, "callee") == _sym(callm, "callee") else [])
      here.append(_Op("call", dict(callee=_sym(callm, "callee"),
                                   loc=loc.group("ref") if loc else "", args=args,
                                   defs=dict(defs))))
    cm = _CUSTOM.search(line)
    if cm:
      target = cm.group("target")
      here.append(_Op("custom", dict(
          target=target, shape=dispatch_shape(target, _shapes(cm.group("operands"))))))
    if "stablehlo.dot_general" in line:
      sig = re.search(r"stablehlo\.dot_general (%\S+), (%\S+), (.*?)(?:, precision = \[[A-Z, ]+\])?"
                      r"(?: algorithm = .*?)? : (.*?)(?: loc\(.*)?$", line)
      here.append(_Op("dot", dict(pinned="precision = [HIGHEST, HIGHEST]" in line,
                                  signature=(sig.group(3) + " : " + sig.group(4)) if sig
                                  else line.strip())))
    if "stablehlo.while(" in line:
      here.append(_Op("while", dict(static=False)))
    if s == "cond {":
      op = next(o for o in reversed(here) if o.kind == "while")
      op.regions.append([])
      stack.append((before + 1, "while", op, op.regions[0]))
    elif brace > before:  # another region (a reduction or sort body): same container
      stack.append((before + 1, "other", None, here))
  for op, arg, defs_then in cases:
    op.detail["index"] = _fold(arg, defs_then, scalars)
  return funcs, scalars


def audit_text(text: str, optimizer: str = "") -> Audit:
  """The audit of one module printed with ``as_text(debug_info=True)``. A case whose
  index is a constant after folding (``platform_dependent``; a step counter fixed at
  lowering, or passed as a constant argument to the function that holds the case)
  counts as its taken branch alone; every other case is a run-time conditional and all
  its branches are counted."""
  lines = text.splitlines()
  locs = _Locations(lines)
  funcs, scalars = _parse_functions(lines)
  decomps, loops, products = [], [], []
  counts = dict(every=0, total=0)

  def when_of(depth: int, where: str) -> str:
    if depth == 0:
      return "every step"
    return "first refresh only" if "first_from" in where else "refresh"

  def walk(ops, depth: int, where: str, stack: tuple, env: dict):
    """``env``: the constant arguments of the function being walked (``%argN``), as its
    call site passes them; XLA inlines the call and folds with them."""
    for op in ops:
      if op.kind == "case":
        idx = op.detail["index"]
        if idx is None and env:
          idx = _fold(op.detail["arg"], op.detail["defs"], scalars, env)
        if idx is not None:  # folded: the branch taken (out of range: the last)
          walk(op.regions[idx if 0 <= idx < len(op.regions) else -1], depth, where, stack,
               env)
          continue
        counts["total"] += 1
        counts["every"] += depth == 0
        for region in op.regions:
          walk(region, depth + 1, where, stack, env)
      elif op.kind == "while":
        loops.append(Loop(op.detail["static"], when_of(depth, where)))
        for region in op.regions:
          walk(region, depth, where, stack, env)
      elif op.kind == "dot":
        products.append((op.detail["pinned"], when_of(depth, where), op.detail["signature"]))
      elif op.kind == "custom":
        if "solver" not in op.detail["target"]:
          continue
        execution, calls = gpu_execution(op.detail["target"], op.detail["shape"])
        decomps.append(Decomposition(op.detail["target"], op.detail["shape"], execution,
                                     calls, when_of(depth, where)))
      elif op.kind == "call" and op.detail["callee"] not in stack:
        callee = op.detail["callee"]
        values = [_fold(a, op.detail["defs"], scalars, env) for a in op.detail["args"]]
        walk(funcs.get(callee, ()), depth, where + " " + locs.text(op.detail["loc"]),
             stack + (callee,), {f"%arg{i}": v for i, v in enumerate(values) if v is not None})

  walk(funcs.get("main", ()), 0, "", ("main",), {})
  return Audit(optimizer, decomps, counts["every"], counts["total"], loops, products)


def lowered_text(fn, *args, platform: str = "cuda") -> str:
  """``jax.jit(fn)`` lowered for ``platform`` on abstract ``args``, with locations."""
  traced = jax.jit(fn).trace(*args)
  return traced.lower(lowering_platforms=(platform,)).as_text(debug_info=True)


STEPS = ("first", "ordinary", "refresh")


def step_counts(name: str, preset: str) -> dict:
  """The step counter each kind of step reads: the first step (0), an ordinary step (1)
  and a refresh after the first (the refresh interval), for methods with a refresh."""
  from benchmarks import step_time
  interval = step_time.interval_of(name, preset)
  if interval <= 1:
    return {"ordinary": 0}
  return {"first": 0, "ordinary": 1, "refresh": interval}


def audit_optimizer(name: str, preset: str, *, layout: str = "stacked",
                    platform: str = "cuda", count=None, hparams: dict | None = None) -> Audit:
  """The GPU audit of ``name``'s update at ``preset``'s shapes (``layout``: ``stacked``,
  the library's default on GPUs, or ``per-leaf``). With ``count`` every step counter of
  the state is that constant, so the program is the one of that step: refresh
  conditionals fold to the branch it takes, as XLA folds them. ``hparams``: keywords of
  a fisher_optax optimizer (e.g. ``refresh="power_qr"``)."""
  from benchmarks import cost_model, step_time
  params, _ = step_time.abstract_params(preset)
  kw = {}
  if step_time._ours(name):  # noqa: SLF001 -- the benchmarks' own helper
    kw = dict(hparams or {}, stack_matrices=step_time.LAYOUTS[layout])
  tx = step_time.build(name, preset, **kw)
  state = jax.eval_shape(tx.init, params)
  if count is None:
    update = tx.update
  else:
    rebuild = cost_model.with_constant_counts(state, count)
    update = lambda g, s, p: tx.update(g, rebuild(s), p)  # noqa: E731
  return audit_text(lowered_text(update, params, state, params, platform=platform), name)


def _format_program(audit: Audit) -> str:
  r = audit.row()
  return (f"{audit.optimizer:12s} program   host syncs {r['syncs_every_step']} every step, up "
          f"to {r['syncs_at_refresh']} at a refresh; loops {r['loops_static']} fixed / "
          f"{r['loops_dynamic']} run-time trip count; matrix products "
          f"{r['products_float32']} float32-pinned ({r['products_float32_distinct']} distinct), "
          f"{r['products_default']} default")


def _format_step(audit: Audit, step: str) -> list[str]:
  total = sum(d.calls for d in audit.decompositions)
  out = [f"{audit.optimizer:12s} {step:9s} solver calls in sequence: {total}"]
  seen: dict = {}
  for d in audit.decompositions:
    key = (d.target, d.shape, d.execution, d.calls)
    seen[key] = seen.get(key, 0) + 1
  for (target, shape, execution, calls), n in seen.items():
    out.append(f"    {n} x {target} {'x'.join(map(str, shape))}: {execution}"
               f"{'' if calls == 1 else f' ({calls} calls)'}")
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--preset", default="60M")
  ap.add_argument("--optimizers", default=",".join(DEFAULT_OPTIMIZERS))
  ap.add_argument("--layout", default="stacked", choices=("stacked", "per-leaf"))
  ap.add_argument("--platform", default="cuda")
  ap.add_argument("--json", default=None, help="write the rows here")
  ap.add_argument("--hparams", type=json.loads, default=None,
                  help='keywords for every fisher_optax optimizer, e.g. \'{"refresh": '
                       '"power_qr"}\'')
  args = ap.parse_args(argv)
  rows = []
  print(f"# {args.preset}, {args.layout}, lowered for {args.platform} "
        f"(jax {jax.__version__})" + (f", {json.dumps(args.hparams)}" if args.hparams else ""))
  where = dict(preset=args.preset, layout=args.layout, platform=args.platform,
               hparams=args.hparams)
  for name in args.optimizers.split(","):
    # the program as it trains: step counters are run-time values
    program = audit_optimizer(name, args.preset, layout=args.layout, platform=args.platform,
                              hparams=args.hparams)
    print(_format_program(program), flush=True)
    rows.append(dict(program.row(), step="program", count=None, **where))
    # each kind of step alone: its conditionals folded to the branch it takes
    counts = step_counts(name, args.preset) if program.syncs_at_refresh else {"ordinary": 0}
    for step, count in counts.items():
      audit = audit_optimizer(name, args.preset, layout=args.layout,
                              platform=args.platform, count=count, hparams=args.hparams)
      print("\n".join(_format_step(audit, step)), flush=True)
      rows.append(dict(audit.row(), step=step, count=count, **where))
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(rows, indent=2))
  return rows


if __name__ == "__main__":
  main()
