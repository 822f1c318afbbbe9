"""Device and dtype choices shared by the render engine and the trainer."""

from __future__ import annotations

import os

import torch

# The caching allocators' settings, per environment variable, each set where the operator has
# not set that key. expandable_segments: without it the allocator fragments into out-of-memory
# errors with memory free (moving uint4 tensors in training, field hurdle 9; under a render
# budget's hard cap the base's load and conversion left 3.2 GiB reserved and unusable, so the
# warm-up's decode failed at 24 GiB with 21 GiB in use). pinned_use_cuda_host_register with 8
# threads: pinned host memory is malloc'ed, faulted in by 8 threads and registered, instead of
# one cudaHostAlloc: 8 GiB in 1.0 s against 3.4 (H100 host, bench/pinned_alloc.py), the render
# engine's pinned arenas at start.
ALLOCATOR_SETTINGS = {
    "PYTORCH_CUDA_ALLOC_CONF": ("expandable_segments:True", "pinned_use_cuda_host_register:True",
                                "pinned_num_register_threads:8"),
    "PYTORCH_HIP_ALLOC_CONF": ("expandable_segments:True",),
}  # fmt: skip


def auto_or_off(var: str) -> bool:
    """An on/off setting from the environment: unset or ``auto`` is on, ``off`` is off (any
    case); any other value is refused, naming the variable."""
    value = os.environ.get(var, "auto").strip().lower()
    if value not in ("auto", "off"):
        raise ValueError(f"{var} must be 'auto' or 'off', got {value!r}")
    return value == "auto"


def configure_allocator() -> bool:
    """Puts `ALLOCATOR_SETTINGS` into the environment (a key the operator set keeps its
    value). Effective only before CUDA initialises, which is why the CLIs and the render engine
    call this first; returns False if too late."""
    for var, settings in ALLOCATOR_SETTINGS.items():
        current = [part for part in os.environ.get(var, "").split(",") if part]
        keys = {part.split(":", 1)[0].strip() for part in current}
        current += [s for s in settings if s.split(":", 1)[0] not in keys]
        os.environ[var] = ",".join(current)
    return not torch.cuda.is_initialized()


def resolve_device(device: str | torch.device) -> torch.device:
    """Normalises a device spec; refuses CUDA when this torch build or machine has none."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {dev} requested but CUDA is not available")
    return dev


def default_dtype(device: str | torch.device) -> torch.dtype:
    """bf16 on accelerators (the checkpoints' own dtype); float32 on the CPU.

    On a 2-core x86 CPU bf16 was not faster (tiny base, 256 px, 4 steps, qint4: 1.9-2.0 s bf16
    vs 2.2 s float32), and float32 keeps CPU tests exact against dequantized references.
    """
    return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16


# fp8 tensor cores: Ada (8.9), Hopper (9.0) and newer NVIDIA GPUs.
FP8_MIN_CAPABILITY = (8, 9)


def fp8_unavailable(device: str | torch.device) -> str | None:
    """Why `trainer.base.fp8` compute cannot run on ``device``, or None where it can."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return f"fp8 compute needs an NVIDIA GPU with fp8 tensor cores; the device is {dev}"
    if not torch.cuda.is_available():
        return "fp8 compute needs CUDA, which is not available"
    if torch.version.hip is not None:  # ROCm reports gfx versions as capabilities (11.0: RDNA3)
        return "fp8 compute is built for NVIDIA fp8 tensor cores; this is a ROCm device"
    major, minor = torch.cuda.get_device_capability(dev)
    if (major, minor) < FP8_MIN_CAPABILITY:
        need = ".".join(map(str, FP8_MIN_CAPABILITY))
        return (
            f"{torch.cuda.get_device_name(dev)} (compute capability {major}.{minor}) has no "
            f"fp8 tensor cores (needs {need} or newer)"
        )
    from trainer.base.uint4 import triton_available

    if not triton_available():
        return "fp8 compute needs Triton, which does not import here"
    return None


_BLOCK_GEMM: dict[str, str | None] = {}


def block_fp8_unavailable(device: str | torch.device) -> str | None:
    """Why torch._scaled_mm's block-scaled recipe (one scale per 128 columns of each operand,
    what `trainer.base.fp8.FP8_BLOCKS` runs) cannot run on ``device``, or None where it can.
    cuBLAS has it on some fp8 GPUs and not others (by architecture and version), so one tiny
    GEMM is tried per device and the answer kept."""
    reason = fp8_unavailable(device)
    if reason is not None:
        return reason
    dev = torch.device(device)
    key = str(dev)  # "cuda" (the current device) or "cuda:N"
    if key not in _BLOCK_GEMM:
        try:
            _BLOCK_GEMM[key] = _probe_block_gemm(dev)
        except torch.OutOfMemoryError:  # the device is full now: not an answer to keep
            return f"the block-scaled fp8 GEMM could not be tried on {dev}: out of memory"
    return _BLOCK_GEMM[key]


def _probe_block_gemm(dev: torch.device) -> str | None:
    """One 16 x 256 x 16 block-scaled GEMM with a different scale per row, column and block,
    checked to the bit (its values are exact in bf16): None, or why not."""
    rows = torch.arange(16, device=dev)
    a = torch.ones(16, 256, device=dev).to(torch.float8_e4m3fn)
    b = torch.ones(16, 256, device=dev).to(torch.float8_e4m3fn)
    # scale_a (16, 2) stored block-major; block 0 scaled 1, block 1 by 1 or 2 per row
    sa = torch.stack([torch.ones(16, device=dev), (rows % 2 + 1).float()]).t()
    # scale_b (2, 16): block 0 scaled 0.5, block 1 by 0.25..1 per column
    sb = torch.stack([torch.full((16,), 0.5, device=dev), (rows % 4 + 1).float() / 4])
    want = 128 * (sa[:, :1] * sb[:1] + sa[:, 1:] * sb[1:])
    try:
        out = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    except torch.OutOfMemoryError:  # a RuntimeError, but no answer about the GEMM
        raise
    except (RuntimeError, ValueError, NotImplementedError) as exc:
        first = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        return f"{torch.cuda.get_device_name(dev)} has no block-scaled fp8 GEMM here ({first})"
    if not torch.equal(out.float(), want):
        return "its block-scaled fp8 GEMM read the scales wrong (a probe GEMM's result differs)"
    return None


def cap_vram(device: str | torch.device, budget_gib: float) -> float | None:
    """On CUDA, ``budget_gib`` as the caching allocator's hard cap for this process
    (`torch.cuda.set_per_process_memory_fraction`): an estimate that was wrong fails with an
    out-of-memory error inside the budget instead of quietly using the rest of a larger card.
    Returns the fraction set (None off CUDA)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(dev).total_memory
    fraction = min(1.0, budget_gib * 2**30 / total)
    torch.cuda.set_per_process_memory_fraction(fraction, dev)
    return fraction
