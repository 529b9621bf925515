"""Building ``engine/ops/csrc/cpu_ops.c`` for this host: the compiler's flags, the instruction-set
ladder each build is checked down (a build is used only once its probe ran in a child
process), and the cache of built libraries keyed by source, flags, compiler and CPU.
``engine.ops.cpu_ops`` loads what ``build`` returns."""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

log = logging.getLogger("engine.ops.cpu_ops")  # one logger for the kernels' build and use

SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.c"
CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC")
# The instruction sets tried in turn (each replaces -march=native in CFLAGS): a build is used
# only once its isa_probe ran in a child process without dying. A host may list instructions
# a process cannot execute as it is: on the Intel hosts here an AMX tile instruction raises
# SIGILL unless the process has first asked Linux for the tile state (arch_prctl
# ARCH_REQ_XCOMP_PERM: qa_enable, which the probe calls before it runs the AMX tiles). Where
# they die anyway the next rung drops AMX and the other late extensions, then plain AVX2,
# then the portable build.
ISA_LADDER = (
    ("-march=native",),
    ("-march=native", "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16", "-mno-avx512fp16",
     "-mno-avxvnni"),
    ("-mavx2", "-mfma", "-mf16c"),
    (),
)
# Linked in a separate step without -ffast-math: linking with it adds crtfastmath.o, whose
# constructor turns on flush-to-zero for the whole process when the library loads (seen:
# hypothesis refusing to run because subnormal floats had vanished).
LDFLAGS = ("-shared", "-fopenmp")
DEFAULT_CACHE_DIR = Path("~/.cache/pdcluster/ext")


def build(cache_dir: str | Path | None = None,
          ladder: tuple[tuple[str, ...], ...] = ISA_LADDER) -> Path | None:
    """Path of this host's compiled library, compiling it if needed: the first rung of
    ``ladder`` (instruction-set flags) that compiles and whose probe runs here. None when
    none does (no compiler, failed compiles, probes dying: the reasons are logged). Another
    ``ladder`` (tests of each instruction path) builds another library."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler: fused CPU kernels unavailable, using the torch paths")
        return None
    out = Path(cache_dir or DEFAULT_CACHE_DIR).expanduser() / f"cpu_ops-{_build_key(cc, ladder)}.so"
    if out.exists():
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if out.exists():  # another process built it while we waited
                return out
            obj, tmp = out.with_suffix(f".tmp{os.getpid()}.o"), out.with_suffix(f".tmp{os.getpid()}.so")
            try:
                for isa in ladder:
                    flags = [f for f in CFLAGS if f != "-march=native"] + list(isa)
                    if _compile(cc, flags, obj, tmp) and _probe(tmp, isa):
                        break
                else:
                    return None
                tmp.replace(out)  # atomic: a concurrent loader never sees half a library
            finally:
                obj.unlink(missing_ok=True)
                tmp.unlink(missing_ok=True)
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("cannot build fused CPU kernels in %s (using the torch paths): %s",
                    out.parent, e)
        return None
    log.info("fused CPU kernels built for this host: %s", out)
    return out


def _compile(cc: str, flags: list[str], obj: Path, lib: Path) -> bool:
    for cmd in ([cc, *flags, "-c", "-o", str(obj), str(SOURCE)],
                [cc, *LDFLAGS, "-o", str(lib), str(obj), "-lm"]):
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
        if res.returncode != 0:
            log.warning("building fused CPU kernels with %s failed:\n%s", " ".join(flags),
                        res.stderr[-2000:])
            return False
    return True


_PROBE = "import ctypes, sys; sys.exit(0 if ctypes.CDLL(sys.argv[1]).isa_probe() >= 0 else 3)"


def _probe(lib: Path, isa: tuple[str, ...]) -> bool:
    """Whether ``lib``'s ``isa_probe`` runs to its end in a child process (a signal there,
    SIGILL above all, rules this build out for the host)."""
    try:
        res = subprocess.run([sys.executable, "-c", _PROBE, str(lib)], capture_output=True,
                             text=True, timeout=120)
    except subprocess.SubprocessError as e:
        log.warning("fused CPU kernels built with %s: probe failed (%s)", " ".join(isa), e)
        return False
    if res.returncode != 0:
        why = (f"killed by {signal.Signals(-res.returncode).name}" if res.returncode < 0
               else f"exit {res.returncode}: {res.stderr[-500:]}")
        log.warning("fused CPU kernels built with %s do not run on this host (%s); trying "
                    "fewer instructions", " ".join(isa) or "no -m flags", why)
        return False
    return True


def _build_key(cc: str, ladder: tuple[tuple[str, ...], ...]) -> str:
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout.splitlines()[:1]
    except (OSError, subprocess.SubprocessError):
        version = []
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    rungs = "/".join(" ".join(isa) for isa in ladder)
    parts = [SOURCE.read_bytes().decode(), " ".join(CFLAGS + LDFLAGS), rungs, cc, *version,
             flags]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
