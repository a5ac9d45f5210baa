"""llama.cpp, the engine the GGUF layouts are served by: found on this machine, or built once from a
pinned source that comes through the package registry.

    python -m draftsmith.layouts.llama_cpp build     # ~/.cache/draftsmith/llama.cpp/<commit>/ (make llama-cpp;
                                          # $DRAFTSMITH_LLAMA_CPP names another directory)
    python -m draftsmith.layouts.llama_cpp where     # the llama-server used, its version and spec types
    python -m draftsmith.layouts.llama_cpp target-gguf smollm2-135m   # the GGUF llama-server serves it from

The source is llama.cpp at commit :data:`COMMIT`, as the PyPI sdist of ``llama-cpp-python``
(:data:`SDIST`) vendors it (``vendor/llama.cpp``): ``pip download`` fetches the sdist (its
sha256 checked), its llama.cpp tree is unpacked into ``<cache>/llama.cpp/<commit>/src`` and only
``llama-server`` and ``llama-bench`` are built (cmake + ninja, ``LLAMA_OPENSSL=OFF``, no tests, no
curl) into ``build/``, with the whole log in ``build.log`` and ``build.json`` written last, saying
how long it took and which instruction sets it chose. A build that was interrupted is continued
(ninja rebuilds what is missing).

The build is portable rather than ``-march=native`` (:func:`isa_options`): ggml's x86 kernels are
enabled one instruction set at a time from what this CPU reports (AVX2, FMA, F16C, AVX512 when its
F/CD/VL/DQ/BW parts are all there, VNNI, BF16...), and AMX never. On Xeons with AMX under a
hypervisor, ggml's AMX tile kernels (``tinygemm_kernel_amx``, which ``-march=native`` turns on for
the Q4/Q8 types) die with SIGILL at ``tilezero`` on the first forward although the kernel grants
the tile permission; AMX speeds up only quantised matrix products, which draftsmith's f32
measurements do not use. Explicit flags were chosen over ``GGML_CPU_ALL_VARIANTS`` because the
runtime selection would pick the Sapphire Rapids variant (AMX) on the same machines, and building
every variant multiplies the CPU backend's compile time on 2 cores.

Every build ends with a smoke test (:func:`smoke_test`): the built server loads the embedded
target's GGUF and decodes a few tokens; a server that fails it fails the build, with the signal's
name and what to try. A ``llama-server`` the user points to (``$LLAMA_SERVER``, ``PATH``) passes
the same test once per binary (remembered by path, size and time in the cache).

The ``llama-server`` used is, in order: ``$LLAMA_SERVER``, a ``llama-server`` on ``PATH``, then the
cache's build; :func:`find_llama_server` checks that it offers the speculative types asked for
(``--spec-type`` in its ``--help``). GGUF files are written by that source tree's own
``convert_hf_to_gguf.py`` (:func:`convert_to_gguf`), with the tree's own ``gguf-py`` first on
``PYTHONPATH`` (newer than PyPI's gguf); draftsmith writes no GGUF itself, but has the converter
add one metadata key, ``draftsmith.written_by = "draftsmith"`` (:data:`WRITER_KEY`), which is how a
later export knows a file is its own earlier output (``draftsmith.layouts.gguf.written_by_draftsmith``) and
may replace it.

A command that starts processes (llama-servers, the converter) stops them however it ends:
:func:`stop_on_signals` turns SIGTERM, SIGINT and SIGHUP into :class:`Stopped` (exit status 128 +
the signal's number), so every ``with`` block unwinds (servers stopped, temporary files and
directories removed); a process is registered for that before anything waits on it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

from draftsmith.files.output_dir import _alive as process_alive
from draftsmith.files.output_dir import (
    _host as host_name,  # a leftover names the host that wrote it
)
from draftsmith.layouts.processes import end_process, free_port, signals_held, stop_on_signals
from draftsmith.targets.resolve import cache_root, resolve_target

COMMIT = "0c1e570"  # llama.cpp, 2026-10-01: draft-eagle3, draft-dflash, draft-dspark, n-gram types
SDIST = ("llama-cpp-python", "0.3.36")
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
CMAKE_OPTIONS = ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                 "-DLLAMA_CURL=OFF")
# llama-quantize: its F32 output is llama.cpp's own de-quantisation of a GGUF (what the tests
# compare a converted target with)
BUILD_TARGETS = ("llama-server", "llama-bench", "llama-quantize")
# ggml's x86 instruction-set switches, each on when /proc/cpuinfo reports every flag it needs
# (ggml's GGML_AVX512 compiles with -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw)
X86_ISA = (("GGML_AVX", ("avx",)), ("GGML_AVX2", ("avx2",)), ("GGML_FMA", ("fma",)),
           ("GGML_F16C", ("f16c",)), ("GGML_BMI2", ("bmi2",)), ("GGML_AVX_VNNI", ("avx_vnni",)),
           ("GGML_AVX512", ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")),
           ("GGML_AVX512_VBMI", ("avx512vbmi",)), ("GGML_AVX512_VNNI", ("avx512_vnni",)),
           ("GGML_AVX512_BF16", ("avx512_bf16",)))
NEVER = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")  # SIGILL under hypervisors (above)
BUILD_COMMAND = "make llama-cpp"  # what a user runs to build it (python -m draftsmith.layouts.llama_cpp build)
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")  # the converter's --outtype values a head may take
WRITER_KEY, WRITER = "draftsmith.written_by", "draftsmith"  # the GGUF metadata of our conversions


# ------------------------------------------------------------------------------------------------
# finding a llama-server (signals and child processes: draftsmith.layouts.processes)


def install_dir() -> Path:
    """``$DRAFTSMITH_LLAMA_CPP`` (a build made elsewhere), else ``<cache>/llama.cpp/<commit>``."""
    if os.environ.get("DRAFTSMITH_LLAMA_CPP"):
        return Path(os.environ["DRAFTSMITH_LLAMA_CPP"]).expanduser()
    return cache_root() / "llama.cpp" / COMMIT


def source_dir() -> Path:
    return install_dir() / "src"


def _built_server() -> Path | None:
    """The cache's llama-server when its build finished (build.json is written last)."""
    server = install_dir() / "build" / "bin" / "llama-server"
    return server if (install_dir() / "build.json").is_file() and server.is_file() else None


def spec_types(server: str | os.PathLike) -> set[str]:
    """The ``--spec-type`` values a llama-server offers, read from its ``--help``."""
    try:
        done = subprocess.run([str(server), "--help"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ValueError(f"{server} cannot be run ({err}); point LLAMA_SERVER at a working "
                         f"llama-server or build one with {BUILD_COMMAND}") from err
    found = re.search(r"--spec-type\s+([a-z0-9,_-]+)", done.stdout + done.stderr)
    return set(found.group(1).split(",")) if found else set()


def llama_tool(name: str) -> Path:
    """Another program of the cache's llama.cpp build (``llama-quantize``), built on first use
    where the build predates it (seconds: the libraries are built)."""
    if name not in BUILD_TARGETS:
        raise ValueError(f"{name!r} is not one of the llama.cpp programs draftsmith builds "
                         f"({', '.join(BUILD_TARGETS)})")
    if _built_server() is None:
        raise FileNotFoundError(f"no llama.cpp build in {install_dir()}: build llama.cpp "
                                f"{COMMIT} once with `{BUILD_COMMAND}`")
    path = install_dir() / "build" / "bin" / name
    if not path.is_file():
        with open(install_dir() / "build.log", "a") as log:
            _run(["ninja", "-C", str(install_dir() / "build"), name], log)
    return path


def find_llama_server(required: tuple[str, ...] | list[str] = ()) -> Path:
    """``$LLAMA_SERVER``, else ``llama-server`` on PATH, else the cache's build; it must offer
    every speculative type in ``required`` (e.g. ``draft-eagle3``)."""
    candidates = []
    if os.environ.get("LLAMA_SERVER"):
        candidates.append(("$LLAMA_SERVER", Path(os.environ["LLAMA_SERVER"]).expanduser()))
    elif shutil.which("llama-server"):
        candidates.append(("PATH", Path(shutil.which("llama-server"))))
    built = _built_server()
    if built is not None:
        candidates.append(("the draftsmith cache", built))
    if not candidates:
        raise FileNotFoundError(
            f"no llama-server: set LLAMA_SERVER, put llama-server on PATH, or build llama.cpp "
            f"{COMMIT} once with `{BUILD_COMMAND}` (python -m draftsmith.layouts.llama_cpp build, about "
            "5 minutes on 2 cores, then a smoke test)")
    where, server = candidates[0]
    if not server.is_file():
        raise FileNotFoundError(f"llama-server from {where} ({server}) does not exist")
    missing = sorted(set(required) - spec_types(server))
    if missing:
        raise ValueError(
            f"the llama-server from {where} ({server}) offers no --spec-type {', '.join(missing)}"
            f" (an older llama.cpp); build llama.cpp {COMMIT} with `{BUILD_COMMAND}` and unset "
            "LLAMA_SERVER, or point it at a newer build")
    if where != "the draftsmith cache":  # the cache's build passed the smoke test when built
        try:
            check_server(server)
        except ValueError as err:
            raise ValueError(f"{err}\n(this llama-server came from {where}: point "
                             f"LLAMA_SERVER at another build, or unset it and run "
                             f"`{BUILD_COMMAND}`)") from err
    return server


# ------------------------------------------------------------------------------------------------
# building it


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _run(command: list[str], log, cwd: Path | None = None) -> None:
    print("$ " + " ".join(command), file=log, flush=True)
    done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=cwd)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(command)}` failed (exit {done.returncode}); the whole "
                           f"log is {log.name}")


def _fetch_source(log) -> None:
    """The sdist through pip (the registry), checked, its vendored llama.cpp unpacked into src/."""
    if (source_dir() / "CMakeLists.txt").is_file():
        return
    name, version = SDIST
    downloads = install_dir() / "sdist"
    downloads.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
          "--dest", str(downloads), f"{name}=={version}"], log)
    archive = next(downloads.glob(f"{name.replace('-', '_')}-{version}.tar.gz"), None)
    if archive is None:
        raise RuntimeError(f"pip download left no {name}-{version} sdist in {downloads}")
    if _sha256(archive) != SDIST_SHA256:
        raise RuntimeError(f"{archive} has sha256 {_sha256(archive)}, expected {SDIST_SHA256}: "
                           "not the pinned source; remove it and build again")
    prefix = f"{name.replace('-', '_')}-{version}/vendor/llama.cpp/"
    with tempfile.TemporaryDirectory(dir=install_dir(), prefix=".src-") as tmp:
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            for member in members:
                member.name = member.name[len(prefix):]
            tar.extractall(tmp, members=[m for m in members if m.name], filter="data")
        os.replace(tmp, source_dir())
        os.makedirs(tmp)  # TemporaryDirectory removes what it made


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The instruction-set flags the CPU reports (Linux ``/proc/cpuinfo``); empty elsewhere."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    found = re.search(r"^flags\s*:(.*)$", cpuinfo, re.MULTILINE)
    return set(found.group(1).split()) if found else set()


def isa_options(machine: str | None = None, flags: set[str] | None = None) -> list[str]:
    """The cmake options that pick the CPU kernels: on x86-64, ``GGML_NATIVE=OFF`` and each
    instruction set of :data:`X86_ISA` on or off by this CPU's flags, AMX off; elsewhere
    llama.cpp's own default (native), which has no AMX path to trip over."""
    machine = machine or os.uname().machine
    if machine not in ("x86_64", "AMD64", "amd64"):
        return []
    flags = cpu_flags() if flags is None else flags
    options = ["-DGGML_NATIVE=OFF"]
    options += [f"-D{name}={'ON' if all(f in flags for f in needs) else 'OFF'}"
                for name, needs in X86_ISA]
    return options + [f"-D{name}=OFF" for name in NEVER]


_SIGNAL_HINTS = {
    "SIGILL": "the binary uses an instruction this CPU (or its hypervisor) refuses: build llama.cpp"
              f" again with `{BUILD_COMMAND}` (a portable build, no -march=native, no AMX)",
    "SIGSEGV": "llama.cpp crashed: a build for another CPU or a damaged model file",
    "SIGKILL": "killed from outside, often by the kernel's out-of-memory killer",
}


def describe_exit(returncode: int, when: str = "") -> str:
    """``exited with code 1`` or ``was killed by SIGILL (illegal instruction) <when>: <what to
    try>``."""
    when = f" {when}" if when else ""
    if returncode >= 0:
        return f"exited with code {returncode}{when}"
    try:
        sig = signal.Signals(-returncode)
    except ValueError:
        return f"was killed by signal {-returncode}{when}"
    hint = _SIGNAL_HINTS.get(sig.name, "")
    what = (signal.strsignal(sig) or sig.name).lower()
    return f"was killed by {sig.name} ({what}){when}" + (f"; {hint}" if hint else "")


def smoke_test(server: str | os.PathLike, *, tokens: int = 4, timeout: float = 120.0) -> dict:
    """Load the embedded target's GGUF in ``server`` and decode ``tokens`` tokens greedily;
    -> ``{"seconds", "tokens"}``. A server that cannot is a ValueError saying how it failed
    (the signal's name: SIGILL is the AMX trap the portable build avoids) and what to try."""
    from draftsmith.targets.resolve import embedded_gguf_path

    model = embedded_gguf_path("smollm2-135m")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="draftsmith-smoke-") as logs:
        try:
            with LlamaServer(["-m", str(model), "-c", "256", "-np", "1"], name="smoke test",
                             threads=min(2, os.cpu_count() or 1), server=Path(server),
                             log_dir=logs, timeout=timeout) as running:
                answer = running.complete([1, 2, 3, 4], tokens, timeout=timeout)
        except ValueError as err:
            raise ValueError(f"the llama-server {server} fails its smoke test (load "
                             f"{model.name}, decode {tokens} tokens): {err}") from err
    got = answer.get("tokens") or []
    if len(got) != tokens:
        raise ValueError(f"the llama-server {server} fails its smoke test: asked for {tokens} "
                         f"tokens, it answered {len(got)}")
    return {"seconds": round(time.monotonic() - started, 1), "tokens": len(got)}


def _checked_record() -> Path:
    return cache_root() / "llama.cpp" / "smoke-tested.json"


def _fingerprint(path: Path) -> str:
    stat = path.stat()
    return f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"


def check_server(server: Path) -> None:
    """Smoke-test a llama-server once per binary; a passing one is remembered in the cache."""
    record = _checked_record()
    try:
        passed = set(json.loads(record.read_text()))
    except (OSError, ValueError, TypeError):
        passed = set()
    key = _fingerprint(server)
    if key in passed:
        return
    smoke_test(server)
    passed.add(key)
    record.parent.mkdir(parents=True, exist_ok=True)
    tmp = record.with_name(f".{record.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(sorted(passed), indent=1) + "\n")
    os.replace(tmp, record)


def build(jobs: int | None = None) -> Path:
    """Build llama-server (and llama-bench) from the pinned source into the cache, or finish a
    build; smoke-test it; -> its path. A build that fails its smoke test is not recorded."""
    done = _built_server()
    if done is not None:
        return done
    install_dir().mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    log_path = install_dir() / "build.log"
    isa = isa_options()
    with open(log_path, "a") as log:
        print(f"[llama.cpp] building llama-server {COMMIT} in {install_dir()} (log: {log_path})",
              file=sys.stderr, flush=True)
        chosen = [o[len("-DGGML_"):-len("=ON")] for o in isa if o.endswith("=ON")]
        print(f"[llama.cpp] CPU kernels: {', '.join(chosen) or 'llama.cpp default (native)'}"
              + (" (portable: no -march=native, no AMX)" if isa else ""),
              file=sys.stderr, flush=True)
        _fetch_source(log)
        build_dir = install_dir() / "build"
        _run(["cmake", "-S", str(source_dir()), "-B", str(build_dir), "-G", "Ninja",
              *CMAKE_OPTIONS, *isa], log)
        _run(["ninja", "-C", str(build_dir), f"-j{jobs or os.cpu_count() or 2}", *BUILD_TARGETS],
             log)
    server = build_dir / "bin" / "llama-server"
    compiled = round(time.monotonic() - started, 1)
    print(f"[llama.cpp] built in {compiled / 60:.1f} min; smoke test: the embedded target, 4 "
          "tokens", file=sys.stderr, flush=True)
    try:
        smoke = smoke_test(server)
    except ValueError as err:
        raise ValueError(f"{err}\nthe build is not recorded as done; the log is {log_path}") from err
    (install_dir() / "build.json").write_text(json.dumps({
        "commit": COMMIT, "source": f"{SDIST[0]}=={SDIST[1]} sdist (sha256 {SDIST_SHA256})",
        "cmake_options": list(CMAKE_OPTIONS) + isa, "cpu_kernels": chosen, "seconds": compiled,
        "smoke_test": smoke, "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
        indent=1) + "\n")
    print(f"[llama.cpp] llama-server built in {compiled / 60:.1f} min, smoke test passed "
          f"({smoke['seconds']} s)", file=sys.stderr)
    return server


# ------------------------------------------------------------------------------------------------
# the converter


# runs the converter as it is, its GGUF writer adding WRITER_KEY to every file it writes
_MARKED_CONVERTER = f"""\
import os, runpy, sys
import gguf
_init = gguf.GGUFWriter.__init__
def _marked_init(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    self.add_string({WRITER_KEY!r}, {WRITER!r})
gguf.GGUFWriter.__init__ = _marked_init
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def converter() -> tuple[list[str], dict[str, str]]:
    """(command prefix, environment) of the source tree's convert_hf_to_gguf.py (run so that the
    files it writes carry :data:`WRITER_KEY`)."""
    script = source_dir() / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise FileNotFoundError(
            f"llama.cpp's converter ({script}) is not here: `{BUILD_COMMAND}` fetches the pinned "
            "source (python -m draftsmith.layouts.llama_cpp build)")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(source_dir() / "gguf-py"), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("NO_LOCAL_GGUF", "")
    return [sys.executable, "-c", _MARKED_CONVERTER, str(script)], env


def convert_to_gguf(model_dir: str | os.PathLike, out_file: str | os.PathLike, *,
                    outtype: str = "f16",
                    target_model_dir: str | os.PathLike | None = None) -> Path:
    """``convert_hf_to_gguf.py MODEL_DIR --outtype T --outfile OUT [--target-model-dir TARGET]``
    into a temporary file beside ``out_file``, renamed into place when it succeeded."""
    if outtype not in GGUF_TYPES:
        raise ValueError(f"GGUF type {outtype!r}: choose one of {', '.join(GGUF_TYPES)}")
    command, env = converter()
    out_file = Path(out_file)
    remove_stale_conversions(out_file)
    tmp = out_file.with_name(f".{out_file.name}.{host_name()}-{os.getpid()}.tmp")
    command += [str(model_dir), "--outtype", outtype, "--outfile", str(tmp)]
    if target_model_dir is not None:
        command += ["--target-model-dir", str(target_model_dir)]
    process = None
    try:
        with signals_held():  # started and recorded together: a stop then ends it
            process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       stdin=subprocess.DEVNULL, text=True, env=env)
        stdout, stderr = process.communicate()
        if process.returncode != 0:
            tail = "\n".join((stderr or stdout).strip().splitlines()[-6:])
            raise ValueError(f"llama.cpp's convert_hf_to_gguf.py refused {model_dir}:\n{tail}")
        os.chmod(tmp, 0o644)
        os.replace(tmp, out_file)
    finally:
        if process is not None:
            end_process(process, grace=10.0)
        tmp.unlink(missing_ok=True)
    return out_file


def stale_writer(name: str, prefix: str, suffix: str = "") -> bool:
    """Whether ``name`` is ``<prefix><host>-<pid><suffix>`` of a process of this host that no
    longer runs (or ``<prefix><pid><suffix>``, as draftsmith named them before hosts were named).
    """
    if not name.startswith(prefix) or not name.endswith(suffix):
        return False
    writer = name[len(prefix):len(name) - len(suffix)]
    host, _, pid = writer.rpartition("-")
    if not pid.isdigit() or host not in ("", host_name()) or (not host and "-" in writer):
        return False
    return not process_alive(int(pid))


def remove_stale_conversions(out_file: str | os.PathLike) -> list[Path]:
    """Delete the partial ``.<out>.<host>-<pid>.tmp`` files that conversions into ``out_file``
    killed before they finished left beside it (their process gone); -> what was deleted."""
    out_file = Path(out_file)
    removed = []
    if not out_file.parent.is_dir():
        return removed
    for leftover in out_file.parent.iterdir():
        if stale_writer(leftover.name, f".{out_file.name}.", ".tmp") and leftover.is_file() \
                and not leftover.is_symlink():
            with contextlib.suppress(FileNotFoundError):
                leftover.unlink()
            removed.append(leftover)
    return removed


# ------------------------------------------------------------------------------------------------
# running it


_ROUND = re.compile(r"accepted\s+(\d+)/\s*(\d+) draft tokens")


class LlamaServer:
    """One ``llama-server`` on 127.0.0.1, started and always stopped (a context manager).

    ``args`` are llama-server's own (the model, ``-md``, ``--spec-type`` ...); the port is free,
    ``--poll 0`` keeps an idle server from spinning beside the others, ``--threads`` is the
    caller's. ``LLAMA_TRACE=1`` makes the server log every verification round ("accepted k/n
    draft tokens"), which :meth:`rounds` reads back. A server that exits, or does not answer
    ``/health`` within ``timeout`` seconds, is a ValueError with the end of its log.
    """

    def __init__(self, args: list[str], *, name: str, threads: int, server: Path | None = None,
                 log_dir: str | os.PathLike | None = None, timeout: float = 180.0,
                 port: int | None = None):
        self.name, self.args, self.threads, self.timeout = name, list(args), threads, timeout
        self.server = server or find_llama_server()
        self.port = port or free_port()
        self._log_dir = Path(log_dir) if log_dir else None
        self.process: subprocess.Popen | None = None
        self._read = 0  # log bytes already parsed by rounds()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LlamaServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        directory = self._log_dir or Path(tempfile.mkdtemp(prefix="draftsmith-llama-"))
        directory.mkdir(parents=True, exist_ok=True)
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", self.name)[:80]
        self.log_path = directory / f"llama-server-{safe}-{self.port}.log"
        command = [str(self.server), *self.args, "--host", "127.0.0.1", "--port", str(self.port),
                   "--threads", str(self.threads), "--poll", "0", "--no-webui"]
        self._log = open(self.log_path, "wb")
        env = {**os.environ, "LLAMA_TRACE": "1"}
        try:
            with signals_held():  # started and recorded together: stop() then ends it
                self.process = subprocess.Popen(command, stdout=self._log,
                                                stderr=subprocess.STDOUT, env=env,
                                                start_new_session=True)
            self._wait_healthy()
        except BaseException:  # a stop while it loads included: never a server left running
            self.stop()
            raise

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.timeout
        while True:
            if self.process.poll() is not None:
                tail = self.log_tail()
                self.stop()
                raise ValueError(f"llama-server for {self.name} "
                                 f"{describe_exit(self.process.returncode, 'while starting')}"
                                 + (f"; its log ends:\n{tail}" if tail else ""))
            try:
                if self._get("/health").get("status") == "ok":
                    return
            except (OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                tail = self.log_tail()
                self.stop()
                raise ValueError(f"llama-server for {self.name} did not answer /health within "
                                 f"{self.timeout:.0f} s:\n{tail}")
            time.sleep(0.25)

    def stop(self) -> None:
        if self.process is not None:
            end_process(self.process, group=True)
        if getattr(self, "_log", None) is not None and not self._log.closed:
            self._log.close()

    def log_tail(self, lines: int = 12) -> str:
        """The log's last ``lines`` lines, after ggml's failed assertions and aborts (which a
        crash's backtrace would push out of the tail)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        all_lines = text.strip().splitlines()
        fatal = [line for line in all_lines[:-lines] if "GGML_ASSERT" in line
                 or "GGML_ABORT" in line or ": error:" in line]
        return "\n".join([*fatal[:3], *all_lines[-lines:]])

    def _get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=10) as response:
            return json.loads(response.read())

    def complete(self, prompt_ids: list[int], n_predict: int, *, temperature: float = 0.0,
                 n_probs: int = 0, timeout: float = 600.0) -> dict:
        """``POST /completion`` with token ids (the caller's chat template applied), greedy by
        default, the prompt never cached between requests; -> the server's answer (``tokens``,
        ``timings`` with ``predicted_ms``, ``draft_n`` and ``draft_n_accepted``)."""
        body = {"prompt": list(prompt_ids), "n_predict": n_predict, "temperature": temperature,
                "cache_prompt": False, "return_tokens": True, "n_probs": n_probs}
        request = urllib.request.Request(self.url + "/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        if self.process is not None and self.process.poll() is not None:
            raise ValueError(f"llama-server for {self.name} "
                             f"{describe_exit(self.process.returncode)}; its log ends:\n"
                             f"{self.log_tail()}")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return json.loads(response.read())
        except (OSError, ValueError) as err:
            if self.process is not None and (isinstance(err, ConnectionError) or isinstance(
                    getattr(err, "reason", None), ConnectionError)):
                try:  # a crashing server closes the connection before it exits (a backtrace)
                    self.process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    pass
            alive = self.process is not None and self.process.poll() is None
            died = "" if alive else (f"; it {describe_exit(self.process.returncode)}; its "
                                     f"log ends:\n{self.log_tail()}")
            raise ValueError(f"llama-server for {self.name} failed a request ({err}){died}") \
                from err

    def rounds(self) -> list[tuple[int, int]]:
        """(accepted, drafted) of every verification round logged since the last call."""
        self._log.flush()
        with open(self.log_path, "rb") as f:
            f.seek(self._read)
            text = f.read().decode(errors="replace")
            self._read = f.tell()
        return [(int(a), int(n)) for a, n in _ROUND.findall(text)]


def gguf_file_type(path: str | os.PathLike) -> str:
    """The weight type a GGUF file declares (``general.file_type``), as llama.cpp names it:
    f32, f16, bf16, q4_1, q8_0, ..."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    field = reader.fields.get("general.file_type")
    if field is None:
        return "unknown"
    value = int(field.parts[field.data[0]][0])
    try:
        name = gguf.LlamaFileType(value).name
    except ValueError:
        return f"type-{value}"
    return name.removeprefix("MOSTLY_").removeprefix("ALL_").lower()


def _directory_key(directory: Path) -> str:
    """Names a target directory's weights without reading them: path, sizes and times."""
    digest = hashlib.sha256(str(directory.resolve()).encode())
    for path in sorted(directory.glob("*.safetensors")) + [directory / "config.json"]:
        stat = path.stat()
        digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def gguf_for_target(spec: str | os.PathLike, outtype: str | None = None) -> tuple[Path, str]:
    """The GGUF llama.cpp serves a target from -> (file, its weight type).

    An embedded name's own GGUF file and a ``.gguf`` are used as they are; a Hugging Face
    directory (or, with ``outtype``, any target's cached directory) is converted once by
    llama.cpp's converter into ``<cache>/gguf/`` (f32 unless ``outtype`` says otherwise)."""
    from draftsmith.targets.resolve import EMBEDDED_TARGETS, embedded_gguf_path

    text = str(spec)
    if outtype is None and text in EMBEDDED_TARGETS:
        path = embedded_gguf_path(text)
        return path, gguf_file_type(path)
    path = Path(text).expanduser()
    if outtype is None and path.suffix == ".gguf" and path.is_file():
        return path, gguf_file_type(path)
    directory = resolve_target(spec)
    outtype = outtype or "f32"
    out = cache_root() / "gguf" / f"{directory.name}-{_directory_key(directory)}-{outtype}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        print(f"[llama.cpp] converting the target {directory} to {out} ({outtype})",
              file=sys.stderr, flush=True)
        convert_to_gguf(directory, out, outtype=outtype)
    return out, outtype


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog=program("python -m draftsmith.layouts.llama_cpp"),
                                     description="llama.cpp for draftsmith's GGUF layouts")
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("build", help=f"build llama-server {COMMIT} into {install_dir()}")
    make.add_argument("--jobs", type=int, default=None)
    sub.add_parser("where", help="the llama-server used, and its speculative types")
    gguf = sub.add_parser("target-gguf", help="the GGUF file llama.cpp serves a target from "
                          "(converted once for a Hugging Face directory)")
    gguf.add_argument("target", help="an embedded name, a .gguf or a Hugging Face directory")
    gguf.add_argument("--type", choices=GGUF_TYPES, default=None,
                      help="convert to this type (default: the target's own GGUF, f32 else)")
    template = sub.add_parser("chat-template", help="the Jinja chat template draftsmith renders "
                              "a target's conversations with (a base model's: its text "
                              "continued), for llama-server --jinja --chat-template-file")
    template.add_argument("target", help="an embedded name, a .gguf or a Hugging Face directory")
    args = parser.parse_args(argv)
    if args.command == "chat-template":
        from draftsmith.targets.target import load_target_tokenizer

        print(load_target_tokenizer(resolve_target(args.target)).chat_template)
        return 0
    if args.command == "target-gguf":
        print(gguf_for_target(args.target, args.type)[0])
        return 0
    if args.command == "build":
        server = build(args.jobs)
        record = json.loads((install_dir() / "build.json").read_text())
        print(f"{server} (built in {record['seconds'] / 60:.1f} min; log {install_dir()}/build.log)")
        return 0
    server = find_llama_server()
    print(f"{server}\nspec types: {', '.join(sorted(spec_types(server)))}")
    return 0


if __name__ == "__main__":
    from draftsmith.files.command_line import program, run_command

    with stop_on_signals("python -m draftsmith.layouts.llama_cpp"):  # a build's cmake/ninja ended too
        sys.exit(run_command(main, "python -m draftsmith.layouts.llama_cpp"))
