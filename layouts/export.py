"""``draftsmith export``: an artifact into the layouts serving engines load.

    draftsmith export <artifact> --format vllm|sglang|speculators --out DIR   # EAGLE-3
    draftsmith export <artifact> --format vllm|sglang --out DIR               # EAGLE-1
    draftsmith export <artifact> --format trtllm|fasterdecoding|vllm-0.32 --out DIR  # Medusa
    draftsmith export <artifact> --format hf --out DIR                        # distilled draft
    ... [--check] [--overwrite] [--verifier ORG/NAME] [--base-model ORG/NAME] [--target T]

The artifact's ``config.json`` says which method it holds (``draftsmith.heads.methods``); that method's row
of ``draftsmith.layouts.table.LAYOUTS`` writes and checks its formats. This module alone dispatches over all
of them; ``draftsmith export`` (draftsmith/cli.py) runs it.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from draftsmith.files.command_line import USER_ERRORS, program, run_command
from draftsmith.files.output_dir import named_paths, refuse_inputs
from draftsmith.heads.methods import artifact_method
from draftsmith.layouts.files import ExportOptions, check_format
from draftsmith.layouts.gguf import DEFAULT_GGUF_TYPE
from draftsmith.layouts.llama_cpp import GGUF_TYPES
from draftsmith.layouts.processes import stop_on_signals
from draftsmith.layouts.table import all_formats, layouts_of, refused_formats
from draftsmith.layouts.verdicts import say
from draftsmith.targets.target import Target


def export(
    artifact_dir: str | os.PathLike,
    fmt: str,
    out_dir: str | os.PathLike,
    *,
    verifier: str | None = None,
    base_model: str | None = None,
    target: Target | str | os.PathLike | None = None,
    write_pt: bool = False,
    overwrite: bool = False,
    gguf_type: str | None = None,
) -> Path:
    """Dispatch on the artifact's method; an unknown or refused format says what to use."""
    artifact_dir = Path(artifact_dir)
    if not artifact_dir.exists():
        raise FileNotFoundError(f"artifact {artifact_dir} does not exist")
    method = artifact_method(artifact_dir)
    row = layouts_of(method)
    check_format(row.formats, row.refused, method, fmt)
    # never onto the --target it reads (a .gguf, a directory), not even with --overwrite; each
    # layout protects the artifact and checks the rest of its destination
    refuse_inputs([out_dir], named_paths(getattr(target, "path", target)), into=False)
    options = ExportOptions(verifier=verifier, base_model=base_model, target=target,
                            write_pt=write_pt, overwrite=overwrite, gguf_type=gguf_type)
    return row.export(artifact_dir, fmt, out_dir, options)


def check_export(artifact_dir: str | os.PathLike, fmt: str, out_dir: str | os.PathLike,
                 target: Target | str | os.PathLike | None = None) -> bool:
    """Print what was verified and what was not; False when a check failed."""
    artifact_dir, out_dir = Path(artifact_dir), Path(out_dir)
    row = layouts_of(artifact_method(artifact_dir))
    ok = row.check(artifact_dir, fmt, out_dir, target)
    if row.not_run_here.get(fmt):
        say("not verified", f"loading by the consumer itself: {row.not_run_here[fmt]}; names, "
            "shapes and config keys follow its pinned loader (draftsmith's tests check them "
            "against rules read from its source)")
    return ok


def build_parser() -> argparse.ArgumentParser:
    formats = all_formats()
    parser = argparse.ArgumentParser(
        prog=program("python -m draftsmith.layouts.export"),
        description="Export a draftsmith artifact into a serving layout. Formats per method: "
        + "; ".join(f"{m}: {', '.join(f)}" for m, f in formats.items()),
    )
    parser.add_argument("artifact", help="artifact directory (the run's artifact/)")
    parser.add_argument(
        "--format",
        required=True,
        dest="fmt",
        choices=sorted({f for fs in formats.values() for f in fs}
                       | {m for _, m in refused_formats()}),
    )
    parser.add_argument("--out", required=True, help="directory to write (new, or an earlier "
                        "export; anything else needs --overwrite)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace --out even if it holds other files (never the artifact)")
    parser.add_argument("--verifier", default=None,
                        help="speculators: the target's hub id (default: the recorded one)")
    parser.add_argument("--base-model", default=None,
                        help="Medusa: the target's hub id written as base_model_name_or_path")
    parser.add_argument("--target", default=None,
                        help="the target (HF dir, .gguf, embedded name) when the artifact's "
                        "record does not locate it (speculators needs its embedding)")
    parser.add_argument("--write-pt", action="store_true",
                        help="fasterdecoding: also write medusa_lm_head.pt (a torch.save pickle "
                        "of plain tensors), the only file FasterDecoding's loader reads")
    parser.add_argument("--gguf-type", choices=GGUF_TYPES, default=None,
                        help=f"gguf: the head's precision in the GGUF file (default "
                        f"{DEFAULT_GGUF_TYPE}); --out is then the .gguf file to write")
    parser.add_argument("--check", action="store_true",
                        help="after writing, read the export back and run the consumer checks "
                        "available here; print what was verified and what was not")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The command; a user's mistake is one line on stderr and exit status 2. A signal
    (SIGTERM, Ctrl-C, SIGHUP) stops the converter and removes the partial files: exit status 128
    + its number."""
    prog = "python -m draftsmith.layouts.export"
    with stop_on_signals(prog):
        return run_command(lambda: _run(build_parser().parse_args(argv)), prog)


def _run(args: argparse.Namespace) -> int:
    out = export(args.artifact, args.fmt, args.out, verifier=args.verifier,
                 base_model=args.base_model, target=args.target, write_pt=args.write_pt,
                 overwrite=args.overwrite, gguf_type=args.gguf_type)
    print(f"wrote {out}")
    row = layouts_of(artifact_method(args.artifact))
    for line in row.notes(out, args.fmt) if row.notes else ():
        print(line)
    if args.check:
        try:
            ok = check_export(args.artifact, args.fmt, out, target=args.target)
        except USER_ERRORS as err:
            print(f"error: --check could not run: {err}", file=sys.stderr)
            return 2
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
