"""Full LLaMA train-step throughput (tokens/s) of optimizers vs optax.adam, interleaved.

    python benchmarks/train_throughput.py --preset small --optimizers racs,alice [--rounds 5]
        [--dtype bfloat16] [--layout auto]

Builds the example's jitted train step (forward, backward, optimizer update; buffers
donated) for Adam and each optimizer in one process, then times ``--steps`` steps of each
in interleaved rounds (adam, opt1, opt2, adam, ...) on the same batches and prints the
median tokens/s and its ratio to Adam's. Each round also times one refresh step of every
optimizer that has one (its state's step counters set to the refresh interval ``K``, on
copies, since the step donates its inputs); the amortised throughput counts one refresh
per ``K`` steps: ``tokens / (((K - 1) * ordinary + refresh) / K)``. Compilation is
excluded (ahead-of-time).

``--profile DIR`` then runs ``--steps`` more steps of each optimizer under the profiler
and prints where the device's time goes (``benchmarks/kernel_profile.py``: busy and
waiting time per step, time per kind of kernel, the largest kernels); the summaries are
in the ``--json`` rows and in ``DIR/summary.json``, the raw traces are removed.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.step_time import interval_of, with_count
from examples.llama import data as data_lib
from examples.llama import train as train_lib


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--preset", default="small")
  ap.add_argument("--optimizers", default="racs,alice")
  ap.add_argument("--steps", type=int, default=5, help="steps per timed block")
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--batch-size", type=int, default=None)
  ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                  help="parameter and activation dtype of the model")
  ap.add_argument("--layout", default="auto", choices=("auto", "stacked", "per-leaf"),
                  help="stack_matrices of the fisher_optax optimizers (default: the library's)")
  ap.add_argument("--json", action="store_true")
  ap.add_argument("--profile", default=None, metavar="DIR",
                  help="also profile --steps steps of each optimizer into DIR")
  args = ap.parse_args()
  layout = {"auto": None, "stacked": True, "per-leaf": False}[args.layout]
  names = ["adam"] + [n for n in args.optimizers.split(",") if n and n != "adam"]
  runs = {}
  for name in names:
    ours = name not in ("adam", "adamw", "muon")
    targs = train_lib.parse_args(["--preset", args.preset, "--optimizer", name, "--steps", "1000",
                                  "--dtype", args.dtype]
                                 + (["--batch-size", str(args.batch_size)]
                                    if args.batch_size else [])
                                 + (["--hparams", json.dumps({"stack_matrices": layout})]
                                    if ours and layout is not None else []))
    setup = train_lib.build(targs)
    params = train_lib.init_params(setup, 0)
    state = setup.tx.init(params)
    step, _ = train_lib.make_steps(setup)
    ctx = setup.cfg.context
    x, y = data_lib.train_batch(setup.corpus.train_ids, 0, 0, setup.batch_size, ctx)
    xs, ys = jnp.asarray(x[None]), jnp.asarray(y[None])
    t0 = time.perf_counter()
    step = step.lower(params, state, xs, ys).compile()
    compile_s = time.perf_counter() - t0
    params, state, loss = step(params, state, xs, ys)  # warm-up (also step 1's refresh)
    jax.block_until_ready(loss)
    k = 1 if name == "adam" else interval_of(name, args.preset)
    runs[name] = dict(step=step, params=params, state=state, xs=xs, ys=ys, times=[],
                      refresh_times=[], interval=k, tokens=setup.batch_size * ctx,
                      compile_s=compile_s)
  for _ in range(args.rounds):
    for name in names:
      r = runs[name]
      t0 = time.perf_counter()
      for _ in range(args.steps):
        r["params"], r["state"], loss = r["step"](r["params"], r["state"], r["xs"], r["ys"])
      jax.block_until_ready(loss)
      r["times"].append((time.perf_counter() - t0) / args.steps)
      if r["interval"] > 1:  # one refresh step, on copies (the step donates its inputs)
        p2, s2 = jax.tree.map(jnp.copy, (r["params"], with_count(r["state"], r["interval"])))
        jax.block_until_ready((p2, s2))
        t0 = time.perf_counter()
        jax.block_until_ready(r["step"](p2, s2, r["xs"], r["ys"]))
        r["refresh_times"].append(time.perf_counter() - t0)
  profiles = {}
  if args.profile:
    import shutil

    from benchmarks import kernel_profile
    for name in names:
      r = runs[name]

      def run(r=r):
        r["params"], r["state"], loss = r["step"](r["params"], r["state"], r["xs"], r["ys"])
        return loss
      log_dir = str(pathlib.Path(args.profile) / name)
      profiles[name] = kernel_profile.profile(run, steps=args.steps, log_dir=log_dir)
      shutil.rmtree(log_dir, ignore_errors=True)
      print("\n".join(kernel_profile.format_summary(name, profiles[name])),
            file=sys.stderr if args.json else sys.stdout, flush=True)
    pathlib.Path(args.profile).mkdir(parents=True, exist_ok=True)
    (pathlib.Path(args.profile) / "summary.json").write_text(json.dumps(profiles, indent=2))

  def speeds(r):
    ordinary = statistics.median(r["times"])
    refresh = statistics.median(r["refresh_times"]) if r["refresh_times"] else ordinary
    amortised = ((r["interval"] - 1) * ordinary + refresh) / r["interval"]
    return r["tokens"] / ordinary, r["tokens"] / amortised, refresh

  adam_tps, adam_amort, _ = speeds(runs["adam"])
  out = []
  for name in names:
    r = runs[name]
    tps, amort, refresh = speeds(r)
    out.append(dict(optimizer=name, preset=args.preset, dtype=args.dtype, layout=args.layout,
                    backend=jax.default_backend(), tokens_per_s=tps,
                    ratio_to_adam=tps / adam_tps, refresh_step_ms=1e3 * refresh,
                    interval=r["interval"], amortised_tokens_per_s=amort,
                    amortised_ratio_to_adam=amort / adam_amort, compile_s=r["compile_s"],
                    step_ms=1e3 * statistics.median(r["times"]),
                    profile=profiles.get(name)))
    if not args.json:
      print(f"{name:10s} {tps:9,.0f} tok/s  {tps / adam_tps:6.1%} of Adam  "
            f"step {1e3 * statistics.median(r['times']):7.1f} ms  "
            f"refresh step {1e3 * refresh:7.1f} ms  amortised(K={r['interval']}) "
            f"{amort:9,.0f} tok/s {amort / adam_amort:6.1%}  compile {r['compile_s']:.1f}s",
            flush=True)
  if args.json:
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
  main()
