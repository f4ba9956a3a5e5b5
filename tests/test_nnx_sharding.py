"""The Flax NNX sharding recipe with the named optimizers: a model whose parameters carry
their sharding names (``nnx.with_partitioning``), created under ``nnx.jit`` with
``nnx.Optimizer``, its state constrained by ``nnx.get_partition_spec`` -- on a 4-device
FSDP mesh and an 8-device FSDP x tensor mesh. Every state leaf carries the names of its
own shape (those of ``fo.state_partition_specs``), the state is sharded, and the updates
are one device's."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

import fisher_optax as fo
from fisher_optax.parallel import sharding as fo_sharding
from tests import registry, util

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (CPU) devices")

# parameter names on the FSDP x tensor mesh; on the FSDP mesh "tensor" is left out
# (w1 is FSDP-sharded on its smaller side, w2 on its larger)
NAMES = {"embed": ("tensor", "fsdp"), "w1": ("fsdp", "tensor"), "w2": ("fsdp", "tensor"),
         "stack": (None, "fsdp", "tensor"), "b1": ("fsdp",)}


def _names(key, axes):
  return tuple(n if n in axes else None for n in NAMES[key])


class Model(nnx.Module):
  """Embedding, a dense layer with bias, a stack of two matrices ``(2, 16, 32)`` and an
  output layer; every parameter made with ``nnx.with_partitioning``."""

  def __init__(self, axes, rngs):
    init = nnx.initializers.normal(0.3)
    # one device: the same model without names (Flax needs a mesh to create named ones)
    part = lambda key, f=init: nnx.with_partitioning(f, _names(key, axes)) if axes else f  # noqa: E731
    self.embed = nnx.Embed(32, 16, embedding_init=part("embed"), rngs=rngs)
    self.w1 = nnx.Linear(16, 32, kernel_init=part("w1"), bias_init=part("b1", nnx.initializers.zeros),
                         rngs=rngs)
    self.stack = nnx.Param(part("stack")(rngs.params(), (2, 16, 32)))
    self.w2 = nnx.Linear(32, 16, use_bias=False, kernel_init=part("w2"), rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    h = jnp.tanh(self.w1(x))
    for i in range(2):
      h = h + jnp.tanh(x @ self.stack[i])
    return self.w2(h) @ self.embed.embedding.T


def _loss(model, tokens):
  logits = model(tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def _tokens(t):
  return jax.random.randint(jax.random.PRNGKey(50 + t), (8, 9), 0, 32)


def _optimizer(name):
  return registry.make(name, full_rank_bases=True)


def _train(name, mesh, steps=3):
  """The recipe of Flax's sharding guide; returns the model's parameters after ``steps``
  and the optimizer."""
  axes = mesh.axis_names if mesh is not None else ()

  @nnx.jit
  def create():
    model = Model(axes, nnx.Rngs(0))
    opt = nnx.Optimizer(model, _optimizer(name), wrt=nnx.Param)
    state = nnx.state(opt)
    if mesh is not None:
      state = jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state))
    nnx.update(opt, state)
    return model, opt

  @nnx.jit
  def step(model, opt, tokens):
    grads = nnx.grad(_loss)(model, tokens)
    opt.update(model, grads)

  def run():
    model, opt = create()
    for t in range(steps):
      step(model, opt, _tokens(t))
    return model, opt

  if mesh is None:
    model, opt = run()
  else:
    with jax.set_mesh(mesh):
      model, opt = run()
  return nnx.state(model, nnx.Param), opt


def _meshes():
  return {"fsdp4": Mesh(np.array(jax.devices()[:4]), ("fsdp",)),
          "fsdp4xtensor2": Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("fsdp", "tensor"))}


def _spec_of(x):
  return tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))


def _want_specs(name, mesh):
  """What ``fo.state_partition_specs``' rules give the state of the same model's plain
  arrays, for an update that reads the state's layout from its boxes (as the recipe's
  does: the boxes name this mesh's axes)."""
  with jax.set_mesh(mesh):
    model = nnx.eval_shape(lambda: Model(mesh.axis_names, nnx.Rngs(0)))
  params = nnx.state(model, nnx.Param)
  pure = nnx.as_pure(params)
  specs = jax.tree.map(lambda v: P(*v.get_metadata("out_sharding")), params,
                       is_leaf=lambda x: isinstance(x, nnx.Variable))
  with jax.set_mesh(mesh):  # built where the recipe builds it (the rotation family's
    tx = _optimizer(name)   # state is then on the owners)
  owned = fo_sharding.owned_specs(tx, jax.eval_shape(tx.init, pure), pure,
                                  nnx.as_pure(specs), mesh=mesh, boxed=True)
  return jax.tree.map(lambda o: o.spec, owned)


def _check_names(name, opt, mesh, *, layout):
  leaves = jax.tree_util.tree_flatten_with_path(
      opt.opt_state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
  want = jax.tree_util.tree_flatten_with_path(_want_specs(name, mesh),
                                              is_leaf=lambda x: isinstance(x, P))[0]
  assert len(leaves) == len(want)
  named = 0
  for (path, v), (_, spec) in zip(leaves, want):
    where = jax.tree_util.keystr(path)
    spec = tuple(spec)
    got = v.get_metadata("out_sharding", None) if isinstance(v, nnx.Variable) else None
    value = v.get_value() if isinstance(v, nnx.Variable) else v
    full = spec + (None,) * (value.ndim - len(spec))
    if got is not None:
      named += 1
      assert tuple(got) == full, (where, got, spec, value.shape)
    if layout:  # laid out as its names say
      assert _spec_of(value) == full, (where, value.sharding.spec, spec)
  assert named > 0


@pytest.mark.parametrize("name", registry.params(default=["racs"]))
def test_recipe_creates_and_steps_with_state_named_by_its_own_shape(name):
  """Each named optimizer (RACS by default, all with ``-m slow``): created by
  the recipe on the FSDP x tensor mesh, each state
  leaf's names have its own rank, are ``fo.state_partition_specs``'s and lay it out; a
  step keeps the names (the layout after it is XLA's, as for any output of ``jit``
  without ``out_shardings``)."""
  mesh = _meshes()["fsdp4xtensor2"]
  _, opt = _train(name, mesh, steps=0)
  _check_names(name, opt, mesh, layout=True)
  _, opt = _train(name, mesh, steps=1)
  _check_names(name, opt, mesh, layout=False)


def _bytes(tree, mesh):
  """The state's bytes on device 0, what its names predict, and a replicated state's."""
  leaves = [x.get_value() if isinstance(x, nnx.Variable) else x
            for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))]
  leaves = [x for x in leaves if isinstance(x, jax.Array)]
  total = sum(x.nbytes for x in leaves)
  per_device = sum(x.addressable_shards[0].data.nbytes for x in leaves)
  split = lambda x: int(np.prod([mesh.shape[n] for e in x.sharding.spec if e  # noqa: E731
                                 for n in (e if isinstance(e, tuple) else (e,))]))
  predicted = sum(x.nbytes // split(x) for x in leaves)
  return per_device, predicted, total


@pytest.mark.parametrize("mesh_name", ["fsdp4xtensor2", pytest.param("fsdp4", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", registry.params(default=["alice"]))
def test_recipe_is_sharded_and_equals_one_device(name, mesh_name):
  """3 steps (refreshes at 1 and 3): the parameters equal one device's; each device holds
  the bytes the state's names say, fewer than a replicated state's (Alice by default on
  the FSDP x tensor mesh; all, and the FSDP mesh, with ``-m slow``); the
  rotation family, built under the mesh, keeps its state on the owners."""
  mesh = _meshes()[mesh_name]
  single, _ = _train(name, None)
  sharded, opt = _train(name, mesh)
  p0 = nnx.as_pure(nnx.state(Model((), nnx.Rngs(0)), nnx.Param))
  single, sharded = nnx.as_pure(single), nnx.as_pure(sharded)
  for path, want in jax.tree_util.tree_flatten_with_path(single)[0]:
    got = dict(jax.tree_util.tree_flatten_with_path(sharded)[0])[path]
    start = dict(jax.tree_util.tree_flatten_with_path(p0)[0])[path]
    change = np.linalg.norm(np.asarray(want, np.float64) - np.asarray(start, np.float64))
    err = np.linalg.norm(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    assert err <= 1e-3 * change, (name, jax.tree_util.keystr(path), err / change)
  per_device, predicted, total = _bytes(opt.opt_state, mesh)
  assert per_device == predicted < total, (name, per_device, predicted, total)
  if name in ("soap", "shampoo", "eigen_adam"):  # built under the mesh: state on owners
    owned = [x for x in jax.tree.leaves(opt.opt_state, is_leaf=lambda x: isinstance(
        x, fo.RotateOwnedState)) if isinstance(x, fo.RotateOwnedState)]
    assert len(owned) == 1 and owned[0].load.shape == (len(mesh.devices.flat),), owned


def test_param_specs_from_the_recipe_reach_the_owner_layout(monkeypatch):
  """On ``Auto`` axes the gradients' split is not visible while tracing; the recipe's
  ``nnx.get_partition_spec`` tree, given as ``fo.OwnerLayout(param_specs=...)``, names
  each kernel's split where the owner layout reads it (a row- and a column-parallel
  kernel of one shape here), and the updates are those without it."""
  from fisher_optax.parallel import owners
  mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  seen = []
  read = owners.view_split
  monkeypatch.setattr(owners, "view_split",
                      lambda v, s, **kw: seen.append(s) or read(v, s, **kw))

  class Two(nnx.Module):
    def __init__(self, rngs):
      init = nnx.initializers.normal(0.3)
      self.a = nnx.Linear(16, 16, kernel_init=nnx.with_partitioning(init, ("fsdp", "tensor")),
                          use_bias=False, rngs=rngs)
      self.b = nnx.Linear(16, 16, kernel_init=nnx.with_partitioning(init, ("tensor", "fsdp")),
                          use_bias=False, rngs=rngs)

    def __call__(self, x):
      return self.b(jnp.tanh(self.a(x)))

  def trained(layout):
    with jax.set_mesh(mesh):
      model = Two(nnx.Rngs(0))
      tx = fo.muon(0.02, stack_matrices=False, owner_layout=layout(model))
      opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

      @nnx.jit
      def step(model, opt, x):
        opt.update(model, nnx.grad(lambda m: (m(x) ** 2).mean())(model))

      for t in range(2):
        step(model, opt, jnp.full((8, 16), 0.1 * (t + 1)))
      return nnx.state(model, nnx.Param)

  given = trained(lambda m: fo.OwnerLayout(param_specs=nnx.get_partition_spec(
      nnx.state(m, nnx.Param))))
  assert P("fsdp", "tensor") in seen and P("tensor", "fsdp") in seen, seen
  plain = trained(lambda m: "auto")
  for x, y in zip(jax.tree.leaves(given), jax.tree.leaves(plain)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("axis_type", ["explicit", "auto"])
def test_on_two_axes_the_low_rank_state_is_on_the_owners(axis_type):
  """On an FSDP x tensor mesh of ``Explicit`` axes (``jax.make_mesh``'s default) or of
  ``Auto`` ones: the recipe (optimizer built and ``nnx.Optimizer`` created under the
  mesh) keeps GaLore's state on the owners, ``init`` reading each kernel's split from
  its type (``Explicit``) or from the names of its box (``Auto``): the two sizes' stacks
  split over the mesh on their slots, and four steps (refreshes at 1 and 3) give one
  device's parameters. The loss is elementwise in the kernels, since a matrix product
  over a sharded contracting axis needs an ``out_sharding`` on ``Explicit`` axes."""
  kind = {"explicit": jax.sharding.AxisType.Explicit, "auto": jax.sharding.AxisType.Auto}
  mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=(kind[axis_type],) * 2)

  class Layers(nnx.Module):
    def __init__(self, named, rngs):
      init = nnx.initializers.normal(0.3)
      kernel = lambda names: nnx.with_partitioning(init, names) if named else init  # noqa: E731
      self.sq = nnx.Linear(16, 16, kernel_init=kernel(("fsdp", "tensor")), use_bias=False,
                           rngs=rngs)
      self.down = nnx.Linear(32, 16, kernel_init=kernel(("tensor", "fsdp")), use_bias=False,
                             rngs=rngs)
      for i in range(10):
        setattr(self, f"up{i}", nnx.Linear(16, 32, kernel_init=kernel(("fsdp", "tensor")),
                                           use_bias=False, rngs=rngs))

  def loss(m, scale):
    kernels = [m.sq, m.down] + [getattr(m, f"up{i}") for i in range(10)]
    return sum(jnp.sum(jnp.sin(k.kernel[...] * scale) ** 2) for k in kernels)

  def trained(on_mesh):
    @nnx.jit
    def create():
      model = Layers(on_mesh, nnx.Rngs(0))
      tx = fo.galore(1e-2, rank=8, interval=2, stack_matrices=False)
      return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, scale):
      opt.update(model, nnx.grad(loss)(model, scale))

    model, opt = create()
    for t in range(4):
      step(model, opt, jnp.float32(3.0 + 0.1 * t))
    return nnx.as_pure(nnx.state(model, nnx.Param)), opt

  want, _ = trained(False)
  with jax.set_mesh(mesh):
    got, opt = trained(True)
  owned = [x for x in jax.tree.leaves(opt.opt_state, is_leaf=lambda x: isinstance(
      x, fo.OwnedStacksState)) if isinstance(x, fo.OwnedStacksState)]
  assert len(owned) == 1 and sorted(owned[0].owned) == ["16x16", "16x32"], owned
  stacks = [x for x in jax.tree.leaves(owned[0].owned) if x.ndim >= 3]
  assert stacks and all(x.sharding.spec == P(("fsdp", "tensor")) or
                        tuple(x.sharding.spec)[0] == ("fsdp", "tensor") for x in stacks)
  start = nnx.as_pure(nnx.state(Layers(False, nnx.Rngs(0)), nnx.Param))
  keyed = lambda t: {jax.tree_util.keystr(k): x  # noqa: E731
                     for k, x in jax.tree_util.tree_flatten_with_path(t)[0]}
  util.assert_close_change(keyed(got), keyed(want), keyed(start), f"galore, {axis_type} axes")
