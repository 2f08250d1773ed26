"""bf16 matrix products on CPUs with AMX through oneMKL (XLA:CPU only).

XLA:CPU (jaxlib 0.10) has no AMX kernel for dots: its best bf16 form (bf16 operands, float32
result) runs at about 0.6x of oneMKL/oneDNN's AMX kernels on a 2-core Xeon, and a product
with a transposed first operand (the weight gradient x^T g) falls to float32 speed.
`bf16_gemm` runs `cblas_gemm_bf16bf16f32` (bf16 operands, float32 accumulation and result,
either operand transposed in place) as an XLA FFI custom call, split over XLA's own thread
pool. The results equal XLA's product up to float32 summation order.

Which products take it (`use_blas_gemm`, decided when a function is traced), from
$JAXSIM_CPU_GEMM:
  xla (default)   none: XLA's dots.
  auto            bf16 products on a single-device CPU backend whose CPU has AMX
                  (`amx_bf16`), when oneMKL (the `mkl` wheel: `pip install jaxsim[cpu-bf16]`)
                  and a C++ compiler are present; anything else stays with XLA. Products of a
                  program partitioned over several devices stay with XLA, which knows how to
                  split its own dots.
  blas            bf16 products on CPU always (an error if the kernel cannot load).
It is opt-in because, on a quiet 2-core Xeon, the products' 3.4x (the MiniLM train step's
products at 4,096 tokens: 114.9 -> 33.8 ms) became only a 5% faster bf16 train step (its time
is mostly elementwise work), no faster encoding, and a slower step when PyTorch shares the
process (benchmarks/train_speed.py: 0.874 -> 0.787 steps/s).

The handler (jaxsim/native/bf16_gemm.cc) is compiled once per source and jaxlib version
into $JAXSIM_NATIVE_DIR (default ~/.cache/jaxsim/native) with the headers jaxlib ships.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.metadata
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxsim.cpu import cpu_flags
from jaxsim.errors import JaxsimError

MODE_ENV = "JAXSIM_CPU_GEMM"
DIR_ENV = "JAXSIM_NATIVE_DIR"
_MODES = ("auto", "blas", "xla")
_TARGET = "jaxsim_bf16_gemm"
_SOURCE = Path(__file__).with_name("bf16_gemm.cc")
_MKL_LP64 = 0  # MKL_INTERFACE_LP64: 32-bit integers, as the handler passes them
_MKL_SEQUENTIAL = 1  # MKL_THREADING_SEQUENTIAL: threads come from XLA's pool instead

log = logging.getLogger(__name__)


class NativeKernelError(JaxsimError):
    """The BLAS bf16 product was asked for ($JAXSIM_CPU_GEMM=blas) but cannot be loaded."""


def mode() -> str:
    value = os.environ.get(MODE_ENV, "xla").strip().lower() or "xla"
    if value not in _MODES:
        raise NativeKernelError(f"${MODE_ENV}={value!r}: expected one of {', '.join(_MODES)}")
    return value


def _cpu_has_amx() -> bool:
    return "amx_bf16" in (cpu_flags() or ())


def _mkl_library() -> Path | None:
    try:
        files = importlib.metadata.files("mkl") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in files:
        if file.name.startswith("libmkl_rt.so"):
            path = Path(file.locate()).resolve()
            if path.exists():
                return path
    return None


def _build_dir() -> Path:
    return Path(os.environ.get(DIR_ENV) or Path.home() / ".cache" / "jaxsim" / "native")


def _compiled_library() -> Path:
    """The handler's shared library, compiled if this source and jaxlib have none yet."""
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + jax.__version__.encode()
                         + jax.ffi.include_dir().encode()).hexdigest()[:16]
    target = _build_dir() / f"bf16_gemm-{key}.so"
    if target.exists():
        return target
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise NativeKernelError("no C++ compiler (g++ or $CXX) to build the bf16 product kernel")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Compiled beside its final name and renamed: concurrent first uses never load half a file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        cmd = [compiler, "-O2", "-std=c++17", "-shared", "-fPIC", "-w",
               f"-I{jax.ffi.include_dir()}", str(_SOURCE), "-o", str(partial)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise NativeKernelError(f"building {_SOURCE.name} failed ({' '.join(cmd)}):\n"
                                    f"{done.stderr.strip()[-2000:]}")
        os.replace(partial, target)
    return target


@functools.cache
def _load() -> str | None:
    """Registers the FFI target; returns None on success, else why it is unavailable."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"not on Linux x86_64 ({platform.system()} {platform.machine()})"
    mkl_path = _mkl_library()
    if mkl_path is None:
        return "oneMKL is not installed (pip install 'jaxsim[cpu-bf16]')"
    try:
        library = ctypes.CDLL(str(_compiled_library()))
        mkl = ctypes.CDLL(str(mkl_path))
        mkl.MKL_Set_Interface_Layer(ctypes.c_int(_MKL_LP64))
        mkl.MKL_Set_Threading_Layer(ctypes.c_int(_MKL_SEQUENTIAL))
        library.jaxsim_set_gemm(ctypes.cast(mkl.cblas_gemm_bf16bf16f32, ctypes.c_void_p),
                                ctypes.c_int(1))
        jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(library.JaxsimBf16Gemm),
                                    platform="cpu")
    except (OSError, AttributeError, NativeKernelError) as error:
        return str(error)
    log.info("bf16 products on CPU run oneMKL's kernel (%s)", mkl_path)
    return None


def unavailable_reason() -> str | None:
    """None if the kernel loads here, else why not (AMX aside)."""
    return _load()


def use_blas_gemm(dtype) -> bool:
    """Whether a product with operands of `dtype` traced now should run `bf16_gemm`."""
    if jnp.dtype(dtype) != jnp.bfloat16:
        return False
    chosen = mode()
    if chosen == "xla" or jax.default_backend() != "cpu":
        return False
    if chosen == "blas":
        reason = _load()
        if reason is not None:
            raise NativeKernelError(f"${MODE_ENV}=blas: {reason}")
        return True
    return jax.device_count() == 1 and _cpu_has_amx() and _load() is None


def bf16_gemm(a: jax.Array, b: jax.Array, *, transpose_a: bool = False,
              transpose_b: bool = False) -> jax.Array:
    """op(a) @ op(b) for 2-D bf16 a, b (op: transpose if asked) -> float32, by oneMKL."""
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"bf16_gemm takes 2-D operands, got {a.shape} and {b.shape}")
    m = a.shape[1] if transpose_a else a.shape[0]
    k = a.shape[0] if transpose_a else a.shape[1]
    kb, n = (b.shape[1], b.shape[0]) if transpose_b else b.shape
    if k != kb:
        raise ValueError(f"bf16_gemm: contraction sizes differ ({a.shape}, {b.shape}, "
                         f"transpose_a={transpose_a}, transpose_b={transpose_b})")
    reason = _load()
    if reason is not None:
        raise NativeKernelError(reason)
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((m, n), jnp.float32),
                            vmap_method="sequential")
    return call(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16),
                transpose_a=bool(transpose_a), transpose_b=bool(transpose_b))


_HLO_CALL = re.compile(r'=\s*f32\[(\d+),(\d+)\]\S*\s+custom-call\(.*custom_call_target="'
                       + _TARGET + r'".*operand_layout_constraints=\{bf16\[(\d+),(\d+)\]\S*, '
                       r'bf16\[(\d+),(\d+)\]')


def hlo_cost(hlo_text: str) -> dict:
    """FLOPs and bytes of this kernel's calls in a compiled program's HLO text, which XLA's
    cost analysis does not count (a custom call is opaque to it): {'flops', 'bytes accessed'}.
    """
    flops = moved = 0.0
    for match in _HLO_CALL.finditer(hlo_text):
        m, n, a0, a1, b0, b1 = (int(v) for v in match.groups())
        k = a0 * a1 // m if m else 0
        flops += 2.0 * m * n * k
        moved += 2.0 * (a0 * a1 + b0 * b1) + 4.0 * m * n
    return {"flops": flops, "bytes accessed": moved}
