"""Checkpointing from several JAX processes: launched here as 2 processes on one machine.

    python examples/multihost.py                       # launches 2 processes x 4 CPU devices
    python examples/multihost.py --processes 4 --devices-per-process 2

On a real cluster every host runs the same program and calls
`jax.distributed.initialize()`, which finds the coordinator itself on Cloud TPU, SLURM
and the like. This script plays the cluster: it starts its own processes, each with a
localhost coordinator address, a process id, fake CPU devices
(`--xla_force_host_platform_device_count`) and gloo for the CPU collectives.

Every process makes the same zarrckpt calls: each writes the chunks its devices hold,
the processes agree through JAX's coordination service that every write succeeded,
and only then does process 0 commit. Restoring, each process reads only what its own
devices need.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading


def launch(args: argparse.Namespace) -> int:
    """Starts the processes, relays their output line by line, returns the worst exit code."""
    with socket.socket() as s:  # a free port for the coordinator
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={args.devices_per_process}")
    procs = [subprocess.Popen([sys.executable, __file__, "--checkpoint-dir", args.checkpoint_dir,
                               "--steps", str(args.steps), "--processes", str(args.processes),
                               "--coordinator", f"127.0.0.1:{port}", "--process-id", str(pid)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for pid in range(args.processes)]

    def relay(pid: int, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            print(f"[process {pid}] {line}", end="", flush=True)

    relays = [threading.Thread(target=relay, args=(pid, proc)) for pid, proc in enumerate(procs)]
    for thread in relays:
        thread.start()
    try:
        codes = [proc.wait(timeout=args.timeout) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:  # one process failed and the others wait for it forever
                proc.kill()
                proc.wait()
        for thread in relays:
            thread.join()
    return max(abs(code) for code in codes)


def work(args: argparse.Namespace) -> None:
    """One process of the job: train, checkpointing as it goes, then restore and compare."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, num_processes=args.processes, process_id=args.process_id)

    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import zarrckpt

    # One mesh over the devices of every process: a weight split over "model", data over "data".
    mesh = Mesh(np.array(jax.devices()).reshape(-1, 2), ("data", "model"))
    w_sharding, replicated = NamedSharding(mesh, P(None, "model")), NamedSharding(mesh, P())

    def global_array(value: np.ndarray, sharding: NamedSharding) -> jax.Array:
        # Every process holds the whole host value and hands over its devices' slices.
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    template = {"w": global_array(np.zeros((16, 8), np.float32), w_sharding),
                "step": global_array(np.zeros((), np.int32), replicated)}

    @jax.jit
    def train_step(state: dict) -> dict:
        key = jax.random.fold_in(jax.random.key(0), state["step"])
        x = jax.lax.with_sharding_constraint(jax.random.normal(key, (64, 16)), NamedSharding(mesh, P("data")))
        y = jnp.sin(x) @ jnp.ones((16, 8))
        grad = jax.grad(lambda w: jnp.mean((x @ w - y) ** 2))(state["w"])
        return {"w": state["w"] - 0.1 * grad, "step": state["step"] + 1}

    with zarrckpt.CheckpointManager(args.checkpoint_dir, save_interval_steps=5, keep_last=2) as mgr:
        state, step = mgr.restore(template)
        print(f"resumed from step {step}" if step else "starting from scratch", flush=True)
        while step < args.steps:
            state = train_step(state)
            step += 1
            mgr.save(step, state)
    # A separate restore, as a new job would do it, compared shard by shard with the live state.
    restored, restored_step = zarrckpt.load_checkpoint_if_it_exists(
        args.checkpoint_dir, {"w": w_sharding, "step": replicated})
    for name in state:
        for mine, back in zip(state[name].addressable_shards, restored[name].addressable_shards):
            np.testing.assert_array_equal(np.asarray(mine.data), np.asarray(back.data))
    print(f"restored step {restored_step}: this process's {len(jax.local_devices())} devices match "
          f"the trained state; committed steps {zarrckpt.all_steps(args.checkpoint_dir)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint-dir", default="checkpoints/multihost", help="local path or fsspec URL")
    parser.add_argument("--steps", type=int, default=20, help="train until this step")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--devices-per-process", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=300, help="seconds before the processes are killed")
    parser.add_argument("--coordinator", help=argparse.SUPPRESS)  # set for the processes launched here
    parser.add_argument("--process-id", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.process_id is None:
        sys.exit(launch(args))
    work(args)


if __name__ == "__main__":
    main()
