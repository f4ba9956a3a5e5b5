"""What each device sends per optimizer update under a sharded layout, read from the
compiled program.

    python benchmarks/collectives.py [--preset tiny] [--devices 8]
                                     [--layout fsdp|fsdp_tp|hsdp|dp]
                                     [--optimizers adam,racs,alice,...] [--json FILE]
                                     [--owner-layout default|on|off|mesh|state|leaf|replicas|
                                                     replica-state]
                                     [--time N]

The update (``tx.update`` under ``jax.jit`` with the parameters' ``NamedSharding`` s and
the state's from ``fo.state_shardings``) is compiled on abstract shapes of a LLaMA
preset for ``--devices`` CPU devices (``XLA_FLAGS`` is set here, before JAX starts), and
its HLO after SPMD partitioning (``compiled.as_text()``) is read:

* every collective -- ``all-gather``, ``reduce-scatter``, ``all-reduce``, ``all-to-all``,
  ``collective-permute`` (and their ``-start`` forms) -- with its result shape and its
  replica-group size ``g`` (read in each of XLA's spellings of replica groups) and the
  mesh axes its groups span;
* bytes each device sends, with ring algorithms: all-gather ``out (g-1)/g``,
  reduce-scatter ``out (g-1)``, all-reduce ``2 x bytes (g-1)/g``, all-to-all
  ``bytes (g-1)/g``, collective-permute ``bytes``;
* loops (``while``) multiply their body by XLA's known trip count; a ``conditional``
  counts its cheapest branch on an **ordinary** step and its dearest on a **refresh**
  step (the refreshes are the conditionals' expensive branches);
* the update's temporary memory per device (``memory_analysis``);
* the optimizer state one device holds, laid out by ``fo.state_shardings`` (padding of
  state kept on owner devices included).

Each figure is reported against the model's parameter bytes, beside the yardstick: the
LLaMA example's gradient computation under the same layout (``train step``: FSDP's own
parameter gathers and gradient reductions). Layouts: ``fsdp`` (every
matrix sharded on its larger axis over all devices, on the other where the larger does not
divide), ``fsdp_tp`` (Megatron tensor
parallelism over 2 devices -- q/k/v/gate/up column-parallel, o/down row-parallel, the
embedding and output layer over the vocabulary -- and FSDP over the rest on the other
axis), ``hsdp`` (data-parallel replicas of FSDP: a ``("data", "fsdp")`` mesh of 2 x
``devices / 2``, every matrix split over ``fsdp`` as ``fsdp`` splits it and replicated
over ``data``) and ``dp`` (replicated parameters: nothing to send). On a mesh of several
axes each row is followed by the bytes per set of mesh axes the collectives' groups
span (``data``, ``fsdp``, ``data+fsdp``, ...). The optimizers are the LLaMA
example's (``benchmarks/step_time.py``): ``adam`` is ``optax.adam``, ``muon``
``optax.contrib.muon``, ``fo_muon`` the library's Muon; the library's run in the
per-leaf layout, their state sharded as ``fo.state_shardings`` gives it, the optimizer
built and the update traced under the mesh as the context mesh (``jax.set_mesh``);
``--owner-layout`` sets their
``owner_layout`` (default: each optimizer's own default; ``off``: every matrix's work
where its shards are, as before the owner layout; ``state``: GaLore's, Fira's, Alice's,
Alice-0's and Alice-SOAP's state on the owners, ``fo.OwnerLayout(state_on_owners=True)``; ``leaf``:
theirs laid out as the parameters under the owner layout, ``state_on_owners=False``;
the others at their default; ``replicas``: the whole-matrix work of an update spread
over the mesh axes every parameter is replicated over too,
``fo.OwnerLayout(across_replicas=True)``, which only a ``hsdp`` layout with the split
known tells from the default; ``replica-state``: the state kept on the owners within
each data-parallel replica, ``fo.OwnerLayout(state_axes=...)`` naming the mesh's axes
other than ``data``, which only ``hsdp`` tells from the default). ``--time N`` also runs
each compiled update ``N`` times on random arrays on the CPU devices and prints its median time and
ratio to ``optax.adam``'s in the same process (on a CPU "devices" share the cores: a
check that the layout costs no time there, not a prediction for accelerators).
``--top N`` lists where the bytes come from: the ``N`` largest sources of an ordinary and
of a refresh step, each the JAX operation that issued the collective (the ``op_name``
XLA keeps in the program's metadata, e.g. ``jit(update)/jit(project)/dot_general``: a
product that GSPMD partitioned with a reduction), loops and branches counted as in the
totals.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import re
import sys
from typing import Optional

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------------------- parser

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
               "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
               "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_OP = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s+([a-z][a-z\-]*)\((.*)$")
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\dm\d(?:fn)?)?)\[([\d,]*)\]")


def shape_bytes(text: str) -> int:
  """Bytes of an HLO shape (a tuple sums its elements): ``f32[4,8]{1,0}`` -> 128."""
  total = 0
  for dtype, dims in _ARRAY.findall(text):
    if dtype not in DTYPE_BYTES:
      continue
    total += DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
  return total


# XLA's mesh spelling of replica groups: the mesh's axes, optionally the device ids in
# its positions (an iota ``[2,4]T(1,0)`` or a list), and the axes a group spans
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]"
                          r"(?:,\s*device_ids=\((\[[\d,]+\](?:T\([\d,]+\))?|[\d,\s]+)\))?"
                          r"\s*\{([^}]*)\}")


def _ids(spec: str, n: int) -> list:
  """Device ids in positions ``0..n-1`` from a ``device_ids`` spelling: an iota
  ``[d0,d1,..]`` optionally ``T(p0,p1,..)``, or a list."""
  m = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", spec.strip())
  if not m:
    return [int(x) for x in spec.split(",") if x.strip()]
  ids = np.arange(n).reshape([int(d) for d in m.group(1).split(",")])
  if m.group(2):
    ids = ids.transpose([int(p) for p in m.group(2).split(",")])
  return [int(i) for i in ids.reshape(-1)]


def group_size(attrs: str, num_devices: int) -> int:
  """Size of a collective's replica groups, in any of XLA's three spellings:
  ``{{0,1,2,3},{4,5,6,7}}``, ``[2,4]<=[8]`` (groups x size) and
  ``mesh['a'=2,'b'=4] {'b'}`` (the product of the named axes; also with the devices
  placed on that mesh, ``mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0)) {'a'}``); empty:
  every device."""
  m = re.search(r"replica_groups=\{\{([\d,\s]*)\}", attrs)
  if m:
    return len([x for x in m.group(1).split(",") if x.strip()])
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", attrs)
  if m:
    return int(m.group(2))
  m = _MESH_GROUPS.search(attrs)
  if m:
    sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
    return math.prod(int(sizes[a]) for a in re.findall(r"'([^']+)'", m.group(3)))
  return num_devices


def _iota_group(attrs: str) -> Optional[list]:
  """The first replica group of the iota spelling ``[G,S]<=[d0,d1,..]T(p0,p1,..)``
  (the device ids :func:`_ids` reads, cut into ``G`` groups of ``S``)."""
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=(\[[\d,]+\](?:T\([\d,]+\))?)", attrs)
  if not m:
    return None
  size = int(m.group(2))
  return _ids(m.group(3), int(m.group(1)) * size)[:size]


def first_group(attrs: str, num_devices: int) -> list:
  """The device ids of a collective's first replica group (the one holding device 0),
  in any of the spellings :func:`group_size` reads."""
  m = re.search(r"replica_groups=\{\{([\d,\s]*)\}", attrs)
  if m:
    return [int(x) for x in m.group(1).split(",") if x.strip()]
  got = _iota_group(attrs)
  if got is not None:
    return got
  m = _MESH_GROUPS.search(attrs)
  if m:
    sizes = [(a, int(n)) for a, n in re.findall(r"'([^']+)'=(\d+)", m.group(1))]
    named = set(re.findall(r"'([^']+)'", m.group(3)))
    n = math.prod(k for _, k in sizes)
    ids = np.asarray(_ids(m.group(2), n) if m.group(2) else np.arange(n)).reshape(
        [k for _, k in sizes])
    index = tuple(slice(None) if a in named else 0 for a, _ in sizes)
    return [int(i) for i in ids[index].reshape(-1)]
  return list(range(num_devices))


def group_axes(attrs: str, num_devices: int, mesh_shape: Optional[dict]) -> str:
  """The mesh axes a collective's group spans (``"data+fsdp"``), the device ids read
  as positions in the mesh (``mesh_shape``: axis name -> size, in order; the
  benchmark's meshes take the devices in id order); ``""`` without a mesh."""
  if not mesh_shape:
    return ""
  coords = [np.unravel_index(d, tuple(mesh_shape.values()))
            for d in first_group(attrs, num_devices)]
  return "+".join(a for i, a in enumerate(mesh_shape)
                  if len({c[i] for c in coords}) > 1)


def sent_bytes(kind: str, result_bytes: int, g: int) -> float:
  """Bytes one device sends for one collective (ring algorithms)."""
  if g <= 1:
    return 0.0
  if kind == "all-gather":
    return result_bytes * (g - 1) / g
  if kind == "reduce-scatter":
    return result_bytes * (g - 1)
  if kind == "all-reduce":
    return 2 * result_bytes * (g - 1) / g
  if kind == "all-to-all":
    return result_bytes * (g - 1) / g
  return float(result_bytes)  # collective-permute


@dataclasses.dataclass
class Traffic:
  """Bytes sent and collectives issued, per kind."""
  sent: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
  count: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(KINDS, 0))
  # bytes per (kind, the JAX operation that issued it: the op_name XLA keeps)
  by_source: dict = dataclasses.field(default_factory=dict)
  # bytes per set of mesh axes the collectives' groups span ("fsdp", "data+fsdp")
  by_axes: dict = dataclasses.field(default_factory=dict)

  @property
  def total(self) -> float:
    return sum(self.sent.values())

  @property
  def collectives(self) -> int:
    return sum(self.count.values())

  def add(self, other: "Traffic", times: float = 1) -> None:
    for k in KINDS:
      self.sent[k] += other.sent[k] * times
      self.count[k] += int(other.count[k] * times)
    for key, b in other.by_source.items():
      self.by_source[key] = self.by_source.get(key, 0.0) + b * times
    for key, b in other.by_axes.items():
      self.by_axes[key] = self.by_axes.get(key, 0.0) + b * times

  def largest(self, n: int) -> list:
    """The ``n`` largest sources: ``(bytes, kind, op_name)``, loops and branches counted
    as in the totals."""
    return sorted(((b, k, name) for (k, name), b in self.by_source.items()),
                  reverse=True)[:n]


@dataclasses.dataclass
class _Comp:
  own: Traffic
  calls: list  # (computation, times)
  whiles: list  # (body, condition, trip count)
  conds: list   # [branch computations]


def source_name(op_name: str) -> str:
  """An ``op_name`` as a source of traffic: the names XLA joins when it combines
  collectives (``a/(b:c:b)``) listed once each (``a/[b + c]``)."""
  if "/(" not in op_name or not op_name.endswith(")"):
    return op_name
  head, inner = op_name.split("/(", 1)
  return head + "/[" + " + ".join(dict.fromkeys(inner[:-1].split(":"))) + "]"


def _parse(text: str, num_devices: int, mesh_shape: Optional[dict] = None
           ) -> tuple[dict, str]:
  comps, entry, cur = {}, None, None
  for line in text.splitlines():
    m = _COMP.match(line)
    if m and not line.startswith(" "):
      cur = _Comp(Traffic(), [], [], [])
      comps[m.group(1)] = cur
      if line.startswith("ENTRY"):
        entry = m.group(1)
      continue
    if cur is None:
      continue
    op = _OP.match(line)
    if not op:
      continue
    shape, kind, rest = op.groups()
    base = kind[:-len("-start")] if kind.endswith("-start") else kind
    if base in KINDS and not kind.endswith("-done"):
      result = shape
      if kind.endswith("-start") and shape.startswith("("):
        # (operand(s), result) of an async start: the result is the last element
        parts = _ARRAY.findall(shape)
        result = "{}[{}]".format(*parts[-1]) if parts else shape
      g = group_size(rest, num_devices)
      b = sent_bytes(base, shape_bytes(result), g)
      cur.own.sent[base] += b
      cur.own.count[base] += 1 if g > 1 else 0
      name = re.search(r'op_name="([^"]*)"', rest)
      key = (base, source_name(name.group(1)) if name else "")
      cur.own.by_source[key] = cur.own.by_source.get(key, 0.0) + b
      if b:
        axes = group_axes(rest, num_devices, mesh_shape)
        cur.own.by_axes[axes] = cur.own.by_axes.get(axes, 0.0) + b
    if kind == "while":
      body = re.search(r"body=%?([\w.\-]+)", rest).group(1)
      cond = re.search(r"condition=%?([\w.\-]+)", rest).group(1)
      trip = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', rest)
      cur.whiles.append((body, cond, int(trip.group(1)) if trip else None))
    elif kind == "conditional":
      m = re.search(r"branch_computations=\{([^}]*)\}", rest)
      if m:
        branches = [b.strip().lstrip("%") for b in m.group(1).split(",")]
      else:
        branches = [re.search(rf"{w}_computation=%?([\w.\-]+)", rest).group(1)
                    for w in ("true", "false")]
      cur.conds.append(branches)
    else:
      for ref in re.findall(r"(?:to_apply|calls)=%?([\w.\-]+)", rest):
        cur.calls.append((ref, 1))
  return comps, entry


def traffic(text: str, num_devices: int, *, refresh: bool,
            mesh_shape: Optional[dict] = None) -> tuple[Traffic, list]:
  """The program's traffic per device on an ordinary step (``refresh=False``: each
  conditional's cheapest branch) or a refresh step (its dearest); also the loops whose
  trip count XLA could not tell (counted once). ``mesh_shape`` (axis name -> size, in
  the mesh's order): also the bytes per set of mesh axes the groups span
  (``Traffic.by_axes``)."""
  comps, entry = _parse(text, num_devices, mesh_shape)
  unknown: list = []
  memo: dict = {}

  def total(name: str) -> Traffic:
    if name in memo:
      return memo[name]
    c = comps.get(name)
    out = Traffic()
    if c is None:
      return out
    out.add(c.own)
    for ref, times in c.calls:
      out.add(total(ref), times)
    for body, cond, trip in c.whiles:
      if trip is None:
        unknown.append(body)
      out.add(total(body), trip or 1)
      out.add(total(cond), (trip or 1) + 1)
    for branches in c.conds:
      options = [total(b) for b in branches]
      out.add((max if refresh else min)(options, key=lambda t: t.total))
    memo[name] = out
    return out

  return total(entry), unknown


# ----------------------------------------------------------------------------- layouts


def layout_specs(params, layout: str, devices: int):
  """``PartitionSpec`` per leaf of the LLaMA parameters for ``layout`` on the mesh
  :func:`make_mesh` builds."""
  import jax
  from jax.sharding import PartitionSpec as P

  fsdp = devices if layout == "fsdp" else devices // 2
  fsdp_like = layout in ("fsdp", "hsdp")

  def spec(path, x):
    key = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
    shape = x.shape
    if layout == "dp" or len(shape) < 2:
      return P()
    if fsdp_like:
      # the larger axis, else the other where the larger does not divide the devices
      entries = [None] * len(shape)
      for a in sorted(range(len(shape)), key=lambda a: -shape[a]):
        if shape[a] % fsdp == 0:
          entries[a] = "fsdp"
          break
      return P(*entries)
    # fsdp_tp: Megatron column/row parallel on "tensor", FSDP on the other axis
    if any(n in key for n in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head")):
      return P("fsdp", "tensor")      # (in, out): columns split
    if any(n in key for n in ("o_proj", "down_proj")):
      return P("tensor", "fsdp")      # rows split
    if "embed" in key:
      return P("tensor", "fsdp")      # (vocab, hidden)
    return P()

  return jax.tree_util.tree_map_with_path(spec, params)


def make_mesh(layout: str, devices: int, axis_types: str = "auto"):
  """The benchmark's mesh: ``("fsdp", "tensor")`` of ``devices // 2 x 2`` for ``fsdp_tp``,
  else ``("fsdp",)``; its axes ``Auto`` (as ``jax.sharding.Mesh`` makes them) or
  ``Explicit`` (as ``jax.make_mesh`` does by default), where the gradients' split is
  part of their types."""
  import jax
  import numpy as np
  from jax.sharding import AxisType, Mesh
  devs = np.array(jax.devices()[:devices])
  kind = AxisType.Explicit if axis_types == "explicit" else AxisType.Auto
  if layout == "fsdp_tp":
    return Mesh(devs.reshape(devices // 2, 2), ("fsdp", "tensor"), axis_types=(kind,) * 2)
  if layout == "hsdp":
    return Mesh(devs.reshape(2, devices // 2), ("data", "fsdp"), axis_types=(kind,) * 2)
  return Mesh(devs, ("fsdp",), axis_types=(kind,))


OWNER = {"default": None, "on": True, "off": False, "mesh": "mesh", "state": "state",
         "leaf": "leaf", "replicas": "replicas", "replica-state": "replica-state"}
# the optimizers that keep their state on the owners with OwnerLayout(state_on_owners=True)
STATE_ON_OWNERS = ("galore", "fira", "alice", "alice0", "alice_soap")


def _keywords(name: str) -> dict:
  """The keyword parameters of the library's named optimizer ``name`` (none for optax's)."""
  import inspect
  import fisher_optax as fo
  fn = getattr(fo, {"fo_muon": "muon"}.get(name, name), None)
  return {} if fn is None else dict(inspect.signature(fn).parameters)


def _default_owner_layout(name: str):
  """The named optimizer's own ``owner_layout`` default."""
  param = _keywords(name).get("owner_layout")
  return "auto" if param is None else param.default


def build(name: str, preset: str, owner: str = "default", mesh=None, param_specs=None,
          max_precond_dim: int | None = None):
  """The LLaMA example's optimizer ``name`` for ``preset`` (``muon`` is
  ``optax.contrib.muon``, ``fo_muon`` the library's), the library's in the per-leaf
  layout (``stack_matrices=False``) with ``owner_layout`` as ``owner`` says (``default``:
  the optimizer's own default; ``mesh``: the mesh itself, with which the rotation
  family keeps its state in the owner layout across steps). ``param_specs``: the
  parameters' specs, given to the owner layout (``fo.OwnerLayout(param_specs=...,
  state_placed=True)``: the state is placed as ``fo.state_shardings`` places it on the
  mesh) wherever it is on. ``max_precond_dim``: the rotation family's largest rotated
  side, for the optimizers that take it (the named optimizer's default otherwise)."""
  import fisher_optax as fo
  from benchmarks import step_time
  kw = {}
  if step_time._ours(name):
    kw = dict(stack_matrices=False)
    setting = OWNER[owner]
    if setting in ("state", "leaf"):  # the low-rank family's state on the owners, or
      # laid out as the parameters under the owner layout; the others' default
      setting = (fo.OwnerLayout(state_on_owners=setting == "state")
                 if name in STATE_ON_OWNERS else None)
    if setting is None and param_specs is not None:
      setting = _default_owner_layout(name)
    if setting == "mesh":
      setting = mesh
    if setting == "replicas":
      setting = fo.OwnerLayout(across_replicas=True)
    if setting == "replica-state":
      setting = fo.OwnerLayout(state_axes=tuple(n for n in mesh.axis_names if n != "data"))
    if param_specs is not None and setting is not False:
      layout = fo.parallel.owners.as_layout(setting)
      # the state is placed by fo.state_shardings on the mesh (measure()): said so
      setting = fo.OwnerLayout(mesh=layout.mesh, transport_dtype=layout.transport_dtype,
                               replicated=layout.replicated, param_specs=param_specs,
                               state_placed=True, state_on_owners=layout.state_on_owners,
                               across_replicas=layout.across_replicas,
                               state_axes=layout.state_axes)
    if setting is not None:
      kw["owner_layout"] = setting
    if max_precond_dim is not None and "max_precond_dim" in _keywords(name):
      kw["max_precond_dim"] = max_precond_dim
  return step_time.build(name, preset, 1e-3, **kw)


def time_update(compiled, params, state, p_sh, s_sh, repeats: int) -> float:
  """Median seconds of one ordinary step of the compiled update on random arrays laid out
  as its inputs: the state carried from step to step, from a step count of zero (the
  first step, a refresh, among the two warm-up runs)."""
  import time
  import jax
  import jax.numpy as jnp
  import numpy as np
  key = iter(jax.random.split(jax.random.PRNGKey(0), 4096))
  real = lambda t, sh: jax.tree.map(  # noqa: E731
      lambda x, s: jax.device_put(jax.random.normal(next(key), x.shape, jnp.float32)
                                  .astype(x.dtype) * 0.02
                                  if jnp.issubdtype(x.dtype, jnp.floating)
                                  else jnp.zeros(x.shape, x.dtype), s), t, sh)
  g, st, p = real(params, p_sh), real(state, s_sh), real(params, p_sh)
  times = []
  for i in range(repeats + 2):
    t0 = time.perf_counter()
    st = jax.block_until_ready(compiled(g, st, p))[1]
    if i >= 2:
      times.append(time.perf_counter() - t0)
  return float(np.median(times))


def boxed(params, names):
  """``params`` in Linen's ``nn.Partitioned`` boxes named by ``names`` (a tree of
  ``PartitionSpec`` s or name tuples of the same structure), as ``nn.with_partitioning``
  makes them; NNX's ``nnx.with_partitioning`` names its ``nnx.Variable`` s alike."""
  import jax
  from jax.sharding import PartitionSpec
  from flax.core import meta
  is_names = lambda x: isinstance(x, (PartitionSpec, tuple))  # noqa: E731
  flat, treedef = jax.tree.flatten(params)
  return treedef.unflatten([
      meta.Partitioned(x, names=tuple(s) + (None,) * (len(x.shape) - len(s)))
      for x, s in zip(flat, jax.tree.leaves(names, is_leaf=is_names))])


def _boxed_init(tx, params, specs, mesh) -> tuple:
  """``init`` of the parameters in boxes named by their specs (:func:`boxed`), under the
  mesh, as the Flax recipes call it: the abstract state and the shardings of the names
  its own boxes carry."""
  import jax
  from jax.sharding import NamedSharding, PartitionSpec
  from flax.core import meta
  from fisher_optax.parallel import variables
  with jax.set_mesh(mesh):
    named = jax.eval_shape(tx.init, boxed(params, specs))
  is_box = lambda x: isinstance(x, meta.Partitioned)  # noqa: E731
  shardings = jax.tree.map(
      lambda x: NamedSharding(mesh, PartitionSpec(*x.names) if is_box(x) else PartitionSpec()),
      named, is_leaf=is_box)
  return variables.unwrap(named), shardings


def measure(name: str, preset: str, layout: str, devices: int, owner: str = "default",
            repeats: int = 0, top: int = 0, axis_types: str = "auto",
            max_precond_dim: int | None = None, donate: bool = False) -> dict:
  """One optimizer's update: bytes sent per device on an ordinary and a refresh step,
  collectives, temporary memory, each also as a ratio to the parameter bytes.
  ``donate``: the state donated to the update (``donate_argnums``), as the LLaMA
  example's training step donates it; the new state then takes the old one's buffers,
  and what XLA needs beside them shows as temporary memory."""
  import jax
  from jax.sharding import NamedSharding
  import fisher_optax as fo
  from benchmarks import step_time

  params, _ = step_time.abstract_params(preset)
  mesh = make_mesh(layout, devices, axis_types)
  specs = layout_specs(params, layout, devices)
  with jax.set_mesh(mesh):  # built under the mesh, as a sharded program is set up
    tx = build(name, preset, owner, mesh, specs if axis_types == "given" else None,
               max_precond_dim)
  p_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                      is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  with_sh = lambda t, sh: jax.tree.map(  # noqa: E731
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), t, sh)
  if axis_types == "boxes" and step_time._ours(name):  # optax's own read no boxes
    state, s_sh = _boxed_init(tx, params, specs, mesh)
  elif axis_types == "arrays" and step_time._ours(name):
    # init of concrete arrays placed by the specs (jax.device_put), as a plain jax.jit
    # program sets them up; the state laid out as fo.state_shardings says
    import jax.numpy as jnp
    tx.init(jax.device_put(jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), params),
                           p_sh))
    s_sh = fo.state_shardings(tx, params, specs, mesh)
    state = jax.eval_shape(tx.init, params)
  else:
    s_sh = fo.state_shardings(tx, params, specs, mesh)
    state = jax.eval_shape(tx.init, params)
    if axis_types == "explicit":  # init reads the split from the types, as a sharded
      with jax.set_mesh(mesh):    # init under the mesh does
        state = jax.eval_shape(tx.init, with_sh(params, p_sh))
  step = jax.jit(tx.update, in_shardings=(p_sh, s_sh, p_sh), out_shardings=(p_sh, s_sh),
                 donate_argnums=(1,) if donate else ())
  with jax.set_mesh(mesh):  # the context mesh, as a sharded program runs
    compiled = step.lower(with_sh(params, p_sh), with_sh(state, s_sh),
                          with_sh(params, p_sh)).compile()
  text = compiled.as_text()
  param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  ordinary, unknown = traffic(text, devices, refresh=False, mesh_shape=dict(mesh.shape))
  refresh, _ = traffic(text, devices, refresh=True, mesh_shape=dict(mesh.shape))
  temp = compiled.memory_analysis().temp_size_in_bytes
  # the optimizer state one device holds, laid out as fo.state_shardings says
  state_bytes = sum(math.prod(sh.shard_shape(x.shape)) * x.dtype.itemsize
                    for x, sh in zip(jax.tree.leaves(state), jax.tree.leaves(
                        s_sh, is_leaf=lambda z: isinstance(z, NamedSharding))))
  seconds = (time_update(compiled, params, state, p_sh, s_sh, repeats) if repeats
             else None)
  extra = ({} if max_precond_dim is None or "max_precond_dim" not in _keywords(name)
           else dict(max_precond_dim=max_precond_dim))
  if donate:  # the bytes of the state whose buffers the new state takes over
    extra.update(donated=True, alias_bytes=compiled.memory_analysis().alias_size_in_bytes)
  return dict(optimizer=name, preset=preset, layout=layout, devices=devices,
              owner_layout=owner, axis_types=axis_types, **extra, param_bytes=param_bytes,
              update_seconds=seconds,
              ordinary_bytes=ordinary.total, refresh_bytes=refresh.total,
              ordinary_ratio=ordinary.total / param_bytes,
              refresh_ratio=refresh.total / param_bytes,
              ordinary_collectives=ordinary.collectives,
              refresh_collectives=refresh.collectives,
              by_kind_refresh={k: v / param_bytes for k, v in refresh.sent.items() if v},
              # bytes per set of mesh axes the collectives span ("data": between the
              # data-parallel replicas of hsdp)
              by_axes_ordinary={k: v / param_bytes for k, v in ordinary.by_axes.items()},
              by_axes_refresh={k: v / param_bytes for k, v in refresh.by_axes.items()},
              largest_ordinary=[(b / param_bytes, k, n) for b, k, n in ordinary.largest(top)],
              largest_refresh=[(b / param_bytes, k, n) for b, k, n in refresh.largest(top)],
              temp_bytes=temp, temp_ratio=temp / param_bytes,
              state_bytes_per_device=state_bytes,
              state_ratio=state_bytes / param_bytes,
              loops_without_trip_count=len(unknown))


def measure_train_step(preset: str, layout: str, devices: int) -> dict:
  """The yardstick: the LLaMA example's gradient computation under the same layout, a
  batch of one sequence per device split over the ``fsdp`` axis (replicated over
  ``tensor``, as Megatron's activations): FSDP's own traffic, parameters gathered for the
  forward and backward passes and gradients reduced, plus tensor parallelism's."""
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx
  from jax.sharding import NamedSharding, PartitionSpec as P
  from benchmarks import step_time
  from examples.llama import presets
  from examples.llama.model import Llama

  cfg = presets.model_config(preset)
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Llama(cfg, nnx.Rngs(0))))
  params, _ = step_time.abstract_params(preset)
  mesh = make_mesh(layout, devices)
  specs = layout_specs(params, layout, devices)
  p_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                      is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  # data parallel over fsdp (and data); replicated over tensor
  batch = NamedSharding(mesh, P(("data", "fsdp") if layout == "hsdp" else "fsdp"))

  def loss(p, tokens):
    state = nnx.State(abstract)
    state.replace_by_pure_dict(p)
    logits = nnx.merge(graphdef, state)(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  tokens = jax.ShapeDtypeStruct((devices, cfg.context + 1), jnp.int32, sharding=batch)
  with_sh = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                         params, p_sh)
  compiled = jax.jit(jax.grad(loss), out_shardings=p_sh).lower(with_sh, tokens).compile()
  param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  t, _ = traffic(compiled.as_text(), devices, refresh=False, mesh_shape=dict(mesh.shape))
  return dict(optimizer="train step (yardstick)", preset=preset, layout=layout,
              devices=devices, param_bytes=param_bytes, ordinary_bytes=t.total,
              refresh_bytes=t.total, ordinary_ratio=t.total / param_bytes,
              refresh_ratio=t.total / param_bytes, ordinary_collectives=t.collectives,
              refresh_collectives=t.collectives,
              by_axes_ordinary={k: v / param_bytes for k, v in t.by_axes.items()},
              temp_bytes=compiled.memory_analysis().temp_size_in_bytes,
              temp_ratio=compiled.memory_analysis().temp_size_in_bytes / param_bytes)


DEFAULT = ("adam", "racs", "galore", "fira", "alice", "alice0", "alice_soap", "apollo",
           "apollo_mini", "soap", "eigen_adam", "shampoo", "fo_muon", "swan", "dion",
           "normuon", "muon")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--preset", default="tiny")
  ap.add_argument("--devices", type=int, default=8)
  ap.add_argument("--layout", default="fsdp", choices=("fsdp", "fsdp_tp", "hsdp", "dp"))
  ap.add_argument("--optimizers", default=",".join(DEFAULT))
  ap.add_argument("--owner-layout", default="default", choices=tuple(OWNER),
                  help="the library's owner_layout: each optimizer's default, on, off, "
                  "the mesh itself (the rotation family's state in the owner layout), or "
                  "state (the low-rank family's state on the owners: "
                  "OwnerLayout(state_on_owners=True)), leaf (theirs laid out as the "
                  "parameters: state_on_owners=False), replicas (an update's "
                  "whole-matrix work spread over data-parallel replicas too: "
                  "OwnerLayout(across_replicas=True)), or replica-state (the state on "
                  "the owners within each replica: OwnerLayout(state_axes=...))")
  ap.add_argument("--time", type=int, default=0, metavar="N",
                  help="also run each compiled update N times on random arrays (median "
                       "seconds, and the ratio to optax.adam's in this process)")
  ap.add_argument("--top", type=int, default=0, metavar="N",
                  help="also list each update's N largest sources of traffic on an "
                       "ordinary and a refresh step: the JAX operation (op_name) that "
                       "issued each collective, with its bytes / parameter bytes")
  ap.add_argument("--axis-types", default="auto",
                  choices=("auto", "explicit", "given", "boxes", "arrays"),
                  help="the mesh's axis types: Auto (jax.sharding.Mesh's default; the "
                       "owner layout guesses each matrix's split from its shape), "
                       "Explicit (jax.make_mesh's default; it reads the split from the "
                       "gradients' types), Auto with the parameters' specs given to "
                       "the owner layout (fo.OwnerLayout(param_specs=..., "
                       "state_placed=True)), or Auto with init given the parameters in "
                       "boxes named by their specs, as the Flax recipes give them (the "
                       "state laid out by its boxes' names), or Auto with init given "
                       "concrete arrays placed by their specs (jax.device_put)")
  ap.add_argument("--max-precond-dim", type=int, default=None, metavar="N",
                  help="the rotation family's largest rotated side (SOAP, Shampoo, "
                       "Eigen-Adam: max_precond_dim; each optimizer's default otherwise)")
  ap.add_argument("--donate", action="store_true",
                  help="donate the state to the update, as the LLaMA example's training "
                       "step does (the temporary memory is then what XLA needs beside the "
                       "state's own buffers)")
  ap.add_argument("--json", default=None, help="write the rows to this file")
  ap.add_argument("--no-train-step", action="store_true",
                  help="leave out the yardstick (the LLaMA example's FSDP gradient step)")
  args = ap.parse_args(argv)
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={args.devices}").strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.path.insert(0, str(ROOT))
  rows = []
  axes = {"auto": "Auto axes", "explicit": "Explicit axes",
          "given": "Auto axes, specs given",
          "boxes": "Auto axes, parameters in named boxes",
          "arrays": "Auto axes, init of placed arrays"}[args.axis_types]
  print(f"{args.preset}, {args.layout}, {args.devices} devices, {axes}, "
        f"owner layout {args.owner_layout}: bytes sent per device per update / parameter bytes")
  print(f"{'optimizer':<12} {'ordinary':>9} {'refresh':>9} {'collectives':>12} {'temp':>7} "
        f"{'state':>7}")
  names = args.optimizers.split(",")
  if args.time and "adam" not in names:
    names = ["adam"] + names  # the yardstick of the time ratios
  if args.layout != "dp" and not args.no_train_step:
    names = ["train_step"] + names
  for name in names:
    try:
      r = (measure_train_step(args.preset, args.layout, args.devices) if name == "train_step"
           else measure(name, args.preset, args.layout, args.devices, args.owner_layout,
                        args.time, args.top, args.axis_types, args.max_precond_dim,
                        args.donate))
    except Exception as e:  # noqa: BLE001 - JAX's ShardingTypeError is not public
      if type(e).__name__ != "ShardingTypeError":
        raise
      # an operation whose sharding is ambiguous on Explicit axes (optax.contrib.muon's
      # Newton--Schulz product of a tensor-parallel matrix)
      print(f"{name:<12} does not trace: {type(e).__name__}: {str(e).splitlines()[0]}")
      rows.append(dict(optimizer=name, error=f"{type(e).__name__}: {e}".splitlines()[0]))
      continue
    name = "train step" if name == "train_step" else name
    rows.append(r)
    timed = ""
    if r.get("update_seconds") is not None:
      adam = next((q["update_seconds"] for q in rows if q["optimizer"] == "adam"), None)
      r["time_ratio_to_adam"] = r["update_seconds"] / adam if adam else None
      timed = f"  {r['update_seconds'] * 1e3:8.2f} ms" + (
          f" {r['time_ratio_to_adam']:6.2f}x adam" if adam else "")
    print(f"{name:<12} {r['ordinary_ratio']:>8.3f}x {r['refresh_ratio']:>8.3f}x "
          f"{r['ordinary_collectives']:>5} / {r['refresh_collectives']:<5} "
          f"{r['temp_ratio']:>6.2f}x " + (f"{r['state_ratio']:>6.2f}x" if "state_ratio" in r
                                           else f"{'':>7}")
          + ("  *" if r.get("loops_without_trip_count") else "")
          + timed, flush=True)
    if args.layout in ("fsdp_tp", "hsdp"):  # which mesh axes the bytes travel over
      print("    by mesh axes: " + "; ".join(
          f"{step} " + ", ".join(f"{a or 'none'} {v:.3f}x" for a, v in sorted(
              r.get(f"by_axes_{step}", {}).items()))
          for step in ("ordinary", "refresh") if f"by_axes_{step}" in r))
    for step in ("ordinary", "refresh") if args.top and name != "train step" else ():
      for ratio, kind, source in r[f"largest_{step}"]:
        print(f"    {step:<8} {ratio:>8.4f}x  {kind:<18} {source or '(no op_name)'}")
  if any(r.get("loops_without_trip_count") for r in rows):
    print("* a loop with a run-time trip count, counted once: the figure is a lower bound")
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
  return rows


if __name__ == "__main__":
  main()
