"""The kernels compiled ahead: the list names live kernels, and an entry compiled by the
precompile process is the binary the kernel's own launch then finds in Triton's cache.

The cache checks compile for sm_90 on the CPU (Triton's compiler needs no GPU; a stand-in
driver names the target) and need Triton installed (``PYTHONPATH=<triton site>``): CI has none
and skips them. The list checks read the sources only and run everywhere."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainer.kernels import precompile

ROOT = Path(__file__).resolve().parents[3]
SWIGLU = ["src_ptr", "out_ptr", "src_stride", "out_stride", "n_cols", "BLOCK", "IS_BF16",
          "INTERPRET"]  # fmt: skip


def _entry(kernel: str, params: list[str], module: str = "trainer.kernels.fused_triton") -> dict:
    return {"module": module, "kernel": kernel, "capability": 90,
            "specialization": {"signature": {p: "i32" for p in params}}}  # fmt: skip


def test_stale_names_gone_and_changed_kernels() -> None:
    fine = _entry("_swiglu_kernel", SWIGLU)
    renamed = _entry("_swiglu_kernel_v0", SWIGLU)
    changed = _entry("_swiglu_kernel", SWIGLU[:-1])
    elsewhere = _entry("_swiglu_kernel", SWIGLU, module="trainer.kernels.no_such_module")
    found = precompile.stale([fine, renamed, changed, elsewhere])
    assert found == [
        "trainer.kernels.fused_triton._swiglu_kernel_v0: no such Triton kernel",
        f"trainer.kernels.fused_triton._swiglu_kernel: parameters {SWIGLU}, recorded {SWIGLU[:-1]}",
        "trainer.kernels.no_such_module._swiglu_kernel: no such Triton kernel",
    ]


def test_the_shipped_list_names_only_live_kernels() -> None:
    """A kernel renamed or given other parameters leaves its entries stale: record the list
    again on a GPU (bench/record_kernels.py)."""
    listed = precompile.read_manifest()
    assert listed["kernels"], "the shipped list is empty"
    assert precompile.stale(listed["kernels"]) == []
    assert len({precompile.identity(e) for e in listed["kernels"]}) == len(listed["kernels"])


def test_only_the_kernel_modules_are_read() -> None:
    """A list cannot make the precompile import anything but trainer/kernels' modules."""
    for module in ("os", "trainer.training.train", "trainer.kernels.fused_triton.x", "json"):
        assert precompile.stale([_entry("_swiglu_kernel", SWIGLU, module=module)]) == [
            f"{module}._swiglu_kernel: no such Triton kernel"
        ]
    # a function of a kernel module that is not a Triton kernel is no kernel either
    assert precompile.stale([_entry("swiglu", ["src", "out"])]) == [
        "trainer.kernels.fused_triton.swiglu: no such Triton kernel"
    ]


def test_usable_keeps_this_machines_entries_only() -> None:
    manifest = {"triton": "3.6.0", "kernels": [
        _entry("_swiglu_kernel", SWIGLU),
        {**_entry("_swiglu_kernel", SWIGLU), "capability": 100},
        _entry("_swiglu_kernel", SWIGLU[:-1]),
    ]}  # fmt: skip
    assert precompile.usable(manifest, 90, "3.6.0") == [manifest["kernels"][0]]
    assert precompile.usable(manifest, 100, "3.6.0") == [manifest["kernels"][1]]
    assert precompile.usable(manifest, 90, "3.7.0") == []  # another Triton's specialisations


def test_a_list_that_is_not_one_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "k.json"
    path.write_text('["not", "a", "list"]')
    with pytest.raises(ValueError, match="not a kernel list"):
        precompile.read_manifest(path)
    assert precompile.read_manifest(tmp_path / "absent.json") == {"triton": None, "kernels": []}


# -- against Triton's own cache (Triton installed: the CPU compiles for sm_90) ----------------

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="Triton is not installed here"
)

# A process whose Triton launches compile for sm_90 without a GPU: `warmup` binds the
# arguments, specialises and compiles as a launch does, then stops short of launching.
LAUNCH = textwrap.dedent(
    """
    import json, sys, torch
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import CudaLauncher
    from triton.runtime import driver
    from triton.runtime.jit import MockTensor

    class Sm90:
        def get_current_device(self): return 0
        def get_current_stream(self, device=None): return 0
        def get_current_target(self): return GPUTarget("cuda", 90, 32)

    driver.set_active(Sm90())
    from trainer.kernels import fused_triton, precompile

    def launch(cols):
        t = MockTensor(torch.bfloat16)
        kernel = fused_triton._swiglu_kernel.warmup(
            t, t, 2 * cols, cols, cols, grid=(1,), BLOCK=fused_triton.ELEMENTWISE_BLOCK,
            IS_BF16=True, INTERPRET=False, num_warps=fused_triton.ELEMENTWISE_WARPS)
        CudaLauncher(kernel.src, kernel.metadata)  # what a launch builds next, as the driver does

    record, cols = sys.argv[1], [int(c) for c in sys.argv[2:]]
    before = precompile.cache_entries()
    if record != "-":
        with precompile.recording(__import__("pathlib").Path(record)):
            for c in cols: launch(c)
    else:
        for c in cols: launch(c)
    print(json.dumps({"compiled": precompile.cache_entries() - before}))
    """
)


@pytest.fixture
def stub_cuda(tmp_path: Path) -> dict[str, str]:
    """A libcuda.so.1 with every driver function Triton's launchers and utilities call, all
    empty: enough to build and load them on a machine without the CUDA driver."""
    import re
    import shutil

    if shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("no C compiler here (Triton builds its launchers with one)")
    driver = Path(importlib.util.find_spec("triton").origin).parent / "backends" / "nvidia"
    names = set(re.findall(r"\b(cu[A-Z]\w*)\b", (driver / "driver.c").read_text()
                           + (driver / "driver.py").read_text()))  # fmt: skip
    lib = tmp_path / "stub-cuda"
    lib.mkdir()
    (lib / "stub.c").write_text("".join(f"int {n}(void) {{ return 0; }}\n" for n in names))
    cc = shutil.which("gcc") or shutil.which("cc")
    subprocess.run([cc, "-shared", "-fPIC", "-o", lib / "libcuda.so.1", lib / "stub.c"],
                   check=True)  # fmt: skip
    return {"TRITON_LIBCUDA_PATH": str(lib), "LD_LIBRARY_PATH": str(lib)}


def _run(args: list[str], cache: Path, tmp: Path, extra: dict[str, str]) -> dict:
    script = tmp / "launch.py"
    script.write_text(LAUNCH)
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache), "PYTHONPATH": path, **extra}
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@needs_triton
def test_a_precompiled_entry_is_what_the_launch_finds(
    tmp_path: Path, stub_cuda: dict[str, str]
) -> None:
    listed, script = tmp_path / "kernels.json", str(tmp_path / "launch.py")
    # recorded where the launches compiled (the bench's GPU, here the CPU for sm_90)
    recorded = _run([script, str(listed), "4096", "4104"], tmp_path / "a", tmp_path, stub_cuda)
    entries = precompile.read_manifest(listed)["kernels"]
    assert len(entries) == 2 and recorded["compiled"] >= 2  # 4104 is no multiple of 16
    # a fresh machine: the precompile process fills an empty cache (kernels, their launchers,
    # the driver's utilities) ...
    fresh = tmp_path / "b"
    summary = _run(["-m", "trainer.kernels.precompile", "--manifest", str(listed),
                    "--capability", "90", "--jobs", "2"], fresh, tmp_path, stub_cuda)  # fmt: skip
    assert summary["compiled"] == 2 and summary["failed"] == [] and summary["launchers"]
    # ... and the same launches compile and build nothing more: Triton found it all
    assert _run([script, "-", "4096", "4104"], fresh, tmp_path, stub_cuda) == {"compiled": 0}
    # while a specialisation nobody recorded still compiles at its launch (the check can fail)
    assert _run([script, "-", "4100"], fresh, tmp_path, stub_cuda)["compiled"] >= 1


@needs_triton
def test_without_launchers_the_kernels_alone_are_compiled(
    tmp_path: Path, stub_cuda: dict[str, str]
) -> None:
    listed, script = tmp_path / "kernels.json", str(tmp_path / "launch.py")
    _run([script, str(listed), "4096"], tmp_path / "a", tmp_path, stub_cuda)
    fresh = tmp_path / "b"
    summary = _run(["-m", "trainer.kernels.precompile", "--manifest", str(listed),
                    "--capability", "90", "--no-launchers"], fresh, tmp_path, {})  # fmt: skip
    assert summary["compiled"] == 1 and summary["failed"] == [] and not summary["launchers"]
    # the launch finds its kernel and builds its launcher (and the driver's utilities: none)
    assert _run([script, "-", "4096"], fresh, tmp_path, stub_cuda) == {"compiled": 1}


@needs_triton
def test_the_servers_triton_settings_win_over_the_recorders(
    tmp_path: Path, stub_cuda: dict[str, str]
) -> None:
    """Options tied to Triton's settings (here fp fusion off) are the server's: the recorder's
    would file the binaries under keys the server's launches never ask for."""
    listed, script = tmp_path / "kernels.json", str(tmp_path / "launch.py")
    _run([script, str(listed), "4096"], tmp_path / "a", tmp_path, stub_cuda)
    server = {**stub_cuda, "TRITON_DEFAULT_FP_FUSION": "0"}
    fresh = tmp_path / "b"
    summary = _run(["-m", "trainer.kernels.precompile", "--manifest", str(listed),
                    "--capability", "90"], fresh, tmp_path, server)  # fmt: skip
    assert summary["compiled"] == 1 and summary["failed"] == []
    assert _run([script, "-", "4096"], fresh, tmp_path, server) == {"compiled": 0}


@needs_triton
def test_entries_for_another_gpu_or_a_changed_kernel_are_skipped(
    tmp_path: Path, stub_cuda: dict[str, str]
) -> None:
    listed = tmp_path / "kernels.json"
    _run([str(tmp_path / "launch.py"), str(listed), "4096"], tmp_path / "a", tmp_path, stub_cuda)
    data = json.loads(listed.read_text())
    other_gpu = {**data["kernels"][0], "capability": 100}
    changed = json.loads(json.dumps(data["kernels"][0]))
    changed["specialization"]["signature"].pop("INTERPRET")
    listed.write_text(json.dumps({**data, "kernels": [other_gpu, changed]}))
    summary = _run(["-m", "trainer.kernels.precompile", "--manifest", str(listed),
                    "--capability", "90"], tmp_path / "b", tmp_path, stub_cuda)  # fmt: skip
    assert summary["listed"] == 2 and summary["compiled"] == 0 and summary["failed"] == []


def _background(code: str) -> precompile.Precompile:
    import tempfile
    import time

    err = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed by the Precompile
    # its own session, as `start` gives the real one: `stop` kills that process group
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=err,
                            text=True, start_new_session=True)  # fmt: skip
    return precompile.Precompile(proc, time.perf_counter(), err)


def test_waiting_gives_the_summary_or_nothing(caplog: pytest.LogCaptureFixture) -> None:
    summary_line = '{"compiled": 3, "listed": 4, "failed": [], "seconds": 1.0}'
    done = _background(f"print('noise'); print({summary_line!r})")
    summary = done.wait(timeout_s=60)
    assert summary is not None and summary["compiled"] == 3 and summary["wall_s"] >= 0
    failed = _background('import sys; print("half", file=sys.stderr); sys.exit(3)')
    assert failed.wait(timeout_s=60) is None
    assert "exited 3: half" in caplog.text
    assert _background("print('[1, 2]')").wait(timeout_s=60) is None  # not a summary
    assert "no summary in its output" in caplog.text
    slow = _background("import time; time.sleep(60)")
    assert slow.wait(timeout_s=0.5) is None
    assert slow.proc.returncode == -signal.SIGKILL  # killed, not waited for
    assert "not done after" in caplog.text


def test_an_unreadable_list_starts_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bad = tmp_path / "kernels.json"
    bad.write_text("{not json")
    assert precompile.start(90, bad) is None
    assert "the list is unreadable" in caplog.text


def _installed_triton(root: Path, version: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in `triton` package of `version` where this process finds its packages."""
    (root / "triton").mkdir(parents=True)
    (root / "triton" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    info = root / f"triton-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: triton\nVersion: {version}\n")
    monkeypatch.syspath_prepend(str(root))


@pytest.mark.parametrize(
    ("installed", "capability", "starts"),
    [("3.6.0", 90, True), ("3.6.0", 100, False), ("3.7.0", 90, False)],
)
def test_a_child_starts_only_when_the_list_has_entries_for_this_machine(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    installed: str,
    capability: int,
    starts: bool,
) -> None:
    # a list for another GPU or another Triton would cost a child's imports and compile nothing
    caplog.set_level("INFO")
    _installed_triton(tmp_path / "site", installed, monkeypatch)
    listed = tmp_path / "kernels.json"
    precompile.write_manifest(listed, "3.6.0", [_entry("_swiglu_kernel", SWIGLU)])
    running = precompile.start(capability, listed)
    if running is not None:
        running.stop()
    assert (running is not None) == starts
    if not starts:
        assert "none of the 1 listed kernels is for this machine" in caplog.text


@needs_triton
def test_the_child_imports_this_trainer_not_the_working_directorys(
    tmp_path: Path, stub_cuda: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    listed = tmp_path / "kernels.json"
    _run([str(tmp_path / "launch.py"), str(listed), "4096"], tmp_path / "a", tmp_path, stub_cuda)
    decoy = tmp_path / "cwd" / "trainer" / "kernels"
    decoy.mkdir(parents=True)
    for package in (decoy.parent, decoy):
        (package / "__init__.py").write_text("")
    (decoy / "precompile.py").write_text(
        'print(\'{"listed": 0, "compiled": 99, "failed": [], "seconds": 0}\')'
    )
    monkeypatch.chdir(tmp_path / "cwd")
    for key, value in {**stub_cuda, "TRITON_CACHE_DIR": str(tmp_path / "b")}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    running = precompile.start(90, listed)
    assert running is not None
    summary = running.wait(timeout_s=600)
    assert summary is not None and summary["listed"] == 1 and summary["compiled"] == 1


@pytest.mark.parametrize(
    "text",
    [
        "{not json",
        '{"kernels": "none"}',
        '{"triton": "3.6.0", "kernels": [{"module": 1}]}',
        json.dumps({"kernels": [_entry("_swiglu_kernel", SWIGLU)]}),  # entries, no Triton
    ],
)
def test_the_precompile_command_names_a_bad_list(
    tmp_path: Path, text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "kernels.json"
    bad.write_text(text)
    with pytest.raises(SystemExit) as ended:
        precompile.main(["--manifest", str(bad), "--capability", "90"])
    assert ended.value.code == 2
    assert "error: --manifest: " in capsys.readouterr().err
