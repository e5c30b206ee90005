"""Ray on bench/dispatch.py's shapes, in the same run: the data plane the mesh's is measured against.

A private local Ray (address="local", never an existing cluster; no dashboard, no usage stats,
actors' output kept out of the driver's, its session files in a temporary folder; Ray's default
token authentication, with a token made for the run instead of one written to ~/.ray) with one
actor per emulated device. Each actor is a JAX CPU device in its own process holding a jax.jit of
the program the mesh runs, with the program's parameters put on its device once (as the worker
holds them), compiled for the shapes used before anything is timed. What a Ray user would write,
measured three ways:

- per shard, async: submit all K shard tasks to one actor, then ray.get them all (one device, as
  the mesh's per-shard jobs use max_devices=1); and the same spread over every actor, for context;
- per shard, one at a time: submit one, get it, repeat;
- streaming: the input in STREAM_PIECE_BYTES pieces, all submitted round-robin over the actors,
  then each result fetched in order into one output array (data there and back through the
  object store, as the mesh carries it there and back).

Ray is imported only here and only when a baseline starts, so the bench runs, and this module's
pure helpers are tested, without it (CI does not install the `bench` extra).
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import secrets
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, MutableMapping, Sequence

import numpy as np

MIB = 1024 * 1024
STREAM_PIECE_BYTES = 8 * MIB  # a fair Ray user's piece: large enough that a task's fixed cost is small beside it
STORE_HEADROOM_BYTES = 128 * MIB  # above the stream's inputs and outputs: the per-shard runs' objects, fragmentation
GET_TIMEOUT_S = 300.0  # ray.get of one run: a run still going by then has stalled
ABSENT_NOTE = "pip install -e '.[bench]' to measure Ray side by side"


def ray_version() -> str | None:
    """Ray's installed version, or None when it is not installed. Read without importing Ray: what
    Ray reads from the environment when imported is set first (quiet_ray_environment)."""
    try:
        return importlib.metadata.version("ray")
    except importlib.metadata.PackageNotFoundError:
        return None


def row_bounds(rows: int, rows_per_piece: int) -> list[tuple[int, int]]:
    """[start, stop) of consecutive pieces of at most rows_per_piece rows covering rows rows."""
    if rows_per_piece < 1:
        raise ValueError(f"rows_per_piece must be at least 1, got {rows_per_piece}")
    return [(start, min(start + rows_per_piece, rows)) for start in range(0, rows, rows_per_piece)]


def object_store_bytes(stream_bytes: int) -> int:
    """The object store a stream of stream_bytes needs when every piece is submitted at once: its
    inputs and its outputs can all be in the store together, so nothing spills to disk."""
    return 2 * stream_bytes + STORE_HEADROOM_BYTES


def ms_per_task(walls_s: Sequence[float], tasks: int) -> float:
    """Mean wall milliseconds per task over runs of `tasks` tasks each (the mesh's job wall / K)."""
    return round(sum(walls_s) * 1e3 / (len(walls_s) * tasks), 3)


def equal_results(got: np.ndarray, expected: np.ndarray, exact: bool) -> bool:
    """Bit-equal where the program is exact (identity); else within the fp32-on-CPU tolerance the
    mesh's results are held to (compile_rules.toml: 1e-5)."""
    if got.shape != expected.shape:
        return False
    return bool(np.array_equal(got, expected) if exact else np.allclose(got, expected, rtol=1e-5, atol=1e-5))


def quiet_ray_environment(environ: MutableMapping[str, str]) -> None:
    """Set what Ray reads at start so it starts quietly and writes nothing outside the run. Its
    authentication mode stays Ray's own choice (token, for a new local cluster); a token or token
    file the caller set is kept."""
    environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no prompt, nothing sent at start
    token_given = "RAY_AUTH_TOKEN" in environ or "RAY_AUTH_TOKEN_PATH" in environ
    if environ.get("RAY_AUTH_MODE", "token") == "token" and not token_given:
        environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)  # else Ray writes one to ~/.ray/auth_token


class DeviceActor:
    """One emulated device: a JAX CPU device in its own process, holding jitted programs."""

    def __init__(self):
        import jax

        self._device = jax.devices("cpu")[0]  # where the mesh's worker runs these programs too
        self._programs: dict[str, tuple[Callable, list]] = {}

    def load(self, name: str, fn: Callable, params: list[np.ndarray], examples: list[np.ndarray]) -> None:
        """Jit `fn`, put its parameters on the device once, compile for every example's shape."""
        import jax

        self._programs[name] = (jax.jit(fn), [jax.device_put(p, self._device) for p in params])
        for example in examples:
            self.run(name, example)

    def run(self, name: str, x: np.ndarray) -> list[np.ndarray]:
        import jax

        fn, resident = self._programs[name]
        outputs = jax.block_until_ready(fn(*resident, jax.device_put(x, self._device)))
        return [np.asarray(o) for o in outputs]


class RayBaseline:
    """A local Ray with one DeviceActor per device; `close()` (or `with`) shuts it down."""

    def __init__(self, devices: int, store_bytes: int):
        quiet_ray_environment(os.environ)
        import ray

        self._ray = ray
        self._folder = tempfile.TemporaryDirectory(prefix="accelmesh-ray-")  # Ray's sessions, logs and sockets
        # The actor class travels by value: the workers need not find this folder on their path.
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        self.actors: list = []
        try:
            with warnings.catch_warnings():
                # Ray starts its processes with fork + exec, which JAX's fork warning cannot tell apart.
                warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
                ray.init(address="local", num_cpus=devices, object_store_memory=store_bytes, include_dashboard=False,
                         log_to_driver=False, logging_level=logging.WARNING, _temp_dir=self._folder.name)
            remote = ray.remote(num_cpus=1)(DeviceActor)  # one device slot each, as the worker's devices
            self.actors = [remote.remote() for _ in range(devices)]
        except BaseException:
            self.close()
            raise
        self.version = ray.__version__
        self.auth_mode = os.environ.get("RAY_AUTH_MODE", "disabled")  # Ray sets it when it enables tokens
        self.store_bytes = store_bytes

    def __enter__(self) -> RayBaseline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.actors = []
        self._ray.shutdown()
        self._folder.cleanup()

    def _get(self, refs):
        return self._ray.get(refs, timeout=GET_TIMEOUT_S)

    def load(self, name: str, fn: Callable, params: list[np.ndarray], examples: Sequence[np.ndarray]) -> None:
        """Every actor jits `fn` with `params` held, compiled for every example's shape."""
        self._get([a.load.remote(name, fn, params, list(examples)) for a in self.actors])

    def shards_async(self, name: str, x: np.ndarray, rows_per_shard: int, spread: bool) -> tuple[float, np.ndarray]:
        """Submit every shard (to the first actor, or round-robin over all with `spread`), then get
        them all; (wall seconds, the first output concatenated)."""
        start = time.perf_counter()
        actors = self.actors if spread else self.actors[:1]
        refs = [actors[i % len(actors)].run.remote(name, x[a:b])
                for i, (a, b) in enumerate(row_bounds(len(x), rows_per_shard))]
        y = np.concatenate([outputs[0] for outputs in self._get(refs)])
        return time.perf_counter() - start, y

    def shards_one_at_a_time(self, name: str, x: np.ndarray, rows_per_shard: int) -> tuple[float, np.ndarray]:
        """Submit a shard to the first actor, get it, then the next; (wall seconds, output)."""
        start = time.perf_counter()
        actor = self.actors[0]
        y = np.concatenate([self._get(actor.run.remote(name, x[a:b]))[0]
                            for a, b in row_bounds(len(x), rows_per_shard)])
        return time.perf_counter() - start, y

    def stream(self, name: str, data: np.ndarray, piece_bytes: int = STREAM_PIECE_BYTES) -> dict:
        """`data` through the actors in pieces, all in flight at once, each result copied into one
        output as it is fetched; {"seconds", "equal", "pieces"}."""
        bounds = row_bounds(len(data), max(1, piece_bytes // data[0].nbytes))
        start = time.perf_counter()
        refs = [self.actors[i % len(self.actors)].run.remote(name, data[a:b]) for i, (a, b) in enumerate(bounds)]
        out = np.empty_like(data)
        for (a, b), ref in zip(bounds, refs):
            out[a:b] = self._get(ref)[0]
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "equal": bool(np.array_equal(out, data)), "pieces": len(bounds)}


def measure_per_shard(baseline: RayBaseline, name: str, x: np.ndarray, rows_per_shard: int, reps: int,
                      expected: np.ndarray, exact: bool) -> dict:
    """The three per-shard ways, `reps` timed runs each after one untimed run, the ways alternating
    within each rep so drift hits all alike; ms per shard = mean wall / K."""
    shards = len(row_bounds(len(x), rows_per_shard))
    ways: dict[str, Callable[[], tuple[float, np.ndarray]]] = {
        "async_one_device": lambda: baseline.shards_async(name, x, rows_per_shard, spread=False),
        "one_at_a_time": lambda: baseline.shards_one_at_a_time(name, x, rows_per_shard),
        "async_spread_over_devices": lambda: baseline.shards_async(name, x, rows_per_shard, spread=True),
    }
    walls: dict[str, list[float]] = {way: [] for way in ways}
    match = True
    for way in ways.values():  # warm: the actors' first tasks, the driver's serialization paths
        way()
    for rep in range(reps):
        order = list(ways.items())
        for way, run in order[rep % len(order):] + order[: rep % len(order)]:
            seconds, y = run()
            walls[way].append(seconds)
            match = match and equal_results(y, expected, exact)
    return {
        "program": name, "rows_per_shard": rows_per_shard, "input_bytes_per_shard": x[:rows_per_shard].nbytes,
        "shards_per_run": shards, "timed_runs": reps,
        **{f"{way}_ms_per_shard": ms_per_task(w, shards) for way, w in walls.items()},
        "results_match_local": match,
    }
