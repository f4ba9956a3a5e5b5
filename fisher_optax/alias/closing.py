"""What closes every named optimizer: its docstring (the arguments all of them share,
the paper reference, a runnable example), :func:`finish` (decoupled weight decay, the
step size, the stacked layout, auto axes on explicit meshes and the routing of leaves),
and :func:`inject_hyperparams` with the arguments that must stay static. The family
modules above it are short chains of blocks; no math here."""

import functools
import inspect
from typing import Callable, Optional, Union

import jax
import optax

from fisher_optax import matrices, model_dims, owned_stacks, routing, stacking, validation
from fisher_optax.parallel import explicit_axes, owners


# Arguments that are never schedules: optax.inject_hyperparams takes any callable for one,
# so a callable mask or dims of the user's (or a dtype class) must stay static.
_NEVER_SCHEDULES = ("mask", "dims", "fallback", "state_dtype")


def inject_hyperparams(factory, *, static_args=(), hyperparam_dtype=None):
  """``optax.inject_hyperparams`` for a named optimizer, with its shape-fixing
  arguments (``factory.static_args``: rank, leading, iters) and its routing arguments
  (``mask``, ``dims``, ``fallback``, ``state_dtype``: callables there are rules, not
  schedules) marked static.

  Plain ``optax.inject_hyperparams(fo.X, static_args=...)`` works too, with the
  arguments each optimizer's docstring marks *static*; :func:`~fisher_optax.path_mask`
  and :func:`~fisher_optax.flax_dims` are not Python callables and pass through it, but
  a ``mask``/``dims`` function of your own (or a dtype class as ``state_dtype``) must be
  listed in ``static_args`` there, since optax calls every callable argument as a
  schedule."""
  names = set(inspect.signature(factory).parameters)
  static = tuple(set(static_args) | set(getattr(factory, "static_args", ()))
                 | (names & set(_NEVER_SCHEDULES)))
  return optax.inject_hyperparams(factory, static_args=static,
                                  hyperparam_dtype=hyperparam_dtype)


_PAPER = "Gong, Scetbon, Ma, Meeds 2025, arXiv:2502.07752"

_COMMON_ARGS = """\
    weight_decay: decoupled weight decay ``lambda`` on the structured leaves
      (``W <- W - lr * (direction + lambda * W)``, as ``optax.adamw``); a float or a
      schedule; default ``None``: no decay (the paper uses none). Any number, ``0.0``
      included, adds the decay step (stateless), so the state is the same with and
      without ``optax.inject_hyperparams``.
    mask: which leaves get the structured rule: a tree of bools, a callable on the
      params (e.g. :func:`~fisher_optax.path_mask`), or ``None`` (default: every
      2-D leaf whose sides are both > 1 and whose name is not a bias or norm scale;
      :func:`~fisher_optax.default_mask`). The others get ``fallback``.
      With ``optax.inject_hyperparams``, a function of your own here must be in its
      ``static_args`` (optax calls callables as schedules); a ``fo.path_mask`` is no
      callable and needs nothing.
    dims: which axes of each leaf are the matrix rows and columns
      (:class:`~fisher_optax.MatrixDims`, a tree or callable of them,
      :func:`~fisher_optax.flax_dims` for a Flax NNX model, or a tree of
      ``optax.contrib.MuonDimensionNumbers`` as ``optax.contrib.muon`` and MaxText take,
      ``None`` entries to the fallback); other axes are stacks of independent matrices. Default ``None``: 2-D leaves as ``(m, n)``, leaves with more
      dims to the fallback. A ``dims`` that does not fit its leaf (axes out of range, a
      ``MatrixDims`` given for a vector) raises a ``ValueError`` naming the leaf at
      ``init``. ``fo.flax_dims`` rules pass through ``optax.inject_hyperparams``; a
      function of your own must be in its ``static_args``.
    stack_matrices: run the structured rule on same-shape matrices stacked into one
      ``(k, m, n)`` array per shape (``fisher_optax.stacking``):
      the same per-matrix update, state stored per shape instead of per leaf, one
      batched kernel per shape instead of one per leaf, compile time flat in depth for
      models with one leaf per layer. ``True``, ``False`` or ``"auto"`` (default:
      stacked where ``jax.default_backend()`` is a GPU or TPU when the optimizer is
      built, per-leaf on CPU, as measured faster on each). The price: the update holds
      a transient copy of the routed matrix gradients (XLA temporary memory;
      +350-650 MiB on the 130M LLaMA). A state of the other layout is a
      ``ValueError`` that says which ``stack_matrices`` continues it;
      :func:`fisher_optax.convert_state_layout` converts it.
      Matrices that draw random numbers (switching, APOLLO) get other draws.
    owner_layout: where whole-matrix work runs under a mesh that shards the matrices
      (:func:`fisher_optax.owner_layout`): ``"auto"``, ``True``, ``False``, a
      ``jax.sharding.Mesh`` or a :class:`~fisher_optax.OwnerLayout` (e.g. bfloat16
      transport). On, the matrices that one Newton--Schulz iteration or refresh
      decomposition serves are handed out whole to owner devices (one all-to-all there
      and one back), each owner computes its own, and no device gathers a matrix; the
      update is the same and the state untouched. ``"auto"`` uses the context mesh
      (``jax.set_mesh``) when it has several devices, unless its axes are
      ``Explicit`` and the gradients are replicated; ``True`` the context mesh always; a
      mesh that mesh where no context mesh is set (for a ``jax.jit`` with shardings).
      SOAP, Shampoo and Eigen-Adam also keep their state on the owners from step to
      step (:class:`~fisher_optax.RotateOwnedState`, padded for the mesh's device
      count), so that their ordinary steps and refreshes send only the two exchanges:
      given a mesh, or with ``"auto"``/``True`` when the optimizer is built under a
      context mesh of several devices (its state's structure is then fixed when it is
      built; parameters visibly replicated over ``Explicit`` axes keep the per-leaf
      state). Default ``"auto"`` where it was measured to send less (Muon, NorMuon,
      SWAN, GaLore, Fira, Alice, Alice-0, APOLLO, APOLLO-mini, SOAP, Shampoo,
      Eigen-Adam; Alice-SOAP where each matrix's split is known or right to guess:
      ``Explicit`` axes, given ``param_specs``, or a mesh of one axis),
      ``False`` elsewhere (docs: "Sharding and multi-host training", Communication).
      Give the jitted step ``out_shardings`` for the state (``fo.state_shardings``) so
      that it keeps its layout from step to step. Each matrix travels from the split it
      has: read from the gradients' types on ``Explicit`` axes; on ``Auto`` axes pass
      ``fo.OwnerLayout(param_specs=...)`` (else it is guessed from the shape).
    fallback: transformation for the other leaves (default
      ``optax.adam(fallback_learning_rate)`` run in float32), e.g.
      ``optax.adamw(lr, weight_decay=0.1)``.
    fallback_learning_rate: learning rate (or schedule) of the default fallback; default
      ``None``: ``learning_rate``, the paper's setting for embeddings, norms and biases.
      The structured rule's learning rate is scaled inside it (``alpha``, a unit-RMS
      direction), so it can be 10-20x above Adam's usable range: when the fallback
      receives weight matrices (kernels with no ``dims``), give it Adam's own rate, e.g.
      ``1e-3`` (docs: "Your model")."""


_APOLLO_ARGS = """\
    b1: first-moment decay.
    b2: second-moment decay.
    eps: Adam's ``epsilon`` (release: 1e-6).
    limiter: norm-growth limit (release: 1.01); ``None`` disables it.
    seed: base seed of the projections."""


def _documented(example: str):
  """Completes a named optimizer's docstring: the arguments every named optimizer
  shares (``{common}`` in its Args), the paper reference, and a runnable example."""

  def wrap(fn):
    doc = fn.__doc__.replace("{common}", _COMMON_ARGS).replace("{apollo}", _APOLLO_ARGS)
    doc = doc.rstrip() + "\n\n  Returns:\n    An ``optax.GradientTransformationExtraArgs``.\n"
    doc += "\n  Example:\n" + "".join(f"    {line}\n" if line else "\n"
                                         for line in example.strip().splitlines())
    doc += f"\n  Reference:\n    {_PAPER}.\n"
    fn.__doc__ = doc
    return fn

  return wrap


_EXAMPLE = """\
>>> import jax, jax.numpy as jnp, optax
>>> import fisher_optax as fo
>>> params = {{"w": jnp.ones((8, 16)), "b": jnp.zeros((16,))}}
>>> tx = fo.{call}
>>> state = tx.init(params)
>>> grads = jax.tree.map(lambda p: jnp.full_like(p, 0.1), params)
>>> updates, state = tx.update(grads, state, params)
>>> params = optax.apply_updates(params, updates)
>>> params["w"].shape
(8, 16)"""


def _ex(call: str) -> str:
  return _EXAMPLE.format(call=call)


def finish(blocks: Callable[[matrices.DimsSpec], list], learning_rate, mask, dims, fallback,
            weight_decay=None, *, name: str = "structured", rank: Optional[int] = None,
            stack: Union[bool, str] = False, fallback_lr=None, owner=False,
            owned: bool = False):
  """Closes a chain: ``blocks(block_dims)``, decoupled weight decay on the structured
  leaves, then the step size; then the optional stacked layout, ``Auto`` axes under an
  ``Explicit`` mesh (:func:`fisher_optax.with_auto_axes`), the owner layout
  (``owner``, :func:`fisher_optax.owner_layout`) and the routing of leaves.

  ``blocks`` builds the optimizer's blocks for the matrix axes they see: the leaves'
  own ``dims``, or under ``stack`` (``stack_matrices=True``) the ``(k, fan_in,
  fan_out)`` stacks of :mod:`fisher_optax.stacking`, whose matrix axes are the last two.

  ``W <- W - lr * (direction + weight_decay * W)`` as in ``optax.adamw`` (Loshchilov &
  Hutter's decoupled decay, multiplied by the learning rate and its schedule). The decay
  applies to the leaves that get the structured rule (``mask``: matrices by default);
  the fallback (default ``optax.adam``) has none unless ``fallback`` brings its own,
  e.g. ``fallback=optax.adamw(lr, weight_decay=...)``.
  """
  validation.check_learning_rate("learning_rate", learning_rate)
  if fallback_lr is not None:
    validation.check_learning_rate("fallback_learning_rate", fallback_lr)
  if weight_decay is not None and not callable(weight_decay):
    validation.check_range("weight_decay", weight_decay, low=0.0, high=float("inf"))
  # ``None`` (not 0) means no decay, as in optax: then a traced weight decay under
  # ``optax.inject_hyperparams`` gives the same state structure as a Python number
  decay = [] if weight_decay is None else [optax.add_decayed_weights(weight_decay)]
  dims = model_dims.as_dims(dims)  # optax.contrib.MuonDimensionNumbers trees read here
  stack = stacking.resolve(stack)
  devices = _owned_devices(owner, owned, name, stack)
  if devices:  # the chain's state on the owners (fisher_optax.owned_stacks), no stacks
    stack = False
    layout = owners.as_layout(owner)
    structured = owned_stacks.owned_stacks(
        blocks, tail=[*decay, optax.scale_by_learning_rate(learning_rate)],
        devices=devices, dims=dims, param_specs=layout.param_specs,
        mesh=layout.mesh or jax.sharding.get_abstract_mesh(), rank=rank,
        summed=2.0 if name == "galore" else 3.0, asked=layout.state_on_owners is True,
        guess=_may_guess(layout))
  else:
    structured = optax.chain(*blocks(None if stack else dims), *decay,
                             optax.scale_by_learning_rate(learning_rate))
  if stack:
    structured = stacking.stack_matrices(structured, dims=dims)
  # under a context mesh with ``Explicit`` axes the structured rule runs on ``Auto`` axes;
  # the owner layout reads the explicit axes first (a replicated tree keeps its layout)
  structured = owners.owner_layout(explicit_axes.with_auto_axes(structured), owner)
  if fallback is not None and fallback_lr is not None:
    raise ValueError(f"fo.{name}: give fallback= or fallback_learning_rate=, not both (the "
                     "learning rate is part of the fallback transformation you pass)")
  if fallback is None:
    fallback_lr = learning_rate if fallback_lr is None else fallback_lr
    fallback = routing.in_float32(optax.adam(fallback_lr))
  return routing.route(structured, mask=mask, dims=dims, fallback=fallback,
                       info=dict(name=name, rank=rank, stack_matrices=stack,
                                 owner_mesh=getattr(owners.as_layout(owner), "mesh", None),
                                 owner_specs=getattr(owners.as_layout(owner), "param_specs",
                                                     None) is not None,
                                 owner_placed=bool(getattr(owners.as_layout(owner),
                                                           "state_placed", False)),
                                 owner_state_axes=getattr(owners.as_layout(owner),
                                                          "state_axes", None),
                                 owned_devices=devices))


def _owned_devices(owner, owned: bool, name: str, stack: bool = False) -> Optional[int]:
  """The device count the chain's state may be kept on the owners for
  (``OwnerLayout.state_on_owners``, by default ``"auto"``): the size of the layout's
  mesh, else of the context mesh when the optimizer is built; ``None`` where it is off,
  or for an optimizer that cannot keep it (``owned``: the low-rank family), or with no
  mesh of several devices to pad for, or (by default) where the split is not known when
  built on ``Auto`` axes of several and the matrices are stacked (``stack``); without
  stacking ``init`` then reads it from the parameters' boxes, else keeps the state as
  the parameters. Asked for (``True``) where it cannot be, it raises."""
  layout = owners.as_layout(owner)
  if layout is None or layout.state_on_owners is False:
    return None
  asked = layout.state_on_owners is True
  if not owned:
    if not asked:
      return None
    raise ValueError(
        f"fo.{name}: OwnerLayout(state_on_owners=True) keeps the low-rank family's state "
        "on the owners (galore, fira, alice, alice0, alice_soap). The rotation family "
        "(soap, shampoo, eigen_adam) keeps its state there when built under a mesh "
        "(owner_layout='auto' or a mesh); the others keep theirs as the parameters: "
        "leave state_on_owners out.")
  devices = owners.state_devices(layout)
  if devices == owners.AUTO:
    devices = owners.build_devices(layout.state_axes)
  if stack and not asked and not _may_guess(layout) and not getattr(
      layout.mesh or jax.sharding.get_abstract_mesh(), "explicit_axes", ()):
    # the split not known when built, on Auto axes of several (tensor parallelism):
    # init reads it from the boxes the parameters come in (Flax's recipes), else the
    # state stays as the parameters (a wrong guess reshuffles every moved matrix: tiny
    # LLaMA, FSDP 4 x TP 2 on 8 CPU devices, Alice 0.23x of the parameter bytes per
    # step on the owners with the split guessed, 0.20x laid out as the parameters,
    # 0.20x on the owners with it given). Where the matrices are stacked (GPU, TPU)
    # that per-leaf state is the stacked one, so it is decided here: stacked.
    return None
  if not devices:
    if not asked:
      return None
    raise ValueError(
        f"fo.{name}: OwnerLayout(state_on_owners=True) pads the state for the mesh's "
        "device count, and there is no mesh of several devices: build the optimizer "
        "under `with jax.set_mesh(mesh):`, or give OwnerLayout(mesh=mesh, "
        "state_on_owners=True).")
  return devices


def _may_guess(layout) -> bool:
  """Whether ``init`` may guess the matrices' split for the low-rank family's state on
  the owners, where neither ``param_specs`` nor the parameters' types give it: asked
  for, or on a mesh of one axis (FSDP's split)."""
  mesh = layout.mesh or jax.sharding.get_abstract_mesh()
  return (layout.state_on_owners is True or layout.param_specs is not None
          or owners._split_axes(mesh) < 2)


# Arguments that fix array shapes. optax.inject_hyperparams turns every numeric argument
# it is not told is static into a jax array; for these that cannot work, and without a
# check the failure surfaces deep inside JAX as a ConcretizationTypeError.
_SHAPE_ARGS = ("rank", "right_rank", "max_precond_dim")


def _check_static(fn: Callable) -> Callable:
  """``fn`` raising a ``ValueError`` that names the fix when a shape-fixing argument
  arrives as a jax array (``optax.inject_hyperparams`` without ``static_args``)."""
  sig = inspect.signature(fn)
  names = [n for n in _SHAPE_ARGS if n in sig.parameters]

  @functools.wraps(fn)
  def named_optimizer(*args, **kwargs):
    given = sig.bind_partial(*args, **kwargs).arguments
    arrays = [n for n in names if isinstance(given.get(n), jax.Array)]
    if arrays:
      name = fn.__name__
      raise ValueError(
          f"fo.{name}: {', '.join(f'`{n}`' for n in arrays)} arrived as a jax array, but "
          "fixes array shapes and must be a Python int. optax.inject_hyperparams turns "
          "every numeric argument not in its static_args into an array: use "
          f"optax.inject_hyperparams(fo.{name}, static_args={tuple(fn.static_args)!r}) or "
          f"fo.inject_hyperparams(fo.{name}), which marks them static.")
    return fn(*args, **kwargs)

  named_optimizer.static_args = fn.static_args
  return named_optimizer



def named(example: str, *, static_args: tuple = ()):
  """Declares a named optimizer: its docstring completed (:func:`_documented` with the
  example ``fo.<example>``), its shape-fixing arguments ``static_args`` (which
  :func:`inject_hyperparams` marks static), and a clear error when one of them arrives
  as a jax array (:func:`_check_static`)."""

  def wrap(fn):
    fn = _documented(_ex(example))(fn)
    fn.static_args = tuple(static_args)
    if any(n in inspect.signature(fn).parameters for n in _SHAPE_ARGS):
      fn = _check_static(fn)
    return fn

  return wrap

