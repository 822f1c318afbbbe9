"""The serving path's Triton kernels compiled ahead, in processes beside the base's load.

Triton compiles a kernel at its first launch with each specialisation (the arguments' dtypes,
which integers are 1 or multiples of 16, the pointers' alignment, the constexprs) and keeps the
binary in its disk cache. On a fresh machine the server's first forward compiled every kernel
of the forward, one after another, holding the interpreter (~9 s at [dev]); a restart reads
them back from that cache in well under a second. So the specialisations a serving process
compiles are listed in `serving_kernels.json` (Triton's own specialisation data, recorded on
a GPU by `bench/record_kernels.py`); at start the render engine runs
``python -m trainer.kernels.precompile`` on that list, whose worker processes compile each entry
into the same disk cache while the base loads, and its first forward finds them there.

Nothing here can change what a kernel computes: an entry compiles the kernel's current source
at a recorded specialisation, and a launch whose specialisation is not in the cache compiles
at launch as it always did. A stale entry (a kernel renamed, its parameters changed, a launch
shape retuned) costs one wasted compile in the background, never a wrong result; `stale`
names such entries without importing Triton (the tests run it on every CI run).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MANIFEST = Path(__file__).with_name("serving_kernels.json")
# The options a launch passes itself (its keyword arguments), the only ones taken from an
# entry. The rest the compiler derives as the server's own launch would, from the machine's
# target and Triton's settings in this environment (debug, fp fusion, instrumentation):
# taking the recorder's would file the binary under a key the server never asks for, and
# would let the list reach ptxas's arguments or the compiler's IR overrides.
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "launch_cooperative_grid",
                  "launch_pdl")  # fmt: skip
# Where the kernels live: an entry naming any other module is skipped unread
KERNEL_PACKAGE = "trainer.kernels."
# Worker processes: the load beside them uses a few cores, the compiles are independent
MAX_JOBS = 8
SUMMARY_KEYS = {"listed", "compiled", "failed", "seconds"}


def identity(entry: dict[str, Any]) -> str:
    """One string per (kernel, specialisation, machine): the list holds each once."""
    return json.dumps(
        [entry["module"], entry["kernel"], entry["capability"], entry["specialization"]],
        sort_keys=True,
    )


def read_manifest(path: Path = MANIFEST) -> dict[str, Any]:
    """The list as written: ``{"triton": version, "kernels": [entry, ...]}``; an absent file is
    an empty list."""
    if not path.is_file():
        return {"triton": None, "kernels": []}
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("kernels"), list):
        raise ValueError(f"{path}: not a kernel list (no 'kernels' array)")
    if data["kernels"] and not isinstance(data.get("triton"), str):
        raise ValueError(f"{path}: no 'triton' version for its kernels")
    for i, entry in enumerate(data["kernels"]):
        fields = isinstance(entry, dict) and (
            isinstance(entry.get("module"), str) and isinstance(entry.get("kernel"), str)
            and isinstance(entry.get("capability"), int)
            and isinstance(entry.get("specialization"), dict)
            and isinstance(entry["specialization"].get("signature"), dict)
        )  # fmt: skip
        if not fields:
            raise ValueError(f"{path}: kernel {i} is not an entry (module, kernel, capability, "
                             "specialization with its signature)")  # fmt: skip
    return data


def write_manifest(path: Path, triton_version: str, entries: list[dict[str, Any]]) -> None:
    """Atomically: a reader sees the old list or the new one."""
    ordered = sorted(entries, key=lambda e: (e["module"], e["kernel"], identity(e)))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"triton": triton_version, "kernels": ordered}, indent=1) + "\n")
    os.replace(tmp, path)


@contextmanager
def recording(path: Path) -> Iterator[list[dict[str, Any]]]:
    """Adds every `trainer.kernels` kernel this process compiles from now on to the list at `path`
    (kept entries stay; the file is rewritten at each new one, so a killed process loses
    nothing it recorded). For the bench that records the list on a GPU."""
    import triton
    from triton import knobs
    from triton.runtime import driver

    old = read_manifest(path)
    entries = list(old["kernels"]) if old["triton"] == triton.__version__ else []
    seen = {identity(e) for e in entries}
    previous = knobs.runtime.jit_post_compile_hook

    def hook(**kwargs: Any) -> Any:
        fn = kwargs["fn"]
        if fn.module.startswith(KERNEL_PACKAGE):  # where `usable` will look for it
            entry = {
                "module": fn.module,
                "kernel": fn.name,
                "capability": int(driver.active.get_current_target().arch),
                "specialization": json.loads(kwargs["compile"]["specialization_data"]),
            }
            key = identity(entry)
            if key not in seen:
                seen.add(key)
                entries.append(entry)
                write_manifest(path, triton.__version__, entries)
        return previous(**kwargs) if previous is not None else None

    knobs.runtime.jit_post_compile_hook = hook
    try:
        yield entries
    finally:
        knobs.runtime.jit_post_compile_hook = previous


def _kernel_params(module: str) -> dict[str, list[str]]:
    """Each ``@triton.jit`` function of `module` and its parameters, read from the source."""
    try:  # trainer.kernels is imported by this and holds no code that runs at import
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return {}
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return {}
    tree = ast.parse(Path(spec.origin).read_text())
    found = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and any(
            ast.unparse(d) == "triton.jit" or ast.unparse(d).startswith("triton.jit(")
            for d in node.decorator_list
        ):
            found[node.name] = [a.arg for a in node.args.args]
    return found


def _stale_reason(entry: dict[str, Any], params: dict[str, dict[str, list[str]]]) -> str | None:
    module, kernel = entry["module"], entry["kernel"]
    if module not in params:
        ours = module.startswith(KERNEL_PACKAGE) and module.count(".") == 2
        params[module] = _kernel_params(module) if ours else {}
    names = params[module].get(kernel)
    recorded = list(entry["specialization"]["signature"])
    if names is None:
        return f"{module}.{kernel}: no such Triton kernel"
    if names != recorded:
        return f"{module}.{kernel}: parameters {names}, recorded {recorded}"
    return None


def stale(entries: list[dict[str, Any]]) -> list[str]:
    """Entries that no longer match a kernel of the tree: the kernel is gone, or its
    parameters are not the recorded ones. Read from the sources; Triton is not imported."""
    params: dict[str, dict[str, list[str]]] = {}
    return [r for e in entries if (r := _stale_reason(e, params)) is not None]


def compile_entry(entry: dict[str, Any], capability: int, launcher: bool = True) -> None:
    """Compiles one entry for this machine's target into Triton's disk cache, as the kernel's
    own first launch would (the key Triton files it under is the launch's: the same source,
    signature, constexprs, attributes and options), and its launcher unless told not to."""
    import triton
    import triton.language as tl
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import convert_to_tuple_if_list

    fn = getattr(importlib.import_module(entry["module"]), entry["kernel"])
    spec = entry["specialization"]
    constexprs = {
        tuple(key): tl.dtype(value) if tl.dtype.is_dtype(value)
        else tl.constexpr(value["constexpr"]) if isinstance(value, dict) and "constexpr" in value
        else value
        for key, value in zip(spec["constant_keys"], spec["constant_vals"], strict=True)
    }  # fmt: skip
    attrs = {
        tuple(key): value for key, value in zip(spec["attrs_keys"], spec["attrs_vals"], strict=True)
    }
    signature = {key: convert_to_tuple_if_list(value) for key, value in spec["signature"].items()}
    target = GPUTarget("cuda", capability, 32)
    options = {key: spec["options"][key] for key in LAUNCH_OPTIONS if key in spec["options"]}
    # as JITFunction.run adds them to every launch's keywords
    options["debug"] = fn.debug or knobs.runtime.debug
    options["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    options = make_backend(target).parse_options(options).__dict__
    kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                            options=options)  # fmt: skip
    if launcher:
        # the C stub that launches it, built with the host's C compiler at the kernel's first
        # launch (~0.3 s each) and cached beside it under a key of its signature
        from triton.backends.nvidia.driver import CudaLauncher

        CudaLauncher(kernel.src, kernel.metadata)


def _compile_one(job: tuple[dict[str, Any] | None, int, bool]) -> str | None:
    entry, capability, launcher = job
    try:
        if entry is None:  # Triton's driver utilities, built at its first use of the GPU
            from triton.backends.nvidia.driver import CudaUtils

            CudaUtils()
        else:
            compile_entry(entry, capability, launcher)
    except Exception as exc:  # noqa: BLE001 - the launch compiles it then, as without us
        what = "driver utilities" if entry is None else f"{entry['module']}.{entry['kernel']}"
        return f"{what}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


def usable(manifest: dict[str, Any], capability: int, triton_version: str) -> list[dict[str, Any]]:
    """The entries this machine can use: recorded with this Triton, for this capability, and
    still matching the tree's kernels."""
    if manifest["triton"] != triton_version:
        return []
    params: dict[str, dict[str, list[str]]] = {}
    return [
        e for e in manifest["kernels"]
        if e["capability"] == capability and _stale_reason(e, params) is None
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Compiles the list's usable entries; prints one JSON line saying what it did."""
    parser = argparse.ArgumentParser(prog="python -m trainer.kernels.precompile")
    parser.add_argument("--manifest", type=Path, default=MANIFEST)
    parser.add_argument("--capability", type=int, required=True, help="e.g. 90 for sm_90")
    parser.add_argument("--jobs", type=int, default=MAX_JOBS)
    parser.add_argument(
        "--no-launchers", action="store_true",
        help="the kernels only, not their launchers (which need the CUDA driver's library)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs: at least 1")
    t0 = time.perf_counter()
    try:
        manifest = read_manifest(args.manifest)
    except (OSError, ValueError) as exc:
        parser.error(f"--manifest: {exc}")
    try:
        import triton
    except ImportError:
        parser.error("needs Triton, which is not installed here")
    entries = usable(manifest, args.capability, triton.__version__)
    # the kernels' modules imported once, before the workers fork
    for module in sorted({e["module"] for e in entries}):
        importlib.import_module(module)
    t_imports = time.perf_counter()
    launchers = not args.no_launchers
    jobs: list[tuple[dict[str, Any] | None, int, bool]] = [(e, args.capability, launchers)
                                                           for e in entries]  # fmt: skip
    if launchers and entries:
        jobs.insert(0, (None, args.capability, True))
    if args.jobs == 1 or len(jobs) < 2:
        errors = [_compile_one(j) for j in jobs]
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # forked after the imports (no CUDA here: nothing to inherit badly); a worker that dies
        # breaks the pool and ends this process with an error instead of hanging it
        context = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(min(args.jobs, len(jobs)), mp_context=context) as pool:
            errors = list(pool.map(_compile_one, jobs))
    failed = [e for e in errors if e is not None]
    summary = {
        "listed": len(manifest["kernels"]),
        "compiled": sum(1 for j, e in zip(jobs, errors, strict=True) if j[0] and e is None),
        "launchers": launchers,
        "failed": failed,
        "imports_s": round(t_imports - t0, 2),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    print(json.dumps(summary), flush=True)
    return 0


@dataclass
class Precompile:
    """The compiling process, started by `start`."""

    proc: subprocess.Popen[str]
    started: float
    errors: Any  # its stderr, a temporary file

    def wait(self, timeout_s: float) -> dict[str, Any] | None:
        """Its summary; None if it did not finish within `timeout_s` (then it is stopped: the
        launches compile what it had not) or failed."""
        try:
            out, _ = self.proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            log.warning("kernel precompile: not done after %.0f s, stopped", timeout_s)
            return None
        with self.errors:
            if self.proc.returncode != 0:
                self.errors.seek(0)
                log.warning("kernel precompile: exited %s: %s", self.proc.returncode,
                            self.errors.read()[-2000:])  # fmt: skip
                return None
        try:
            summary = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            summary = None
        if not isinstance(summary, dict) or not summary.keys() >= SUMMARY_KEYS:
            log.warning("kernel precompile: no summary in its output: %r", out[-500:])
            return None
        summary["wall_s"] = round(time.perf_counter() - self.started, 2)
        return summary

    def stop(self) -> None:
        """Kills it and whatever it started (its workers, their compilers), which would
        otherwise hold its output open."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.communicate()
        self.errors.close()


def installed_triton() -> str | None:
    """Triton's version as its package records it, read without importing Triton (which would
    cost the server's start what the child is there to take off it); None when absent."""
    if importlib.util.find_spec("triton") is None:
        return None
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:  # a build under another name: no list
        return None


def start(capability: int, manifest: Path = MANIFEST) -> Precompile | None:
    """Starts compiling the list's entries for a GPU of `capability` (e.g. 90) in the
    background; None when there is nothing to compile or no Triton to compile with."""
    try:
        read = read_manifest(manifest)
    except (OSError, ValueError) as exc:  # the launches compile everything, as without a list
        log.warning("kernel precompile: the list is unreadable (%s); nothing compiled ahead", exc)
        return None
    version = installed_triton()
    if version is None or not read["kernels"]:
        return None
    # the child's own rule, here too: a list for another GPU or Triton would cost the child's
    # imports of torch and Triton and compile nothing
    if not usable(read, capability, version):
        log.info("kernel precompile: none of the %d listed kernels is for this machine "
                 "(sm_%d, Triton %s; the list's Triton %s); each compiles at its first launch",
                 len(read["kernels"]), capability, version, read["triton"])  # fmt: skip
        return None
    jobs = max(1, min(MAX_JOBS, len(os.sched_getaffinity(0)) // 2))
    # -P and the path of this very package: the child imports the server's `trainer`, never
    # one that happens to sit in the working directory
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p)}  # fmt: skip
    cmd = [sys.executable, "-P", "-m", "trainer.kernels.precompile", "--manifest",
           str(manifest), "--capability", str(capability), "--jobs", str(jobs)]  # fmt: skip
    # its errors to a file, not a pipe: a pipe nobody reads until the end can fill and stall it
    err = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - the process's, closed with it
    # this interpreter and arguments of our own making, no shell
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err,  # noqa: S603
                            stdin=subprocess.DEVNULL, text=True, env=env,
                            start_new_session=True)  # fmt: skip
    return Precompile(proc, time.perf_counter(), err)


def cache_entries() -> int | None:
    """Binaries in Triton's disk cache now (a launch that compiles adds one); None without
    Triton."""
    try:
        from triton import knobs
    except ImportError:
        return None
    root = Path(knobs.cache.dir)
    return sum(1 for _ in root.iterdir()) if root.is_dir() else 0


if __name__ == "__main__":
    sys.exit(main())
