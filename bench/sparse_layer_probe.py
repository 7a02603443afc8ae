"""Probe: the first layer's products as dense or sparse DTensor programs, per mesh (issue 39).

    python bench/sparse_layer_probe.py [--batch 256] [--nonzeros 330] [--meshes feature=2 batch=8 ...] [--seconds 4]

A training step pays for the first layer twice over the whole vocabulary: the forward product
X·K and the kernel's gradient Xᵀ·dY, both dense [batch, width] products although a review has a
few hundred non-zero n-grams. This times, on random batches of the given shape (width 150,016,
64 hidden units) and each mesh in a process of its own (devices are fixed once TensorFlow starts):
  dense     X dense, y = X·K, the tape's gradient, K -= lr·g (what `TrainState.train_step` does)
  sparse    X as a packed SparseTensor (DTensor rewrites MatMul with a sparse left operand into
            SparseTensorDenseMatMul), the gradient from a custom gradient over Xᵀ, packed too
  forward   the sparse X·K alone
  backward  the sparse Xᵀ·dY alone (run at two --nonzeros: a product whose time does not follow
            the non-zeros was densified)
and prints ms per step and the largest difference of the sparse gradient from numpy's XᵀdY. A mesh
that DTensor refuses is printed with DTensor's reason.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WIDTH, HIDDEN = 150_016, 64
MODES = ("dense", "sparse", "forward", "backward")


def refused(exc: Exception) -> str:
    """DTensor's reason, from the MLIR error line of its message (the last line names only the pass)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    reason = next((line for line in lines if "error:" in line), lines[-1] if lines else type(exc).__name__)
    return f"refused: {reason.split('error:', 1)[-1].strip()[:200]}"


def worker(mesh_spec: str, batch: int, nonzeros: int, mode: str, seconds: float) -> str:
    from common.mesh import ModelLayouts, build_mesh, configure_devices, dim_size
    from common.mesh_spec import BATCH, FEATURE, mesh_size, parse_mesh

    dims = parse_mesh(mesh_spec)
    configure_devices(mesh_size(dims), "CPU")
    import numpy as np
    import tensorflow as tf
    from tensorflow.experimental import dtensor

    from common.model import to_mesh

    mesh = build_mesh(dims, "CPU")
    layouts = ModelLayouts.for_mesh(mesh)
    rng = np.random.default_rng(0)
    cells = np.unique(np.stack([np.repeat(np.arange(batch), nonzeros),
                                rng.integers(0, WIDTH, batch * nonzeros)], axis=1), axis=0)
    values = rng.random(len(cells)).astype(np.float32)
    rows, columns = batch // dim_size(mesh, BATCH), WIDTH // dim_size(mesh, FEATURE)
    batch_spec, feature_spec = layouts.inputs.sharding_specs

    def pieces(transpose: bool) -> list:
        out = []
        for location in mesh.local_device_locations():
            r, f = location.get(BATCH, 0), location.get(FEATURE, 0)
            mine = (cells[:, 0] // rows == r) & (cells[:, 1] // columns == f)
            local, v = cells[mine] - [r * rows, f * columns], values[mine]
            if transpose:
                local = local[:, ::-1]
                order = np.lexsort((local[:, 1], local[:, 0]))
                local, v = local[order], v[order]
            shape = [columns, rows] if transpose else [rows, columns]
            out.append(tf.SparseTensor(local.astype(np.int64), v, shape))
        return out

    dense = np.zeros((batch, WIDTH), np.float32)
    dense[cells[:, 0], cells[:, 1]] = values
    kernel = dtensor.DVariable(to_mesh((rng.random((WIDTH, HIDDEN), dtype=np.float32) - 0.5) / 100,
                                       layouts.dense1_kernel))
    dy_host = rng.random((batch, HIDDEN), dtype=np.float32)
    dy = to_mesh(dy_host, dtensor.Layout([batch_spec, layouts.dense1_kernel.sharding_specs[1]], mesh))
    try:
        x = to_mesh(dense, layouts.inputs) if mode == "dense" else dtensor.pack(pieces(False), layouts.inputs)
        xt = dtensor.pack(pieces(True), dtensor.Layout([feature_spec, batch_spec], mesh))
    except Exception as exc:  # noqa: BLE001 - a probe: report what DTensor refused
        return refused(exc)

    def product(k: tf.Tensor) -> tf.Tensor:
        @tf.custom_gradient
        def first_layer(value: tf.Tensor):
            return tf.matmul(x, value), lambda upstream: tf.matmul(xt, upstream)
        return first_layer(k)

    @tf.function
    def step(check: bool):  # (a scalar, and the kernel's gradient when `check`)
        """One step. The timed calls return a scalar only: returning the [width, hidden] gradient, or
        a slice of it (which gathers the sharded kernel axis), costs more than the sparse products."""
        if mode == "forward":
            return tf.reduce_sum(tf.matmul(x, kernel) * dy), None
        if mode == "backward":
            g = tf.matmul(xt, dy)
            loss = tf.reduce_sum(dy)
        else:
            with tf.GradientTape() as tape:
                y = tf.matmul(x, kernel) if mode == "dense" else product(kernel.read_value())
                loss = tf.reduce_sum(y * dy)
            g = tape.gradient(loss, kernel)
        kernel.assign_sub(1e-9 * g)  # the update keeps the product in the program
        return loss, (g if check else None)

    try:
        _, g = step(True)
        step(False)
    except Exception as exc:  # noqa: BLE001
        return refused(exc)
    error = ""
    if g is not None:
        got = dtensor.unpack(dtensor.relayout(g, dtensor.Layout.replicated(mesh, 2)))[0].numpy()
        error = f", max |g - XᵀdY| {np.abs(got - dense.T @ dy_host).max():.1e}"
    calls, started = 0, time.perf_counter()
    while calls < 5 or time.perf_counter() - started < seconds:
        loss, _ = step(False)
        calls += 1
    dtensor.unpack(loss)[0].numpy()
    return f"{(time.perf_counter() - started) / calls * 1000:.1f} ms{error}"


def default_meshes() -> list[str]:
    from common.mesh_spec import STRATEGIES, format_mesh, strategy_mesh

    return ["feature=2"] + [format_mesh(strategy_mesh(strategy, 8)) for strategy in STRATEGIES]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--nonzeros", type=int, default=330, help="n-grams per review (IMDB: 328 on average)")
    parser.add_argument("--meshes", nargs="+", default=default_meshes(),
                        help="meshes as NAME=SIZE,... (default: feature=2, this host's default, and every --strategy "
                             "on 8 devices)")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        mesh_spec, batch, nonzeros, mode = args.worker
        print(worker(mesh_spec, int(batch), int(nonzeros), mode, args.seconds))
        return
    print(f"batch {args.batch}, {args.nonzeros} non-zeros a review, width {WIDTH}, hidden {HIDDEN}")
    for mesh_spec in args.meshes:
        for mode, nonzeros in [(m, args.nonzeros) for m in MODES] + [("backward", max(1, args.nonzeros // 30))]:
            done = subprocess.run([sys.executable, __file__, "--seconds", str(args.seconds), "--worker", mesh_spec,
                                   str(args.batch), str(nonzeros), mode], check=False, capture_output=True, text=True,
                                  cwd=REPO)
            lines = done.stdout.strip().splitlines() or [f"failed: {done.stderr.strip().splitlines()[-1:]}"]
            print(f"{mesh_spec:26} {mode:8} nnz {nonzeros:4}: {lines[-1]}", flush=True)


if __name__ == "__main__":
    main()
