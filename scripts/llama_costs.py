"""What a speculative round costs in llama.cpp and in draftsmith's engine, on this machine.

    python scripts/llama_costs.py --out reports/llama_costs.json [--threads 1 2]

* verification: the target's forward over n = 1, 2, 3, 4, 5, 8 tokens with 128 tokens already in
  its cache, in llama.cpp (``llama-bench -p N -n 0 -d 128``, built beside llama-server by
  ``make llama-cpp``) for the embedded Q4_1 GGUF and an f32 GGUF of the same weights, and in
  draftsmith's engine: whole rounds verifying n tokens (draftsmith.eval.tree_cost.measure_verify_cost: the
  fp32 target through transformers, the mask, the acceptance, the host read, the cache
  compaction), eagerly and compiled (``--compile off max``; compiling happens before the
  timing). llama-bench's figure is a forward that keeps the last logits only; a round keeps
  all n, as verification must;
* a draft step: each shipped draft served by llama-server (``-lv 4`` prints the drafting time
  of every request), milliseconds per drafted token (our engine's draft costs are in each
  artifact's tree_calibration.json and in ``--tree auto``'s output).

Every figure is a median of repeated timings; run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("MKL_CBWR", "AUTO")  # as draftsmith.eval.bench: MKL's small-GEMM path is slow on EPYC

import torch  # noqa: E402

from draftsmith.layouts.llama_cpp import LlamaServer, find_llama_server, gguf_for_target  # noqa: E402

SIZES = (1, 2, 3, 4, 5, 8)
PROMPT = "Write a short story about a robot who learns to paint."


def llama_bench(model: Path, threads: int, repeats: int = 7) -> dict[int, float]:
    bench = find_llama_server().with_name("llama-bench")
    if not bench.is_file():
        subprocess.run(["ninja", "-C", str(bench.parents[1]), "llama-bench"], check=True,
                       capture_output=True)
    out = subprocess.run([str(bench), "-m", str(model), "-p", ",".join(map(str, SIZES)),
                          "-n", "0", "-d", "128", "-t", str(threads), "-r", str(repeats),
                          "--poll", "0", "-o", "json"], capture_output=True, text=True,
                         check=True)
    return {int(row["n_prompt"]): row["avg_ns"] / 1e6 for row in json.loads(out.stdout)}


def draft_step_ms(target_gguf: Path, draft_args: list[str], threads: int, prompt: list[int],
                  tokens: int = 128) -> dict:
    """Milliseconds of llama.cpp's drafting per drafted token, from its -lv 4 statistics."""
    with tempfile.TemporaryDirectory() as logs, LlamaServer(
            ["-m", str(target_gguf), "-c", "2048", "-np", "1", "-lv", "4", *draft_args],
            name="costs", threads=threads, log_dir=logs) as server:
        for _ in range(3):
            timings = server.complete(prompt, tokens)["timings"]
        text = Path(server.log_path).read_text()
    stats = re.findall(r"#gen tokens = +(\d+).*dur\(b,g,a\) = ([\d.]+), ([\d.]+), ([\d.]+) ms",
                       text)
    generated, _, drafting, _ = (float(x) for x in stats[-1])
    return {"ms_per_drafted_token": drafting / generated, "drafted_tokens": int(generated),
            "decode_ms_per_token": timings["predicted_per_token_ms"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="reports/llama_costs.json")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--eagle", default="artifacts/smollm2-135m/eagle3")
    parser.add_argument("--dflash", default=None, help="a block draft artifact to time as well")
    parser.add_argument("--compile", nargs="+", default=["off", "max"],
                        help="the engine's compile modes to time (draftsmith.eval.forward)")
    args = parser.parse_args()
    from draftsmith.eval.tree_cost import measure_verify_cost
    from draftsmith.layouts.eagle import export_eagle_gguf
    from draftsmith.targets.target import load_target

    report = {"machine": open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0]
              .strip(": "), "sizes": list(SIZES), "llama.cpp": {}, "draftsmith": {},
              "draft_step": {}}
    quantised, _ = gguf_for_target("smollm2-135m")
    f32, _ = gguf_for_target("smollm2-135m", "f32")
    for name, model in (("q4_1", quantised), ("f32", f32)):
        for threads in args.threads:
            report["llama.cpp"][f"{name} threads={threads}"] = llama_bench(model, threads)
    target = load_target("smollm2-135m", device="cpu", dtype="float32")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for mode in args.compile:
            costs = measure_verify_cost(target, SIZES, context=128, repeats=9, compile=mode)
            report["draftsmith"][f"fp32 threads={threads} compile={mode}"] = {
                n: s * 1000 for n, s in costs.items()}
    prompt = target.chat_ids(PROMPT)
    with tempfile.TemporaryDirectory() as tmp:
        drafts = {}
        for kind in ("f16", "q8_0", "f32"):
            path = Path(tmp) / f"eagle3-{kind}.gguf"
            export_eagle_gguf(args.eagle, path, target=target, gguf_type=kind)
            drafts[f"eagle3 {kind}"] = ["-md", str(path), "--spec-type", "draft-eagle3",
                                        "--spec-draft-n-max", "3"]
        if args.dflash:
            from draftsmith.layouts.dflash import export_block

            path = Path(tmp) / "dflash.gguf"
            export_block(args.dflash, "gguf", path, target=target, gguf_type="f16")
            drafts["dflash f16"] = ["-md", str(path), "--spec-type", "draft-dflash",
                                    "--spec-draft-n-max", "7"]
        for name, draft in drafts.items():
            for target_name, model in (("q4_1", quantised), ("f32", f32)):
                report["draft_step"][f"{name} beside {target_name}"] = draft_step_ms(
                    model, draft, 1, prompt)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
