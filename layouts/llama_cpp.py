"""llama.cpp, the engine the GGUF layouts are served by: found on this machine, or built once from a
pinned source that comes through the package registry.

    python -m layouts.llama_cpp build     # ~/.cache/draftsmith/llama.cpp/<commit>/ (make llama-cpp;
                                          # $DRAFTSMITH_LLAMA_CPP names another directory)
    python -m layouts.llama_cpp where     # the llama-server used, its version and spec types
    python -m layouts.llama_cpp target-gguf smollm2-135m   # the GGUF llama-server serves it from

The source is llama.cpp at commit :data:`COMMIT`, as the PyPI sdist of ``llama-cpp-python``
(:data:`SDIST`) vendors it (``vendor/llama.cpp``): ``pip download`` fetches the sdist (its
sha256 checked), its llama.cpp tree is unpacked into ``<cache>/llama.cpp/<commit>/src`` and only
``llama-server`` is built (cmake + ninja, ``LLAMA_OPENSSL=OFF``, no tests, no curl) into
``build/``, with the whole log in ``build.log`` and ``build.json`` written last, saying how long
it took. A build that was interrupted is continued (ninja rebuilds what is missing).

The ``llama-server`` used is, in order: ``$LLAMA_SERVER``, a ``llama-server`` on ``PATH``, then the
cache's build; :func:`find_llama_server` checks that it offers the speculative types asked for
(``--spec-type`` in its ``--help``). GGUF files are written by that source tree's own
``convert_hf_to_gguf.py`` (:func:`convert_to_gguf`), with the tree's own ``gguf-py`` first on
``PYTHONPATH`` (newer than PyPI's gguf); draftsmith writes no GGUF itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

from heads.target import cache_root

COMMIT = "0c1e570"  # llama.cpp, 2026-10-01: draft-eagle3, draft-dflash, draft-dspark, n-gram types
SDIST = ("llama-cpp-python", "0.3.36")
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
CMAKE_OPTIONS = ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                 "-DLLAMA_CURL=OFF")
BUILD_COMMAND = "make llama-cpp"  # what a user runs to build it (python -m layouts.llama_cpp build)
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")  # the converter's --outtype values a head may take


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
            f"{COMMIT} once with `{BUILD_COMMAND}` (python -m layouts.llama_cpp build, about "
            "10-25 minutes on 2 cores)")
    where, server = candidates[0]
    if not server.is_file():
        raise FileNotFoundError(f"llama-server from {where} ({server}) does not exist")
    missing = sorted(set(required) - spec_types(server))
    if missing:
        raise ValueError(
            f"the llama-server from {where} ({server}) offers no --spec-type {', '.join(missing)}"
            f" (an older llama.cpp); build llama.cpp {COMMIT} with `{BUILD_COMMAND}` and unset "
            "LLAMA_SERVER, or point it at a newer build")
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


def build(jobs: int | None = None) -> Path:
    """Build llama-server from the pinned source into the cache (or finish a build); -> its path."""
    done = _built_server()
    if done is not None:
        return done
    install_dir().mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    log_path = install_dir() / "build.log"
    with open(log_path, "a") as log:
        print(f"[llama.cpp] building llama-server {COMMIT} in {install_dir()} (log: {log_path})",
              file=sys.stderr, flush=True)
        _fetch_source(log)
        build_dir = install_dir() / "build"
        _run(["cmake", "-S", str(source_dir()), "-B", str(build_dir), "-G", "Ninja",
              *CMAKE_OPTIONS], log)
        _run(["ninja", "-C", str(build_dir), f"-j{jobs or os.cpu_count() or 2}", "llama-server"],
             log)
    seconds = round(time.monotonic() - started, 1)
    (install_dir() / "build.json").write_text(json.dumps({
        "commit": COMMIT, "source": f"{SDIST[0]}=={SDIST[1]} sdist (sha256 {SDIST_SHA256})",
        "cmake_options": list(CMAKE_OPTIONS), "seconds": seconds,
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=1) + "\n")
    print(f"[llama.cpp] llama-server built in {seconds / 60:.1f} min", file=sys.stderr)
    return install_dir() / "build" / "bin" / "llama-server"


# ------------------------------------------------------------------------------------------------
# the converter


def converter() -> tuple[list[str], dict[str, str]]:
    """(command prefix, environment) of the source tree's convert_hf_to_gguf.py."""
    script = source_dir() / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise FileNotFoundError(
            f"llama.cpp's converter ({script}) is not here: `{BUILD_COMMAND}` fetches the pinned "
            "source (python -m layouts.llama_cpp build)")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(source_dir() / "gguf-py"), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("NO_LOCAL_GGUF", "")
    return [sys.executable, str(script)], env


def convert_to_gguf(model_dir: str | os.PathLike, out_file: str | os.PathLike, *,
                    outtype: str = "f16",
                    target_model_dir: str | os.PathLike | None = None) -> Path:
    """``convert_hf_to_gguf.py MODEL_DIR --outtype T --outfile OUT [--target-model-dir TARGET]``
    into a temporary file beside ``out_file``, renamed into place when it succeeded."""
    if outtype not in GGUF_TYPES:
        raise ValueError(f"GGUF type {outtype!r}: choose one of {', '.join(GGUF_TYPES)}")
    command, env = converter()
    out_file = Path(out_file)
    tmp = out_file.with_name(f".{out_file.name}.{os.getpid()}.tmp")
    command += [str(model_dir), "--outtype", outtype, "--outfile", str(tmp)]
    if target_model_dir is not None:
        command += ["--target-model-dir", str(target_model_dir)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-6:])
            raise ValueError(f"llama.cpp's convert_hf_to_gguf.py refused {model_dir}:\n{tail}")
        os.chmod(tmp, 0o644)
        os.replace(tmp, out_file)
    finally:
        tmp.unlink(missing_ok=True)
    return out_file


# ------------------------------------------------------------------------------------------------
# running it


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                        env=env, start_new_session=True)
        deadline = time.monotonic() + self.timeout
        while True:
            if self.process.poll() is not None:
                tail = self.log_tail()
                self.stop()
                raise ValueError(f"llama-server for {self.name} exited with code "
                                 f"{self.process.returncode} while starting:\n{tail}")
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
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        if getattr(self, "_log", None) is not None and not self._log.closed:
            self._log.close()

    def log_tail(self, lines: int = 12) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])

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
            raise ValueError(f"llama-server for {self.name} died:\n{self.log_tail()}")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return json.loads(response.read())
        except (OSError, ValueError) as err:
            alive = self.process is not None and self.process.poll() is None
            raise ValueError(f"llama-server for {self.name} failed a request ({err})"
                             + ("" if alive else f"; it died:\n{self.log_tail()}")) from err

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
    from heads.target import EMBEDDED_TARGETS, embedded_gguf_path, resolve_target

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

    parser = argparse.ArgumentParser(prog="python -m layouts.llama_cpp",
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
    args = parser.parse_args(argv)
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
    from heads.command_line import run_command

    sys.exit(run_command(main, "python -m layouts.llama_cpp"))
