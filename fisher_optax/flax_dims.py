"""Matrix views of a Flax model's parameters, read from its modules: NNX
(:func:`flax_dims`) and Linen (:func:`linen_dims`).

Both return a rule (:class:`FlaxDims`) that maps a tree of the model's parameters to how
each parameter is a matrix (:class:`~fisher_optax.MatrixDims`), that it is none
(:data:`~fisher_optax.NOT_A_MATRIX`: the named optimizers send it to their fallback), or
that the rule could not tell (:class:`~fisher_optax.Unclassified`: also the
fallback, but :func:`fisher_optax.describe` flags it and says why). Pass it as ``dims=``
to any named optimizer::

    tx = fo.alice(1e-2, dims=fo.flax_dims(model))                 # NNX
    tx = fo.alice(1e-2, dims=fo.linen_dims(module, x))            # Linen

The rule table (the module that owns a parameter decides; axes beyond what the module
declares are leading *layer* axes from ``nnx.vmap``/``nnx.scan``/``nn.scan``/``nn.vmap``,
batch axes of independent matrices). Rows are the fan-in (contracted) side, columns the
fan-out side:

===========================================  ==================================  ==========
parameter                                    matrix (rows x cols)                as in
===========================================  ==================================  ==========
``Linear``/``Dense`` kernel ``(in, out)``    ``in x out``                        Muon
``LinearGeneral``/``DenseGeneral`` kernel    in-feature axes x out-feature axes, optax's
(attention ``(in, heads, head_dim)``,        merged: ``in x heads*head_dim``,    Muon
output ``(heads, head_dim, out)``)           ``heads*head_dim x out``            dimension
                                                                                 numbers
``Einsum`` kernel (any module with an        from the spec: contracted axes x    Gemma
``einsum_str``, or a Linen module called     output axes (``fo.einsum_dims``)
with its equation, as ``gemma``'s),
e.g. ``"BTD,NDH->BTNH"``
``Conv``/``ConvTranspose`` kernel            ``kh*kw*cin x cout``                Shampoo
``(kh, kw, cin, cout)``                                                          for conv
``Embed`` embedding (also tied as the         ``EMBEDDING``: the fallback          the paper
output layer), and a 2-D parameter of any    (``overrides=`` routes it)          (Adam)
module whose class name holds ``Embed``
(Gemma's ``Embedder``, MaxText's ``Embed``)
biases, norm scales, any other parameter     ``NOT_A_MATRIX``                    fallback
of a known module
``kernel`` of another module that declares   in-feature axes x out-feature axes; MaxText
its features (``in_features_shape`` and      the other axes, wherever they sit,
``out_features_shape``, or ``in_features``   are layers (by shape; a tie broken
and ``out_features``)                        by their logical names)
a parameter whose logical axis names         the two other axes, in order        MaxText
(sharding metadata) call all but two of                                          MoE
its axes layers or experts
(``BATCH_AXIS_NAMES``)
a 2-D parameter of another module            its two axes, ``(in, out)``
a parameter of another module with more      ``Unclassified``: fallback, flagged
than two dims                                by ``describe``; route it with
                                             ``overrides=``
===========================================  ==================================  ==========

``overrides={path regex: MatrixDims or NOT_A_MATRIX}`` sets any parameter's entry by
hand (first matching pattern wins). :func:`fisher_optax.describe` prints the result leaf
by leaf, each matrix as fan-in x fan-out.
"""

from __future__ import annotations

from typing import Any, Optional

import jax

from fisher_optax import matrices, model_dims, routing


class FlaxDims(model_dims.ModelDims):
  """The ``dims=`` rule of one Flax model (built by :func:`flax_dims` for NNX and
  :func:`linen_dims` for Linen).

  Attributes:
    table: ``{"/"-joined parameter path: MatrixDims, NOT_A_MATRIX or Unclassified}``.
  """

  helper = "fo.flax_dims"


def _kernel_only(name: str, want: str, dims) -> Any:
  return dims if name == want else matrices.NOT_A_MATRIX


def _last_two(ndim: int):
  k = ndim - 2
  return matrices.MatrixDims(rows=k, cols=k + 1) if k >= 0 else matrices.NOT_A_MATRIX


def _general(ndim: int, n_batch: int, n_in: int, n_out: int):
  """Kernel ``layers + batch + in + out`` (Flax's LinearGeneral/DenseGeneral layout)."""
  k = ndim - (n_batch + n_in + n_out)
  if k < 0:
    return matrices.NOT_A_MATRIX
  first = k + n_batch
  return matrices.MatrixDims(rows=tuple(range(first, first + n_in)),
                             cols=tuple(range(first + n_in, first + n_in + n_out)))


def _conv(ndim: int, kernel_size):
  spatial = len(kernel_size) if isinstance(kernel_size, (tuple, list)) else 1
  k = ndim - (spatial + 2)
  if k < 0:
    return matrices.NOT_A_MATRIX
  return matrices.MatrixDims(rows=tuple(range(k, k + spatial + 1)), cols=k + spatial + 1)


def _einsum(spec: str, ndim: int, shape: Optional[tuple] = None):
  """The spec's view of a weight of ``ndim`` dims (``shape``, when known, for the stacked
  gate/up rule of :func:`~fisher_optax.einsum_dims`), shifted past the leading layer
  axes that ``nn.scan``/``nnx.vmap`` add in front of the spec's own."""
  operands = spec.replace(" ", "").split("->")[0].split(",")
  declared = len(operands[1]) if len(operands) == 2 else ndim
  k = ndim - declared
  own = None if shape is None or k < 0 else tuple(shape)[k:]
  d = model_dims.einsum_dims(spec, ndim if k < 0 else declared, shape=own)
  if isinstance(d, matrices.NotAMatrix) or k <= 0:
    return d
  shift = lambda axes: tuple(a + k for a in matrices.as_axes(axes))  # noqa: E731
  return matrices.MatrixDims(rows=shift(d.rows), cols=shift(d.cols))


def _len(x) -> int:
  return len(x) if isinstance(x, (tuple, list)) else 1


def _general_counts(module) -> tuple:
  """``(batch, in, out)`` axis counts of a LinearGeneral (NNX) or DenseGeneral (Linen)."""
  if hasattr(module, "in_features"):  # nnx.LinearGeneral
    return (len(getattr(module, "batch_axis", {}) or {}), _len(module.in_features),
            _len(module.out_features))
  return _len(module.batch_dims or ()), _len(module.axis), _len(module.features)


def _layer_dims(lib, module, name: str, ndim: int, shape: Optional[tuple] = None):
  """Dims of parameter ``name`` (``ndim`` dims) of ``module``, a layer of ``lib`` (NNX or
  Linen: the same layers under two names), or ``None`` if the module type is unknown."""
  linear = getattr(lib, "Linear", None) or lib.Dense
  general = getattr(lib, "LinearGeneral", None) or lib.DenseGeneral
  if isinstance(module, linear):
    return _kernel_only(name, "kernel", _last_two(ndim))
  if isinstance(module, general):
    return _kernel_only(name, "kernel", _general(ndim, *_general_counts(module)))
  if isinstance(module, lib.Einsum):
    return _kernel_only(name, "kernel", _einsum(module.einsum_str, ndim, shape))
  if isinstance(module, (lib.Conv, lib.ConvTranspose)):
    return _kernel_only(name, "kernel", _conv(ndim, module.kernel_size))
  if isinstance(module, lib.Embed):
    return _kernel_only(name, "embedding", matrices.EMBEDDING)
  norms = tuple(getattr(lib, n) for n in ("LayerNorm", "RMSNorm", "BatchNorm", "GroupNorm")
                if hasattr(lib, n))
  if isinstance(module, norms):
    return matrices.NOT_A_MATRIX
  return None


# Logical axis names (a ``Param``'s sharding metadata) of axes that index independent
# matrices: scanned layers (``nnx.scan``/``nn.scan``'s partition name, MaxText's
# ``"layers"``), pipeline stages, mixture-of-experts experts (MaxText's ``"exp"``).
BATCH_AXIS_NAMES = ("layers", "layer", "stage", "stages", "exp", "expert", "experts",
                    "num_experts")


def _is_batch_name(name) -> bool:
  return isinstance(name, str) and name in BATCH_AXIS_NAMES


def _declared_features(module) -> Optional[tuple]:
  """``(in_shape, out_shape)`` a DenseGeneral-like module declares (MaxText's
  ``in_features_shape``/``out_features_shape``, or ``in_features``/``out_features`` as
  ints or tuples of ints), else ``None``."""
  for a, b in (("in_features_shape", "out_features_shape"), ("in_features", "out_features")):
    i, o = getattr(module, a, None), getattr(module, b, None)
    i = (i,) if isinstance(i, int) else i
    o = (o,) if isinstance(o, int) else o
    if (isinstance(i, (tuple, list)) and isinstance(o, (tuple, list)) and i and o
        and all(isinstance(n, int) for n in tuple(i) + tuple(o))):
      return tuple(i), tuple(o)
  return None


def _declared_general(shape: tuple, features: tuple, names: Optional[tuple]):
  """A kernel ``in_shape + out_shape`` with extra layer axes anywhere (MaxText scans its
  layers at axis 1): the extra axes are found by shape, ties broken by their logical
  names; ``None`` when the shape does not hold the declared features, ``Unclassified``
  when it holds them in several ways."""
  import itertools
  in_shape, out_shape = features
  want = in_shape + out_shape
  k = len(shape) - len(want)
  if k < 0:
    return None
  found = []
  for extra in itertools.combinations(range(len(shape)), k):
    rest = [a for a in range(len(shape)) if a not in extra]
    if tuple(shape[a] for a in rest) == want:
      found.append((extra, tuple(rest[:len(in_shape)]), tuple(rest[len(in_shape):])))
  if names is not None and len(names) == len(shape) and len(found) > 1:
    named = [f for f in found if all(_is_batch_name(names[a]) for a in f[0])]
    found = named or found
  views = {(r, c) for _, r, c in found}
  if not views:
    return None
  if len(views) > 1:
    return matrices.Unclassified(
        f"kernel of shape {shape} holds its declared features {in_shape} -> {out_shape} "
        "in several ways (layer axes of the same size); give its dims with "
        "overrides={path regex: fo.MatrixDims(rows=..., cols=...)}")
  rows, cols = views.pop()
  return matrices.MatrixDims(rows=rows, cols=cols)


def _other_module(module, path, ndim: int, shape: tuple = (), names: Optional[tuple] = None,
                  equations: frozenset = frozenset()):
  """A parameter of a module no rule knows: an einsum spec it carries; a kernel of the
  input and output features the module declares (a DenseGeneral of another library,
  layer axes anywhere); the axes left once those its logical names call layers or
  experts are set aside, when two; else its two axes when 2-D; else unclassified."""
  spec = getattr(module, "einsum_str", None) if module is not None else None
  if isinstance(spec, str) and ndim >= 2:
    return _einsum(spec, ndim, shape)
  if equations and ndim >= 2:  # equations the module was called with
    views = {_einsum(e, ndim, shape) for e in equations}
    if len(views) == 1:
      return views.pop()
    return matrices.Unclassified(
        f"{type(module).__name__} was called with einsum equations {sorted(equations)} that "
        "read its weight in different ways; give its dims with overrides=")
  if routing.is_vector_name(path) or ndim < 2:
    return matrices.NOT_A_MATRIX
  features = _declared_features(module) if module is not None else None
  if features is not None and matrices.path_to_str(path).rsplit("/", 1)[-1] == "kernel":
    d = _declared_general(tuple(shape), features, names)
    if d is not None:
      return d
  if names is not None and len(names) == ndim and ndim > 2:
    rest = tuple(a for a in range(ndim) if not _is_batch_name(names[a]))
    if len(rest) == 2:
      return matrices.MatrixDims(rows=rest[0], cols=rest[1])
  if ndim == 2 and module is not None and "Embed" in type(module).__name__:
    return matrices.EMBEDDING  # an embedding table of another library (Gemma's Embedder)
  if ndim == 2:
    return matrices.MatrixDims()
  owner = type(module).__name__ if module is not None else "no module"
  return matrices.Unclassified(
      f"{ndim}-D parameter of {owner}, a module the rule does not know; give its "
      "dims with overrides={path regex: fo.MatrixDims(rows=..., cols=...)}")


def _import_flax(part: str):
  try:
    if part == "nnx":
      from flax import nnx as mod
    else:
      from flax import linen as mod
  except ImportError as e:
    raise ImportError("fo.flax_dims and fo.linen_dims read Flax models and need flax: "
                      "pip install 'fisher-optax[flax]'") from e
  return mod


def _owner_key(owners: dict, key: str) -> Optional[str]:
  """The path of the innermost module in ``owners`` that holds parameter ``key``."""
  parts = key.split("/")
  for c in range(len(parts) - 1, -1, -1):
    if owners.get("/".join(parts[:c])) is not None:
      return "/".join(parts[:c])
  return None


def _leaves(tree: Any):
  """``(path, shape, logical names)`` of every parameter of ``tree``, read through Flax's
  boxes (``nnx.Variable``'s ``out_sharding``, ``nn.Partitioned``'s ``names``)."""
  from fisher_optax.parallel import variables
  boxes = variables.box_types()
  is_box = lambda x: bool(boxes) and isinstance(x, boxes)  # noqa: E731
  for path, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_box)[0]:
    names = variables.names(x) if is_box(x) else None
    yield path, tuple(getattr(variables.value(x) if is_box(x) else x, "shape", ())), names


def _rule(lib, owners: dict, tree: Any, helper: str, overrides: Optional[dict],
          on_unmatched: str, equations: Optional[dict] = None) -> FlaxDims:
  """The rule table of ``tree``'s parameters: each read by the module of ``owners``
  (``{module path: module}``) that holds it (:func:`_layer_dims`, else
  :func:`_other_module` with its logical names and the einsum equations the module was
  called with), then ``overrides``."""
  table, ndims = {}, {}
  for path, shape, names in _leaves(tree):
    key = matrices.path_to_str(path)
    owner_key = _owner_key(owners, key)
    module = None if owner_key is None else owners[owner_key]
    ndims[key] = len(shape)
    d = (_layer_dims(lib, module, key.split("/")[-1], len(shape), tuple(shape))
         if module is not None else None)
    eqs = (equations or {}).get(key) or (equations or {}).get(owner_key, ())
    table[key] = d if d is not None else _other_module(
        module, path, len(shape), shape, names, frozenset(eqs))
  return FlaxDims(model_dims.apply_overrides(table, overrides, helper, ndims, on_unmatched))


def _equations(args, kwargs) -> set:
  """The einsum equations among a call's arguments (the official ``gemma`` package's
  ``Einsum`` takes its equation at call time: ``self.q_einsum('BTD,NDH->BTNH', x)``)."""
  return {a for a in list(args) + list(kwargs.values())
          if isinstance(a, str) and "->" in a and "," in a.split("->", 1)[0]}


def _not_nnx(model: Any) -> Optional[str]:
  """Why ``model`` is no NNX module (a message naming the right helper), or ``None``."""
  try:
    from flax import linen as nn
  except ImportError:  # pragma: no cover - flax is checked by the caller
    nn = None
  if nn is not None and isinstance(model, nn.Module):
    return ("fo.flax_dims reads a Flax NNX model; this is a Linen module: use "
            "fo.linen_dims(module, *example_inputs), which traces module.init on them")
  if isinstance(model, dict) or type(model).__name__ == "FrozenDict":
    return ("fo.flax_dims reads a Flax NNX model, not a parameter dict: a dict cannot tell "
            "a layer stack from an attention or conv kernel. For a Linen model use "
            "fo.linen_dims(module, *example_inputs); for plain arrays give "
            "fo.MatrixDims(...) per leaf (a tree of them)")
  if type(model).__module__.startswith("equinox") or any(
      c.__module__.startswith("equinox") for c in type(model).__mro__):
    return "fo.flax_dims reads a Flax NNX model; for an Equinox model use fo.equinox_dims(model)"
  return f"fo.flax_dims reads a Flax NNX model (an nnx.Module), got {type(model).__name__}"


def flax_dims(model: Any, *, overrides: Optional[dict] = None,
              on_unmatched: str = "raise") -> FlaxDims:
  """The :class:`MatrixDims` (or :data:`NOT_A_MATRIX`) of every parameter of an NNX
  ``model``, as a ``dims=`` rule (:class:`FlaxDims`) that maps any tree whose paths are
  the model's parameter paths -- ``nnx.state(model, nnx.Param)``, its pure-dict form, or
  the masked trees inside ``optax.partition`` -- to the dims of its leaves.

  ``nnx.Einsum`` kernels (and those of any module carrying an ``einsum_str``, as
  Gemma's) are read from their spec (:func:`~fisher_optax.einsum_dims`). A
  parameter the rule cannot classify goes to the fallback as
  :class:`~fisher_optax.Unclassified`: :func:`~fisher_optax.describe` flags it
  and the rule's ``unclassified`` lists it.

  The rule is not a Python callable, so it passes through
  ``optax.inject_hyperparams`` (which takes callables for schedules) unchanged.

  Args:
    model: an ``nnx.Module``.
    overrides: ``{path regex: MatrixDims or NOT_A_MATRIX}``, applied over the module
      rules (first matching pattern wins); an override that does not fit a leaf it
      matches raises a ``ValueError`` here.
    on_unmatched: a pattern of ``overrides`` that matches no path: ``"raise"`` (default:
      a typo would leave the rule unchanged), ``"warn"`` or ``"ignore"`` (one overrides
      dict for several models), as :func:`~fisher_optax.path_mask`'s.

  Raises:
    TypeError: ``model`` is a Linen module, a parameter dict or an Equinox model (the
      message names the helper for it).
    ImportError: flax is not installed (the ``flax`` extra installs it).
  """
  nnx = _import_flax("nnx")
  if not isinstance(model, nnx.Module):
    raise TypeError(_not_nnx(model))
  owners = {matrices.path_to_str(path): module for path, module in nnx.iter_graph(model)
            if isinstance(module, nnx.Module)}
  return _rule(nnx, owners, nnx.state(model, nnx.Param), "fo.flax_dims", overrides,
               on_unmatched)


def linen_dims(module: Any, *example_inputs: Any, overrides: Optional[dict] = None,
               on_unmatched: str = "raise", method: Any = None,
               **example_kwargs: Any) -> FlaxDims:
  """:func:`flax_dims` for a Flax Linen ``module``: the dims of every parameter, read
  from the layers that own them.

  The layers are found by tracing ``module.init`` on ``example_inputs`` with
  ``jax.eval_shape`` (nothing is computed or allocated): Dense, DenseGeneral (any
  ``axis``, ``features`` and ``batch_dims``), Einsum, Conv, ConvTranspose, Embed, the
  DenseGenerals inside MultiHeadDotProductAttention, and layers stacked by
  ``nn.scan``/``nn.vmap`` (their leading axes are batch axes). The rule resolves the
  ``params`` collection (``variables["params"]``, a ``TrainState``'s ``params``) and the
  whole variables dict alike.

  Args:
    module: an unbound ``flax.linen.Module``.
    *example_inputs: arguments of its ``__call__`` (arrays or ``jax.ShapeDtypeStruct``).
    overrides: as in :func:`flax_dims`.
    on_unmatched: as in :func:`flax_dims`.
    method: the method to trace instead of ``__call__`` (as ``Module.init``'s).
    **example_kwargs: keyword arguments of the call.

  Raises:
    TypeError: ``module`` is no Linen module.
  """
  nn = _import_flax("linen")
  if not isinstance(module, nn.Module):
    raise TypeError(f"fo.linen_dims reads a Flax Linen module, got {type(module).__name__}"
                    + ("; for an NNX model use fo.flax_dims(model)"
                       if type(module).__module__.startswith("flax.nnx") else ""))
  owners: dict = {}
  equations: dict = {}

  def record(fn, args, kwargs, context):
    key = "/".join(context.module.path)
    owners.setdefault(key, context.module)
    # a module naming its weight (gemma's Einsum(weight_name=...), which shares its
    # parent's scope with nn.share_scope) gets its equations by that parameter's path
    weight = getattr(context.module, "weight_name", None)
    where = "/".join(p for p in (key, weight) if p) if isinstance(weight, str) else key
    equations.setdefault(where, set()).update(_equations(args, kwargs))
    return fn(*args, **kwargs)

  init = lambda: module.init(jax.random.key(0), *example_inputs, method=method,  # noqa: E731
                             **example_kwargs)
  # under jax.disable_jit the bodies of nn.jit modules run at every trace: nn.jit caches
  # its traced body, so a second trace with the same shapes (or one after module.init)
  # would not call the submodules and the interceptor would see none of them
  with nn.intercept_methods(record), jax.disable_jit():
    variables = jax.eval_shape(init)
  return _rule(nn, owners, variables.get("params", {}), "fo.linen_dims", overrides,
               on_unmatched, equations)
